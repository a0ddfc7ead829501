"""The frame checksum: the extension's CRC32C (include/stagewise/crc32c.h) on each of its paths
against the standard check value and the `crc32c` package, over every length up to 300 bytes,
odd alignments, the lane boundaries of the three-stream hardware loop and large buffers; and its
checksum-while-copying variant (what the frame encoder writes ring slots with)."""

from __future__ import annotations

import random

import crc32c
import pytest

from stagewise import _C
from stagewise.transport import checksum

HARDWARE = _C.crc32c_hardware()
PATHS = [
    "auto",
    "software",
    pytest.param("hardware", marks=pytest.mark.skipif(
        HARDWARE is None, reason="this CPU has no CRC32C instruction (SSE4.2 / ARMv8 CRC); the software path is tested")),
]  # fmt: skip
# Around the lane lengths (64 B, 256 B, 2 KB, 8 KB, 128 KB lanes; blocks of three) and beyond.
BOUNDARIES = [191, 192, 193, 767, 768, 769, 768 * 2 + 7, 6143, 6144, 6145, 8192 + 80, 24575, 24576, 24577,
              3 * 131072 - 1, 3 * 131072, 3 * 131072 + 9]
DATA = random.Random(7).randbytes(4 << 20)


@pytest.mark.parametrize("path", PATHS)
def test_check_value(path):
    assert _C.crc32c(b"123456789", path=path) == 0xE3069283
    assert _C.crc32c(b"", path=path) == 0


@pytest.mark.parametrize("path", PATHS)
def test_every_short_length_at_every_alignment(path):
    for offset in range(8):
        view = memoryview(DATA)[offset:]
        for n in range(301):
            assert _C.crc32c(view[:n], path=path) == crc32c.crc32c(view[:n]), (offset, n)


@pytest.mark.parametrize("path", PATHS)
def test_lane_boundaries_and_large_buffers(path):
    for n in [*BOUNDARIES, len(DATA) - 3]:
        for offset in (0, 1, 3):
            view = memoryview(DATA)[offset : offset + n]
            assert _C.crc32c(view, path=path) == crc32c.crc32c(view), (offset, n)


@pytest.mark.parametrize("path", PATHS)
def test_continuing_from_a_previous_crc(path):
    rng = random.Random(3)
    for _ in range(50):
        cut = sorted(rng.randrange(100_000) for _ in range(2))
        a, b, c = DATA[: cut[0]], DATA[cut[0] : cut[1]], DATA[cut[1] : 100_000]
        crc = _C.crc32c(c, _C.crc32c(b, _C.crc32c(a, path=path), path=path), path=path)
        assert crc == crc32c.crc32c(DATA[:100_000])
    assert checksum.digest([a, b, c]) == checksum.reference_digest([a, b, c]) == crc


@pytest.mark.parametrize("path", PATHS)
def test_checksum_while_copying(path):
    for n in [*range(0, 301, 7), *BOUNDARIES]:
        for src_off, dst_off in ((0, 0), (1, 3), (5, 0)):
            src = memoryview(DATA)[src_off : src_off + n]
            dst = bytearray(n + 16)
            crc = _C.crc32c_copy(memoryview(dst)[dst_off:], src, 7, path=path)
            assert crc == crc32c.crc32c(src, 7), (n, src_off, dst_off)
            assert dst[dst_off : dst_off + n] == src and dst[:dst_off] == bytes(dst_off)
            assert dst[dst_off + n :] == bytes(16 - dst_off)  # nothing written past the copy
    with pytest.raises(ValueError, match="'dst' has 3 bytes, 'src' 4"):
        _C.crc32c_copy(bytearray(3), b"abcd", path=path)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'path' must be 'auto', 'hardware' or 'software', got 'fast'"):
        _C.crc32c(b"x", path="fast")
    with pytest.raises(ValueError, match="'value' must be a 32-bit CRC"):
        _C.crc32c(b"x", 1 << 32)
    with pytest.raises(TypeError):
        _C.crc32c("text")


@pytest.mark.skipif(HARDWARE is not None, reason="checks the message on a CPU without the instruction")
def test_hardware_path_without_the_instruction_is_refused():
    with pytest.raises(RuntimeError, match="no CRC32C instruction"):
        _C.crc32c(b"x", path="hardware")
