"""The frame checksum: XXH3-64 (seed 0), streamed over several buffers without joining them.

XXH3-64 rather than CRC32C: both are in seed 000 §3.2's spirit ("crc32 or xxhash64"), and on
this project's CPUs the xxhash package hashes at several GB/s, about twice the crc32c package
(`stagewise bench transport` prints the measured rate).

The codec's fast path in the extension (``csrc/bindings/frame_py.cpp``) computes the same XXH3-64
with the same xxHash library (vendored in ``csrc/third_party/xxhash``); this module is the
reference the tests hold it to.
"""

from __future__ import annotations

import xxhash

NAME = "XXH3-64"


def digest(buffers) -> int:
    """XXH3-64 of the concatenation of ``buffers`` (bytes-like objects)."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()

