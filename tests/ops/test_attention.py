"""decode_attention: split-KV flash-decoding over the paged cache (+ the new token).

Held against stagewise.ops.reference.decode_attention, and against a plain
float64 softmax attention over unpaged K/V built here: each sequence's K/V is
made contiguous first, then scattered into randomly permuted cache blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.kernels import DEVICES, DTYPES, HAS_CUDA, TOLERANCES, assert_close, paged_kv, poison_, strided

import stagewise.ops as ops
from stagewise.ops import reference

# The kernel and both oracles get the same half values, exact in float32, so
# lse differs only by float32 accumulation order (~1e-6 relative of an lse of a
# few units). For half inputs 1e-4 absolute leaves room for device kernels that
# fold scale * log2(e) into the scores and work in base 2.
LSE_TOL = {torch.float32: TOLERANCES[torch.float32], torch.bfloat16: dict(rtol=1e-5, atol=1e-4)}
LSE_TOL[torch.float16] = LSE_TOL[torch.bfloat16]

SEQ_LENS = [0, 1, 15, 16, 17, 100, 333]  # mixed in one batch: empty, one token, block edges
HEADS = [(4, 4), (8, 2), (4, 1)]  # (num_q_heads, num_kv_heads): MHA, GQA 4:1, MQA
DEVICE_HEAD_DIMS = (64, 128, 256)  # what the CUDA kernel supports; the CPU takes any


HEAD_DIMS = (64, 128, 256, 91, 7)  # 91: every vector width + a scalar tail
# (device, head_dim): the CPU takes every head_dim, CUDA only its kernel's.
DEVICE_HEAD_DIM_CASES = [pytest.param(*d.values, h, marks=d.marks, id=f"{d.values[0]}-d{h}")
                         for d in (pytest.param(x) if isinstance(x, str) else x for x in DEVICES) for h in HEAD_DIMS
                         if d.values[0] == "cpu" or h in DEVICE_HEAD_DIMS]


def plain_attention(q, seqs, scale, k_new=None, v_new=None):
    """Softmax attention of q ``[B, Hq, D]`` over unpaged K/V (+ new token) in float64.

    Query head h uses kv head h // (Hq / Hk). Returns out ``[B, Hq, D]`` and lse ``[B, Hq]``, float64.
    """
    batch, hq, d = q.shape
    outs, lses = [], []
    for b, (k, v) in enumerate(seqs):
        if k_new is not None:
            k, v = torch.cat([k, k_new[b : b + 1]]), torch.cat([v, v_new[b : b + 1]])
        hk = k.size(1)
        if k.size(0) == 0:
            outs.append(torch.zeros(hq, d, dtype=torch.float64, device=q.device))
            lses.append(torch.full((hq,), -math.inf, dtype=torch.float64, device=q.device))
            continue
        qg = q[b].double().reshape(hk, hq // hk, d)  # [Hk, G, D]
        scores = torch.einsum("kgd,nkd->kgn", qg, k.double()) * scale
        outs.append(torch.einsum("kgn,nkd->kgd", torch.softmax(scores, -1), v.double()).reshape(hq, d))
        lses.append(torch.logsumexp(scores, -1).reshape(hq))
    return torch.stack(outs), torch.stack(lses)


def poisoned_outputs(batch, hq, d, dtype, device):
    """NaN-filled out ``[B, Hq, D]`` (rows strided) and lse ``[B, Hq]``."""
    out = strided(poison_(torch.empty(batch, hq, d, dtype=dtype, device=device)))
    return out, poison_(torch.empty(batch, hq, dtype=torch.float32, device=device))


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("with_new", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("device", "head_dim"), DEVICE_HEAD_DIM_CASES)
def test_matches_reference_and_plain_attention(device, dtype, head_dim, heads, with_new, num_splits):
    hq, hk = heads
    seq_lens = SEQ_LENS[::-1] if with_new else SEQ_LENS  # vary which row is which length
    k_cache, v_cache, tables, seqs = paged_kv(seq_lens, hk, head_dim, 16, dtype, device)
    batch = len(seq_lens)
    q = strided((2 * torch.randn(batch, hq, head_dim)).to(dtype).to(device))  # peaked softmax
    k_new = v_new = None
    if with_new:
        k_new = strided(torch.randn(batch, hk, head_dim).to(dtype).to(device))
        v_new = strided(torch.randn(batch, hk, head_dim).to(dtype).to(device))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out, lse = poisoned_outputs(batch, hq, head_dim, dtype, device)

    ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, k_new, v_new, num_splits, out=out, lse=lse)

    ref_out, ref_lse = reference.decode_attention(q, k_cache, v_cache, tables, lens, scale, k_new, v_new)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse, **LSE_TOL[dtype])
    plain_out, plain_lse = plain_attention(q, seqs, scale, k_new, v_new)
    assert_close(out, plain_out.to(dtype))
    assert_close(lse, plain_lse.float(), **LSE_TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("lens_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_index_dtypes_and_block_sizes(device, table_dtype, lens_dtype, block_size):
    seq_lens = [40, 0, 7, 64]  # the longest fills its table row exactly
    k_cache, v_cache, tables, seqs = paged_kv(seq_lens, 2, 64, block_size, torch.float32, device,
                                              table_dtype, spare_columns=0)
    q = torch.randn(len(seq_lens), 4, 64, device=device)
    lens = torch.tensor(seq_lens, dtype=lens_dtype, device=device)
    out, lse = poisoned_outputs(len(seq_lens), 4, 64, torch.float32, device)
    ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=2, out=out, lse=lse)
    plain_out, plain_lse = plain_attention(q, seqs, 0.125)
    assert_close(out, plain_out.float())
    assert_close(lse, plain_lse.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_independent_of_num_splits(device, dtype):
    seq_lens = [1, 250, 1000, 31]
    k_cache, v_cache, tables, _ = paged_kv(seq_lens, 2, 128, 16, dtype, device)
    q = torch.randn(len(seq_lens), 8, 128).to(dtype).to(device)
    lens = torch.tensor(seq_lens, device=device)
    base_out, base_lse = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=1)
    for num_splits in [*range(2, 9), 16, None]:
        out, lse = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=num_splits)
        assert_close(out, base_out, msg=lambda m: f"num_splits={num_splits}: {m}")
        assert_close(lse, base_lse, **LSE_TOL[dtype], msg=lambda m: f"num_splits={num_splits}: {m}")


def test_single_long_sequence_heuristic_splits(device):
    """Batch 1, one kv head: the split heuristic is what spreads the work; the result must not change."""
    k_cache, v_cache, tables, seqs = paged_kv([3000], 1, 128, 16, torch.float32, device)
    q = torch.randn(1, 8, 128, device=device)
    lens = torch.tensor([3000], device=device)
    out, lse = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.09)
    plain_out, plain_lse = plain_attention(q, seqs, 0.09)
    assert_close(out, plain_out.float())
    assert_close(lse, plain_lse.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_nothing_to_attend_to(device, dtype):
    """seq_len 0 and no new token: out = 0, lse = -inf; with only the new token: out = v_new."""
    k_cache, v_cache, tables, _ = paged_kv([0, 0, 0], 2, 64, 16, dtype, device)
    lens = torch.zeros(3, dtype=torch.int32, device=device)
    q = torch.randn(3, 4, 64).to(dtype).to(device)
    for num_splits in [None, 1, 4]:
        out, lse = poisoned_outputs(3, 4, 64, dtype, device)
        ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits, out=out, lse=lse)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, -math.inf))

        k_new = torch.randn(3, 2, 64).to(dtype).to(device)
        v_new = torch.randn(3, 2, 64).to(dtype).to(device)
        out, lse = poisoned_outputs(3, 4, 64, dtype, device)
        ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, k_new, v_new, num_splits, out=out, lse=lse)
        # One key: softmax weight 1, so out is v_new of the head's group and lse its score.
        assert_close(out, v_new.repeat_interleave(2, dim=1), rtol=0, atol=0)
        score = torch.einsum("bhd,bhd->bh", q.float(), k_new.float().repeat_interleave(2, dim=1)) * 0.125
        assert_close(lse, score, **LSE_TOL[dtype])


@pytest.mark.parametrize("with_new", [False, True])
def test_nan_query_carries_to_its_head_only(device, with_new):
    """A NaN in one query row makes that head's out and lse NaN, as the reference's (a split whose
    softmax sum is NaN is not mistaken for an empty one), and leaves every other head as it was."""
    k_cache, v_cache, tables, _ = paged_kv([40, 20, 333], 2, 64, 16, torch.float32, device)
    lens = torch.tensor([40, 20, 333], dtype=torch.int32, device=device)
    q = torch.randn(3, 4, 64, device=device)
    q[0, 1, 3] = math.nan
    new = (torch.randn(3, 2, 64, device=device), torch.randn(3, 2, 64, device=device)) if with_new else (None, None)
    for num_splits in [1, 3]:
        out, lse = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, *new, num_splits)
        ref_out, ref_lse = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, *new)
        assert out[0, 1].isnan().all() and lse[0, 1].isnan()
        ok = torch.ones(3, 4, dtype=torch.bool)
        ok[0, 1] = False
        assert_close(out[ok], ref_out[ok], **TOLERANCES[torch.float32])
        assert_close(lse[ok], ref_lse[ok], **LSE_TOL[torch.float32])


def test_empty_batch(device):
    k_cache, v_cache, tables, _ = paged_kv([5], 2, 64, 16, torch.float32, device)
    q = torch.empty(0, 4, 64, device=device)
    no_lens = torch.zeros(0, dtype=torch.int32, device=device)
    out, lse = ops.decode_attention(q, k_cache, v_cache, tables[:0], no_lens, 0.1)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


BAD_METADATA = {
    # name: (seq_lens, (row, column, block id) to write, exception, message pattern)
    "block_id_too_big": ([3, 60], (1, 3, 999), IndexError, r"block_tables\[1\]\[3\] = 999 is out of range \[0, 64\)"),
    "block_id_negative": ([3, 60], (1, 0, -1), IndexError, r"block_tables\[1\]\[0\] = -1 is out of range \[0, 64\)"),
    "seq_len_too_long": ([3, 129], None, ValueError, r"seq_lens\[1\] = 129 is out of range \[0, 128\]"),
    "seq_len_negative": ([-1, 60], None, ValueError, r"seq_lens\[0\] = -1 is out of range \[0, 128\]"),
}


# The CUDA kernel clamps or skips bad metadata instead of raising (no host sync): CPU only.
@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("case", BAD_METADATA)
def test_bad_metadata_raises_and_leaves_outputs(device, case):
    seq_lens, bad_entry, error, pattern = BAD_METADATA[case]
    k_cache = torch.randn(64, 16, 2, 64, device=device)
    v_cache = torch.randn(64, 16, 2, 64, device=device)
    tables = torch.randperm(64, device=device)[:16].view(2, 8).int()  # capacity 8 * 16 = 128 tokens
    if bad_entry is not None:
        row, column, block = bad_entry
        tables[row, column] = block
    q = torch.randn(2, 4, 64, device=device)
    out, lse = poisoned_outputs(2, 4, 64, torch.float32, device)
    with pytest.raises(error, match=pattern):
        ops.decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, device=device), 0.1,
                             num_splits=2, out=out, lse=lse)
    assert out.isnan().all() and lse.isnan().all(), "outputs written before the error"


# ---- sliding window ---------------------------------------------------------------------------

WINDOWS = [1, 2, 16, 17, 60, 400]  # the query alone; block edges; shorter and longer than the sequences


def windowed(seqs, tables, window, with_new, block_size=16):
    """Each sequence's last keys in the window (unpaged), and its table with the entries of blocks
    wholly before the window set to -1, as a sliding-window layer's freed blocks are."""
    tables = tables.clone()
    kept = []
    for b, (k, v) in enumerate(seqs):
        first = max(0, k.size(0) + with_new - window)
        tables[b, : first // block_size] = -1
        kept.append((k[first:], v[first:]))
    return kept, tables


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("with_new", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_matches_reference_and_plain_attention(device, dtype, window, with_new, num_splits):
    """Keys older than the window are not attended to, and the blocks holding only such keys are
    never read: their table entries are -1."""
    seq_lens = SEQ_LENS[::-1] if with_new else SEQ_LENS
    k_cache, v_cache, tables, seqs = paged_kv(seq_lens, 2, 64, 16, dtype, device)
    seqs, tables = windowed(seqs, tables, window, with_new)
    batch = len(seq_lens)
    q = strided((2 * torch.randn(batch, 8, 64)).to(dtype).to(device))
    k_new = v_new = None
    if with_new:
        k_new, v_new = (strided(torch.randn(batch, 2, 64).to(dtype).to(device)) for _ in range(2))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out, lse = poisoned_outputs(batch, 8, 64, dtype, device)

    ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, k_new, v_new, num_splits, window=window, out=out,
                         lse=lse)

    ref_out, ref_lse = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, k_new, v_new, window)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse, **LSE_TOL[dtype])
    plain_out, plain_lse = plain_attention(q, seqs, 0.125, k_new, v_new)
    assert_close(out, plain_out.to(dtype))
    assert_close(lse, plain_lse.float(), **LSE_TOL[dtype])


