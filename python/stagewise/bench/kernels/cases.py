"""The op cases of `stagewise bench kernels`: inputs, bytes moved, baselines, validation.

Each case holds its own buffers and runs OURS (``stagewise.ops``) on them; the
pure-torch baseline is ``stagewise.ops.reference`` except for decode_attention,
whose reference is a per-sequence Python loop: there the baseline is the
vectorised ``attention_baselines.torch_decode_attention``, and for the linears,
whose baseline is ``F.linear``. The attention cases also have SDPA and
FlexAttention over the same paged cache (``Case.others``, from
:mod:`~stagewise.bench.kernels.attention_baselines`). ``nbytes`` is the least
the op must read plus write, counted from the shapes (never measured).

dense_linear's weights are several copies that together exceed the caches, a
different one for each call (``Case.rotate``): as in a decode step, every call
reads its weights from memory.

In-place ops (fused_add_rms_norm, rope, qk_norm_rope, reshape_and_cache) are
timed on the same buffers call after call: the values drift but stay finite
(rotations and normalisations), and the memory traffic is the same, so no reset
is needed between calls. Validation runs first, on clones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stagewise import ops
from stagewise.ops import reference as ref
from stagewise.bench.kernels import attention_baselines as ab
from stagewise.bench.kernels import flashinfer as fi
from stagewise.bench.kernels.attention_baselines import torch_decode_attention, torch_extend_attention

EPS = 1e-6
BLOCK = 16
OPS = ("rms_norm", "fused_add_rms_norm", "rope", "qk_norm_rope", "reshape_and_cache", "slot_mapping",
       "decode_attention", "extend_attention", "merge_attn_states", "dense_linear", "quant_linear",
       "quant_linear_int8")  # fmt: skip

# Sizes per preset and device. Attention shapes are Llama-3-8B / Qwen3-8B like
# (32 query heads, 8 KV heads, head_dim 128) unless a size says otherwise.
_NORM = {"cpu": [dict(T=1, H=4096), dict(T=64, H=4096), dict(T=2048, H=4096)],
         "cuda": [dict(T=64, H=4096), dict(T=16384, H=4096)],
         "tiny": [dict(T=3, H=83)]}  # fmt: skip
_ROPE = {"cpu": [dict(T=1), dict(T=64), dict(T=1024)], "cuda": [dict(T=64), dict(T=16384)],
         "tiny": [dict(T=3, Hq=4, Hk=2, D=32)]}  # fmt: skip
SIZES = {
    "rms_norm": _NORM, "fused_add_rms_norm": _NORM, "rope": _ROPE, "qk_norm_rope": _ROPE,
    # cuda T=16384: 64 MB of K/V rows written.
    "reshape_and_cache": {"cpu": [dict(T=64), dict(T=2048)], "cuda": [dict(T=64), dict(T=16384)],
                          "tiny": [dict(T=5, Hk=2, D=32)]},
    "slot_mapping": {"cpu": [dict(T=64), dict(T=4096)], "cuda": [dict(T=64), dict(T=65536)], "tiny": [dict(T=7)]},
    # cuda: 64 x 8k tokens = 2 GiB of bf16 K+V.
    "decode_attention": {"cpu": [dict(B=8, ctx=1024), dict(B=1, ctx=4096)],
                         "cuda": [dict(B=64, ctx=8192), dict(B=64, ctx=8192, Hq=64), dict(B=1, ctx=32768)],
                         "tiny": [dict(B=2, ctx=40, Hq=4, Hk=2, D=32)]},
    # 16 tokens after a 1,024-token cached prefix in SmolLM2's heads (a prefix-cache hit), a 512-token prompt.
    "extend_attention": {"cpu": [dict(n=16, ctx=1040, Hq=9, Hk=3, D=64), dict(n=512, ctx=512)],
                         "cuda": [dict(n=16, ctx=8192), dict(n=2048, ctx=8192)],
                         "tiny": [dict(n=5, ctx=40, Hq=4, Hk=2, D=32)]},
    "merge_attn_states": {"cpu": [dict(N=64)], "cuda": [dict(N=64), dict(N=16384)],
                          "tiny": [dict(N=3, H=4, D=32)]},
    # A decode step of a dense float32 model of hidden 2048 (a random Qwen3-VL's: MLP 6144, a 32000-row LM
    # head), one row; a batch of 4 and of 16 on the gate/up. pool_mb: the copies of W together (tiny: two).
    "dense_linear": {"cpu": [dict(T=1, N=6144, K=2048), dict(T=1, N=2048, K=6144), dict(T=1, N=4096, K=2048),
                             dict(T=1, N=2048, K=2048), dict(T=1, N=32000, K=2048), dict(T=4, N=6144, K=2048),
                             dict(T=16, N=6144, K=2048)],
                     "cuda": [], "tiny": [dict(T=3, N=40, K=64, pool_mb=0)]},
    # SmolLM2-135M's fused gate/up (Q4_1) and tied LM head (Q8_0) at decode batch 1 and 16; a Llama-8B
    # sized gate/up in the K-quants (the common GGUF types of larger models).
    "quant_linear": {"cpu": [dict(T=1, N=3072, K=576, q="Q4_1"), dict(T=16, N=3072, K=576, q="Q4_1"),
                             dict(T=1, N=49152, K=576, q="Q8_0"), dict(T=16, N=49152, K=576, q="Q8_0"),
                             dict(T=1, N=4096, K=4096, q="Q4_K"), dict(T=1, N=4096, K=4096, q="Q6_K")],
                     "cuda": [dict(T=1, N=14336, K=4096, q="Q4_1"), dict(T=16, N=14336, K=4096, q="Q4_1")],
                     "tiny": [dict(T=3, N=40, K=64, q="Q4_1")]},
    # The int8 mode (CPU only) on the same matrices.
    "quant_linear_int8": {"cpu": [dict(T=1, N=3072, K=576, q="Q4_1"), dict(T=16, N=3072, K=576, q="Q4_1"),
                                  dict(T=1, N=49152, K=576, q="Q8_0"), dict(T=16, N=49152, K=576, q="Q8_0"),
                                  dict(T=1, N=4096, K=4096, q="Q4_K"), dict(T=1, N=4096, K=4096, q="Q6_K")],
                          "cuda": [], "tiny": [dict(T=3, N=40, K=64, q="Q4_1")]},
}  # fmt: skip
NORM_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(kw_only=True, slots=True)
class Case:
    op: str
    name: str
    """The shapes, for the table."""
    dtype: torch.dtype
    nbytes: int
    """Least bytes the op must read plus write."""
    ours: Callable[[], object]
    """Runs the stagewise op on the case's buffers."""
    baseline: Callable
    """Pure-torch baseline (the same function object for every case of an op: it is compiled once)."""
    baseline_args: tuple
    validate: Callable[[], float]
    """Runs ours once on clones of the inputs; returns its max abs error against the reference."""
    flashinfer: Callable[[], object] | None = None
    flashinfer_note: str = "not compared"
    """Why there is no FlashInfer timing, when there is none."""
    rotate: Callable[[], None] | None = None
    """Run before every timed call of ours and of the baselines (timed with it, a fraction of a microsecond):
    points the case's weights at the next of several copies."""
    others: dict[str, Callable[[], object] | str] = field(default_factory=dict)
    """Further baselines by column (``report.OTHERS``): a callable returning ours' first output (checked
    against ours, then timed), or why there is none."""


