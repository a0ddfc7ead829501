"""The preflight probe (``stagewise stage ... --probe``): what ``stagewise doctor`` starts on every
host in place of a stage rank, by the same launcher (printed command, ssh, Ray), before any weight
is read.

It binds the rank's listen address (so a port that is taken or not allowed fails here, named),
prints the ``STAGEWISE-LISTENING`` line as a stage does, and answers the doctor on that port in
JSON lines over TCP (no pickle; each connection in a thread of its own):

- ``{"op": "report"}``: this host's stagewise and protocol versions, Python and torch, and the
  plan's model as read here (its fingerprint, or why it cannot be read), plus the address and
  network interface this host reaches the asker by (the one gloo and NCCL would pick without
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, which are reported when set);
- ``{"op": "echo", "n": N, "reply": M}`` followed by N bytes: M bytes come back (round trips and
  bandwidth are measured with it);
- ``{"op": "probe", "host": H, "port": P}``: measure from here to another probe (a hop's
  direction; ``H`` one of the plan's hosts) and answer with the figures or the error;
- ``{"op": "measure", "types": [...], "fresh": false}``: this node's profile for the rank's device
  and threads (:func:`stagewise.measure.node.node_profile`: cached, or with ``fresh`` measured
  again), for ``--partition measured``;
- ``{"op": "bye"}``: the probe exits (it also does after ``IDLE_S`` without a request).

A probe opens each connection with a line of its own, ``{"nonce": HEX}``. When the run has a shared
secret (``--auth-token`` / ``STAGEWISE_AUTH_TOKEN``), the first request must be ``{"op": "auth",
"mac": HMAC-SHA256(secret, nonce)}`` (the secret itself never crosses the network, as in the
stages' hello); any other request, or another mac, is answered with an error and the connection
closed, so that a probe serves only the run's own doctor and probes.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import secrets
import socket
import statistics
import threading
import time

from stagewise.parallel.runplan import PROTOCOL_VERSION, RunPlan, parse_address
from stagewise.transport.hello import auth_key, proof
from stagewise.pipeline.lines import print_listening

IDLE_S = 120.0
MAX_ECHO = 64 << 20
ROUND_TRIPS = 20
BANDWIDTH_BYTES = 8 << 20


def host_report(plan: RunPlan) -> dict:
    """This host's side of the preflight: versions, and the plan's model as read here."""
    import platform

    from stagewise import version

    out = {"host": socket.gethostname(), "stagewise": version.__version__, "protocol": PROTOCOL_VERSION,
           "python": platform.python_version(), "model": plan.model,
           "socket_ifname": {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}}
    try:
        import torch

        out["torch"] = torch.__version__
        from stagewise.model.loader import open_checkpoint

        checkpoint = open_checkpoint(plan.model)
        out["fingerprint"] = plan.fingerprint(checkpoint.hf_config)
    except Exception as err:  # noqa: BLE001 - reported, named, to the doctor
        out["model_error"] = f"{type(err).__name__}: {err}"
    return out


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (None if unknown)."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


# ---- the wire: one JSON line each way, raw bytes for echoes ------------------------------------


def request(f, sock: socket.socket, msg: dict, payload: bytes = b"") -> dict:
    """Send ``msg`` and ``payload``; the probe's answer."""
    sock.sendall(json.dumps(msg).encode() + b"\n" + payload)
    line = f.readline(1 << 16)
    if not line:
        raise ConnectionError("the probe closed the connection")
    return json.loads(line)


