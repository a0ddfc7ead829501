"""Shared-memory activation ring between two processes on one host.

A ring is a POSIX shared-memory segment (``/dev/shm/<name>``) holding a
header, the message size of each slot and ``num_slots`` slots of
``slot_bytes`` bytes (layout: ``include/stagewise/ring.h``). One process
writes, the other reads (single producer, single consumer); messages are byte
strings up to ``slot_bytes`` long, delivered in order. The ring carries bytes
only: a frame codec (``stagewise.transport.frame``) encodes into the slot
the writer reserved and decodes from the slot the reader acquired.

Zero copy: :meth:`ShmRing.reserve` returns a writable memoryview of the slot
itself and :meth:`ShmRing.acquire` a read-only one (``torch.frombuffer`` turns
it into a tensor without a copy); the bytes stay valid until
:meth:`ShmRing.commit` / :meth:`ShmRing.release`, after which the view is
released (using it raises ``ValueError``).

Waiting: a full ring makes the writer wait (back-pressure), an empty one the
reader; both spin for ``spin_us`` then sleep on a futex, so an idle stage uses
no CPU. ``timeout=None`` waits forever (Ctrl-C still interrupts within ~0.1 s);
a timeout raises :class:`TimeoutError`.

Lifetime: the creator's ``close()`` (or exit) removes the name; the peer
removes it as soon as it has attached, so once both ends hold the mapping no
crash of either leaves a file in ``/dev/shm``. Either side's ``close()`` ends
the ring for the other: the reader first gets the messages already committed,
then :class:`RingClosedError`; a peer process that dies without closing is
noticed by a waiter within ~20 ms. A creator killed before its peer attached
leaves its segment behind (nothing can run after SIGKILL).

Not thread-safe: use each end from one thread (another thread may ``close()`` it, which
ends that thread's wait with :class:`RingClosedError`). Linux only (futex, /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import time
import weakref
from functools import partial

import torch

from stagewise import _C

__all__ = ["ShmRing", "HostRing", "RingClosedError", "SHM_DIR", "RING_OPS"]

# The torch ops behind this module (schema: csrc/bindings/schema.cpp).
RING_OPS = ("ring_bytes", "ring_init", "ring_attach", "ring_info", "ring_reserve", "ring_commit",
            "ring_acquire", "ring_release", "ring_close")  # fmt: skip

SHM_DIR = "/dev/shm"
TIMED_OUT, CLOSED = -1, -2  # results of the ring ops besides a slot index (kRingTimedOut, kRingClosed)
_EXTERNAL_SLOTS = 1  # kRingExternalSlots: the slots are not in the segment (a CUDA IPC ring)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_WAIT_CHUNK_US = 100_000  # a long wait returns to Python this often (signals, Ctrl-C)

_ops = torch.ops.stagewise


class RingClosedError(ConnectionError):
    """The other end closed the ring, or its process is gone."""


def _check_name(op: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise ValueError(
            f"stagewise.{op}: argument 'name' must be 1-200 characters of letters, digits, '_', '.', '-' "
            f"not starting with '.', got {name!r}"
        )
    return os.path.join(SHM_DIR, name)


class _Segment:
    """What must be undone when a ring end goes away: the mapping, and for the creator the name."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool):
        self.path, self.mm, self.owner = path, mm, owner
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # the `ring` argument of the torch ops

    def close(self) -> None:
        """Mark the ring closed (the peer's waits end) and remove the name. The mapping is not
        closed here but when the last reference goes: a thread may still be inside a wait on it."""
        if self.tensor is None:
            return
        _ops.ring_close(self.tensor)
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # the peer removed it when it attached
                pass
        self.tensor = None


