"""Frames over TCP: ``listen`` / ``accept`` and ``connect``, each followed by the hello exchange.

On the stream every frame travels as a record: ``b"SWTR"`` + u64 little-endian length + the
encoded frame. The record is the unit of resynchronisation:

* a bad *frame* inside a well-formed record (any codec error: magic, checksum, truncated frame,
  shapes...) raises FrameError from ``recv``; the record has been consumed whole, so the channel
  stays usable and the next ``recv`` returns the next frame;
* a bad *record* (wrong marker, or a length above the receiver's limit) means the stream can no
  longer be trusted (TCP itself does not corrupt bytes: the sender is broken or hostile): ``recv``
  raises FrameError naming ``record.marker`` / ``record.length`` and closes the channel; later
  calls raise ChannelClosed. A listener keeps accepting other connections.

Received frames are read straight into a fresh buffer that the decoded tensors then view (no
copy after the socket); sent tensors go to ``sendmsg`` as views of their own memory.

With a :class:`~stagewise.transport.tls.TlsConfig`, a connection with another host is a TLS
stream, both sides verified against the run's CA before the hello (loopback stays plain): the same
records, sent view by view through the TLS layer.
"""

from __future__ import annotations

import errno
import math
import select
import socket
import ssl
import struct
import time

import torch

from stagewise.transport.channel import Channel, ChannelStats, describe_peer
from stagewise.transport.codec import encode_parts, decode_frame
from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, MAX_CONTROL_BYTES, MAX_ROWS, MAX_TENSORS, Frame
from stagewise.transport.hello import Hello, handshake
from stagewise.transport.tls import TlsConfig

RECORD = struct.Struct("<4sQ")
RECORD_MARKER = b"SWTR"
_MAX_HEAD_BYTES = 80 + 24 * MAX_ROWS + 80 * MAX_TENSORS + MAX_CONTROL_BYTES + 64
_SMALL = 64 << 10  # frames up to this size are joined and sent with one call
_IOV_MAX = 1024
HELLO_TIMEOUT_S = 10.0


def _fmt(addr) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"


