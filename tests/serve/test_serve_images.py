"""Images in `stagewise serve`'s chat requests (``image_url`` parts), over a tiny random Qwen3-VL
built by transformers: a data: URL and the same image fetched over http answer with the tokens of
`Pipeline.generate` given the image, which are transformers' own; two images keep their order;
every bad image or URL is a 400 naming its part, and the server goes on serving."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from helpers.vl_models import IMAGE, build, save

pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
from starlette.testclient import TestClient  # noqa: E402

from stagewise.api import Pipeline  # noqa: E402
from stagewise.serve.app import build_app  # noqa: E402
from stagewise.serve.media import MediaLimits, read_image_url  # noqa: E402

NEW = 6
LIMITS = MediaLimits(max_bytes=40_000, timeout_s=1.0, fetch=True, max_images=2)
TEXT = "w5 w6 w7"


def _image(w: int, h: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


A, B = _image(37, 29, 0), _image(19, 61, 1)
BIG = _image(120, 120, 2)  # its PNG is over LIMITS.max_bytes


class _Files(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(LIMITS.timeout_s + 0.5)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        body = {"/a.png": _png(A), "/big.png": _png(BIG), "/slow.png": _png(A)}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    hf = build("dense")
    folder = save(hf, tmp_path_factory.mktemp("qwen3vl"))
    pipe = Pipeline(str(folder))
    with TestClient(build_app(pipe, model_name="vl", media=LIMITS)) as client:
        yield hf, folder, pipe, client
    pipe.close()


def _chat(*parts, stream: bool = False) -> dict:
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith(("data:", "http", "file:", "{files}")) else
               {"type": "text", "text": p} for p in parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def _transformers_tokens(hf, folder, prompt_ids: list[int], images) -> list[int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    inputs = dict(Qwen2VLImageProcessorPil.from_pretrained(folder)(images=images, return_tensors="pt"))
    ids = torch.tensor([prompt_ids])
    out = hf.generate(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **inputs, max_new_tokens=NEW,
                      do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_a_data_url_image_answers_with_transformers_tokens(vl):
    hf, folder, pipe, client = vl
    [want] = pipe.generate([TEXT], chat=True, images=[[A]], max_new_tokens=NEW, ignore_eos=True)
    assert want.prompt_token_ids.count(IMAGE) > 1  # the placeholder grew to the image's tokens
    assert want.token_ids == _transformers_tokens(hf, folder, want.prompt_token_ids, [A])
    r = client.post("/v1/chat/completions", json=_chat(_data_url(_png(A)), TEXT))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(want.token_ids)


def test_a_fetched_image_streams_the_same_answer(vl, files):
    _, _, pipe, client = vl
    [want] = pipe.generate([TEXT], chat=True, images=[[A]], max_new_tokens=NEW, ignore_eos=True)
    with client.stream("POST", "/v1/chat/completions", json=_chat(f"{files}/a.png", TEXT, stream=True)) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want.text


def test_two_images_keep_their_order(vl):
    hf, folder, pipe, client = vl
    [want] = pipe.generate([TEXT], chat=True, images=[[A, B]], max_new_tokens=NEW, ignore_eos=True)
    [swapped] = pipe.generate([TEXT], chat=True, images=[[B, A]], max_new_tokens=NEW, ignore_eos=True)
    assert want.prompt_token_ids != swapped.prompt_token_ids  # the order is visible in the prompt
    assert want.token_ids == _transformers_tokens(hf, folder, want.prompt_token_ids, [A, B])
    r = client.post("/v1/chat/completions", json=_chat(_data_url(_png(A)), _data_url(_png(B)), TEXT))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


GOOD = _data_url(_png(A))
BAD_BODIES = [
    (_chat("data:image/png;base64,not base64!", TEXT), "messages[0].content[0]", "base64"),
    (_chat(_data_url(b"plain words", "text/plain"), TEXT), "messages[0].content[0]", "not an image"),
    (_chat(GOOD, _data_url(b"not an image file"), TEXT), "messages[0].content[1]", "no readable image"),
    (_chat(_data_url(_png(BIG)), TEXT), "messages[0].content[0]", "above the limit"),
    (_chat("file:///etc/passwd", TEXT), "messages[0].content[0]", "neither a data: URL"),
    (_chat("{files}/missing.png", TEXT), "messages[0].content[0]", "HTTP 404"),
    (_chat("{files}/big.png", TEXT), "messages[0].content[0]", "above the limit"),
    (_chat("{files}/slow.png", TEXT), "messages[0].content[0]", "timed out"),
    (_chat("{files}/moved.png", TEXT), "messages[0].content[0]", "redirects are not followed"),
    (_chat(GOOD, GOOD, GOOD, TEXT), "messages[0].content[2]", "at most 2 images a request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "needs"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": GOOD}}]}]},
     "messages[0].content[0]", "user messages only"),
]


def test_bad_images_get_400_naming_the_part_and_nothing_else_is_disturbed(vl, files):
    _, _, pipe, client = vl
    [want] = pipe.generate([TEXT], chat=True, images=[[A]], max_new_tokens=NEW, ignore_eos=True)
    for body, param, words in BAD_BODIES:
        for message in body["messages"]:
            for part in message["content"]:
                if part["type"] == "image_url" and "url" in part["image_url"]:
                    part["image_url"]["url"] = part["image_url"]["url"].replace("{files}", files)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (param, words, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    r = client.post("/v1/chat/completions", json=_chat(GOOD, TEXT))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text


def test_image_urls_read_within_their_limits(files):
    raw = _png(A)
    assert read_image_url(_data_url(raw), LIMITS) == raw
    assert read_image_url(f"data:image/png;charset=x;base64,{base64.b64encode(raw).decode()}", LIMITS) == raw
    assert read_image_url(f"{files}/a.png", LIMITS) == raw
    no_fetch = MediaLimits()  # the default: data: URLs only
    assert read_image_url(_data_url(raw), no_fetch) == raw
    with pytest.raises(ValueError, match="--allow-image-fetch"):
        read_image_url(f"{files}/a.png", no_fetch)
    for url, words in [("data:image/png,abc", "not base64"), ("data:image/png;base64", "no ','"),
                       ("ftp://host/x.png", "neither"), ("x" * 200, "neither")]:
        with pytest.raises(ValueError, match=words):
            read_image_url(url, LIMITS)
    with pytest.raises(ValueError, match="positive"):
        MediaLimits(max_bytes=0)
    with pytest.raises(ValueError, match="max_images"):
        MediaLimits(max_images=-1)
