"""Registration of the op library: every public op exists under torch.ops.stagewise,
has a fake implementation giving the right output shapes and dtypes, passes
torch.library.opcheck (schema and mutation annotations, fake tensor, autograd
registration, AOT dispatch with dynamic shapes), and a decode-layer-like function
of several ops compiles into one graph (fullgraph=True) that gives the eager results.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

import stagewise.ops as ops
from helpers.kernels import DEVICES, strided

EPS = 1e-6
T, HIDDEN = 5, 96  # tokens, hidden size (norms)
B, HQ, HK, D = 3, 8, 2, 64  # batch, query heads, kv heads (GQA 4:1), head dim
ROTARY_DIM = 32  # partial rotary, as in some Llama/Falcon variants
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 12, 16, 3  # paged cache: up to 48 tokens a sequence
MAX_POSITION = 128


def _cos_sin_cache(rotary_dim: int, device) -> torch.Tensor:
    """``[MAX_POSITION, rotary_dim]``: cos of each position's angles, then sin."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def _paged_cache(device) -> dict:
    """K/V caches ``[NUM_BLOCKS, BLOCK_SIZE, HK, D]``, block tables ``[B, MAX_BLOCKS]`` of
    distinct blocks, and cached lengths ``[B]`` (several blocks, one token, exactly one block)."""
    return dict(
        k_cache=torch.randn(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=device),
        v_cache=torch.randn(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=device),
        block_tables=torch.randperm(NUM_BLOCKS)[: B * MAX_BLOCKS].view(B, MAX_BLOCKS).to(torch.int32).to(device),
        seq_lens=torch.tensor([37, 1, 16], dtype=torch.int32, device=device),
    )


# Arguments of each op in schema order (csrc/bindings/schema.cpp), on a device.


def _rms_norm(dev):
    x = strided(torch.randn(T, HIDDEN, device=dev))  # rows with a stride, as a slice of a wider buffer
    return (torch.empty(T, HIDDEN, device=dev), x, torch.randn(HIDDEN, device=dev), EPS)


def _fused_add_rms_norm(dev):
    x, residual = torch.randn(T, HIDDEN, device=dev), torch.randn(T, HIDDEN, device=dev)
    return (x, residual, torch.randn(HIDDEN, device=dev), EPS)


def _positions(dev):
    return torch.tensor([0, 1, 17, 64, MAX_POSITION - 1], device=dev)


def _rope(dev):
    q, k = torch.randn(T, HQ, D, device=dev), torch.randn(T, HK, D, device=dev)
    return (q, k, _positions(dev), _cos_sin_cache(ROTARY_DIM, dev), True)


def _qk_norm_rope(dev):
    q, k = torch.randn(T, HQ, D, device=dev), torch.randn(T, HK, D, device=dev)
    w = torch.randn(D, device=dev), torch.randn(D, device=dev)
    return (q, k, *w, _positions(dev), _cos_sin_cache(D, dev), EPS, False)


def _reshape_and_cache(dev):
    c = _paged_cache(dev)
    slots = torch.tensor([3, -1, 40, 17, 191], device=dev)  # -1: a padding token, skipped
    return (torch.randn(T, HK, D, device=dev), torch.randn(T, HK, D, device=dev), c["k_cache"], c["v_cache"], slots)


def _compact(dev):
    """An int8 cache of _paged_cache's shape: codes and float16 scales, its rows written."""
    c = _paged_cache(dev)
    k_cache, v_cache = (torch.zeros(c["k_cache"].shape, dtype=torch.int8, device=dev) for _ in range(2))
    k_scale, v_scale = (torch.zeros(c["k_cache"].shape[:3], dtype=torch.float16, device=dev) for _ in range(2))
    slots = torch.arange(k_cache.size(0) * k_cache.size(1), device=dev)
    kv = torch.randn(len(slots), HK, D, device=dev)
    ops.reshape_and_cache(kv, -kv, k_cache, v_cache, slots, k_scale, v_scale)
    return c, (k_cache, v_cache, k_scale, v_scale)


def _reshape_and_cache_compact(dev):
    _, (k_cache, v_cache, k_scale, v_scale) = _compact(dev)
    slots = torch.tensor([3, -1, 40, 17, 191], device=dev)
    return (torch.randn(T, HK, D, device=dev), torch.randn(T, HK, D, device=dev), k_cache, v_cache, slots, k_scale,
            v_scale)


