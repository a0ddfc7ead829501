"""The ``cuda-ipc`` rows of `stagewise bench transport`: frames of CUDA tensors between two
processes on one GPU, through the link the pipeline uses between two GPU stages on one host
(:class:`~stagewise.transport.rings.CudaIpcChannel`: the tensor bytes by a device-to-device copy
into a slot of a ring in GPU memory, the frame's descriptor over the link's TCP channel), a ring
per direction; beside the device-to-device copy of the same bytes within one process, measured
in the same run.

- one-way latency: half the median ping-pong round trip, the round trip ending when this
  process's GPU has the echoed frame (an event recorded after the receive has completed; the
  echo peer's copy back is enqueued behind its stream's wait for the frame, and this process's
  stream waits for the echo: the whole chain is inside the round trip);
- stream GB/s: :data:`~stagewise.bench.transport.pingpong.WINDOW` frames back to back, until the
  peer acknowledged the last and this process's copies into the ring have completed (the
  receiver reads the slot in place: that copy is the whole transfer);
- D2D copy: ``dst.copy_(src)`` of the same bytes in one process, timed with CUDA events, the L2
  cache flushed before each copy (:func:`stagewise.measure.timing.copy_bandwidth`); its GB/s
  counts the frame's bytes once, as the hop's do, so % D2D = stream GB/s over it.

Checksum on, as the pipeline runs (it covers the descriptor; the GPU bytes are not checksummed).

Both processes are spawned (the bench's own process starts no CUDA context): a GPU wait on a
ring counter that never ends would otherwise hang the whole bench in its exit. The measuring
process sends each result to this one as soon as it has it (JSON bytes), so a failure keeps
what was measured before it; its waits for the GPU are polled (:class:`GpuDone`), the bench waits
at most :data:`SILENCE_S` for each result, and both processes are killed if they do not end.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import time

import torch

from stagewise.bench.transport.pingpong import HELLO, accept_pair, dial_pair, echo, measure, size_text
from stagewise.measure.timing import TimingPolicy, copy_bandwidth
from stagewise.transport import Frame, StepKind, tcp
from stagewise.transport.rings import CUDA_IPC_OPS

NAME = "cuda-ipc"
"""The transport (:mod:`stagewise.transport.registry`) these rows measure."""
TARGET_ONE_WAY_US, SMALL_BYTES = 10.0, 64 << 10
"""The issue's latency target: one way within this many µs for frames of at most SMALL_BYTES."""
TARGET_PCT_D2D, LARGE_BYTES = 80.0, 8 << 20
"""The issue's bandwidth target: this % of the D2D copy for frames of at least LARGE_BYTES."""
SETUP_S = 45.0
"""How long a process waits for the other during the link's setup."""
GPU_WAIT_S = 30.0
"""How long a process waits for its GPU to finish a round trip or a burst."""
SILENCE_S = 60.0
"""How long the bench waits for the measuring process's next result."""


def unavailable() -> str | None:
    """Why the cuda-ipc rows cannot run here; None when they can."""
    if not torch.cuda.is_available():
        return (f"no CUDA GPU (torch.cuda.is_available() is False; torch {torch.__version__}"
                + ("" if torch.version.cuda else ", built without CUDA") + ")")  # fmt: skip
    missing = [op for op in CUDA_IPC_OPS if not hasattr(torch.ops.stagewise, op)]
    if missing:
        return f"the stagewise extension has no {', '.join(missing)} (built without CUDA?)"
    if not _has_cuda_kernel("cuda_ring_wait"):
        return "the stagewise extension was built without CUDA kernels (stagewise::cuda_ring_wait has none)"
    return None


def _has_cuda_kernel(op: str) -> bool:
    check = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)  # private: where absent, the run tells
    try:
        return check is None or check(f"stagewise::{op}", "CUDA")
    except RuntimeError:
        return True


class GpuDone:
    """Waits until this process's current stream has done what was enqueued so far: polled, not
    ``synchronize()``, so that a stream wait on a ring counter that never ends fails the run
    after ``timeout_s`` instead of hanging it."""

    def __init__(self, timeout_s: float = GPU_WAIT_S) -> None:
        self.timeout_s = timeout_s
        self._event = torch.cuda.Event()

    def __call__(self) -> None:
        self._event.record()
        deadline = time.perf_counter() + self.timeout_s
        while not self._event.query():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the GPU did not finish in {self.timeout_s:.0f} s (a stream wait on a ring "
                                   "counter that never ended?)")  # fmt: skip