def case_specs(device: str, ops_wanted: list[str], preset: str) -> list[tuple[str, torch.dtype, dict]]:
    """The (op, dtype, size) triples to run; ``preset`` is 'full', 'quick' or 'tiny'."""
    specs = []
    for op in ops_wanted:
        sizes = SIZES[op]["tiny" if preset == "tiny" else device]
        if preset == "quick":
            sizes = sizes[:1] + sizes[1:][-1:]  # the decode size and the largest one
        dtypes = NORM_DTYPES if op in ("rms_norm", "fused_add_rms_norm") and preset != "quick" else (torch.bfloat16,)
        if op in ("dense_linear", "quant_linear", "quant_linear_int8"):
            dtypes = (torch.float32,)  # the dtype of the dense kernel, and the one a quantised GGUF runs in
        specs += [(op, dt, size) for size in sizes for dt in dtypes]
    return specs


def build_case(op: str, dtype: torch.dtype, size: dict, device: str) -> Case:
    return _BUILDERS[op](dtype=dtype, dev=torch.device(device), **size)


def _same(ours_fn: Callable, ref_fn: Callable, args: tuple) -> Callable[[], float]:
    """Validation of an op that returns its results (ours allocates them)."""
    return lambda: max_abs_err(ours_fn(*args), ref_fn(*args))


def max_abs_err(actual, expected) -> float:
    """Largest |actual - expected| over tensors or tuples of tensors, in float64."""
    if isinstance(actual, torch.Tensor):
        actual, expected = (actual,), (expected,)
    return max((a.double() - e.double()).abs().max().item() if a.numel() else 0.0 for a, e in zip(actual, expected))


def _randn(*shape, dtype, dev):
    return torch.randn(*shape, dtype=torch.float32, device=dev).to(dtype)


