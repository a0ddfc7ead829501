"""Process groups and collectives over torch.distributed: gloo between CPU processes, NCCL
between GPUs, one rank to a GPU (NCCL refuses two ranks on one GPU: such a world runs gloo, whose
collectives take a CUDA tensor through a host copy, :func:`_through_host`); a group whose ranks
are all CPU processes on one host runs its collectives over shared memory instead
(:mod:`stagewise.parallel.shm_group`). A :class:`Group` of one rank does nothing, so
single-process code calls the same collectives at no cost.

A world is bootstrapped through a ``TCPStore``: one process hosts it (:func:`host_store`; in a
pipeline the world's first rank, :mod:`stagewise.parallel.groups`) and every rank joins it as a
client (:func:`init_world`).
"""

from __future__ import annotations

import functools
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.parallel.shm_group import ShmGroup

DEFAULT_TIMEOUT_S = 120.0
# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single (same arguments); older
# releases have only the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def host_store(host: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, tuple[str, int]]:
    """A store on ``host`` (a free port) for the ranks to meet at; returns it and its address.
    Keep the store object alive while the ranks use it. A loopback ``host`` (127.0.0.1) listens
    there only (its ranks are processes of this host); any other, on every interface (TCPStore's
    own choice)."""
    fd = None
    if host == "127.0.0.1":
        server = socket.create_server((host, 0))
        port, fd = server.getsockname()[1], server.detach()  # the store owns the socket from here
    store = dist.TCPStore(host, 0 if fd is None else port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    return store, (host, store.port)


def backend_for(devices: list[str], hosts: list[str] | None = None) -> str:
    """NCCL when every rank runs on a GPU of its own, gloo otherwise (one backend for the whole
    group; NCCL refuses two ranks on one GPU, "Duplicate GPU detected"). ``hosts``: each rank's
    host (default: all on one), so that ``cuda:0`` of two hosts are two GPUs."""
    gpus = [torch.device(d) for d in devices]
    if not gpus or any(d.type != "cuda" for d in gpus):
        return "gloo"
    where = list(zip(hosts if hosts is not None else [""] * len(gpus), (d.index or 0 for d in gpus), strict=True))
    return "nccl" if len(set(where)) == len(where) else "gloo"


def loopback_interface() -> str | None:
    """The name of this host's loopback interface (on Linux the one flagged IFF_LOOPBACK; else
    ``lo0`` or ``lo`` where the host has it); None where there is none to name."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return next((name for name in ("lo0", "lo") if name in names), None)


def init_world(*, rank: int, world_size: int, store: tuple[str, int], backend: str = "gloo",
               timeout_s: float = DEFAULT_TIMEOUT_S, local: bool = False) -> Group:
    """Join the default process group as ``rank`` of ``world_size`` through the store at
    ``store`` (host, port); returns the whole world as a :class:`Group`. With NCCL the caller
    has already selected this rank's GPU (``torch.cuda.set_device``). ``local``: every rank is a
    process of this host, so gloo's sockets (and NCCL's bootstrap) listen on the loopback
    interface only, whatever interface the host's name (or ``GLOO_SOCKET_IFNAME``) would pick."""
    if not 0 <= rank < world_size:
        raise ValueError(f"init_world: rank must be in [0, {world_size}), got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_world: backend must be 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_initialized():
        loopback = loopback_interface() if local else None
        if loopback is not None:  # read when the process group is made; this process joins no other world
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback
        host, port = store
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=client, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"init_world: this process is already rank {dist.get_rank()} of {dist.get_world_size()}, "
                         f"not rank {rank} of {world_size}")
    return Group(list(range(world_size)))


