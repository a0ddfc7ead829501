"""Process groups and collectives (stagewise.parallel.comm): a one-rank group needs no process
group at all; two and four gloo processes sum, broadcast and gather as torch.distributed does,
including in subgroups of the world."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from stagewise.parallel import comm


def test_a_group_of_one_rank_does_nothing():
    group = comm.Group.single()
    t = torch.arange(6.0)
    assert group.size == 1 and group.rank == 0
    assert group.all_reduce(t) is t and torch.equal(t, torch.arange(6.0))
    assert group.broadcast(t) is t
    assert group.all_gather(t) is t
    group.barrier()


def test_bad_groups_and_ranks_are_refused():
    with pytest.raises(ValueError, match="distinct and non-empty"):
        comm.Group([0, 0])
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        comm.init_world(rank=2, world_size=2, store=("127.0.0.1", 1))
    with pytest.raises(ValueError, match="backend must be"):
        comm.init_world(rank=0, world_size=2, store=("127.0.0.1", 1), backend="mpi")
    assert comm.backend_for(["cuda:0", "cuda:1"]) == comm.backend_for(["cuda"]) == "nccl"
    assert comm.backend_for(["cuda:0", "cuda"]) == comm.backend_for(["cuda:1", "cuda:1"]) == "gloo"  # one GPU
    assert comm.backend_for(["cuda:0", "cuda:0"], ["10.0.0.1", "10.0.0.2"]) == "nccl"  # a GPU on each host
    assert comm.backend_for(["cuda:0", "cuda:0"], ["10.0.0.1", "10.0.0.1"]) == "gloo"
    assert comm.backend_for(["cuda:0", "cpu"]) == comm.backend_for([]) == "gloo"


def test_a_loopback_store_listens_on_loopback_only():
    """A stage's world meets at a store on 127.0.0.1 (its ranks share the host): the store opens no
    port on any other interface."""
    psutil = pytest.importorskip("psutil")
    store, (host, port) = comm.host_store("127.0.0.1", timeout_s=10)
    listening = [c.laddr for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port == port]
    assert host == "127.0.0.1" and listening and all(a.ip == "127.0.0.1" for a in listening)
    client = comm.dist.TCPStore(host, port, is_master=False, timeout=comm.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def _listening(rank: int, store: tuple[str, int], local: bool, out) -> None:
    import psutil

    comm.init_world(rank=rank, world_size=2, store=store, local=local)
    try:
        t = torch.ones(2)
        comm.dist.all_reduce(t)
        out.put((rank, t.tolist(), sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                                           if c.status == psutil.CONN_LISTEN})))
        comm.dist.barrier()
    finally:
        comm.destroy_world()


@pytest.mark.parametrize("local", [False, True])
def test_a_local_world_listens_on_loopback_whatever_interface_gloo_is_told(local, monkeypatch):
    """A host whose name resolves to its network address (or ``GLOO_SOCKET_IFNAME`` naming that
    interface) makes gloo listen there; a world of one host's processes (``local``: a stage's own
    world) listens on the loopback interface instead."""
    psutil = pytest.importorskip("psutil")
    nic = next(((name, a.address) for name, addrs in psutil.net_if_addrs().items() if name != comm.loopback_interface()
                for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    if nic is None or comm.loopback_interface() is None:
        pytest.skip("this host has no network interface with an IPv4 address besides loopback")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", nic[0])  # the spawned ranks inherit it
    store, address = comm.host_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_listening, args=(r, address, local, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, summed, listening in results:
        assert summed == [2.0, 2.0]
        assert listening == (["127.0.0.1"] if local else [nic[1]]), (rank, listening)
    del store


def _rank(rank: int, world: int, store: tuple[str, int], out, device: str = "cpu") -> None:
    if device != "cpu":
        torch.cuda.set_device(device)
    backend = comm.backend_for([device] * world)
    world_group = comm.init_world(rank=rank, world_size=world, store=store, backend=backend)
    torch.set_default_device(device)
    try:
        t = torch.full((3,), float(rank + 1))
        world_group.all_reduce(t)
        assert t.device.type == torch.device(device).type
        b = torch.full((2,), float(rank))
        world_group.broadcast(b, src=world - 1)
        gathered = world_group.all_gather(torch.tensor([rank, 10 * rank]))
        # Two subgroups {0, 1} and {2, 3}: every rank creates both, in the same order.
        pairs = [comm.Group.new([0, 1]), comm.Group.new([2, 3])] if world == 4 else []
        sub = None
        for group in pairs:
            if rank in group.ranks:
                sub = group.all_reduce(torch.tensor([float(rank)])).tolist() + [group.rank]
        # gather to one rank, reduce-scatter and all-to-all against their definitions
        x = torch.arange(world * 2, dtype=torch.float32).view(world, 2) * (rank + 1)
        at_last = world_group.gather(x, dim=1, dst=world - 1)
        scattered = world_group.reduce_scatter(x, dim=0)
        exchanged = world_group.all_to_all(x, dim=0)
        along1 = world_group.all_gather(torch.tensor([[rank], [rank + 100]]), dim=1)
        world_group.barrier()
        extra = (None if at_last is None else at_last.tolist(), scattered.tolist(), exchanged.tolist(),
                 along1.tolist(), world_group.calls)
        out.put((rank, t.tolist(), b.tolist(), gathered.tolist(), sub, extra))
    finally:
        comm.destroy_world()


@pytest.mark.parametrize("world, device", [
    (4, "cpu"),
    pytest.param(2, "cuda:0", id="2-ranks-sharing-one-gpu", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_gloo_collectives_between_processes(world, device):
    """Four CPU processes; and two processes on one GPU, which NCCL refuses ("Duplicate GPU"):
    their world runs gloo, each collective of a CUDA tensor through a host copy (a TP stage's
    all-reduce path when its ranks share a GPU)."""
    store, address = comm.host_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, address, out, device)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    total = float(sum(range(1, world + 1)))
    base = torch.arange(world * 2, dtype=torch.float32).view(world, 2)
    for rank, summed, broadcast, gathered, sub, (at_last, scattered, exchanged, along1, calls) in results:
        assert at_last == (torch.cat([base * (r + 1) for r in range(world)], dim=1).tolist()
                           if rank == world - 1 else None)
        assert scattered == (base[rank : rank + 1] * sum(r + 1 for r in range(world))).tolist()
        assert exchanged == [(base[rank] * (r + 1)).tolist() for r in range(world)]
        assert along1 == [list(range(world)), [r + 100 for r in range(world)]]
        assert calls == 7  # every collective but the barrier counted (the subgroup's are its own)
        assert summed == [total] * 3
        assert broadcast == [float(world - 1)] * 2
        assert gathered == [x for r in range(world) for x in (r, 10 * r)]
        if world == 4:
            pair = [0, 1] if rank < 2 else [2, 3]
            assert sub == [float(sum(pair)), pair.index(rank)]
    assert all(p.exitcode == 0 for p in procs)
    del store


def _nccl_world_of_one(store: tuple[str, int], out) -> None:
    torch.cuda.set_device(0)
    world = comm.init_world(rank=0, world_size=1, store=store, backend=comm.backend_for(["cuda:0"]))
    try:
        t = torch.arange(4.0, device="cuda")
        comm.dist.all_reduce(t)  # NCCL's own, on a world of one
        group = comm.Group.new([0])
        out.put((comm.dist.get_backend(), t.tolist(), world.size, group.all_reduce(t).tolist(),
                 group.all_gather(t).tolist()))
    finally:
        comm.destroy_world()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_nccl_world_of_one_gpu_rank():
    store, address = comm.host_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_nccl_world_of_one, args=(address, out))
    proc.start()
    try:
        backend, summed, size, grouped, gathered = out.get(timeout=120)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert (backend, size) == ("nccl", 1)
    assert summed == grouped == gathered == [0.0, 1.0, 2.0, 3.0]
    assert proc.exitcode == 0
    del store