def _decode_attention_compact(dev):
    c, (k_cache, v_cache, k_scale, v_scale) = _compact(dev)
    new = (torch.randn(B, HK, D, device=dev), torch.randn(B, HK, D, device=dev))
    out, lse = torch.empty(B, HQ, D, device=dev), torch.empty(B, HQ, device=dev)
    q = torch.randn(B, HQ, D, device=dev)
    return (out, lse, q, k_cache, v_cache, c["block_tables"], c["seq_lens"], D**-0.5, *new, 2, 0, k_scale, v_scale)


def _slot_mapping(dev):
    c = _paged_cache(dev)
    seq_index = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32, device=dev)
    # context parallel: 2 ranks, interleaved by 4 tokens; -1 a padding token
    return (c["block_tables"], seq_index, torch.tensor([36, 37, 1, -1, 16], device=dev), BLOCK_SIZE, 2, 1, 4)


def _decode_attention(dev, new_tokens: bool, window: int = 0):
    c = _paged_cache(dev)
    new = (torch.randn(B, HK, D, device=dev), torch.randn(B, HK, D, device=dev)) if new_tokens else (None, None)
    out, lse = torch.empty(B, HQ, D, device=dev), torch.empty(B, HQ, device=dev)
    q = torch.randn(B, HQ, D, device=dev)
    return (out, lse, q, c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], D**-0.5, *new, 2, window)


def _extend_attention(dev, window: int = 0, compact: bool = False):
    """Runs of 3, 1 and 16 tokens: the last of each sequence's 37, 1 and 16 cached ones."""
    c, caches = _compact(dev) if compact else (_paged_cache(dev), None)
    starts = torch.tensor([0, 3, 4, 20], dtype=torch.int32, device=dev)
    q = torch.randn(20, HQ, D, device=dev)
    kv = caches if compact else (c["k_cache"], c["v_cache"], None, None)
    return (torch.empty_like(q), q, *kv[:2], c["block_tables"], starts, c["seq_lens"], D**-0.5, window, *kv[2:])


def _merge_attn_states(dev):
    out_a, out_b = torch.randn(T, HQ, D, device=dev), torch.randn(T, HQ, D, device=dev)
    lse_a, lse_b = torch.randn(T, HQ, device=dev), torch.randn(T, HQ, device=dev)
    lse_b[0] = -math.inf  # one side empty for a token: the other side as is
    return (torch.empty_like(out_a), torch.empty_like(lse_a), out_a, lse_a, out_b, lse_b)


def _apply_token_bitmask(dev):
    logits = strided(torch.randn(T, 70, device=dev))  # 70 tokens: a last word half used
    bitmask = torch.randint(-2**31, 2**31, (3, 3), dtype=torch.int64).to(torch.int32).to(dev)
    return (logits, bitmask, torch.tensor([4, 0, 2], device=dev))


def _dense_linear(dev):
    x = strided(torch.randn(T, 20, device=dev))  # rows with a stride
    return (torch.empty(T, 6, device=dev), x, torch.randn(6, 20, device=dev), torch.randn(6, device=dev))


def _quant_linear(dev):
    # Random bytes are valid blocks except where an fp16 scale is inf/NaN: clear the exponent's top bit.
    qweight = torch.randint(0, 256, (6, 2 * 20), dtype=torch.uint8)
    qweight.view(6, 2, 20)[:, :, 1] &= 0x3F  # Q4_1: d and m of each block finite
    qweight.view(6, 2, 20)[:, :, 3] &= 0x3F
    x = torch.randn(T, 64, device=dev)
    return (torch.empty(T, 6, device=dev), x, qweight.to(dev), 3, torch.randn(6, device=dev))


def _quant_linear_int8(dev):
    out, x, qweight, qtype, bias = _quant_linear("cpu")
    return (out.to(dev), x.to(dev), ops.quant_pack_int8(qweight, qtype).to(dev), qtype, bias.to(dev))


def _quant_pack_int8(dev):
    return (_quant_linear(dev)[2], 3)


