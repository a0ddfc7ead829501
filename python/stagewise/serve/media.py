"""The images of a chat request: each ``image_url`` part's URL read into the image file's bytes,
from a ``data:`` URL (base64, as OpenAI's clients send a local image) or fetched over http(s).

Limits hold for both: at most ``max_images`` images a request, ``max_bytes`` of image file per
image, and a fetch that has not finished within ``timeout_s`` (the whole transfer: every read
waits at most the time left) is abandoned. Fetching is off unless the server is started with it
(``stagewise serve --allow-image-fetch``): a server that fetches what its clients name can be made
to reach any address it can (its own network, cloud metadata), so only an operator who accepts that
turns it on; redirects are not followed. Every problem is a ValueError saying what is wrong with the
URL; the server answers it with 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_bytes: int = 20 << 20
    """Of one image file (decoded from base64, or as fetched)."""
    timeout_s: float = 10.0
    """For one fetch, connection to last byte."""
    fetch: bool = False
    """Whether http(s) URLs are fetched (else only ``data:`` URLs are taken)."""
    max_images: int = 16
    """Images a request may hold."""

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"MediaLimits.max_bytes: expected a positive integer, got {self.max_bytes!r}")
        if isinstance(self.max_images, bool) or not isinstance(self.max_images, int) or self.max_images < 0:
            raise ValueError(f"MediaLimits.max_images: expected an integer >= 0, got {self.max_images!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"MediaLimits.timeout_s: expected a positive number of seconds, got {self.timeout_s!r}")


def read_image_url(url: str, limits: MediaLimits) -> bytes:
    """The image file ``url`` names (not yet decoded as an image)."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, limits)
    if scheme in ("http", "https"):
        if not limits.fetch:
            raise ValueError("this server does not fetch image URLs (start it with --allow-image-fetch); "
                             "send the image in a data: URL (data:image/png;base64,...)")
        return _fetch(url, limits)
    shown = url if len(url) <= 80 else url[:77] + "..."
    raise ValueError(f"the image URL {shown!r} is neither a data: URL (data:image/png;base64,...) nor http(s)")


def _data_url(url: str, limits: MediaLimits) -> bytes:
    head, comma, data = url[len("data:"):].partition(",")
    if not comma:
        raise ValueError("the data: URL has no ',' before its data (data:image/png;base64,...)")
    media_type, *params = head.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise ValueError(f"the data: URL's media type is {media_type!r}, not an image/... type")
    if "base64" not in (p.strip().lower() for p in params):
        raise ValueError("the data: URL is not base64 (data:image/png;base64,...)")
    if len(data) // 4 * 3 > limits.max_bytes + 2:
        raise ValueError(f"the data: URL holds about {len(data) // 4 * 3} bytes of image, above the limit of "
                         f"{limits.max_bytes}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"the data: URL's base64 is invalid: {err}") from None
    if len(raw) > limits.max_bytes:
        raise ValueError(f"the data: URL holds {len(raw)} bytes of image, above the limit of {limits.max_bytes}")
    return raw


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise ValueError(f"{req.full_url} redirects to {newurl}; redirects are not followed: give the final URL")


_OPENER = urllib.request.build_opener(_NoRedirects, urllib.request.ProxyHandler({}))


def _fetch(url: str, limits: MediaLimits) -> bytes:
    deadline = time.monotonic() + limits.timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "stagewise", "Accept": "image/*"})
    try:
        with _OPENER.open(request, timeout=limits.timeout_s) as response:
            size = response.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > limits.max_bytes:
                raise ValueError(f"{url} is {size} bytes, above the limit of {limits.max_bytes}")
            sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
            parts, got = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"fetching {url} took longer than {limits.timeout_s:g} s")
                if sock is not None:
                    sock.settimeout(left)  # each read waits at most the time left
                part = response.read1(CHUNK)
                if not part:
                    return b"".join(parts)
                got += len(part)
                if got > limits.max_bytes:
                    raise ValueError(f"{url} is more than {limits.max_bytes} bytes, the limit")
                parts.append(part)
    except urllib.error.HTTPError as err:
        raise ValueError(f"fetching {url} gave HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise ValueError(f"fetching {url} failed: {err.reason}") from None
    except (TimeoutError, OSError, http.client.HTTPException) as err:
        raise ValueError(f"fetching {url} failed: {type(err).__name__}: {err}") from None
