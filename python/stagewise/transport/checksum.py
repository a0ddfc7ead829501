"""The frame checksum: CRC32C, streamed over several buffers without joining them.

CRC32C (the Castagnoli CRC of iSCSI and ext4) because CPUs compute it in hardware: the
extension's implementation (``include/stagewise/crc32c.h``; the SSE4.2 or ARMv8 CRC
instruction on three interleaved streams, a table-driven loop elsewhere) runs at about 27 GB/s
on one core of the development machine (AMD EPYC) for data in cache and 20-24 GB/s from memory
(``bench/results/*-transport.md``), and the frame encoder checksums tensors while it copies them
into a ring slot, so checksummed frames cost little more than unchecksummed ones. :func:`digest` is that C++
code; :func:`reference_digest` is the maintained ``crc32c`` package, the independent reference
the tests hold the C++ to and the codec's Python reference uses.
"""

from __future__ import annotations

import crc32c

from stagewise import _C

NAME = "CRC32C"


def digest(buffers) -> int:
    """CRC32C of the concatenation of ``buffers`` (bytes-like objects), by the extension."""
    crc = 0
    for b in buffers:
        crc = _C.crc32c(b, crc)
    return crc


def reference_digest(buffers) -> int:
    """The same by the ``crc32c`` package."""
    crc = 0
    for b in buffers:
        crc = crc32c.crc32c(b, crc)
    return crc


def hardware() -> str | None:
    """The CPU instruction the extension's CRC32C uses ("sse4.2", "armv8-crc"), None for the software loop."""
    return _C.crc32c_hardware()