OPCHECK_CASES = [
    pytest.param("rms_norm", _rms_norm, id="rms_norm"),
    pytest.param("fused_add_rms_norm", _fused_add_rms_norm, id="fused_add_rms_norm"),
    pytest.param("rope", _rope, id="rope"),
    pytest.param("qk_norm_rope", _qk_norm_rope, id="qk_norm_rope"),
    pytest.param("reshape_and_cache", _reshape_and_cache, id="reshape_and_cache"),
    # A compact cache: int8 codes (float8 ones have the same schema, and torch's schema check cannot
    # compare float8 tensors: "mul" is not implemented for them).
    pytest.param("reshape_and_cache", _reshape_and_cache_compact, id="reshape_and_cache-int8"),
    pytest.param("slot_mapping", _slot_mapping, id="slot_mapping"),
    pytest.param("decode_attention", lambda dev: _decode_attention(dev, False), id="decode_attention"),
    pytest.param("decode_attention", lambda dev: _decode_attention(dev, True), id="decode_attention-k_new"),
    pytest.param("decode_attention", lambda dev: _decode_attention(dev, True, 3), id="decode_attention-window"),
    pytest.param("decode_attention", _decode_attention_compact, id="decode_attention-int8"),
    pytest.param("extend_attention", _extend_attention, id="extend_attention"),
    pytest.param("extend_attention", lambda dev: _extend_attention(dev, window=5), id="extend_attention-window"),
    pytest.param("extend_attention", lambda dev: _extend_attention(dev, compact=True), id="extend_attention-int8"),
    pytest.param("merge_attn_states", _merge_attn_states, id="merge_attn_states"),
    pytest.param("apply_token_bitmask", _apply_token_bitmask, id="apply_token_bitmask"),
    pytest.param("dense_linear", _dense_linear, id="dense_linear"),
    pytest.param("quant_linear", _quant_linear, id="quant_linear"),
    pytest.param("quant_linear_int8", _quant_linear_int8, id="quant_linear_int8"),
    pytest.param("quant_pack_int8", _quant_pack_int8, id="quant_pack_int8"),
]


CPU_ONLY = {"quant_linear_int8", "quant_pack_int8",  # the int8 mode is a CPU kernel only
            "dense_linear"}  # a CPU op: F.linear serves the GPU
# (op, make_args, device): every op on the CPU, those with a CUDA kernel on CUDA too.
OPCHECK_GRID = [pytest.param(*case.values, *d.values, marks=[*case.marks, *d.marks], id=f"{case.id}-{d.values[0]}")
                for case in OPCHECK_CASES for d in (pytest.param(x) if isinstance(x, str) else x for x in DEVICES)
                if d.values[0] == "cpu" or case.values[0] not in CPU_ONLY]


@pytest.mark.parametrize("op, make_args, device", OPCHECK_GRID)
def test_opcheck(op, make_args, device):
    torch.library.opcheck(getattr(torch.ops.stagewise, op), make_args(device))


def test_opcheck_covers_every_op():
    assert {case.values[0] for case in OPCHECK_CASES} == set(ops.__all__)


# ---------------------------------------------------------------------------
# Every op exists, is public, and has a fake implementation.


@pytest.mark.parametrize("name", ops.__all__)
def test_op_is_registered_with_a_fake(name):
    assert hasattr(torch.ops.stagewise, name), f"torch.ops.stagewise.{name} is not registered"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"stagewise::{name}", "Meta"), f"{name} has no fake impl"


def test_every_registered_op_is_public():
    from stagewise.transport.rings import CUDA_IPC_OPS, RING_OPS

    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("stagewise::")}
    # The transport's ring ops act on shared memory, not in graphs: stagewise.transport is their face.
    assert registered == set(ops.__all__) | set(RING_OPS) | set(CUDA_IPC_OPS)


def test_fake_shapes_and_dtypes():
    """The Python API under fake tensors: no kernel runs, outputs have the documented shapes and dtypes."""
    dt = torch.bfloat16
    with FakeTensorMode():
        x = torch.empty(T, HIDDEN, dtype=dt)
        w = torch.empty(HIDDEN, dtype=dt)
        y = ops.rms_norm(x, w, EPS)
        assert (y.shape, y.dtype) == ((T, HIDDEN), dt)
        assert ops.fused_add_rms_norm(x, torch.empty_like(x), w, EPS) is None

        q, k = torch.empty(T, HQ, D, dtype=dt), torch.empty(T, HK, D, dtype=dt)
        positions = torch.empty(T, dtype=torch.int32)
        cache = torch.empty(MAX_POSITION, ROTARY_DIM)
        assert ops.rope(q, k, positions, cache, True, rotary_dim=ROTARY_DIM) is None
        hw = torch.empty(D, dtype=dt)
        assert ops.qk_norm_rope(q, k, hw, hw, positions, torch.empty(MAX_POSITION, D), EPS, True) is None

        k_cache = torch.empty(NUM_BLOCKS, BLOCK_SIZE, HK, D, dtype=dt)
        v_cache = torch.empty_like(k_cache)
        slots = torch.empty(T, dtype=torch.int64)
        assert ops.reshape_and_cache(k, torch.empty_like(k), k_cache, v_cache, slots) is None

        block_tables = torch.empty(B, MAX_BLOCKS, dtype=torch.int32)
        slots = ops.slot_mapping(block_tables, torch.empty(T, dtype=torch.int32), positions, BLOCK_SIZE, 2, 1, 4)
        assert (slots.shape, slots.dtype) == ((T,), torch.int64)

        qd = torch.empty(B, HQ, D, dtype=dt)
        seq_lens = torch.empty(B, dtype=torch.int32)
        kn = torch.empty(B, HK, D, dtype=dt)
        for new in ((None, None), (kn, torch.empty_like(kn))):
            out, lse = ops.decode_attention(qd, k_cache, v_cache, block_tables, seq_lens, D**-0.5, *new)
            assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((B, HQ, D), dt, (B, HQ), torch.float32)

        out = ops.extend_attention(q, k_cache, v_cache, block_tables, torch.empty(B + 1, dtype=torch.int32), seq_lens,
                                   D**-0.5)
        assert (out.shape, out.dtype) == ((T, HQ, D), dt)

        out, lse = ops.merge_attn_states(q, torch.empty(T, HQ), torch.empty_like(q), torch.empty(T, HQ))
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((T, HQ, D), dt, (T, HQ), torch.float32)

        y = ops.dense_linear(torch.empty(2, T, HIDDEN), torch.empty(7, HIDDEN))
        assert (y.shape, y.dtype) == ((2, T, 7), torch.float32)

        packed = ops.quant_pack_int8(torch.empty(37, 3 * 144, dtype=torch.uint8), ops.QTYPES["Q4_K"])
        assert (packed.shape, packed.dtype) == ((3, 3 * 2368), torch.uint8)