class TcpChannel(Channel):
    def __init__(self, sock: socket.socket, *, local_name: str, peer_name: str, checksum: bool = True,
                 verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:  # fmt: skip
        super().__init__()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock, self.local_name, self._peer_base = sock, local_name, peer_name
        self.peer_name = peer_name
        self.checksum, self.verify_checksum, self.max_payload_bytes = checksum, verify_checksum, max_payload_bytes
        self._prefix, self._prefix_got = bytearray(RECORD.size), 0
        self._body, self._body_view, self._body_got = None, None, 0
        self._closed_why: str | None = None
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._poll_in, self._poll_out = select.poll(), select.poll()
        self._poll_in.register(sock, select.POLLIN)
        self._poll_out.register(sock, select.POLLOUT)

    # -- sending
    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        head, parts = encode_parts(frame, checksum=self.checksum)
        self._send_record(head, parts, t0, timeout)

    def send_bytes(self, data) -> None:
        """Send an already encoded frame (or, in tests, any bytes) as one record."""
        t0 = time.perf_counter()
        self._send_record(memoryview(data).cast("B"), [], t0, None)

    def _send_record(self, head, parts, t0: float, timeout: float | None) -> None:
        self._check_open()
        total = len(head) + sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        prefix = RECORD.pack(RECORD_MARKER, total)
        bufs = [b"".join([prefix, head, *parts])] if total <= _SMALL else [prefix + bytes(head), *parts]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._sendmsg_all([memoryview(b).cast("B") for b in bufs], deadline)
        except TimeoutError:
            self._shut(f"a send timed out after {timeout}s with part of a frame written")
            raise
        self.stats.frames_sent += 1
        self.stats.bytes_sent += total
        self.stats.send_s += time.perf_counter() - t0

    def _sendmsg_all(self, views: list[memoryview], deadline: float | None) -> None:
        while views:
            try:
                n = self._sock.send(views[0]) if self._tls else self._sock.sendmsg(views[:_IOV_MAX])
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(self._poll_out, deadline, "send")
                continue
            except ssl.SSLWantReadError:
                self._wait(self._poll_in, deadline, "send")
                continue
            except OSError as e:
                raise self._lost(e) from None
            while n:
                if n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0], n = views[0][n:], 0

    # -- receiving
    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        t0 = time.perf_counter()
        try:
            body = self._recv_body(timeout, max_frame_bytes)
            try:
                limit = self.max_payload_bytes if max_frame_bytes is None else min(self.max_payload_bytes, max_frame_bytes)
                frame = decode_frame(body, verify_checksum=self.verify_checksum, max_payload_bytes=limit, copy=False)
            except FrameError:
                self.stats.bad_frames += 1
                raise
            self.stats.frames_received += 1
            return frame
        finally:
            self.stats.recv_wait_s += time.perf_counter() - t0

    def recv_bytes(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> torch.Tensor:
        """The next record's bytes (an encoded frame, uint8) without decoding them: for a link that
        decodes its frames itself (the cuda-ipc ring pairs descriptors with slots). Raises what
        :meth:`recv` raises about the stream (TimeoutError, ChannelClosed, FrameError of a record)."""
        t0 = time.perf_counter()
        try:
            return self._recv_body(timeout, max_frame_bytes)
        finally:
            self.stats.recv_wait_s += time.perf_counter() - t0

    def _recv_body(self, timeout: float | None, max_frame_bytes: int | None) -> torch.Tensor:
        deadline = None if timeout is None else time.monotonic() + timeout
        body = self._recv_record(deadline, max_frame_bytes)
        self.stats.bytes_received += body.numel()
        return body

    def _recv_record(self, deadline: float | None, max_frame_bytes: int | None) -> torch.Tensor:
        self._check_open()
        prefix = memoryview(self._prefix)
        while self._prefix_got < RECORD.size:
            self._prefix_got += self._read_into(prefix[self._prefix_got :], deadline)
        if self._body is None:
            marker, length = RECORD.unpack(self._prefix)
            limit = max_frame_bytes or self.max_payload_bytes + _MAX_HEAD_BYTES
            if marker != RECORD_MARKER:
                self._bad_record(FrameError("record.marker", f"expected {RECORD_MARKER!r}, got {bytes(marker)!r} from {self.peer_name}; closing the stream"))
            if length > limit:
                self._bad_record(FrameError("record.length", f"{length} bytes above this receiver's limit of {limit} from {self.peer_name}; closing the stream"))
            self._body = torch.empty(length, dtype=torch.uint8)
            self._body_view, self._body_got = memoryview(self._body.numpy()), 0
        while self._body_got < self._body.numel():
            self._body_got += self._read_into(self._body_view[self._body_got :], deadline, partial=True)
        body = self._body
        self._prefix_got, self._body, self._body_view = 0, None, None
        return body

    def _read_into(self, view: memoryview, deadline: float | None, partial: bool = False) -> int:
        while True:
            try:
                n = self._sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait(self._poll_in, deadline, "recv")
                continue
            except ssl.SSLWantWriteError:
                self._wait(self._poll_out, deadline, "recv")
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                n = 0
            except OSError as e:
                raise self._lost(e) from None
            if n == 0:
                where = ""
                if partial or self._prefix_got:
                    got = self._body_got if self._body is not None else self._prefix_got
                    want = self._body.numel() if self._body is not None else RECORD.size
                    where = f" in the middle of a frame ({got} of {want} bytes)"
                raise self._lost(None, f"closed by the peer (EOF){where}")
            return n

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._closed_why is not None:
            return True  # recv will raise at once
        if self._prefix_got or self._body is not None or (self._tls and self._sock.pending()):
            return True
        return bool(self._poll_in.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def fileno(self) -> int:
        return self._sock.fileno()

    # -- state
    def _wait(self, poller, deadline: float | None, what: str) -> None:
        if self._tls and poller is self._poll_in and self._sock.pending():
            return  # decrypted bytes wait in the TLS layer, not on the socket
        if deadline is None:
            poller.poll()
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"stagewise.transport: {what} with {self.peer_name} timed out")
        poller.poll(math.ceil(left * 1000))

    def _bad_record(self, err: FrameError) -> None:
        self.stats.bad_frames += 1
        self._shut(str(err))
        raise err

    def _lost(self, err: OSError | None, what: str | None = None) -> ChannelClosed:
        what = what or f"lost ({type(err).__name__}: {err})"
        self._shut(f"connection {what}")
        return ChannelClosed(f"stagewise.transport: connection to {self.peer_name} {what}")

    def _check_open(self) -> None:
        if self._closed_why is not None:
            raise ChannelClosed(f"stagewise.transport: channel to {self.peer_name} is closed: {self._closed_why}")

    def _shut(self, why: str) -> None:
        if self._closed_why is None:
            self._closed_why = why
            try:  # wakes a send or recv that another thread is waiting in (close alone would not)
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected, or already reset
                pass
            self._sock.close()

    def close(self) -> None:
        self._shut("closed by this side")

    @property
    def closed(self) -> bool:
        return self._closed_why is not None

    @property
    def local_address(self) -> tuple[str, int]:
        """This end's (host, port): the address the peer reaches this process at."""
        return self._sock.getsockname()[:2]

    def _set_peer(self, hello: Hello) -> None:
        self.peer, self.peer_name = hello, describe_peer(self._peer_base, hello)


class Listener:
    """A listening socket; ``accept`` returns channels whose hello matched ``hello``."""

    def __init__(self, sock: socket.socket, hello: Hello, auth_token, options: dict,
                 tls: TlsConfig | None = None) -> None:
        self._sock, self.hello, self._auth_token, self._options, self._tls = sock, hello, auth_token, options, tls
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def accept(self, timeout: float | None = None, *, hello_timeout: float = HELLO_TIMEOUT_S) -> TcpChannel:
        """The next connection whose hello succeeds. TimeoutError if none arrives in ``timeout``;
        HandshakeError if one arrives and fails its hello (the listener stays usable)."""
        if not self._poll.poll(None if timeout is None else max(0, int(timeout * 1000))):
            raise TimeoutError(f"stagewise.transport: no connection on {_fmt(self.address)} within {timeout}s")
        sock, addr = self._sock.accept()
        local, peer = f"listener at {_fmt(self.address)}", f"connector from {_fmt(addr)}"
        if self._tls is not None and self._tls.applies(addr[0]):
            sock.settimeout(hello_timeout)
            sock = self._tls.server_side(sock, peer)
        ch = TcpChannel(sock, local_name=local, peer_name=peer, **self._options)
        _open(ch, self.hello, initiator=False, auth_token=self._auth_token, timeout=hello_timeout)
        return ch

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(ch: TcpChannel, hello: Hello, *, initiator: bool, auth_token, timeout: float | None) -> None:
    try:
        ch._set_peer(handshake(ch, hello, initiator=initiator, auth_token=auth_token, timeout=timeout,
                               local_name=ch.local_name, peer_name=ch._peer_base))  # fmt: skip
        ch.stats = ChannelStats()  # count the run's frames, not the hello's
    except (HandshakeError, ChannelClosed, OSError):
        ch.close()
        raise


def listen(host: str = "127.0.0.1", port: int = 0, *, hello: Hello, auth_token=None, backlog: int = 16,
           checksum: bool = True, verify_checksum: bool = True,
           max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, tls: TlsConfig | None = None) -> Listener:  # fmt: skip
    """Listen on ``host:port`` (loopback unless an address is given; port 0 picks a free one);
    with ``tls``, connections from other hosts must complete mutual TLS first."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"stagewise.transport: cannot listen on {host}:{port}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebinding after a restart (TIME_WAIT)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        why = "address already in use (another process listens there)" if e.errno == errno.EADDRINUSE else e.strerror
        raise OSError(e.errno, f"stagewise.transport: cannot listen on {_fmt((host, port))}: {why}") from None
    options = dict(checksum=checksum, verify_checksum=verify_checksum, max_payload_bytes=max_payload_bytes)
    return Listener(sock, hello, auth_token, options, tls)


def connect(host: str, port: int, *, hello: Hello, auth_token=None, timeout: float = 30.0, checksum: bool = True,
            verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
            tls: TlsConfig | None = None) -> TcpChannel:  # fmt: skip
    """Connect and run the hello, retrying refused connections until ``timeout`` (the peer may
    still be starting). A refused hello (or TLS handshake, with ``tls`` to another host) is not
    retried: it raises HandshakeError."""
    deadline = time.monotonic() + timeout
    delay, last = 0.02, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"stagewise.transport: could not connect to {_fmt((host, port))} within {timeout}s ({last})")
        try:
            sock = socket.create_connection((host, port), timeout=left)
            break
        except (ConnectionRefusedError, ConnectionResetError, socket.timeout) as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
    local, peer = f"connector from {_fmt(sock.getsockname())}", f"listener at {_fmt(sock.getpeername())}"
    if tls is not None and tls.applies(sock.getpeername()[0]):  # the address, as the other end sees ours
        sock = tls.client_side(sock, peer)
    ch = TcpChannel(sock, local_name=local, peer_name=peer, checksum=checksum, verify_checksum=verify_checksum,
                    max_payload_bytes=max_payload_bytes)  # fmt: skip
    _open(ch, hello, initiator=True, auth_token=auth_token, timeout=max(0.1, deadline - time.monotonic()))
    return ch
