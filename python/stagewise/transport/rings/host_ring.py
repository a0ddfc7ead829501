"""What both ring kinds share: the control segment, its counters, waiting, closing.

A ring is a single-producer single-consumer queue of ``num_slots`` slots of ``slot_bytes`` bytes,
in a POSIX shared-memory segment (``/dev/shm/<name>``; :mod:`~stagewise.transport.rings.segment`)
that holds the header, each slot's message size and, for :class:`~stagewise.transport.rings.ShmRing`,
the slots themselves. One process writes, the other reads; messages are byte strings up to
``slot_bytes`` long, delivered in order.

Waiting: a full ring makes the writer wait (back-pressure), an empty one the reader; both spin for
``spin_us`` then sleep on a futex, so an idle stage uses no CPU. The reader also paces its waits
by how long it waited for the last messages: it sleeps until shortly before the next is due and
spins from then (``include/stagewise/ring.h``), and may run ``on_due`` meanwhile. ``timeout=None``
waits forever (Ctrl-C still interrupts within ~0.1 s); a timeout raises :class:`TimeoutError`. Either side's
``close()`` ends the ring for the other: the reader first gets the messages already committed,
then :class:`RingClosedError`; a peer process that dies without closing is noticed by a waiter
within ~20 ms.

Not thread-safe: use each end from one thread (another thread may ``close()`` it, which ends that
thread's wait with :class:`RingClosedError`). Linux only (futex, /dev/shm).
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from functools import partial

import torch

from stagewise import _C
from stagewise.transport.rings.segment import Segment, check_name, create_segment

# The torch ops behind the rings (schema: csrc/bindings/schema.cpp).
RING_OPS = ("ring_bytes", "ring_init", "ring_attach", "ring_info", "ring_reserve", "ring_commit",
            "ring_acquire", "ring_release", "ring_close")  # fmt: skip

TIMED_OUT, CLOSED, DUE = -1, -2, -3  # results of the ring ops besides a slot index (kRingTimedOut, ...)
DUE_AT_ONCE, DUE_AFTER = 1, 2  # ring_acquire's due modes (kDueAtOnce, kDueAfter)
DUE_EVERY_US = 300
"""While a message is due, a reader with ``on_due`` runs it this often: a stage's caches, warmed
once, are cold again within a millisecond or two of its neighbour's step (measured: a small
frame's decode takes ~100 us after one warming at the window's start, ~40 us warmed this often)."""
_WAIT_CHUNK_US = 100_000  # a long wait returns to Python this often (signals, Ctrl-C)

_ops = torch.ops.stagewise


class RingClosedError(ConnectionError):
    """The other end closed the ring, or its process is gone."""


class HostRing:
    """What both ring kinds share: the control segment, its counters, waiting, closing.

    Subclasses say where the slots are (:class:`ShmRing`: in the segment; ``CudaIpcRing``:
    in GPU memory) and what a slot view is (a memoryview, a CUDA tensor).
    """

    _external_slots = False  # kRingExternalSlots: the slots are not in the segment

    def __init__(self, name: str, segment: Segment):
        self.name = name
        self._segment = segment
        self._finalizer = weakref.finalize(self, Segment.close, segment)  # also at interpreter exit
        info = _ops.ring_info(segment.tensor)
        self.slot_bytes, self.num_slots, self._stride, self._data_offset = info[:4]
        self._user_offset = info[8]
        direct = (_C.ring_reserve, _C.ring_commit, _C.ring_acquire, _C.ring_release)
        self._bind(*direct, segment.tensor.data_ptr(), len(segment.mm))

    def _bind(self, reserve, commit, acquire, release, *ring) -> None:
        self._reserve_fn, self._commit_fn = partial(reserve, *ring), partial(commit, *ring)
        self._acquire_due_fn, self._release_fn = partial(acquire, *ring), partial(release, *ring)
        self._acquire_fn = lambda timeout_us: acquire(*ring, timeout_us, 0)  # noqa: E731

    def use_torch_ops(self) -> None:
        """Go through the torch ops (the dispatcher) instead of the extension's direct functions;
        same C++ underneath, about 5 us more a call: for tests of the ops and the benchmark that
        prices the dispatcher. (The op has no due mode: ``on_due`` is not called.)"""
        self._bind(_ops.ring_reserve, _ops.ring_commit,
                   lambda ring, timeout_us, _due_mode: _ops.ring_acquire(ring, timeout_us), _ops.ring_release,
                   self._segment.tensor)

    def _acquire_slot(self, timeout: float | None, on_due) -> tuple[int, int]:
        """(slot, nbytes) of the next message; ``on_due()`` is called when the wait slept until the
        message was due (the consumer's pacing, ``include/stagewise/ring.h``), then every
        :data:`DUE_EVERY_US` of spinning while it stays due: the moments to warm the caches for it."""
        if on_due is None:
            return self._wait("acquire", self._acquire_fn, timeout)
        due = [False]

        def acquire(timeout_us: int):
            if due[0]:  # spin a while, then say whether it is still due
                result = self._acquire_due_fn(min(timeout_us, DUE_EVERY_US), DUE_AFTER)
            else:
                result = self._acquire_due_fn(timeout_us, DUE_AT_ONCE)
            due[0] = result[0] == DUE  # else a message, or its window passed: wait on as usual
            if not due[0]:
                return result
            on_due()
            return TIMED_OUT, 0  # _wait calls again, unless the deadline passed

        return self._wait("acquire", acquire, timeout)

    @staticmethod
    def unique_name(prefix: str = "stagewise") -> str:
        """A fresh segment name: ``<prefix>-<pid>-<random hex>``."""
        return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"

    @classmethod
    def create_segment(cls, name: str, slot_bytes: int, num_slots: int, spin_us: int = 50, user=None) -> Segment:
        """The initialised control segment of a ring of this kind, published as ``name`` (what
        ``create`` builds on; alone, a ring's host half). ``user(ring_info) -> bytes`` (optional)
        gives what to store in the header's opaque bytes before the segment is published."""
        kind = cls.__name__
        path = check_name(f"{kind}.create", name)
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

        return create_segment(f"{kind}.create", path, size, init)

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
    def pacing(self) -> tuple[float | None, bool]:
        """The consumer's pacing (``include/stagewise/ring.h``): the wait it expects for its next
        message, in seconds (None until two messages kept it waiting), and whether it is waiting."""
        info = _ops.ring_info(self._segment.tensor)
        expected = min(info[11], info[12])
        return (expected / 1e9 if expected > 0 else None), bool(info[13])

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

