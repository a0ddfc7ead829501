"""The other process of the ring tests: `python tests/helpers/ring_peer.py MODE ARGS...`.

Modes:
  read NAME SEED COUNT DELAY [ops]  attach, sleep DELAY s, read COUNT messages and check each
                                    against messages(SEED); then expect the ring closed
  write NAME SEED COUNT [ops]       attach, write COUNT messages of messages(SEED), close
  echo IN OUT                       attach both, send every message of IN back on OUT until IN closes
  hold-attached NAME                attach, then wait to be killed
  hold-created NAME SLOT NUM        create, then wait to be killed
  cuda-read NAME SEED COUNT         as read, for a CudaIpcRing (checks on the GPU)
  cuda-write NAME SEED COUNT        as write, for a CudaIpcRing
Exit status 0 means every check passed; a failure prints why and exits 1. The tests start it with
:func:`spawn` and wait for it with :func:`finish`.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

from stagewise.transport.rings import CudaIpcRing, RingClosedError, ShmRing


def messages(seed: int, count: int, slot_bytes: int):
    """COUNT messages of random sizes in [0, slot_bytes] (the edges often) and random bytes."""
    rng = random.Random(seed)
    for _ in range(count):
        size = rng.choice([0, 1, slot_bytes, rng.randrange(slot_bytes + 1), rng.randrange(slot_bytes + 1)])
        yield rng.randbytes(size)


def as_tensor(data: bytes, device: str = "cpu"):
    import torch

    return (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)).to(device)


def spawn(*args) -> subprocess.Popen:
    """This script in a new process, with ``args`` as its arguments; its output piped."""
    return subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Waits for a peer of :func:`spawn`, which must have passed its checks."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"peer failed ({proc.returncode}): {out}"


def _ops(ring: ShmRing, argv: list[str]) -> ShmRing:
    if "ops" in argv:
        ring.use_torch_ops()
    return ring


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "read":
        ring = _ops(ShmRing.attach(argv[1], timeout=60), argv)
        time.sleep(float(argv[4]))
        for i, expected in enumerate(messages(int(argv[2]), int(argv[3]), ring.slot_bytes)):
            view = ring.acquire(timeout=60)
            if view.readonly is not True or view != expected:
                print(f"message {i}: got {len(view)} bytes, expected {len(expected)} (or differing bytes)")
                return 1
            ring.release()
        try:
            ring.acquire(timeout=60)
            print("a message beyond the last one")
            return 1
        except RingClosedError:
            pass
        ring.close()
    elif mode == "write":
        ring = _ops(ShmRing.attach(argv[1], timeout=60), argv)
        for data in messages(int(argv[2]), int(argv[3]), ring.slot_bytes):
            ring.send(data, timeout=60)
        ring.close()
    elif mode == "echo":
        rx, tx = ShmRing.attach(argv[1], timeout=60), ShmRing.attach(argv[2], timeout=60)
        try:
            while True:
                view = rx.acquire(timeout=60)
                tx.reserve(len(view), timeout=60)[:] = view
                tx.commit()
                rx.release()
        except RingClosedError:
            pass
        rx.close()
        tx.close()
    elif mode == "hold-attached":
        ring = ShmRing.attach(argv[1], timeout=60)
        time.sleep(600)
    elif mode == "hold-created":
        ring = ShmRing.create(argv[1], int(argv[2]), int(argv[3]))
        time.sleep(600)
    elif mode == "cuda-read":
        import torch

        ring = CudaIpcRing.attach(argv[1], timeout=60)
        for i, expected in enumerate(messages(int(argv[2]), int(argv[3]), ring.slot_bytes)):
            view = ring.acquire(timeout=60)
            ok = view.is_cuda and torch.equal(view, as_tensor(expected, "cuda"))  # on the stream that waited
            ring.release()
            if not ok:
                print(f"message {i}: {view.numel()} bytes, expected {len(expected)} (or differing bytes)")
                return 1
        try:
            ring.acquire(timeout=60)
            print("a message beyond the last one")
            return 1
        except RingClosedError:
            pass
        ring.close()
    elif mode == "cuda-write":
        ring = CudaIpcRing.attach(bytes.fromhex(argv[1]), timeout=60)  # by handle
        for data in messages(int(argv[2]), int(argv[3]), ring.slot_bytes):
            ring.send(as_tensor(data, "cuda"), timeout=60)
        ring.close()  # after this process's GPU work, which the reader's stream waits for
    else:
        print(f"unknown mode {mode!r}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
