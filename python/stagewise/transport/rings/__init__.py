"""Zero-copy links between stage processes on one host: rings of slots in shared memory (``shm``)
or GPU memory (``cuda-ipc``), set up on a TCP channel by a ``link`` message (``docs/rings.md``).

Module map, each importing only those above it:

- :mod:`~stagewise.transport.rings.segment`: the shared-memory segment (create, attach, no leaks);
- :mod:`~stagewise.transport.rings.host_ring`: what both ring kinds share (counters, waiting, closing);
- :mod:`~stagewise.transport.rings.shm_ring`, :mod:`~stagewise.transport.rings.cuda_ipc_ring`: the rings;
- :mod:`~stagewise.transport.rings.link`: the ``link`` message, :class:`RingLink` (a channel of ring +
  TCP) and :class:`TcpLink` (the ``tcp`` transport's setup: the TCP channel itself);
- :mod:`~stagewise.transport.rings.shm`, :mod:`~stagewise.transport.rings.cuda_ipc`: frames over the rings;
- :mod:`~stagewise.transport.rings.upgrade`: :func:`upgrade_dialled` / :func:`upgrade_accepted`
  (what the runtime calls on a fresh data link: the transport's setup from
  :mod:`stagewise.transport.registry`) and :func:`open_link`.
"""

from __future__ import annotations

from stagewise.transport.rings.cuda_ipc import CudaIpcChannel
from stagewise.transport.rings.cuda_ipc_ring import CUDA_IPC_OPS, CudaIpcRing, RingHandle
from stagewise.transport.rings.host_ring import RING_OPS, HostRing, RingClosedError
from stagewise.transport.rings.link import RingLink, TcpLink
from stagewise.transport.rings.segment import SHM_DIR
from stagewise.transport.rings.shm import ShmChannel
from stagewise.transport.rings.shm_ring import ShmRing
from stagewise.transport.rings.upgrade import open_link, upgrade_accepted, upgrade_dialled

__all__ = [
    "CUDA_IPC_OPS", "RING_OPS", "SHM_DIR", "CudaIpcChannel", "CudaIpcRing", "HostRing", "RingClosedError",
    "RingHandle", "RingLink", "ShmChannel", "ShmRing", "TcpLink", "open_link", "upgrade_accepted", "upgrade_dialled",
]  # fmt: skip