def test_window_rows_of_one_sequence(device):
    """A prompt chunk's rows, as the attention layer runs them after writing the chunk: each row
    of one sequence attends over the cache up to its own position (seq_len = position + 1), its
    window counted back from itself."""
    k_cache, v_cache, tables, seqs = paged_kv([45], 2, 64, 5, torch.float32, device)
    rows = torch.arange(20, 45, device=device)
    q = torch.randn(rows.numel(), 4, 64, device=device)
    out, lse = ops.decode_attention(q, k_cache, v_cache, tables.expand(rows.numel(), -1).contiguous(),
                                    (rows + 1).int(), 0.125, window=7)
    (k, v), = seqs
    want = plain_attention(q, [(k[p - 6 : p + 1], v[p - 6 : p + 1]) for p in rows.tolist()], 0.125)
    assert_close(out, want[0].float())
    assert_close(lse, want[1].float())


@pytest.mark.parametrize("device", ["cpu"])
def test_window_checks_only_its_blocks(device):
    """A bad block id inside the window raises; one before it is never read (CPU: the CUDA kernel
    masks bad ids instead)."""
    k_cache, v_cache = torch.randn(64, 16, 2, 64), torch.randn(64, 16, 2, 64)
    tables = torch.randperm(64)[:16].view(2, 8).int()
    lens = torch.tensor([100, 100], dtype=torch.int32)
    q = torch.randn(2, 4, 64)
    tables[0, 2] = 999  # tokens 32-47: before the window of 40 (tokens 60-99)
    ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, window=40)
    tables[1, 5] = 999  # tokens 80-95: in it
    with pytest.raises(IndexError, match=r"block_tables\[1\]\[5\] = 999 is out of range \[0, 64\)"):
        ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, window=40)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [16, 32, 91])
