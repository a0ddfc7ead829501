"""Shared-memory activation ring between two processes on one host: the ring of
:mod:`~stagewise.transport.rings.host_ring` with its slots in the segment.

Zero copy: :meth:`ShmRing.reserve` returns a writable memoryview of the slot itself and
:meth:`ShmRing.acquire` a read-only one (``torch.frombuffer`` turns it into a tensor without a
copy); the bytes stay valid until :meth:`ShmRing.commit` / :meth:`ShmRing.release`, after which
the view is released (using it raises ``ValueError``). The ring carries bytes only: the frame
codec encodes into the slot the writer reserved and decodes from the slot the reader acquired
(:class:`~stagewise.transport.rings.shm.ShmChannel`).
"""

from __future__ import annotations

from stagewise.transport.rings.host_ring import HostRing
from stagewise.transport.rings.segment import Segment, open_segment


class ShmRing(HostRing):
    """One end of a shared-memory ring; make it with :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, segment: Segment):
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
        return cls(name, cls.create_segment(name, slot_bytes, num_slots, spin_us))

    @classmethod
    def attach(cls, name: str, timeout: float = 0.0) -> ShmRing:
        """Attach to the ring another process created, waiting up to ``timeout`` seconds for it to appear.

        Removes the name: the two ends now hold the only references. Raises ``FileNotFoundError``
        when there is no such ring, ``ValueError`` when the segment is not a ring.
        """
        return cls(name, open_segment(f"{cls.__name__}.attach", name, timeout, cls._external_slots))

    def close(self) -> None:
        for held in (self._reserved, self._acquired):
            if held is not None:
                _release_view(held[1])
        self._reserved = self._acquired = None
        for view in (*self._readonly_slots, *self._slots):
            view.release()
        self._slots, self._readonly_slots = [], []
        super().close()

    def slot_address(self, slot: int) -> int:
        """The address of slot ``slot`` in this process: a tensor made from an acquired view
        starts there (zero copy)."""
        segment = self._segment.tensor
        if not 0 <= slot < self.num_slots or segment is None:
            raise ValueError(f"stagewise.ShmRing.slot_address: argument 'slot' must be in [0, {self.num_slots}) of "
                             f"an open ring, got {slot}")  # fmt: skip
        return segment.data_ptr() + self._data_offset + slot * self._stride

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

    def acquire(self, timeout: float | None = None, on_due=None) -> memoryview:
        """Wait for the next message and return a read-only view of it (valid until :meth:`release`).
        ``on_due()``: called while the message is due and has not come (see HostRing)."""
        if self._acquired is not None:
            raise RuntimeError(f"stagewise.ShmRing.acquire: ring {self.name!r} already has an acquired message")
        slot, nbytes = self._acquire_slot(timeout, on_due)
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