def _d2d(nbytes: int, quick: bool) -> dict:
    policy = TimingPolicy(warmup=2, min_repeats=5, max_repeats=20) if quick else TimingPolicy()
    c = copy_bandwidth("cuda", nbytes, policy)
    return {"bytes": nbytes, "median_ms": c["median_ms"], "repeats": c["repeats"],
            "gbps": nbytes / c["median_ms"] / 1e6, "read_write_gbps": c["gbps"]}  # fmt: skip


def _measuring_side(conn, sizes: list[int], quick: bool, slot_bytes: int) -> None:
    """The measuring process: the D2D baseline, then the link to the echo peer and a row per size;
    each result to the bench as one JSON message (``gpu``+``d2d``, ``port``, ``row``; then
    ``done`` once the link is closed, or ``error``)."""
    def say(**message) -> None:
        conn.send_bytes(json.dumps(message).encode())

    try:
        with contextlib.ExitStack() as cleanup:
            try:
                _measure(say, cleanup, sizes, quick, slot_bytes)
            except Exception as err:  # noqa: BLE001 - said to the bench, then cleaned up
                say(error=f"{type(err).__name__}: {err}")
                return
        say(done=True)
    except Exception as err:  # noqa: BLE001
        say(error=f"closing the link: {type(err).__name__}: {err}")
    finally:
        conn.close()


def _measure(say, cleanup: contextlib.ExitStack, sizes: list[int], quick: bool, slot_bytes: int) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    say(gpu=torch.cuda.get_device_name(0), d2d=[_d2d(n, quick) for n in sizes])
    lis = cleanup.enter_context(tcp.listen(hello=HELLO))
    say(port=lis.address[1])
    ch = accept_pair(NAME, lis, slot_bytes=slot_bytes, device=0, timeout=SETUP_S)
    cleanup.callback(ch.close)
    lis.close()
    settle = GpuDone()
    for nbytes in sizes:
        say(row=measure(ch, nbytes, quick, device="cuda", settle=settle))
    ch.send(Frame(step_kind=StepKind.CONTROL, control={"stop": True}))


def _echo_side(port: int, slot_bytes: int) -> None:
    """The echo peer, in its own process on the same GPU."""
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    echo(dial_pair(NAME, port, slot_bytes=slot_bytes, device=0, timeout=SETUP_S))


def _next(reader, procs: dict) -> dict:
    """The measuring process's next message; TimeoutError or OSError when it cannot come."""
    deadline = time.monotonic() + SILENCE_S
    while not reader.poll(1.0):
        failed = [f"the {what} process ended with exit code {p.exitcode}" for what, p in procs.items()
                  if p.exitcode not in (None, 0)]  # fmt: skip
        if failed:
            raise OSError("; ".join(failed))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result from the measuring process in {SILENCE_S:.0f} s")
    try:
        return json.loads(reader.recv_bytes())
    except EOFError:
        procs["measuring"].join(5)
        raise OSError(f"the measuring process ended (exit code {procs['measuring'].exitcode}) before it was done") \
            from None


def run(sizes: list[int], quick: bool, log) -> dict:
    """The cuda-ipc section of the results (see the module doc): ``gpu``, ``d2d`` and ``rows`` per
    size, ``targets``, and ``error`` (None, or why the link failed; what was measured before stays)."""
    slot_bytes = max(sizes) + (1 << 20)
    section = {"transport": NAME, "gpu": None, "slot_bytes": slot_bytes, "d2d": [], "rows": [], "error": None}
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    procs = {"measuring": ctx.Process(target=_measuring_side, args=(writer, sizes, quick, slot_bytes), daemon=True)}
    try:
        procs["measuring"].start()
        writer.close()  # the pipe ends (EOF) when the measuring process does
        while True:
            message = _next(reader, procs)
            if "error" in message:
                section["error"] = message["error"]
                break
            if "done" in message:
                break
            if "port" in message:
                procs["echo"] = ctx.Process(target=_echo_side, args=(message["port"], slot_bytes), daemon=True)
                procs["echo"].start()
            elif "row" in message:
                row = message["row"]
                log(f"{NAME} {row['bytes']} bytes: one-way {row['one_way_us']:.1f} µs, "
                    f"stream {row['stream_gbps']:.1f} GB/s")
                section["rows"].append(row)
            else:
                section.update(gpu=message["gpu"], d2d=message["d2d"])
                log(f"{NAME}: {message['gpu']}, D2D copy of {size_text(max(sizes))} "
                    f"{message['d2d'][-1]['gbps']:.0f} GB/s (frame bytes)")
    except (OSError, TimeoutError, ValueError) as err:
        section["error"] = f"{type(err).__name__}: {err}"
    except BaseException:  # Ctrl-C: the children are ended as after an error, not waited for
        section["error"] = "interrupted"
        raise
    finally:
        for p in procs.values():  # after an error, give them time to close their rings, then kill
            if p.pid is None:
                continue
            p.join(30 if section["error"] is None else 10)
            if p.is_alive():
                p.kill()
                p.join(5)
        reader.close()
    if section["error"]:
        log(f"{NAME}: failed: {section['error']}")
    d2d = {d["bytes"]: d["gbps"] for d in section["d2d"]}
    for row in section["rows"]:
        row["pct_d2d"] = 100 * row["stream_gbps"] / d2d[row["bytes"]] if row["bytes"] in d2d else None
    section["targets"] = targets(section["rows"])
    return section


