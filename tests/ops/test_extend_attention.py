"""extend_attention: runs of new tokens attending causally over the paged cache that holds them
(a prompt from its first token, a later chunk, a prefix-cache hit, drafts being verified).

Held against stagewise.ops.reference.extend_attention, and against a plain float64 softmax
attention over unpaged K/V built here (each run's token sees the keys up to its own position, or
its window's), over float caches of every dtype and compact int8/e4m3 ones; and against
decode_attention run token by token, which the CUDA path is.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import DEVICES, DTYPES, HAS_CUDA, assert_close, paged_kv, poison_

import stagewise.ops as ops
from stagewise.ops import reference

HEADS = [(4, 4), (9, 3), (8, 2), (4, 1)]  # MHA, SmolLM2's 3:1, GQA 4:1, MQA
# (new tokens, cached tokens in all) per sequence: a whole prompt, runs after a cache at block
# edges and not, one token, a run of 40 (more than a work item's 16 tokens), an empty run.
RUNS = [(6, 6), (1, 17), (16, 16 + 33), (40, 100), (3, 31), (0, 9)]
HEAD_DIMS = (64, 128, 91, 7)  # 91, 7: vector widths and scalar tails
DEVICE_HEAD_DIMS = (64, 128)


def _cases():
    for device in DEVICES:
        dev = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for d in HEAD_DIMS:
            if dev == "cpu" or d in DEVICE_HEAD_DIMS:
                yield pytest.param(dev, d, marks=marks, id=f"{dev}-d{d}")


def _runs(runs, heads, head_dim, dtype, device, block_size=16, **kw):
    hq, hk = heads
    k_cache, v_cache, tables, seqs = paged_kv([n for _, n in runs], hk, head_dim, block_size, dtype, device, **kw)
    starts = torch.tensor([0, *torch.tensor([q for q, _ in runs]).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([n for _, n in runs], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), hq, head_dim).to(dtype).to(device)
    return q, k_cache, v_cache, tables, starts.to(device), lens.to(device), seqs


def plain_extend(q, runs, seqs, scale, window=None):
    """float64 softmax attention of every run's token over its sequence's keys up to itself."""
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for (n, total), (k, v) in zip(runs, seqs):
        group = q.size(1) // k.size(1)
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        for i in range(n):
            pos = total - n + i
            first = 0 if window is None else max(0, pos - window + 1)
            s = torch.einsum("hd,thd->ht", q[t].double(), k[first : pos + 1]) * scale
            out[t] = torch.einsum("ht,thd->hd", s.softmax(-1), v[first : pos + 1])
            t += 1
    return out


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("device", "head_dim"), list(_cases()))
def test_matches_reference_and_plain_attention(device, head_dim, dtype, heads, window):
    q, k_cache, v_cache, tables, starts, lens, seqs = _runs(RUNS, heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    out = poison_(torch.empty_like(q))
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale, window=window, out=out)
    assert got is out
    want = reference.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale, window=window)
    assert_close(got, want)
    exact = plain_extend(q.cpu(), RUNS, [(k.cpu(), v.cpu()) for k, v in seqs], scale, window)
    assert_close(got.double().cpu(), exact, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_equals_decode_rows(device):
    """Each token of a run gets what decode_attention gives it as a row of its own, over the cache
    up to itself (the CUDA op is that; on the CPU it is held to it)."""
    q, k_cache, v_cache, tables, starts, lens, _ = _runs(RUNS, (9, 3), 64, torch.float32, device)
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.125, window=7)
    seq = torch.repeat_interleave(torch.arange(len(RUNS)), torch.tensor([n for n, _ in RUNS]))
    rows = torch.tensor([total - n + i + 1 for n, total in RUNS for i in range(n)], dtype=torch.int32)
    want, _ = ops.decode_attention(q, k_cache, v_cache, tables[seq.to(tables.device)], rows.to(device), 0.125,
                                   window=7)
    assert_close(got, want)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("device", "head_dim"), list(_cases()))
def test_compact_cache_reads_the_codes(device, head_dim, dtype, codes):
    """A compact cache: attention over the dequantised K/V, the reference's and float64's."""
    q, k_float, v_float, tables, starts, lens, _ = _runs(RUNS, (8, 2), head_dim, dtype, device)
    shape = k_float.shape
    k_cache, v_cache = (torch.zeros(shape, dtype=codes, device=device) for _ in range(2))
    k_scale, v_scale = (torch.zeros(shape[:3], dtype=torch.float16, device=device) for _ in range(2))
    slots = torch.arange(shape[0] * shape[1], device=device)
    ops.reshape_and_cache(k_float.view(-1, *shape[2:]), v_float.view(-1, *shape[2:]), k_cache, v_cache, slots,
                          k_scale, v_scale)
    scale = head_dim**-0.5
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale, k_scale=k_scale, v_scale=v_scale)
    want = reference.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale, k_scale=k_scale,
                                      v_scale=v_scale)
    assert_close(got, want, **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}))
    k_back = reference.dequantise_kv(k_cache.view(-1, *shape[2:]), k_scale.view(-1, shape[2])).view(shape)
    v_back = reference.dequantise_kv(v_cache.view(-1, *shape[2:]), v_scale.view(-1, shape[2])).view(shape)
    exact = reference.extend_attention(q.double(), k_back.double(), v_back.double(), tables, starts, lens, scale)
    assert_close(got.double(), exact, dtype=dtype, **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_independent_of_threads_and_work_split(threads):
    """Work items split a run into tiles of tokens and deal them to threads: every split gives the
    same bits (each token's keys are walked in the same order whoever runs it)."""
    runs = [(40, 1000), (3, 3), (17, 50)]
    q, k_cache, v_cache, tables, starts, lens, _ = _runs(runs, (9, 3), 64, torch.float32, "cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
        torch.set_num_threads(threads)
        many = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_index_dtypes_and_block_sizes(index_dtype, block_size):
    q, k_cache, v_cache, tables, starts, lens, seqs = _runs(RUNS, (4, 2), 32, torch.float32, "cpu",
                                                            block_size=block_size, table_dtype=index_dtype)
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts.to(index_dtype), lens.to(index_dtype), 0.2)
    assert_close(got.double(), plain_extend(q, RUNS, seqs, 0.2), dtype=torch.float32)


def test_nan_query_carries_to_its_row_only():
    q, k_cache, v_cache, tables, starts, lens, _ = _runs(RUNS, (4, 2), 64, torch.float32, "cpu")
    q[7, 1, 3] = float("nan")
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
    assert got[7, 1].isnan().all()
    got[7, 1] = 0
    assert got.isfinite().all()


BAD_RUNS = {  # (query_start_loc, seq_lens, block id of table row 1, q rows): the message
    "starts-not-from-0": ([1, 2, 4], [3, 20], 2, 4,
                          r"query_start_loc must run from 0 to num_tokens = 4 \(q dim 0\), got 1 \.\. 4"),
    "starts-past-q": ([0, 3, 5], [3, 20], 2, 4, r"query_start_loc must run from 0 to num_tokens = 4"),
    "starts-decrease": ([0, 3, 1], [3, 20], 2, 1, r"query_start_loc must not decrease, got 3 then 1 at sequence 1"),
    "lens-below-the-run": ([0, 3, 4], [2, 20], 2, 4,
                           r"seq_lens\[0\] = 2 must be in \[3, 32\]: at least the sequence's 3 new tokens"),
    "lens-past-the-table": ([0, 3, 4], [3, 33], 2, 4, r"seq_lens\[1\] = 33 must be in \[1, 32\]"),
    "block-out-of-range": ([0, 3, 4], [3, 20], 9, 4, r"block_tables\[1\]\[0\] = 9 is out of range \[0, 9\)"),
}


@pytest.mark.parametrize("case", BAD_RUNS)
def test_bad_runs_raise_and_leave_out(case):
    starts, lens, block, rows, message = BAD_RUNS[case]
    k_cache, v_cache = torch.randn(9, 16, 2, 8), torch.randn(9, 16, 2, 8)
    tables = torch.tensor([[0, 1], [block, 3]], dtype=torch.int32)
    q, out = torch.randn(rows, 4, 8), torch.full((rows, 4, 8), 7.0)
    with pytest.raises((ValueError, IndexError), match=message):
        ops.extend_attention(q, k_cache, v_cache, tables, torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), 0.3, out=out)
    assert (out == 7.0).all()