def _norm(dtype, dev, T, H, fused=False) -> Case:
    x, w = _randn(T, H, dtype=dtype, dev=dev), _randn(H, dtype=dtype, dev=dev)
    es = x.element_size()
    if not fused:
        out = torch.empty_like(x)
        return Case(op="rms_norm", name=f"x[{T},{H}]", dtype=dtype, nbytes=(2 * T * H + H) * es,
                    ours=lambda: ops.rms_norm(x, w, EPS, out=out), baseline=ref.rms_norm, baseline_args=(x, w, EPS),
                    validate=_same(ops.rms_norm, ref.rms_norm, (x, w, EPS)),
                    **fi.rmsnorm(x, w, EPS, out))  # fmt: skip
    res = _randn(T, H, dtype=dtype, dev=dev)

    def validate():
        expected = ref.fused_add_rms_norm(x, res, w, EPS)
        xa, ra = x.clone(), res.clone()
        ops.fused_add_rms_norm(xa, ra, w, EPS)
        return max_abs_err((xa, ra), expected)

    # Read x, residual and weight; write x and residual.
    return Case(op="fused_add_rms_norm", name=f"x[{T},{H}]", dtype=dtype, nbytes=(4 * T * H + H) * es,
                ours=lambda: ops.fused_add_rms_norm(x, res, w, EPS), baseline=ref.fused_add_rms_norm,
                baseline_args=(x, res, w, EPS), validate=validate, **fi.fused_add_rmsnorm(x, res, w, EPS))  # fmt: skip


def _cos_sin_cache(max_pos, rot, dev):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, device=dev, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(max_pos, device=dev, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1)  # [max_pos, rot] float32


def _rope(dtype, dev, T, Hq=32, Hk=8, D=128, norm=False) -> Case:
    q, k = _randn(T, Hq, D, dtype=dtype, dev=dev), _randn(T, Hk, D, dtype=dtype, dev=dev)
    max_pos = 32768
    cache, pos = _cos_sin_cache(max_pos, D, dev), torch.randint(0, max_pos, (T,), device=dev)
    qw, kw = _randn(D, dtype=dtype, dev=dev), _randn(D, dtype=dtype, dev=dev)
    es = q.element_size()
    # q and k read and written, one position (int64) and one cache row per token.
    nbytes = 2 * T * (Hq + Hk) * D * es + T * 8 + T * D * cache.element_size()
    if norm:  # plus the two [D] norm weights
        args, fn, ref_fn = (q, k, qw, kw, pos, cache, EPS, True), ops.qk_norm_rope, ref.qk_norm_rope
        nbytes += 2 * D * es
    else:
        args, fn, ref_fn = (q, k, pos, cache, True), ops.rope, ref.rope

    def validate():
        expected = ref_fn(*args)
        qa, ka = q.clone(), k.clone()
        fn(qa, ka, *args[2:])
        return max_abs_err((qa, ka), expected)

    return Case(op="qk_norm_rope" if norm else "rope", name=f"T={T} q{Hq}/k{Hk}x{D}", dtype=dtype, nbytes=nbytes,
                ours=lambda: fn(*args), baseline=ref_fn, baseline_args=args, validate=validate)  # fmt: skip


def _reshape_and_cache(dtype, dev, T, Hk=8, D=128) -> Case:
    k, v = _randn(T, Hk, D, dtype=dtype, dev=dev), _randn(T, Hk, D, dtype=dtype, dev=dev)
    num_blocks = 2 * math.ceil(T / BLOCK)
    kc = torch.zeros(num_blocks, BLOCK, Hk, D, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * BLOCK, device=dev)[:T]
    args = (k, v, kc, vc, slots)

    def validate():
        expected = ref.reshape_and_cache(*args)
        ka, va = kc.clone(), vc.clone()
        ops.reshape_and_cache(k, v, ka, va, slots)
        return max_abs_err((ka, va), expected)

    # Read k, v and the slots (int64); write the same K/V rows into the caches.
    nbytes = 4 * T * Hk * D * k.element_size() + T * 8
    return Case(op="reshape_and_cache", name=f"T={T} k/v{Hk}x{D}", dtype=dtype, nbytes=nbytes,
                ours=lambda: ops.reshape_and_cache(*args), baseline=ref.reshape_and_cache, baseline_args=args,
                validate=validate)  # fmt: skip