class HostRing:
    """What both ring kinds share: the control segment, its counters, waiting, closing.

    Subclasses say where the slots are (:class:`ShmRing`: in the segment; ``CudaIpcRing``:
    in GPU memory) and what a slot view is (a memoryview, a CUDA tensor).
    """

    _external_slots = False  # kRingExternalSlots: the slots are not in the segment

    def __init__(self, name: str, segment: _Segment):
        self.name = name
        self._segment = segment
        self._finalizer = weakref.finalize(self, _Segment.close, segment)  # also at interpreter exit
        info = _ops.ring_info(segment.tensor)
        self.slot_bytes, self.num_slots, self._stride, self._data_offset = info[:4]
        self._user_offset = info[8]
        direct = (_C.ring_reserve, _C.ring_commit, _C.ring_acquire, _C.ring_release)
        self._bind(*direct, segment.tensor.data_ptr(), len(segment.mm))

    def _bind(self, reserve, commit, acquire, release, *ring) -> None:
        self._reserve_fn, self._commit_fn = partial(reserve, *ring), partial(commit, *ring)
        self._acquire_fn, self._release_fn = partial(acquire, *ring), partial(release, *ring)

    def _use_torch_ops(self) -> None:
        """Go through the torch ops (the dispatcher) instead of the extension's direct functions;
        same C++ underneath. For tests and the benchmark that prices the dispatcher."""
        self._bind(_ops.ring_reserve, _ops.ring_commit, _ops.ring_acquire, _ops.ring_release, self._segment.tensor)

    @staticmethod
    def unique_name(prefix: str = "stagewise") -> str:
        """A fresh segment name: ``<prefix>-<pid>-<random hex>``."""
        return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"

    @classmethod
    def _create_segment(cls, name: str, slot_bytes: int, num_slots: int, spin_us: int, user=None) -> _Segment:
        """The initialised control segment; ``user(ring_info) -> bytes`` (optional) gives what to store in
        the header's opaque bytes before the segment is published."""
        kind = cls.__name__
        path = _check_name(f"{kind}.create", name)
        for field, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots), ("spin_us", spin_us)):
            if not isinstance(value, int) or value < (0 if field == "spin_us" else 1):
                least = 0 if field == "spin_us" else 1
                raise ValueError(
                    f"stagewise.{kind}.create: argument '{field}' must be an int >= {least}, got {value!r}"
                )
        size = _ops.ring_bytes(slot_bytes, num_slots, cls._external_slots)

        def init(t: torch.Tensor) -> None:
            _ops.ring_init(t, slot_bytes, num_slots, cls._external_slots, spin_us)
            if user is not None:
                info = _ops.ring_info(t)
                data = user(info)
                t[info[8] : info[8] + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        return _make_segment(f"{kind}.create", path, size, init)

    def _user_bytes(self, n: int) -> bytes:
        """The first n of the header's opaque bytes (what the creator stored there)."""
        return bytes(self._segment.mm[self._user_offset : self._user_offset + n])

    def close(self) -> None:
        """End the ring for both sides (idempotent). Views handed out become invalid."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether either end has closed the ring."""
        return not self._finalizer.alive or bool(_ops.ring_info(self._segment.tensor)[7])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, slot_bytes={self.slot_bytes}, num_slots={self.num_slots})"

    def _check_nbytes(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(
                f"stagewise.{type(self).__name__}.reserve: argument 'nbytes' must be in [0, slot_bytes="
                f"{self.slot_bytes}] for ring {self.name!r}, got {nbytes} (a message must fit one slot; create "
                f"the ring with a larger slot_bytes)"
            )

    def _wait(self, op: str, fn, timeout: float | None):
        """Call ``fn(timeout_us)`` until it has a slot; long waits go in chunks so signals get handled."""
        segment = self._segment  # its tensor is None once this end is closed (the finalizer ran)
        if segment.tensor is None:
            raise RingClosedError(f"stagewise.{type(self).__name__}.{op}: ring {self.name!r} was closed by this end")
        if timeout is not None and timeout <= 0:
            return self._result(op, fn(0), timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            chunk = _WAIT_CHUNK_US
            if deadline is not None:
                chunk = max(0, min(chunk, int((deadline - time.monotonic()) * 1e6)))
            result = fn(chunk)
            slot = result[0] if type(result) is tuple else result
            if slot >= 0 and segment.tensor is not None:  # the common case, in short
                return result
            if slot != TIMED_OUT or (deadline is not None and time.monotonic() >= deadline):
                return self._result(op, result, timeout)

    def _result(self, op: str, result, timeout: float | None):
        if self._segment.tensor is None:  # closed by another thread of this process during the wait
            raise RingClosedError(f"stagewise.{type(self).__name__}.{op}: ring {self.name!r} was closed by this end")
        return self._check_result(op, result, timeout)

    def _check_result(self, op: str, result, timeout: float | None):
        slot = result[0] if isinstance(result, tuple) else result
        if slot >= 0:
            return result
        where = f"stagewise.{type(self).__name__}.{op}: ring {self.name!r}"
        if slot == CLOSED:
            raise RingClosedError(f"{where} was closed by the other end")
        waited = "no free slot (the reader is behind)" if op == "reserve" else "no message"
        raise TimeoutError(f"{where}: {waited} within {timeout} s")


class ShmRing(HostRing):
    """One end of a shared-memory ring; make it with :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, segment: _Segment):
        super().__init__(name, segment)
        whole, offset, stride = memoryview(segment.mm), self._data_offset, self._stride
        self._slots = [whole[offset + i * stride :][: self.slot_bytes] for i in range(self.num_slots)]
        self._readonly_slots = [view.toreadonly() for view in self._slots]
        self._reserved: tuple[int, memoryview] | None = None  # (slot, view handed out)
        self._acquired: tuple[int, memoryview] | None = None

    @classmethod
    def create(cls, name: str, slot_bytes: int, num_slots: int = 4, *, spin_us: int = 50) -> ShmRing:
        """Create the segment ``/dev/shm/<name>`` for ``num_slots`` messages of up to ``slot_bytes`` bytes.

        ``spin_us``: how long a waiter (on either end) polls, yielding its CPU, before it sleeps; more
        lowers the latency of a busy ring at the price of CPU. Raises ``FileExistsError`` if the name is taken.
        """
        return cls(name, cls._create_segment(name, slot_bytes, num_slots, spin_us))

    @classmethod
    def attach(cls, name: str, timeout: float = 0.0) -> ShmRing:
        """Attach to the ring another process created, waiting up to ``timeout`` seconds for it to appear.

        Removes the name: the two ends now hold the only references. Raises ``FileNotFoundError``
        when there is no such ring, ``ValueError`` when the segment is not a ring.
        """
        return cls(name, _open_segment(f"{cls.__name__}.attach", name, timeout, cls._external_slots))

    def close(self) -> None:
        for held in (self._reserved, self._acquired):
            if held is not None:
                _release_view(held[1])
        self._reserved = self._acquired = None
        for view in (*self._readonly_slots, *self._slots):
            view.release()
        self._slots, self._readonly_slots = [], []
        super().close()

    # ---- writer ----------------------------------------------------------------

    def reserve(self, nbytes: int, timeout: float | None = None) -> memoryview:
        """Wait for a free slot and return a writable view of its first ``nbytes`` bytes."""
        if not 0 <= nbytes <= self.slot_bytes:
            self._check_nbytes(nbytes)
        if self._reserved is not None:
            raise RuntimeError(f"stagewise.ShmRing.reserve: ring {self.name!r} already has a reserved slot; commit it")
        slot = self._wait("reserve", self._reserve_fn, timeout)
        view = self._slots[slot][:nbytes]
        self._reserved = (slot, view)
        return view

    def commit(self, nbytes: int | None = None) -> None:
        """Publish the reserved slot's first ``nbytes`` bytes (default: as many as reserved)."""
        if self._reserved is None:
            raise RuntimeError(f"stagewise.ShmRing.commit: ring {self.name!r} has no reserved slot; reserve one first")
        slot, view = self._reserved
        self._commit_fn(slot, len(view) if nbytes is None else nbytes)
        self._reserved = None
        _release_view(view)

    def send(self, data, timeout: float | None = None) -> None:
        """Copy a bytes-like object into the next slot and commit it."""
        src = memoryview(data).cast("B")
        self.reserve(len(src), timeout)[:] = src
        self.commit()

    # ---- reader ----------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> memoryview:
        """Wait for the next message and return a read-only view of it (valid until :meth:`release`)."""
        if self._acquired is not None:
            raise RuntimeError(f"stagewise.ShmRing.acquire: ring {self.name!r} already has an acquired message")
        slot, nbytes = self._wait("acquire", self._acquire_fn, timeout)
        view = self._readonly_slots[slot][:nbytes]
        self._acquired = (slot, view)
        return view

    def release(self) -> None:
        """Give the acquired message's slot back to the writer."""
        if self._acquired is None:
            raise RuntimeError(f"stagewise.ShmRing.release: ring {self.name!r} has no acquired message")
        slot, view = self._acquired
        self._acquired = None
        _release_view(view)
        self._release_fn(slot)

    def recv(self, timeout: float | None = None) -> bytes:
        """Copy the next message out and release its slot."""
        data = bytes(self.acquire(timeout))
        self.release()
        return data


def _release_view(view: memoryview) -> None:
    """Invalidate a view handed out, so a use after commit/release fails instead of racing the peer."""
    try:
        view.release()
    except BufferError:  # the caller made a buffer from it (e.g. torch.frombuffer): theirs to keep
        pass


def _make_segment(op: str, path: str, size: int, init) -> _Segment:
    """Create an unnamed segment (O_TMPFILE), initialise it, then give it its name with link(),
    which fails if the name exists: an attacher never sees a half-written header, and a
    creator killed before that leaves nothing behind."""
    fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        segment = _Segment(path, mm, owner=False)
        try:
            init(segment.tensor)
            _link_unnamed(fd, path)
        except BaseException as e:
            segment.tensor = None
            mm.close()
            if isinstance(e, FileExistsError):
                raise FileExistsError(
                    f"stagewise.{op}: a shared-memory segment named {os.path.basename(path)!r} already "
                    f"exists ({path}); choose another name, or remove it if it is stale"
                ) from None
            raise
        segment.owner = True
    finally:
        os.close(fd)
    return segment


def _link_unnamed(fd: int, path: str) -> None:
    """Name the O_TMPFILE file `fd`: linkat(/proc/self/fd/N, path, AT_SYMLINK_FOLLOW). A dir fd
    makes os.link use linkat (with plain link() the magic link itself would be linked)."""
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)


def _open_segment(op: str, name: str, timeout: float, external_slots: bool) -> _Segment:
    """Map an existing ring segment, check its kind, record this process as its attacher and
    remove its name. A segment of the wrong kind is left as it was."""
    path = _check_name(op, name)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise FileNotFoundError(
                    f"stagewise.{op}: no ring named {name!r} ({path} does not exist: not created yet, "
                    f"already attached by another process, or closed)"
                ) from None
            time.sleep(0.001)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"stagewise.{op}: {path} is empty, not a stagewise ring")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    segment = _Segment(path, mm, owner=False)
    try:
        flags = _ops.ring_info(segment.tensor)[4]
        if bool(flags & _EXTERNAL_SLOTS) != external_slots:
            kind = "CudaIpcRing (its slots are in GPU memory)" if flags & _EXTERNAL_SLOTS else "ShmRing"
            raise ValueError(f"it is a {kind}")
        _ops.ring_attach(segment.tensor)
    except ValueError as e:
        segment.tensor = None
        mm.close()
        raise ValueError(f"stagewise.{op}: {path} is not a ring of this kind: {e}") from None
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return segment
