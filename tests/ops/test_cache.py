"""reshape_and_cache and slot_mapping against stagewise.ops.reference, plain
formulas and a worked example; out-of-range indices raise before anything is
written."""

from __future__ import annotations

import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import DTYPES, strided
from stagewise.ops import reference

BLOCK_SIZE = 16
TOKENS = [0, 1, 3, 17, 200]


# --- reshape_and_cache ---------------------------------------------------------------


def _kv(tokens: int, heads: int, head_dim: int, dtype, device, layout: str) -> torch.Tensor:
    x = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    if layout == "strided_tokens":
        return strided(x)
    if layout == "strided_heads":
        buf = torch.full((tokens, heads, head_dim + 5), float("nan"), dtype=dtype, device=device)
        buf[..., :head_dim] = x
        return buf[..., :head_dim]
    return x


def _caches(num_blocks: int, heads: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches holding prior values, so that a slot written by mistake shows."""
    shape = (num_blocks, BLOCK_SIZE, heads, head_dim)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)


def _slots(tokens: int, num_slots: int, slot_dtype, device) -> torch.Tensor:
    """Distinct random slots, about one token in four padding (-1)."""
    slots = torch.randperm(num_slots)[:tokens]
    slots[torch.rand(tokens) < 0.25] = -1
    return slots.to(dtype=slot_dtype, device=device)


@pytest.mark.parametrize("layout", ["contiguous", "strided_tokens", "strided_heads"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,head_dim", [(3, 83), (8, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(device, dtype, heads, head_dim, tokens, slot_dtype, layout):
    k = _kv(tokens, heads, head_dim, dtype, device, layout)
    v = _kv(tokens, heads, head_dim, dtype, device, layout)
    num_blocks = tokens // BLOCK_SIZE + 3
    k_cache, v_cache = _caches(num_blocks, heads, head_dim, dtype, device)
    slots = _slots(tokens, num_blocks * BLOCK_SIZE, slot_dtype, device)
    expected_k, expected_v = reference.reshape_and_cache(k, v, k_cache, v_cache, slots)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    ops.reshape_and_cache(k, v, k_cache, v_cache, slots)

    # A copy: bit for bit.
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
    # Slots no token maps to keep their prior values.
    untouched = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0].long()] = False
    flat = (num_blocks * BLOCK_SIZE, heads, head_dim)
    torch.testing.assert_close(k_cache.view(flat)[untouched], k_before.view(flat)[untouched], rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(flat)[untouched], v_before.view(flat)[untouched], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-2, 64, 10**12])
def test_reshape_and_cache_out_of_range_slot(device, bad):
    k, v = torch.randn(6, 2, 8, device=device), torch.randn(6, 2, 8, device=device)
    k_cache, v_cache = _caches(4, 2, 8, torch.float32, device)  # 64 slots
    slots = torch.tensor([0, 1, -1, 2, 3, 4], device=device)
    slots[4] = bad
    k_before, v_before = k_cache.clone(), v_cache.clone()

    if device == "cuda":
        # The GPU skips an out-of-range slot instead of raising (cache.h); the others are written.
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
        slots[4] = -1
        expected_k, expected_v = reference.reshape_and_cache(k, v, k_before, v_before, slots)
        torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
        torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
        return
    with pytest.raises(IndexError, match=rf"stagewise\.reshape_and_cache: slot_mapping\[4\] = {bad} is out of range \[-1, 64\)"):
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    # Checked before anything is written: tokens 0..3 were not cached either.
    torch.testing.assert_close(k_cache, k_before, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_before, rtol=0, atol=0)


# --- slot_mapping ----------------------------------------------------------------------


def _block_tables(num_seqs: int, max_blocks: int, index_dtype, device) -> torch.Tensor:
    """Distinct block ids, shuffled, so distinct (sequence, block) pairs never share a block."""
    ids = torch.randperm(num_seqs * max_blocks + 7)[: num_seqs * max_blocks]
    return ids.view(num_seqs, max_blocks).to(dtype=index_dtype, device=device)


def _tokens(tokens: int, num_seqs: int, max_position: int, index_dtype, device):
    """seq_index and positions of `tokens` tokens; some positions are padding (negative)."""
    seq_index = torch.randint(0, num_seqs, (tokens,))
    positions = torch.randint(0, max_position, (tokens,))
    positions[torch.rand(tokens) < 0.1] = -1
    return seq_index.to(dtype=index_dtype, device=device), positions.to(dtype=index_dtype, device=device)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", TOKENS)
def test_slot_mapping_without_cp_is_the_paged_slot(device, tokens, index_dtype):
    num_seqs, max_blocks = 5, 9
    tables = _block_tables(num_seqs, max_blocks, index_dtype, device)
    seq_index, positions = _tokens(tokens, num_seqs, max_blocks * BLOCK_SIZE, index_dtype, device)

    out = ops.slot_mapping(tables, seq_index, positions, BLOCK_SIZE)

    # The plain formula, one token at a time.
    expected = [
        -1 if pos < 0 else int(tables[seq, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
        for seq, pos in zip(seq_index.tolist(), positions.tolist())
    ]
    assert out.dtype == torch.int64 and out.device == positions.device
    assert out.tolist() == expected


CP_LAYOUTS = [(cp, interleave) for cp in (2, 4) for interleave in (1, 2, BLOCK_SIZE)]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("cp_world_size,interleave", CP_LAYOUTS)
def test_slot_mapping_context_parallel(device, cp_world_size, interleave, tokens, index_dtype):
    num_seqs, max_blocks = 5, 9
    tables = _block_tables(num_seqs, max_blocks, index_dtype, device)
    seq_index, positions = _tokens(tokens, num_seqs, max_blocks * BLOCK_SIZE * cp_world_size, index_dtype, device)

    per_rank = []
    for rank in range(cp_world_size):
        out = ops.slot_mapping(tables, seq_index, positions, BLOCK_SIZE, cp_world_size, rank, interleave)
        expected = reference.slot_mapping(tables, seq_index, positions, BLOCK_SIZE, cp_world_size, rank, interleave)
        assert out.tolist() == expected.tolist()
        per_rank.append(out.cpu())

    owned = torch.stack(per_rank) >= 0  # [cp_world_size, tokens]
    # Every real position is stored by exactly one rank; padding by none.
    assert owned.sum(0).tolist() == [1 if p >= 0 else 0 for p in positions.tolist()]
    # On each rank, distinct positions of one sequence get distinct slots.
    keys = list(zip(seq_index.tolist(), positions.tolist()))
    for out in per_rank:
        slot_of = {}
        for key, slot in zip(keys, out.tolist()):
            if slot >= 0:
                assert slot_of.setdefault(key, slot) == slot  # a repeated token maps to the same slot
        for seq in range(num_seqs):
            slots = [s for (sq, _), s in slot_of.items() if sq == seq]
            assert len(slots) == len(set(slots))


def test_slot_mapping_worked_example(device):
    # The context-parallel layout (cache.h) with block_size 4, pcp_size * dcp_size = 2 ranks and
    # cp_kv_cache_interleave_size 2: virtual_block_size = 4 * 2 = 8. One sequence with
    # block table [7, 3]. For token x: virtual block x // 8 (block 7, then 3),
    # offset o = x % 8, local block index o // 2, device (o // 2) % 2, offset in the
    # local block ((o // 2) // 2) * 2 + o % 2. So x = 0, 1 -> rank 0 offsets 0, 1;
    # x = 2, 3 -> rank 1 offsets 0, 1; x = 4, 5 -> rank 0 offsets 2, 3; x = 6, 7 -> rank 1
    # offsets 2, 3; x = 8..15 repeat this in block 3. Slot = block * 4 + offset:
    # rank 0: 28 29 . . 30 31 . . 12 13 . . 14 15 . .   (. = -1, another rank's token)
    # rank 1: . . 28 29 . . 30 31 . . 12 13 . . 14 15
    # A last token at position -1 is padding on both ranks.
    tables = torch.tensor([[7, 3]], dtype=torch.int32, device=device)
    positions = torch.tensor(list(range(16)) + [-1], device=device)
    seq_index = torch.zeros(17, dtype=torch.int64, device=device)
    expected = {
        0: [28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15, -1, -1, -1],
        1: [-1, -1, 28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15, -1],
    }
    for rank in (0, 1):
        out = ops.slot_mapping(tables, seq_index, positions, 4, cp_world_size=2, cp_rank=rank, interleave_size=2)
        assert out.tolist() == expected[rank]


def _slot_mapping_case(device):
    """3 sequences x 4 blocks of block_size 4, 2 ranks, interleave 2; 5 valid tokens."""
    tables = torch.arange(12, device=device).view(3, 4)
    seq_index = torch.tensor([0, 1, 2, 1, 0], device=device)
    positions = torch.tensor([0, 5, 31, -1, 9], device=device)  # 31: last position of the 4 blocks x 8
    return tables, seq_index, positions


def test_slot_mapping_out_of_range_seq_index(device):
    tables, seq_index, positions = _slot_mapping_case(device)
    seq_index[2] = 3
    if device == "cuda":  # the GPU maps the token to -1 instead of raising (cache.h)
        assert ops.slot_mapping(tables, seq_index, positions, 4, 2, 1, 2)[2].item() == -1
        return
    with pytest.raises(IndexError, match=r"stagewise\.slot_mapping: seq_index\[2\] = 3 is out of range \[0, 3\)"):
        ops.slot_mapping(tables, seq_index, positions, 4, 2, 1, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_slot_mapping_position_past_block_table(device, rank):
    # Position 32 is in virtual block 4 of a 4-block table, whichever rank owns it.
    tables, seq_index, positions = _slot_mapping_case(device)
    positions[4] = 32
    if device == "cuda":
        assert ops.slot_mapping(tables, seq_index, positions, 4, 2, rank, 2)[4].item() == -1
        return
    with pytest.raises(IndexError, match=r"stagewise\.slot_mapping: positions\[4\] = 32 is out of range \[0, 32\)"):
        ops.slot_mapping(tables, seq_index, positions, 4, 2, rank, 2)


def test_slot_mapping_negative_block_id(device):
    if device == "cuda":
        pytest.skip("cache.h leaves a negative block id on the GPU unspecified")
    # Token 1 (sequence 1, position 5) is in virtual block 0 of sequence 1 and owned by rank 0
    # (offset 5 -> local block 2 -> rank 0); make that block id negative.
    tables, seq_index, positions = _slot_mapping_case(device)
    tables[1, 0] = -1
    with pytest.raises(IndexError, match=r"stagewise\.slot_mapping: block_tables\[1, 0\] = -1 is out of range \[0, inf\)"):
        ops.slot_mapping(tables, seq_index, positions, 4, 2, 0, 2)
    # Rank 1 stores no token of that block: the entry is never read, so no error.
    out = ops.slot_mapping(tables, seq_index, positions, 4, 2, 1, 2)
    assert out.tolist() == reference.slot_mapping(tables, seq_index, positions, 4, 2, 1, 2).tolist()