def _slot_mapping(dtype, dev, T, seqs=64, max_blocks=256) -> Case:
    tables = torch.randperm(seqs * max_blocks, device=dev, dtype=torch.int32).view(seqs, max_blocks)
    seq_index = torch.randint(0, seqs, (T,), device=dev)
    positions = torch.randint(0, max_blocks * BLOCK, (T,), device=dev)
    args = (tables, seq_index, positions, BLOCK)
    # Read seq_index and position (int64) and one block-table entry (int32) per token; write the slot (int64).
    return Case(op="slot_mapping", name=f"T={T} seqs={seqs}", dtype=torch.int64, nbytes=T * (8 + 8 + 4 + 8),
                ours=lambda: ops.slot_mapping(*args), baseline=ref.slot_mapping, baseline_args=args,
                validate=_same(ops.slot_mapping, ref.slot_mapping, args))  # fmt: skip


def _decode_attention(dtype, dev, B, ctx, Hq=32, Hk=8, D=128) -> Case:
    per_seq = math.ceil(ctx / BLOCK)
    kc = _randn(B * per_seq, BLOCK, Hk, D, dtype=dtype, dev=dev)
    vc = _randn(B * per_seq, BLOCK, Hk, D, dtype=dtype, dev=dev)
    tables = torch.randperm(B * per_seq, device=dev, dtype=torch.int32).view(B, per_seq)  # scattered blocks
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = _randn(B, Hq, D, dtype=dtype, dev=dev)
    k_new, v_new = _randn(B, Hk, D, dtype=dtype, dev=dev), _randn(B, Hk, D, dtype=dtype, dev=dev)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, dtype=torch.float32, device=dev)
    args = (q, kc, vc, tables, seq_lens, D**-0.5, k_new, v_new)
    es = q.element_size()
    # q, the K and V rows attended (cached and new), the block-table entries and
    # lengths read; out and lse (float32) written.
    nbytes = 2 * B * Hq * D * es + 2 * B * (ctx + 1) * Hk * D * es + B * per_seq * 4 + B * 4 + B * Hq * 4
    return Case(op="decode_attention", name=f"B={B} ctx={ctx} q{Hq}/kv{Hk}x{D}", dtype=dtype, nbytes=nbytes,
                ours=lambda: ops.decode_attention(*args, out=out, lse=lse), baseline=torch_decode_attention,
                baseline_args=args, validate=_same(ops.decode_attention, ref.decode_attention, args),
                others=ab.decode_baselines(args), **fi.decode(q, kc, vc, tables, seq_lens, D**-0.5, BLOCK))  # fmt: skip


def _extend_attention(dtype, dev, n, ctx, Hq=32, Hk=8, D=128) -> Case:
    per_seq = math.ceil(ctx / BLOCK)
    kc, vc = (_randn(per_seq, BLOCK, Hk, D, dtype=dtype, dev=dev) for _ in range(2))
    tables = torch.randperm(per_seq, device=dev, dtype=torch.int32).view(1, per_seq)
    starts, lens = torch.tensor([0, n], dtype=torch.int32, device=dev), torch.tensor([ctx], dtype=torch.int32, device=dev)
    q = _randn(n, Hq, D, dtype=dtype, dev=dev)
    out = torch.empty_like(q)
    args = (q, kc, vc, tables, starts, lens, D**-0.5)
    # q and out, the K and V rows of the cache (read once), the table entries.
    nbytes = 2 * n * Hq * D * q.element_size() + 2 * ctx * Hk * D * q.element_size() + per_seq * 4
    return Case(op="extend_attention", name=f"{n} after {ctx - n} q{Hq}/kv{Hk}x{D}", dtype=dtype, nbytes=nbytes,
                ours=lambda: ops.extend_attention(*args, out=out), baseline=torch_extend_attention, baseline_args=args,
                validate=_same(ops.extend_attention, ref.extend_attention, args),
                others=ab.extend_baselines(args))  # fmt: skip


def _merge(dtype, dev, N, H=32, D=128) -> Case:
    a, b = _randn(N, H, D, dtype=dtype, dev=dev), _randn(N, H, D, dtype=dtype, dev=dev)
    lse_a, lse_b = torch.randn(N, H, device=dev) * 2 + 5, torch.randn(N, H, device=dev) * 2 + 5
    out, lse = torch.empty_like(a), torch.empty_like(lse_a)
    args = (a, lse_a, b, lse_b)
    # Read both parts and their LSEs, write the merged part and LSE.
    nbytes = 3 * N * H * (D * a.element_size() + 4)
    return Case(op="merge_attn_states", name=f"[{N},{H},{D}]", dtype=dtype, nbytes=nbytes,
                ours=lambda: ops.merge_attn_states(*args, out=out, lse=lse), baseline=ref.merge_attn_states,
                baseline_args=args, validate=_same(ops.merge_attn_states, ref.merge_attn_states, args))  # fmt: skip


