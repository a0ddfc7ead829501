"""Collectives over shared memory between the CPU processes of one group on one host.

One segment per group: a header with a cache line per rank (its arrival counter, an int64
sequence number, and its pid), then two buffers of one slot per rank. The group's first rank
creates the segment and shares its name through the world's store; every rank maps it, the ranks
meet at a store barrier, and the creator unlinks the name at once, so nothing is left in
``/dev/shm`` even when a process is killed later.

A collective is one exchange (several for a tensor larger than a slot: it goes in slot-sized
chunks, each an exchange): at sequence number ``s`` a rank writes its tensor into its slot of
buffer ``s % 2``, publishes ``s``, waits until the ranks it reads from have published ``>= s`` and
reads their slots. Why one barrier per exchange suffices: a rank publishes ``s`` only after it
has finished exchange ``s - 1``, reads included; buffer ``s % 2`` was last read in exchange
``s - 2``; so once every rank has published ``>= s - 1`` nobody reads that buffer any more.
Before writing, a rank therefore waits for every rank at ``>= s - 1``, which it already knows
when its previous exchange waited for everyone; exchanges that read nothing (gather on a rank
other than the destination, broadcast on the source) skip their own wait and leave it to the
next exchange. The ordering relies on x86's stores becoming visible in program order (data
before counter), so :func:`available` is false on other machines and the group keeps
torch.distributed there.

All-reduce adds the ranks' tensors in rank order (in float32 for 16-bit types), so every rank
gets bit-identical sums. A wait spins briefly, then yields the core, then sleeps with a backoff
(the ranks often share fewer cores than there are processes); a peer whose process is gone
raises at once, and a wait past the group's timeout raises naming the ranks that did not arrive.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from datetime import timedelta

import torch

DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes per rank per buffer: a decode step's activations fit in one exchange."""
LINE = 64
"""One cache line per rank in the header: [seq, pid, unused...]."""
SPINS = 20
"""Polls before the first yield (a few µs)."""
YIELD_S = 2e-3
"""How long a wait polls with ``sched_yield`` in between before it sleeps."""
SLEEP_S = (20e-6, 1e-3)
"""The first and the longest sleep between polls."""
PEER_CHECK_S = 5e-3
"""How often a waiting rank checks that the ranks it waits for are alive."""


def available() -> bool:
    """Whether this host can run the shared-memory collectives (Linux ``/dev/shm``, x86)."""
    return os.path.isdir("/dev/shm") and platform.machine().lower() in ("x86_64", "amd64")


