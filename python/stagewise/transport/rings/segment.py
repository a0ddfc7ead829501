"""The shared-memory segment of a ring: creating it without a window for leaks, attaching to it,
removing its name. Layout and atomics: ``include/stagewise/ring.h`` and ``csrc/cpu/ring.cpp``.

A creator makes the segment unnamed (``O_TMPFILE``), initialises it, then names it with
``link()`` (which fails if the name is taken and never shows a half-written header); the
attacher removes the name as soon as it has mapped the segment. From then on no crash leaves a
file in ``/dev/shm``; before that, the creator's close, its garbage collection or its normal exit
remove the name, and only a creator killed by SIGKILL before its peer attached leaves it. A
process about to be killed so (a Ray actor whose stage did not end in time) first calls
:func:`remove_names`.
"""

from __future__ import annotations

import mmap
import os
import re
import time

import torch

SHM_DIR = "/dev/shm"
EXTERNAL_SLOTS = 1  # kRingExternalSlots: the slots are not in the segment (a CUDA IPC ring)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_ops = torch.ops.stagewise
_published: set[str] = set()
"""Paths of the segments this process named and has not removed (the peer may have, on attach)."""


def check_name(op: str, name: str) -> str:
    """The segment's path for a valid name; ValueError naming the argument otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise ValueError(
            f"stagewise.{op}: argument 'name' must be 1-200 characters of letters, digits, '_', '.', '-' "
            f"not starting with '.', got {name!r}"
        )
    return os.path.join(SHM_DIR, name)


class Segment:
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
            _published.discard(self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # the peer removed it when it attached
                pass
        self.tensor = None


def create_segment(op: str, path: str, size: int, init) -> Segment:
    """Create an unnamed segment (O_TMPFILE), initialise it, then give it its name with link(),
    which fails if the name exists: an attacher never sees a half-written header, and a
    creator killed before that leaves nothing behind."""
    fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        segment = Segment(path, mm, owner=False)
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
        _published.add(path)
    finally:
        os.close(fd)
    return segment


def remove_names() -> int:
    """Remove the name of every segment this process created and has not closed (a peer that has
    not attached yet then cannot); returns how many were still there. For a process about to be
    killed without unwinding; the rings themselves stay usable by whoever has them mapped."""
    removed = 0
    for path in list(_published):
        _published.discard(path)
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _link_unnamed(fd: int, path: str) -> None:
    """Name the O_TMPFILE file `fd`: linkat(/proc/self/fd/N, path, AT_SYMLINK_FOLLOW). A dir fd
    makes os.link use linkat (with plain link() the magic link itself would be linked)."""
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)


def open_segment(op: str, name: str, timeout: float, external_slots: bool) -> Segment:
    """Map an existing ring segment, check its kind, record this process as its attacher and
    remove its name. A segment of the wrong kind is left as it was."""
    path = check_name(op, name)
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
    segment = Segment(path, mm, owner=False)
    try:
        flags = _ops.ring_info(segment.tensor)[4]
        if bool(flags & EXTERNAL_SLOTS) != external_slots:
            kind = "CudaIpcRing (its slots are in GPU memory)" if flags & EXTERNAL_SLOTS else "ShmRing"
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