def f_linear(x, w):
    """The baseline of the linears: F.linear (for quant_linear over the weights dequantised beforehand)."""
    return torch.nn.functional.linear(x, w)


def _dense_linear(dtype, dev, T, N, K, pool_mb=256) -> Case:
    # Copies of W, at least two, that together exceed the last-level cache many times over.
    copies = [_randn(N, K, dtype=dtype, dev=dev) for _ in range(max(2, (pool_mb << 20) // (N * K * 4)))]
    w = torch.empty(0, dtype=dtype, device=dev).set_(copies[0])  # the copies in turn, by set_
    turn = itertools.count(1)
    x, out = _randn(T, K, dtype=dtype, dev=dev), torch.empty(T, N, dtype=dtype, device=dev)

    def rotate() -> None:
        w.set_(copies[next(turn) % len(copies)])

    # Read W and x, write out.
    nbytes = (N * K + T * K + T * N) * x.element_size()
    return Case(op="dense_linear", name=f"W[{N},{K}] x[{T}]", dtype=dtype, nbytes=nbytes,
                ours=lambda: ops.dense_linear(x, w, out=out), baseline=f_linear, baseline_args=(x, w),
                validate=lambda: max_abs_err(ops.dense_linear(x, w), ref.dense_linear(x.double(), w.double())),
                rotate=rotate,
                flashinfer_note="FlashInfer has no CPU kernels")  # fmt: skip


def _quant_linear(dtype, dev, T, N, K, q, int8: bool = False) -> Case:
    qtype = ops.QTYPES[q]
    # Real blocks with finite scales: quantise a random matrix the way llama.cpp's Q8_0/Q4_x do.
    w = torch.randn(N, K, device=dev)
    blocks = w.reshape(N, K // 32, 32)
    if q == "Q4_1":
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).half()
        qv = ((blocks - lo) / d.float().clamp_min(1e-8)).round().clamp(0, 15).to(torch.uint8)
        head = torch.cat([d.view(torch.uint8), lo.half().view(torch.uint8)], -1)
    elif q == "Q8_0":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
        qv = (blocks / d.float().clamp_min(1e-8)).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        head = d.view(torch.uint8)
    elif q in ("Q4_K", "Q6_K"):  # random valid super-blocks (quantising into them is llama.cpp's own search)
        from stagewise.measure.primitives import random_blocks

        qv = head = None
    else:
        raise ValueError(f"bench quant_linear: q must be Q4_1, Q8_0, Q4_K or Q6_K, got {q!r}")
    if head is None:
        qweight = random_blocks(N, K, qtype).to(dev)
    else:
        if q == "Q4_1":
            qv = qv[..., :16] | (qv[..., 16:] << 4)
        qweight = torch.cat([head, qv], -1).reshape(N, -1).contiguous()
    dense = ref.dequantize(qweight, qtype)
    x = _randn(T, K, dtype=dtype, dev=dev)
    out = torch.empty(T, N, dtype=dtype, device=dev)
    # Read the blocks and x, write out.
    nbytes = qweight.numel() + (T * K + T * N) * x.element_size()
    if int8:  # the panels a model packs once at load time (as many bytes as the blocks)
        packed = ops.quant_pack_int8(qweight, qtype)
        op, ref_fn, name = (lambda xs, **kw: ops.quant_linear_int8(xs, packed, qtype, N, **kw)), ref.quant_linear_int8, \
            "quant_linear_int8"
    else:
        op, ref_fn, name = (lambda xs, **kw: ops.quant_linear(xs, qweight, qtype, **kw)), ref.quant_linear, "quant_linear"
    return Case(op=name, name=f"{q} W[{N},{K}] x[{T}]", dtype=dtype, nbytes=nbytes,
                ours=lambda: op(x, out=out), baseline=f_linear,
                baseline_args=(x, dense),
                validate=lambda: max_abs_err(op(x), ref_fn(x, qweight, qtype)),
                flashinfer_note="FlashInfer has no GGUF block GEMM")  # fmt: skip


_BUILDERS = {
    "rms_norm": _norm,
    "fused_add_rms_norm": lambda **kw: _norm(fused=True, **kw),
    "rope": _rope,
    "qk_norm_rope": lambda **kw: _rope(norm=True, **kw),
    "reshape_and_cache": _reshape_and_cache,
    "slot_mapping": _slot_mapping,
    "decode_attention": _decode_attention,
    "extend_attention": _extend_attention,
    "merge_attn_states": _merge,
    "dense_linear": _dense_linear,
    "quant_linear": _quant_linear,
    "quant_linear_int8": lambda **kw: _quant_linear(int8=True, **kw),
}