# ---------------------------------------------------------------------------
# torch.compile: one decode step of an attention block, with a partial result of
# another context-parallel rank merged in.


def _decode_layer(hidden, residual, w, cache, meta, other_out, other_lse):
    """hidden, residual ``[B, HIDDEN]``; returns (output ``[B, HIDDEN]``, residual); writes the cache."""
    ops.fused_add_rms_norm(hidden, residual, w["input_norm"], EPS)
    q, k, v = (hidden @ w["qkv"]).split([HQ * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(B, HQ, D), k.view(B, HK, D), v.view(B, HK, D)  # strided views of one buffer
    ops.qk_norm_rope(q, k, w["q_norm"], w["k_norm"], meta["positions"], w["cos_sin_cache"], EPS, True)
    # the cached tokens and this step's token, then this step's token into the cache
    attn, lse = ops.decode_attention(
        q, cache["k_cache"], cache["v_cache"], cache["block_tables"], cache["seq_lens"], D**-0.5, k_new=k, v_new=v
    )
    ops.reshape_and_cache(k, v, cache["k_cache"], cache["v_cache"], meta["slots"])
    attn, lse = ops.merge_attn_states(attn, lse, other_out, other_lse)
    return ops.rms_norm(attn.view(B, HQ * D) @ w["o"], w["post_norm"], EPS), residual


def _decode_layer_inputs(device):
    w = dict(
        input_norm=torch.randn(HIDDEN, device=device),
        qkv=torch.randn(HIDDEN, (HQ + 2 * HK) * D, device=device) / HIDDEN**0.5,
        q_norm=torch.randn(D, device=device),
        k_norm=torch.randn(D, device=device),
        cos_sin_cache=_cos_sin_cache(D, device),
        o=torch.randn(HQ * D, HIDDEN, device=device) / (HQ * D) ** 0.5,
        post_norm=torch.randn(HIDDEN, device=device),
    )
    cache = _paged_cache(device)
    # this step's token goes right after the cached ones
    positions = cache["seq_lens"].long()
    blocks = cache["block_tables"].long().gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0]
    meta = dict(positions=positions, slots=blocks * BLOCK_SIZE + positions % BLOCK_SIZE)
    other_out, other_lse = torch.randn(B, HQ, D, device=device), torch.randn(B, HQ, device=device)
    hidden, residual = torch.randn(B, HIDDEN, device=device), torch.randn(B, HIDDEN, device=device)
    return hidden, residual, w, cache, meta, other_out, other_lse


def test_compile_decode_layer(device):
    inputs = _decode_layer_inputs(device)
    eager_inputs, compiled_inputs = tree_map(torch.clone, inputs), tree_map(torch.clone, inputs)
    expected = _decode_layer(*eager_inputs)
    torch._dynamo.reset()
    # inductor compiles this on CPU in a few seconds (the ops stay opaque calls)
    compiled = torch.compile(_decode_layer, backend="inductor", fullgraph=True)
    actual = compiled(*compiled_inputs)
    # The same kernels on the same inputs: equal to the bit, as is everything written
    # in place (hidden, residual, the caches).
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(tree_leaves(compiled_inputs), tree_leaves(eager_inputs), rtol=0, atol=0)
    # and the step did write its token into the cache
    assert not torch.equal(eager_inputs[3]["k_cache"], inputs[3]["k_cache"])