class Connection:
    """A connection to a probe (``with Connection(address, token) as c: c.ask(...)``), proven
    with the run's ``token`` when there is one. ValueError with the probe's words when it refuses."""

    def __init__(self, address, token: str | None = None, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(tuple(address), timeout=timeout)
        try:
            self.f = self.sock.makefile("rb")
            hello = json.loads(self.f.readline(1 << 16) or b"{}")
            if "nonce" not in hello:
                raise ValueError(f"not a stagewise probe: {str(hello)[:200]}")
            if token:
                got = self.ask({"op": "auth", "mac": _mac(token, hello["nonce"])})
                if not got.get("ok"):
                    raise ValueError(got.get("error"))
        except BaseException:
            self.sock.close()
            raise

    def ask(self, msg: dict, payload: bytes = b"") -> dict:
        return request(self.f, self.sock, msg, payload)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


def _mac(token: str, nonce: str) -> str:
    """The proof of the run's token for a probe's nonce (the stages' hello's HMAC, its own label)."""
    return proof(auth_key(token), "probe", nonce.encode())


def measure(host: str, port: int, timeout: float = 10.0, token: str | None = None) -> dict:
    """Round trip (median of small echoes) and one-way bandwidth from here to the probe at
    ``host:port``; raises OSError when it cannot be reached (ValueError when it refuses)."""
    with Connection((host, port), token, timeout) as c:
        c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter()
            c.ask({"op": "echo", "n": 1, "reply": 1}, b"x")
            c.f.read(1)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.ask({"op": "echo", "n": BANDWIDTH_BYTES, "reply": 1}, bytes(BANDWIDTH_BYTES))
        c.f.read(1)
        seconds = time.perf_counter() - t0
        c.sock.sendall(b'{"op": "close"}\n')
    return {"rtt_ms": 1e3 * statistics.median(times), "gbps": BANDWIDTH_BYTES / seconds / 1e9}


def say_bye(addresses, token: str | None = None) -> None:
    for address in addresses:
        if isinstance(address, str):
            continue
        try:
            with Connection(address, token, timeout=2.0) as c:
                c.ask({"op": "bye"})
        except (OSError, ValueError):
            pass


# ---- the probe process ---------------------------------------------------------------------------


def serve_probe(plan: RunPlan, index: int, rank: int, listen: str | None = None, token: str | None = None, *,
                announce=print_listening, done: threading.Event | None = None) -> int:
    """Run the probe of stage ``index`` rank ``rank`` until told bye, idle or ``done`` is set; its
    exit code. ``token``: the run's shared secret, which every request must then carry;
    ``announce(host, port)``: once it listens (by default the line a launcher reads)."""
    host, port = parse_address(listen or plan.stages[index].rank_listen(rank))
    try:
        server = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    report = host_report(plan)
    report["device"] = plan.stages[index].rank_device(rank)
    # A probe measures hops towards the plan's own hosts only (it is not a relay to anywhere).
    peers = {st.host for st in plan.stages} | {parse_address(st.listen)[0] for st in plan.stages}
    bound = server.getsockname()
    announce(bound[0], bound[1])
    done, last, jobs = done or threading.Event(), [time.monotonic()], queue.SimpleQueue()
    server.settimeout(0.1)
    with server:
        while not done.is_set() and time.monotonic() - last[0] < IDLE_S:
            while not jobs.empty():  # a node measurement: in this thread, as torch's profiler wants
                job, box = jobs.get()
                box.put(job())
                last[0] = time.monotonic()
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            last[0] = time.monotonic()
            threading.Thread(target=_answer, args=(conn, report, peers, done, last, jobs, token),
                             daemon=True).start()
    return 0


def _measure_node(report: dict, types, fresh: bool = False) -> dict:
    """The node's profile; torch's profiler (the per-layer framework cost) writes lines of its own to
    this process's stderr, the launcher's terminal: they go to /dev/null meanwhile (in a Ray actor,
    whose stderr is its log, every thread's lines for those seconds)."""
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        from stagewise.measure.node import node_profile

        return node_profile(report["device"], tuple(str(t) for t in types or ()), reuse=not fresh)
    except Exception as err:  # noqa: BLE001 - the driver names the stage with it
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)


def _answer(conn: socket.socket, report: dict, peers: set[str], done: threading.Event, last: list,
            jobs: queue.SimpleQueue, token: str | None) -> None:
    with conn:
        conn.settimeout(IDLE_S)
        f = conn.makefile("rb")
        nonce = secrets.token_hex(16)
        conn.sendall(json.dumps({"nonce": nonce}).encode() + b"\n")
        proven = not token
        while True:
            line = f.readline(1 << 16)
            if not line:
                return
            last[0] = time.monotonic()
            try:
                msg = json.loads(line)
                op = msg["op"]
            except (ValueError, KeyError, TypeError):
                return
            if not proven:
                proven = op == "auth" and hmac.compare_digest(str(msg.get("mac", "")), _mac(token, nonce))
                conn.sendall(json.dumps({"ok": True} if proven else {
                    "ok": False, "error": "this probe needs the run's auth token (--auth-token or "
                                          "STAGEWISE_AUTH_TOKEN): it was not proven, or is another"}).encode() + b"\n")
                if not proven:
                    return
                continue
            if op == "report":
                mine = conn.getsockname()[0]
                reply = {**report, "toward_asker": {"address": mine, "interface": interface_of(mine)}}
            elif op == "echo":
                n, back = int(msg.get("n", 0)), int(msg.get("reply", 0))
                if not (0 <= n <= MAX_ECHO and 0 <= back <= MAX_ECHO):
                    return
                f.read(n)
                conn.sendall(json.dumps({"ok": True}).encode() + b"\n" + bytes(back))
                continue
            elif op == "probe" and str(msg.get("host")) not in peers:
                reply = {"ok": False, "error": f"{msg.get('host')!r} is not a host of the run plan"}
            elif op == "probe":
                try:
                    reply = {"ok": True, **measure(str(msg["host"]), int(msg["port"]), token=token)}
                except (OSError, ValueError, KeyError) as err:
                    reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            elif op == "measure":  # run by the thread serving the probe
                box: queue.SimpleQueue = queue.SimpleQueue()
                jobs.put((lambda types=msg.get("types"), fresh=msg.get("fresh") is True:
                          _measure_node(report, types, fresh), box))
                reply = box.get()
            elif op == "auth":  # a probe without a token takes any
                reply = {"ok": True}
            elif op == "bye":
                done.set()
                reply = {"ok": True}
            else:  # close
                return
            conn.sendall(json.dumps(reply).encode() + b"\n")