def test_other_head_dims_on_cuda(head_dim, monkeypatch):
    """The CUDA kernel takes head_dim 64, 128, 256: the op itself refuses others with a ValueError
    (not a crash), and stagewise.ops runs them through the reference, saying so once."""
    seq_lens = [0, 17, 100]
    k_cache, v_cache, tables, seqs = paged_kv(seq_lens, 2, head_dim, 16, torch.float32, "cuda")
    q = torch.randn(len(seq_lens), 4, head_dim, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out, lse = poisoned_outputs(len(seq_lens), 4, head_dim, torch.float32, "cuda")
    with pytest.raises(ValueError, match=rf"^stagewise\.decode_attention: on CUDA head_dim must be 64, 128 or 256, "
                                         rf"got {head_dim}"):
        torch.ops.stagewise.decode_attention(out, lse, q, k_cache, v_cache, tables, lens, 0.25, None, None, 0, 0,
                                             None, None)
    monkeypatch.setattr(ops, "_warned_head_dims", set())
    with pytest.warns(RuntimeWarning, match=f"no CUDA attention kernel for head_dim {head_dim}"):
        ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, out=out, lse=lse)
    plain_out, plain_lse = plain_attention(q, seqs, 0.25)
    assert_close(out, plain_out.float())
    assert_close(lse, plain_lse.float())