def targets(rows: list[dict]) -> dict:
    """The issue's targets against the rows: the worst row of the sizes each is about, and whether
    it meets it (``met`` None: no row of those sizes)."""
    small = [r for r in rows if r["bytes"] <= SMALL_BYTES]
    large = [r for r in rows if r["bytes"] >= LARGE_BYTES and r.get("pct_d2d") is not None]
    return {"one_way_us": _target(f"<= {TARGET_ONE_WAY_US:g} µs one way for frames <= {size_text(SMALL_BYTES)}",
                                  max(small, key=lambda r: r["one_way_us"], default=None), "one_way_us",
                                  lambda worst: worst <= TARGET_ONE_WAY_US),
            "pct_d2d": _target(f">= {TARGET_PCT_D2D:g} % of the D2D copy for frames >= {size_text(LARGE_BYTES)}",
                               min(large, key=lambda r: r["pct_d2d"], default=None), "pct_d2d",
                               lambda worst: worst >= TARGET_PCT_D2D)}  # fmt: skip


def _target(text: str, row: dict | None, key: str, ok) -> dict:
    if row is None:
        return {"target": text, "worst": None, "at": None, "met": None}
    return {"target": text, "worst": row[key], "at": row["bytes"], "met": ok(row[key])}


def _verdict(t: dict, unit: str) -> str:
    if t["met"] is None:
        return f"{t['target']}: not measured (no frame of those sizes in this run)"
    return f"{t['target']}: {'met' if t['met'] else 'NOT met'} (worst {t['worst']:.1f}{unit} at {size_text(t['at'])})"


def markdown(section: dict) -> list[str]:
    """The section's lines in the results' Markdown."""
    lines = [
        "", f"## {NAME}: two processes on one GPU ({section['gpu'] or 'GPU unknown'})", "",
        "Frames of one bfloat16 CUDA tensor through the pipeline's cuda-ipc link (the bytes by a device-to-device "
        "copy into a slot of a ring in GPU memory, the descriptor over the link's TCP channel), a ring per "
        "direction, checksum on (it covers the descriptor only). One-way = median ping-pong round trip / 2, the "
        "round trip ending when this process's GPU has the echoed frame; pingpong GB/s = bytes / one-way; stream "
        "GB/s = 4 frames back to back, until acknowledged and this process's copies are done. D2D copy = "
        "`dst.copy_(src)` of the same bytes in one process (CUDA events, L2 flushed before each copy), GB/s of "
        "the frame's bytes; % D2D = stream GB/s over it.", "",
        "| size | one-way µs | pingpong GB/s | stream GB/s | D2D copy GB/s | % D2D |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    d2d = {d["bytes"]: d["gbps"] for d in section["d2d"]}
    for r in section["rows"]:
        pct = "" if r.get("pct_d2d") is None else f"{r['pct_d2d']:.0f}%"
        lines.append(f"| {size_text(r['bytes'])} | {r['one_way_us']:.1f} | {r['pingpong_gbps']:.2f} | "
                     f"{r['stream_gbps']:.2f} | {d2d.get(r['bytes'], float('nan')):.1f} | {pct} |")  # fmt: skip
    lines += ["", f"Targets: {_verdict(section['targets']['one_way_us'], ' µs')}; "
                  f"{_verdict(section['targets']['pct_d2d'], ' %')}."]  # fmt: skip
    if section["error"]:
        lines += ["", f"**Failed**: {section['error']} (rows above: measured before it)"]
    return lines
