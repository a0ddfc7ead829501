"""The pipeline hop as the stages run it: the planner's ``tcp`` and ``shm`` transports on a CPU
(part of `stagewise bench profile`).

Two processes joined by the pipeline's own link (a stagewise.transport channel set up with the
hello, checksum on, a ring slot as large as the largest frame). The sender plays a stage that ends
a step: it churns its caches (streams a buffer larger than the last-level cache, as a stage's
layers stream their weights through them), takes the time, makes the step's frame
(:func:`stagewise.pipeline.protocol.to_frame`) and sends it. The receiver plays the next stage: it
waits for the frame (on a ring, paced by the frames before, as a stage's wait is), decodes it,
makes the step of it (:func:`~stagewise.pipeline.protocol.from_frame`, which it also runs to warm
its caches while a frame is due, as a stage does) and takes the time; then it churns its own
caches, for less time than the sender's period, so that it waits for every frame as a stage does.

One-way time: from the sender's time (the frame's step id, in nanoseconds: CLOCK_MONOTONIC, which
the processes of a host share) to the receiver's step. Latency: the small frame's time (one
decode row of SmolLM2's hidden size, 2,304 bytes) minus its bytes at the fitted bandwidth;
bandwidth: the slope between the small and the large frame (1 MiB, a prompt's rows). This is what
a hop adds to a token in a pipeline on this machine, with the caches cold after a step and the
receiver's wake-up included; the hot ping-pong of `stagewise bench transport` is a floor beneath
it (on the 2-vCPU machine of the results: ~15 us there, ~0.3 ms here).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import torch

HIDDEN = 576
"""SmolLM2's hidden size: a decode row's frame carries 2,304 bytes of float32."""
LINK_ROWS = (1, 455)
"""Rows of the two frames: one decode row, and a prompt's 455 rows (1 MiB)."""
LINK_FRAMES = 40
CHURN_BYTES = 48 << 20
"""A buffer beyond a last-level cache (32 MiB on the machine of the results), streamed between frames."""
SENDER_PERIOD_S = 0.008
"""The sender's step: at least this long (its churn), the receiver's a quarter of it."""
MAX_MODEL_LEN = 4096


def _churn(buf: torch.Tensor, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while True:
        buf.sum()
        if time.perf_counter() >= end:
            return


def _shape():
    from stagewise.pipeline.protocol import StageShape

    return StageShape(index=1, hidden_size=HIDDEN, dtype=torch.float32, max_model_len=MAX_MODEL_LEN,
                      device=torch.device("cpu"))


def _receiver(port: int, conn) -> None:
    """The next stage: reports the median one-way time per row count (JSON over ``conn``)."""
    torch.set_num_threads(1)
    from stagewise.pipeline import protocol
    from stagewise.transport import Hello, StepKind, tcp
    from stagewise.transport.rings import upgrade_accepted

    hello = Hello(fingerprint="bench/profile", stage_from=0, stage_to=1)
    ch = upgrade_accepted(tcp.connect("127.0.0.1", port, hello=hello, timeout=60))
    shape, buf = _shape(), torch.ones(CHURN_BYTES // 4)
    ch.warm = lambda frame: protocol.from_frame(frame, shape)  # as a stage's upstream link is warmed
    times: dict[int, list[float]] = {}
    try:
        while True:
            frame = ch.recv(timeout=60)
            if frame.step_kind == StepKind.CONTROL:
                break
            step = protocol.from_frame(frame, shape)
            now = time.perf_counter_ns()
            times.setdefault(step.batch.num_tokens, []).append((now - step.step_id) * 1e-9)
            _churn(buf, SENDER_PERIOD_S / 4)
        conn.send_bytes(json.dumps({n: statistics.median(v[3:]) for n, v in times.items()}).encode())
    finally:
        ch.close()


def measure_hop(kind: str) -> dict:
    """One-way time of a decode row's step and of a 1 MiB step over the pipeline's ``kind`` link
    (see the module doc): ``latency_s``, ``bandwidth`` and the raw times."""
    from stagewise.model.batch import StepBatch
    from stagewise.pipeline import protocol
    from stagewise.transport import Frame, Hello, StepKind, tcp
    from stagewise.transport.rings import upgrade_dialled

    torch.set_num_threads(1)
    hello = Hello(fingerprint="bench/profile", stage_from=0, stage_to=1)
    lis = tcp.listen(hello=hello)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(lis.address[1], child), daemon=True)
    proc.start()
    got = None
    try:
        ch = upgrade_dialled(lis.accept(120), kind, slot_bytes=2 << 20)
        lis.close()
        buf = torch.ones(CHURN_BYTES // 4)
        for rows in LINK_ROWS:
            hidden = torch.randn(rows, HIDDEN)
            for k in range(LINK_FRAMES + 3):
                _churn(buf, SENDER_PERIOD_S)
                first = 0 if rows > 1 else 128 + k
                batch = StepBatch(request_ids=[0], num_prefills=int(rows > 1), query_lens=[rows],
                                  context_lens=[first], positions=torch.arange(first, first + rows),
                                  hidden_states=hidden)
                step = protocol.Step(step_id=time.perf_counter_ns(), group=0, batch=batch)
                ch.send(protocol.to_frame(step, stage_from=0, stage_to=1))
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"stop": True}))
        if parent.poll(60):
            got = {int(k): v for k, v in json.loads(parent.recv_bytes()).items()}
        ch.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if got is None:
        raise OSError(f"bench profile: the {kind} hop's receiver reported nothing")
    (small, big), bytes_of = LINK_ROWS, (lambda rows: rows * HIDDEN * 4)
    bandwidth = (bytes_of(big) - bytes_of(small)) / max(got[big] - got[small], 1e-9)
    latency = max(got[small] - bytes_of(small) / bandwidth, 0.0)
    return {"latency_s": latency, "bandwidth": bandwidth,
            "one_way_s": {str(bytes_of(rows)): got[rows] for rows in LINK_ROWS},
            "what": f"a pipeline step over the stagewise.transport {kind} link between two processes, "
                    "protocol and codec included, caches churned between steps, checksum on"}
