"""Shared-memory collectives (stagewise.parallel.shm_group) between real processes: every
collective against a torch reference (float32, bfloat16, odd sizes, 2 and 3 ranks), bit-identical
sums on every rank, hundreds of back-to-back calls of varying sizes with ranks out of step (the
double buffer), tensors in chunks, a killed peer named at once, a timeout naming the late rank, and
nothing left in /dev/shm.

Each rank is this file run as a script (``python test_shm_group.py ARGS.json``): the arguments go
as JSON, and each rank writes its findings (errors, digests of its results) to a JSON file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from stagewise.parallel import comm, shm_group
from stagewise.parallel.shm_group import PeerDied, ShmGroup

pytestmark = pytest.mark.skipif(not shm_group.available(), reason="no /dev/shm, or not x86")

GLOBAL = 10
"""Global rank of group rank 0 (the others follow), so that messages are seen to name both."""
SMALL_SLOT = 1000
"""Bytes per slot of the group that chunks nearly everything (rounded up to 1024)."""


def _inputs(seed: int, size: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input of one case (each rank computes all of them, for the references)."""
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed * 31 + r)).to(dtype)
            for r in range(size)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _run_case(g: ShmGroup, kind: str, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """One collective on ``g`` against its reference; returns a digest of the result (which
    every rank shares, for the sums) or raises AssertionError."""
    size, me = g.size, g.rank
    xs = _inputs(seed, size, shape, dtype)
    t = xs[me].clone()
    ordered = functools.reduce(lambda a, b: a + b, [x.float() for x in xs]).to(dtype)  # rank order
    exact = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
    if kind == "all_reduce":
        out = g.all_reduce(t)
        assert out is t
        assert torch.equal(out, ordered), "all_reduce is not the sum in rank order"
        torch.testing.assert_close(out, exact)
    elif kind == "all_gather":
        out = g.all_gather(t)
        assert torch.equal(out, torch.stack(xs))
    elif kind == "gather":
        dst = size - 1
        out = g.gather(t, dst=dst)
        if me != dst:
            assert out is None
            return "none"
        assert torch.equal(out, torch.stack(xs))
    elif kind == "broadcast":
        src = seed % size
        out = g.broadcast(t, src=src)
        assert out is t and torch.equal(out, xs[src])
    elif kind == "reduce_scatter":
        out = g.reduce_scatter(t)
        part = shape[0] // size
        assert torch.equal(out, ordered[me * part : (me + 1) * part])
        torch.testing.assert_close(out, exact[me * part : (me + 1) * part])
    elif kind == "all_to_all":
        out = g.all_to_all(t)
        part = shape[0] // size
        assert torch.equal(out, torch.cat([x[me * part : (me + 1) * part] for x in xs]))
    else:
        raise ValueError(kind)
    return _digest(out)


KINDS = ("all_reduce", "all_gather", "gather", "broadcast", "reduce_scatter", "all_to_all")


def _cases(size: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for kind in KINDS:
            for rows, cols in ((size, 1), (size, 7), (3 * size, 193), (size, 576), (2 * size, 4611)):
                out.append((kind, (rows, cols), dtype))
    return out


def _worker(args: dict) -> None:
    rank, size = args["rank"], args["size"]
    host, port = args["store"]
    store = torch.distributed.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    ranks = [GLOBAL + r for r in range(size)]
    big = ShmGroup.join(store, "big", rank=rank, ranks=ranks)
    small = ShmGroup.join(store, "small", rank=rank, ranks=ranks, slot_bytes=SMALL_SLOT)
    spare = ShmGroup.join(store, "spare", rank=rank, ranks=ranks)
    found: dict = {"errors": [], "digests": {}, "pids": big.pids}

    def check(name: str, g: ShmGroup, kind: str, seed: int, shape, dtype) -> None:
        try:
            found["digests"][name] = _run_case(g, kind, seed, shape, dtype)
        except AssertionError as err:
            found["errors"].append(f"{name}: {err}")

    for i, (kind, shape, dtype) in enumerate(_cases(size)):
        for label, g in (("big", big), ("small", small)):
            check(f"{label} {kind} {shape} {dtype}", g, kind, i, shape, dtype)
    # A tensor larger than a slot goes in chunks (1 MiB slots: 300k floats are 2 exchanges).
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        check(f"chunked {kind}", big, kind, 7, (size * 100_003,), torch.float32)
    # Back to back, varying sizes and kinds, the ranks out of step (random pauses of their own).
    plan, pauses = random.Random(5), random.Random(100 + rank)
    for i in range(400):
        kind = plan.choice(KINDS)
        shape = (size * plan.randint(1, 4), plan.randint(1, 97))
        if pauses.random() < 0.1:
            time.sleep(pauses.random() * 2e-3)
        check(f"stress {i} {kind} {shape}", small if i % 3 else big, kind, 1000 + i, shape,
              torch.float32 if i % 2 else torch.bfloat16)
    big.barrier()
    found["calls_ok"] = True

    # Failures. 2 ranks: rank 1 is late (a timeout on rank 0), then killed (rank 0 names it).
    # 3 ranks: the last rank is killed while the others wait for it.
    victim = size - 1
    if rank == victim:
        if size == 2:
            time.sleep(1.5)
        Path(args["died"]).write_text(json.dumps(time.time()))
        Path(args["out"]).write_text(json.dumps(found))
        os.kill(os.getpid(), signal.SIGKILL)
    if size == 2:
        big.timeout_s = 0.3
        start = time.perf_counter()
        try:
            big.all_reduce(torch.ones(5))
        except TimeoutError as err:
            found["timeout"] = [str(err), time.perf_counter() - start]
        try:
            big.all_reduce(torch.ones(5))
        except RuntimeError as err:
            found["broken"] = str(err)
    try:
        spare.all_reduce(torch.ones(5))
    except PeerDied as err:
        found["died"] = [str(err), time.time()]
    for g in (big, small, spare):
        g.close()
    Path(args["out"]).write_text(json.dumps(found))


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("stagewise-coll-")}


def _run_group(size: int, tmp_path: Path) -> list[dict]:
    before = _shm_entries()
    store, address = comm.host_store("127.0.0.1", timeout_s=30)
    procs = []
    try:
        for r in range(size):
            args = {"rank": r, "size": size, "store": list(address), "out": str(tmp_path / f"rank{r}.json"),
                    "died": str(tmp_path / "died.json")}
            (tmp_path / f"args{r}.json").write_text(json.dumps(args))
            procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path / f"args{r}.json")],
                                          stderr=subprocess.PIPE, text=True))
        # Reap the killed rank last: until then it is a zombie, which must count as dead too.
        deadline = time.monotonic() + 120
        for p in procs[:-1] + procs[-1:]:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    for r, p in enumerate(procs):
        expected = -signal.SIGKILL if r == size - 1 else 0
        assert p.returncode == expected, f"rank {r} exited {p.returncode}:\n{p.stderr.read()[-3000:]}"
        p.stderr.close()
    assert _shm_entries() <= before, "a segment was left in /dev/shm"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