def test_window_reads_only_its_blocks():
    """Blocks before every query's window are never read: their table entries may be -1."""
    q, k_cache, v_cache, tables, starts, lens, seqs = _runs([(4, 100)], (4, 2), 16, torch.float32, "cpu")
    want = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, window=10)
    tables[0, :5] = -1  # tokens 0..79: before position 96 - 10 + 1
    got = ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, window=10)
    assert torch.equal(got, want)
    assert_close(got.double(), plain_extend(q, [(4, 100)], seqs, 0.25, window=10), dtype=torch.float32)
    with pytest.raises(ValueError, match="argument 'window' must be an int >= 1 or None, got 0"):
        ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, window=0)



@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [16, 32])
def test_other_head_dims_on_cuda(head_dim, monkeypatch):
    """Head sizes the CUDA kernel is not built for: a ValueError from the op itself (not a crash),
    the reference's result through stagewise.ops, with a warning."""
    q, k_cache, v_cache, tables, starts, lens, seqs = _runs(RUNS, (8, 2), head_dim, torch.float32, "cuda")
    out = poison_(torch.empty_like(q))
    with pytest.raises(ValueError, match=rf"^stagewise\.decode_attention: on CUDA head_dim must be 64, 128 or 256, "
                                         rf"got {head_dim}"):
        torch.ops.stagewise.extend_attention(out, q, k_cache, v_cache, tables, starts, lens, 0.25, 0, None, None)
    monkeypatch.setattr(ops, "_warned_head_dims", set())
    with pytest.warns(RuntimeWarning, match=f"no CUDA attention kernel for head_dim {head_dim}"):
        ops.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, out=out)
    exact = plain_extend(q.cpu(), RUNS, [(k.cpu(), v.cpu()) for k, v in seqs], 0.25)
    assert_close(out.double().cpu(), exact, dtype=torch.float32)