def _dead(pid: int) -> bool:
    """Whether process ``pid`` has exited (also when it is a zombie its parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


class PeerDied(RuntimeError):
    """A rank of the group exited while this rank waited for it."""


class ShmGroup:
    """This process's end of a shared-memory group of ``len(ranks)`` processes (``ranks``: their
    global ranks, for messages). Build it with :meth:`join`; every rank calls the same
    collectives in the same order, with tensors of the same shape and dtype."""

    def __init__(self, mm: mmap.mmap, name: str, rank: int, ranks: list[int], slot_bytes: int,
                 timeout_s: float) -> None:
        self.name, self.rank, self.ranks, self.size = name, rank, list(ranks), len(ranks)
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        self._mm = mm
        header = _header_bytes(self.size)
        self._hdr = memoryview(mm)[:header].cast("q")
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=header, count=2 * self.size * slot_bytes)
        self._bufs = data.view(2, self.size, slot_bytes)
        self._step = LINE // 8
        self.pids = [self._hdr[r * self._step + 1] for r in range(self.size)]
        self._seq = self._hdr[rank * self._step]
        self._seen = [self._seq] * self.size
        """The last sequence number seen published by each rank."""
        self._broken: str | None = None
        self._views: dict[tuple[int, torch.dtype, int], tuple] = {}

    @classmethod
    def join(cls, store, key: str, *, rank: int, ranks: list[int], slot_bytes: int = DEFAULT_SLOT_BYTES,
             timeout_s: float = 120.0) -> ShmGroup:
        """Group rank ``rank``'s end of the group ``key`` (unique in the world's ``store``, a
        torch.distributed Store); every rank of the group calls this at the same time."""
        size = len(ranks)
        if not 0 <= rank < size:
            raise ValueError(f"ShmGroup.join: rank must be in [0, {size}), got {rank}")
        slot_bytes = -(-int(slot_bytes) // LINE) * LINE
        if slot_bytes <= 0:
            raise ValueError(f"ShmGroup.join: slot_bytes must be positive, got {slot_bytes}")
        total = _header_bytes(size) + 2 * size * slot_bytes
        path = None
        try:
            if rank == 0:
                name = f"stagewise-coll-{os.getpid()}-{secrets.token_hex(6)}"
                path = f"/dev/shm/{name}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, total)  # a full /dev/shm is an error here, not a SIGBUS later
                except OSError as err:
                    os.close(fd)
                    raise OSError(err.errno, f"/dev/shm has no room for a collectives segment of {total} bytes "
                                             f"({size} ranks x 2 x {slot_bytes}): {err.strerror}") from err
                store.set(f"{key}/name", name)
            else:
                name = store.get(f"{key}/name").decode()
                try:
                    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
                except FileNotFoundError as err:
                    raise RuntimeError(f"shm group {key}: the segment of group rank 0 (global rank {ranks[0]}) "
                                       f"is gone; did it fail?") from err
            try:
                if os.fstat(fd).st_size != total:
                    raise RuntimeError(f"shm group {key}: segment {name} has {os.fstat(fd).st_size} bytes, "
                                       f"expected {total} (do the ranks agree on the slot size?)")
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            hdr = memoryview(mm)[: _header_bytes(size)].cast("q")
            hdr[rank * (LINE // 8) + 1] = os.getpid()
            hdr.release()
            store.set(f"{key}/ready/{rank}", b"1")
            store.wait([f"{key}/ready/{r}" for r in range(size)], timedelta(seconds=timeout_s))
        finally:
            if path is not None:
                os.unlink(path)
        return cls(mm, name, rank, ranks, slot_bytes, timeout_s)

    def close(self) -> None:
        """Unmap the segment (the group is unusable after)."""
        self._broken = self._broken or "closed"
        self._hdr.release()
        self._bufs = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views the segment: the mapping goes with it
            pass

    def __repr__(self) -> str:
        return f"ShmGroup({self.name}, rank {self.rank} of {self.ranks})"

    # -- the exchange --------------------------------------------------------------------------

    def _who(self, r: int) -> str:
        return f"group rank {r} (global rank {self.ranks[r]}, pid {self.pids[r]})"

    def _fail(self, err: Exception) -> None:
        self._broken = str(err)
        raise err

    def _wait(self, target: int, ranks) -> None:
        """Until each of ``ranks`` has published ``>= target``."""
        seen, hdr, step = self._seen, self._hdr, self._step
        pending = [r for r in ranks if seen[r] < target]
        polls, start, check, sleep = 0, 0.0, 0.0, SLEEP_S[0]
        while pending:
            still = []
            for r in pending:
                v = hdr[r * step]
                if v < target:
                    still.append(r)
                else:
                    seen[r] = v
            pending = still
            if not pending:
                return
            polls += 1
            if polls <= SPINS:
                continue
            now = time.perf_counter()
            if polls == SPINS + 1:
                start = check = now
            elif now - check >= PEER_CHECK_S:
                check = now
                for r in pending:
                    if _dead(self.pids[r]):
                        self._fail(PeerDied(f"shm group {self.name}: {self._who(r)} died (exchange {target})"))
                if now - start > self.timeout_s:
                    self._fail(TimeoutError(
                        f"shm group {self.name}: timed out after {self.timeout_s:g} s at exchange {target} waiting for "
                        f"{', '.join(self._who(r) for r in pending)}"))
            if now - start < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, SLEEP_S[1])

    def _typed(self, numel: int, dtype: torch.dtype, b: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Views of buffer ``b`` for a one-exchange payload of ``numel`` elements of ``dtype``: this
        rank's slot, every rank's ``[size, numel]`` and their rows; made once per shape (a decode
        step's collectives repeat a few shapes), so that a small collective costs a copy in, the
        waits and its arithmetic."""
        key = (numel, dtype, b)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 256:
                self._views.clear()
            rows = self._bufs[b][:, : numel * dtype.itemsize].view(dtype)
            v = self._views[key] = (rows[self.rank], rows, rows.unbind(0))
        return v

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and 0 < t.numel() * t.element_size() <= self.slot_bytes

    def _open(self) -> int:
        """The next exchange's sequence number, once nobody still reads its buffer (that of
        exchange ``s - 2``): this rank may write its slot."""
        if self._broken is not None:
            raise RuntimeError(f"shm group {self.name} is broken: {self._broken}")
        s = self._seq + 1
        self._wait(s - 1, range(self.size))
        return s

    def _close(self, s: int, readers) -> None:
        """Publish exchange ``s`` (this rank's slot is written), then wait for ``readers``."""
        self._hdr[self.rank * self._step] = s
        self._seq = s
        self._wait(s, readers)

    def _swap(self, t: torch.Tensor, readers) -> tuple[torch.Tensor, tuple]:
        """One exchange of ``t`` (contiguous, at most a slot) through the cached views: every rank's
        ``[size, numel]`` and their rows (valid until the next exchange but one)."""
        s = self._open()
        mine, rows, each = self._typed(t.numel(), t.dtype, s % 2)
        mine.copy_(t.view(-1))
        self._close(s, readers)
        return rows, each

    def _exchange(self, data: torch.Tensor | None, readers) -> torch.Tensor:
        """One exchange: ``data`` (bytes, at most a slot; None: write nothing) into this rank's
        slot, then wait for the ranks in ``readers`` (those whose slots this rank reads). Returns
        this exchange's buffer ``[size, slot_bytes]`` (uint8)."""
        s = self._open()
        buf = self._bufs[s % 2]
        if data is not None:
            buf[self.rank, : data.numel()].copy_(data)
        self._close(s, readers)
        return buf

    def _chunks(self, nbytes: int, elem: int):
        """Byte ranges [lo, hi) of a payload of ``nbytes``, one per exchange, whole elements each."""
        step = self.slot_bytes // elem * elem
        return [(lo, min(lo + step, nbytes)) for lo in range(0, max(nbytes, 1), step)]

    # -- collectives -----------------------------------------------------------------------------

    def barrier(self) -> None:
        self._exchange(None, range(self.size))

    def _sum(self, parts, out: torch.Tensor) -> None:
        """``out`` = the rows of ``parts`` (``[size, n]``, or its rows) added in rank order (16-bit
        types in float32)."""
        if out.dtype in (torch.float16, torch.bfloat16):
            acc = parts[0].float()
            for r in range(1, self.size):
                acc.add_(parts[r])
            out.copy_(acc)
            return
        if self.size == 1:
            out.copy_(parts[0])
            return
        torch.add(parts[0], parts[1], out=out)
        for r in range(2, self.size):
            out.add_(parts[r])

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (rank order: the same bits on every rank); returns ``t``."""
        if self._fits(t):
            self._sum(self._swap(t, range(self.size))[1], t.view(-1))
            return t
        flat = t.contiguous().view(-1)
        raw, es = flat.view(torch.uint8), flat.element_size()
        for lo, hi in self._chunks(raw.numel(), es):
            buf = self._exchange(raw[lo:hi], range(self.size))
            self._sum(buf[:, : hi - lo].view(t.dtype), flat[lo // es : hi // es])
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``t`` of group rank ``src`` on every rank, in place; returns ``t``."""
        me = self.rank == src
        flat = t.contiguous().view(-1)
        raw = flat.view(torch.uint8)
        for lo, hi in self._chunks(raw.numel(), 1):
            buf = self._exchange(raw[lo:hi] if me else None, () if me else (src,))
            if not me:
                raw[lo:hi].copy_(buf[src, : hi - lo])
        if not me and (flat.data_ptr() != t.data_ptr() or not t.is_contiguous()):
            t.copy_(flat.view(t.shape))
        return t

    def _gather_rows(self, t: torch.Tensor, readers, keep: bool) -> torch.Tensor | None:
        """Every rank's ``t`` stacked ``[size, *t.shape]`` (when ``keep``)."""
        raw = t.contiguous().view(-1).view(torch.uint8)
        n = raw.numel()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype) if keep else None
        rows = out.view(self.size, -1).view(torch.uint8) if keep else None
        for lo, hi in self._chunks(n, 1):
            buf = self._exchange(raw[lo:hi], readers)
            if keep:
                rows[:, lo:hi].copy_(buf[:, : hi - lo])
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked along a new first dimension, in rank order."""
        if self._fits(t):
            return self._swap(t, range(self.size))[0].clone().view(self.size, *t.shape)
        return self._gather_rows(t, range(self.size), True)

    def gather(self, t: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """As :meth:`all_gather` on group rank ``dst`` only (the others read nothing); None elsewhere."""
        keep = self.rank == dst
        return self._gather_rows(t, range(self.size) if keep else (), keep)

    def _split(self, t: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
        """``t`` flat and the elements of each rank's part (its first dimension split ``size`` ways)."""
        if t.dim() == 0 or t.size(0) % self.size:
            raise ValueError(f"ShmGroup.{what}: dim 0 of {tuple(t.shape)} does not split into {self.size} parts")
        flat = t.contiguous().view(-1)
        return flat, flat.numel() // self.size

    def _rounds_of_part(self, flat: torch.Tensor, part: int):
        """For each exchange of ``flat``: its buffer and the elements [a, b) of this rank's part in
        it (offsets into the part; a == b: none)."""
        raw, es = flat.view(torch.uint8), flat.element_size()
        mine = (self.rank * part, (self.rank + 1) * part)
        for lo, hi in self._chunks(raw.numel(), es):
            a, b = max(lo // es, mine[0]), min(hi // es, mine[1])
            buf = self._exchange(raw[lo:hi], range(self.size) if a < b else ())
            yield buf[:, : hi - lo].view(flat.dtype), a - lo // es, b - lo // es, a - mine[0], b - mine[0]

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t``, split into ``size`` parts along dim 0: rank ``i`` gets part ``i``."""
        flat, part = self._split(t, "reduce_scatter")
        out = torch.empty(part, dtype=t.dtype)
        for vals, a, b, oa, ob in self._rounds_of_part(flat, part):
            if a < b:
                self._sum(vals[:, a:b], out[oa:ob])
        return out.view(t.size(0) // self.size, *t.shape[1:])

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` split into ``size`` parts along dim 0; part ``i`` goes to rank ``i``; the parts
        received, one from each rank in rank order, stacked in place of the parts sent."""
        flat, part = self._split(t, "all_to_all")
        out = torch.empty(self.size, part, dtype=t.dtype)
        for vals, a, b, oa, ob in self._rounds_of_part(flat, part):
            if a < b:
                out[:, oa:ob].copy_(vals[:, a:b])
        return out.view(t.shape)


def _header_bytes(size: int) -> int:
    return -(-size * LINE // 4096) * 4096