def _check_collectives(found: list[dict], size: int) -> None:
    for r, f in enumerate(found):
        assert f.get("calls_ok"), f"rank {r} did not finish its collectives"
        assert not f["errors"], f"rank {r}: " + "\n".join(f["errors"][:10])
    names = found[0]["digests"]
    assert len(names) > 500
    for name, digest in names.items():
        if {"all_reduce", "all_gather", "broadcast"} & set(name.split()):  # the same result on every rank, bit for bit
            assert all(f["digests"][name] == digest for f in found), name


def _check_death(found: list[dict], size: int, died_at: float) -> None:
    victim = size - 1
    for r in range(victim):
        message, when = found[r]["died"]
        assert f"group rank {victim} (global rank {GLOBAL + victim}, pid {found[0]['pids'][victim]}) died" in message
        assert when - died_at < 0.5, f"rank {r} noticed the death {when - died_at:.2f} s late"


def test_two_ranks_collectives_timeout_and_death(tmp_path):
    found = _run_group(2, tmp_path)
    _check_collectives(found, 2)
    message, elapsed = found[0]["timeout"]
    assert "timed out after 0.3 s" in message and "group rank 1 (global rank 11" in message
    assert 0.3 <= elapsed < 1.2
    assert "is broken" in found[0]["broken"] and "timed out" in found[0]["broken"]
    _check_death(found, 2, json.loads((tmp_path / "died.json").read_text()))


def test_three_ranks_collectives_and_death(tmp_path):
    found = _run_group(3, tmp_path)
    _check_collectives(found, 3)
    _check_death(found, 3, json.loads((tmp_path / "died.json").read_text()))


def test_bad_arguments_are_refused(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ShmGroup.join(store, "x", rank=2, ranks=[0, 1])
    before = _shm_entries()
    g = ShmGroup.join(store, "one", rank=0, ranks=[4], slot_bytes=100)
    assert g.slot_bytes == 128 and _shm_entries() == before  # the name is gone once every rank mapped it
    x = torch.arange(6.0)
    assert torch.equal(g.all_gather(x), x[None]) and g.all_to_all(x.clone()).tolist() == x.tolist()
    with pytest.raises(ValueError, match="does not split into 1 parts"):
        g.reduce_scatter(torch.tensor(1.0))
    g.close()
    with pytest.raises(RuntimeError, match="is broken: closed"):
        g.barrier()


if __name__ == "__main__":
    _worker(json.loads(Path(sys.argv[1]).read_text()))