def destroy_world() -> None:
    """Leave the default process group (no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _through_host(in_place: bool):
    """A collective of :class:`Group` that gloo carries for host tensors only: on a gloo group a
    CUDA tensor's runs on a host copy, the result back on its device (into the tensor itself for
    the in-place collectives)."""
    def wrap(collective):
        @functools.wraps(collective)
        def run(self: Group, t: torch.Tensor, *args, **kwargs):
            if not (self._host_only and t.is_cuda):
                return collective(self, t, *args, **kwargs)
            out = collective(self, t.cpu(), *args, **kwargs)
            if in_place:
                return t.copy_(out)
            return None if out is None else out.to(t.device)
        return run
    return wrap


class Group:
    """The ranks of one tensor- or context-parallel group. ``ranks`` are global ranks; a group
    of one rank needs no process group at all; ``shm``: this rank's end of the group's
    shared-memory collectives, which then replace torch.distributed's."""

    def __init__(self, ranks: list[int], handle=None, *, shm: ShmGroup | None = None) -> None:
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"Group: ranks must be distinct and non-empty, got {ranks}")
        self.ranks = list(ranks)
        self._handle = handle
        self.shm = shm
        self.seconds = 0.0
        """Wall time spent in this group's collectives (on a GPU, until each was enqueued)."""
        self.calls = 0
        self.bytes = 0
        """Bytes of the tensors this rank handed to collectives."""
        self._host_only = len(ranks) > 1 and shm is None and dist.is_initialized() \
            and dist.get_backend() == "gloo"  # the world's: its subgroups take the same
        """gloo carries host tensors only: a CUDA tensor's collective runs on a host copy."""

    def _count(self, start: float, t: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += t.numel() * t.element_size()

    @classmethod
    def single(cls) -> Group:
        return cls([0])

    @classmethod
    def new(cls, ranks: list[int], *, shm_store=None, key: str = "",
            timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
        """A subgroup of the default process group; every rank of the world must call this with
        the same ranks, in the same order of calls (torch.distributed's rule). With ``shm_store``
        (a store the group's ranks share; only when they are CPU processes of this host, and then
        on each of them) the collectives run over shared memory, the ranks meeting as group
        ``key`` of that store; the torch.distributed group is made all the same, so that every
        process of the world makes the same calls whatever its host decides."""
        if len(ranks) == 1:
            return cls(ranks)
        handle = dist.new_group(ranks)
        me = dist.get_rank()
        if shm_store is None or me not in ranks:
            return cls(ranks, handle)
        return cls(ranks, handle, shm=ShmGroup.join(shm_store, key, rank=ranks.index(me), ranks=list(ranks),
                                                    timeout_s=timeout_s))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the group."""
        return 0 if self.size == 1 else self.ranks.index(dist.get_rank())

    @_through_host(in_place=True)
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t``."""
        if self.size > 1:
            start = time.perf_counter()
            if self.shm is not None:
                self.shm.all_reduce(t)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._handle)
            self._count(start, t)
        return t

    @_through_host(in_place=True)
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``t`` of group rank ``src`` on every rank, in place; returns ``t``."""
        if self.size > 1:
            start = time.perf_counter()
            if self.shm is not None:
                self.shm.broadcast(t, src)
            else:
                dist.broadcast(t, src=self.ranks[src], group=self._handle)
            self._count(start, t)
        return t

    @_through_host(in_place=False)
    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each) concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return t
        start = time.perf_counter()
        if self.shm is not None:
            out = _cat(self.shm.all_gather(t), dim)
            self._count(start, t)
            return out
        out = torch.empty((self.size * t.size(0), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous(), group=self._handle)
        self._count(start, t)
        if dim == 0:
            return out
        return torch.cat(out.chunk(self.size), dim=dim)

    @_through_host(in_place=False)
    def gather(self, t: torch.Tensor, dim: int = 0, dst: int = 0) -> torch.Tensor | None:
        """Every rank's ``t`` (same shape on each) concatenated along ``dim`` on group rank
        ``dst``, in rank order; None on the other ranks."""
        if self.size == 1:
            return t
        start = time.perf_counter()
        if self.shm is not None:
            rows = self.shm.gather(t, dst)
            self._count(start, t)
            return None if rows is None else _cat(rows, dim)
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(t.contiguous(), parts, dst=self.ranks[dst], group=self._handle)
        self._count(start, t)
        return None if parts is None else torch.cat(parts, dim=dim)

    def _chunks_first(self, op: str, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t`` with ``dim`` moved first and contiguous, once ``dim`` splits into ``size`` chunks."""
        if t.size(dim) % self.size:
            raise ValueError(f"Group.{op}: dim {dim} of size {t.size(dim)} does not split into {self.size} equal "
                             "chunks")
        return t.movedim(dim, 0).contiguous()

    @_through_host(in_place=False)
    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum of every rank's ``t`` (same shape on each), split into ``size`` equal chunks
        along ``dim``: group rank ``i`` gets chunk ``i``."""
        if self.size == 1:
            return t
        start, src = time.perf_counter(), self._chunks_first("reduce_scatter", t, dim)
        if self.shm is not None:
            out = self.shm.reduce_scatter(src)
        else:
            out = torch.empty((src.size(0) // self.size, *src.shape[1:]), dtype=t.dtype, device=t.device)
            _reduce_scatter(out, src, op=dist.ReduceOp.SUM, group=self._handle)
        self._count(start, t)
        return out.movedim(0, dim)

    @_through_host(in_place=False)
    def all_to_all(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``t`` split into ``size`` equal chunks along ``dim``; chunk ``i`` goes to group rank
        ``i``, and the chunks received (one from each rank, in rank order) are concatenated
        along ``dim``."""
        if self.size == 1:
            return t
        start, src = time.perf_counter(), self._chunks_first("all_to_all", t, dim)
        if self.shm is not None:
            out = self.shm.all_to_all(src)
        else:
            out = torch.empty_like(src)
            dist.all_to_all_single(out, src, group=self._handle)
        self._count(start, t)
        return out.movedim(0, dim)

    def barrier(self) -> None:
        if self.size > 1:
            if self.shm is not None:
                self.shm.barrier()
            else:
                dist.barrier(group=self._handle)


def _cat(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows`` ``[size, *shape]`` concatenated along ``dim`` of ``shape``."""
    if dim % (rows.dim() - 1) == 0:
        return rows.view(-1, *rows.shape[2:])
    return torch.cat(rows.unbind(0), dim=dim)
