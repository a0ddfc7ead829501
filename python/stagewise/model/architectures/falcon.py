"""Falcon (rotary variants): LayerNorm, fused qkv, GELU MLP, attention and MLP in parallel.

transformers' FalconForCausalLM has three layouts of ``query_key_value [out, hidden]``, in blocks
of ``head_dim`` rows (:func:`qkv_heads`):
  new_decoder_architecture (40B/180B): per KV group ``[q_0 .. q_{g-1}, k, v]``, g = Hq / Hk;
  multi_query (7B): ``[q_0 .. q_{Hq-1}, k, v]``;
  neither (RW-1B style): per head ``[q_h, k_h, v_h]``.
A tensor-parallel rank's rows keep the layout with its own head counts (the loader takes its
heads' blocks in order, :mod:`stagewise.model.loader.sharding`); they are unpacked here into plain
q, k, v so that one attention serves all three. HF names, per layer ``transformer.h.{i}.``:
``self_attention.{query_key_value,dense}``, ``mlp.{dense_h_to_4h,dense_4h_to_h}``, norms
``input_layernorm`` (+ ``post_attention_layernorm`` when sequential) or ``ln_attn`` + ``ln_mlp``
(two norms in parallel).

Under tensor parallelism the sequential layout all-reduces after attention and after the MLP, as
Llama does. In the parallel layout attention and MLP read the same input and their outputs are
added, so their row-parallel partial sums are added first and reduced once: one all-reduce per
layer, and both biases (whole on every rank) added after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagewise.model.architectures.base import Architecture, HFKeys, LayerWork, StageBuild, own_fields
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.config import ModelConfig
from stagewise.model.layers.attention import Attention
from stagewise.model.layers.linear import AllReduce, Linear, RowParallelLinear, tp_all_reduce
from stagewise.model.layers.mlp import PlainMLP
from stagewise.model.layers.norm import LayerNorm
from stagewise.model.rows import TensorShape, kv_heads_per_rank, linear_rows, norm_rows
from stagewise.model.weights import Weights

QKV, DENSE = "self_attention.query_key_value", "self_attention.dense"
UP, DOWN = "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"
INPUT_NORM, POST_NORM, LN_ATTN, LN_MLP = "input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp"


@dataclass(frozen=True, kw_only=True, slots=True)
class FalconLayout:
    """Falcon's own fields (``ModelConfig.arch``): the layout of its fused qkv and of its layer."""

    new_decoder_architecture: bool = False
    """Falcon-40B/180B layout: grouped KV heads, fused qkv per group."""
    multi_query: bool = False
    """Falcon-7B layout: one shared KV head."""
    parallel_attn: bool = False
    """Attention and MLP both read the layer input; their outputs are summed."""
    num_ln_in_parallel_attn: int = 1
    """With parallel_attn: 2 = separate input norms for attention and MLP, 1 = shared."""

    def __post_init__(self) -> None:
        if self.num_ln_in_parallel_attn not in (1, 2):
            raise ValueError("FalconLayout.num_ln_in_parallel_attn: expected 1 or 2, got "
                             f"{self.num_ln_in_parallel_attn!r}")


def layout(config: ModelConfig) -> FalconLayout:
    return own_fields(config, FalconLayout)


# ---- config.json ----------------------------------------------------------------------------------

def _parse(hf: HFKeys) -> dict[str, Any]:
    if hf.get("alibi", False):
        raise ValueError("config.json: alibi=True (Falcon with ALiBi position bias) is not supported; "
                         "only rotary Falcon models are")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    new_arch = bool(hf.get("new_decoder_architecture", False))
    multi_query = bool(hf.get("multi_query", True)) and not new_arch
    if hidden % heads:
        raise ValueError(f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    if new_arch:
        kv_heads = hf.get("num_kv_heads", heads)  # Falcon-40B/180B: grouped KV heads
    elif multi_query:
        kv_heads = 1  # Falcon-7B: one KV head shared by all query heads
    else:
        kv_heads = heads  # RW-1B: fused qkv of num_heads each
    # The new layout always runs attention and MLP in parallel, by default with two input norms.
    parallel = new_arch or bool(hf.get("parallel_attn", True))
    bias = bool(hf.get("bias", False))
    norms = hf.get("num_ln_in_parallel_attn", 2 if new_arch else 1) if parallel else 1
    return dict(
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=hf.get("ffn_hidden_size", 4 * hidden),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation", "gelu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        arch=FalconLayout(new_decoder_architecture=new_arch, multi_query=multi_query, parallel_attn=parallel,
                          num_ln_in_parallel_attn=norms),
    )


# ---- the table's rows -----------------------------------------------------------------------------

def qkv_heads(config: ModelConfig) -> list[tuple[str, int]]:
    """The ``head_dim``-row blocks of ``query_key_value`` in order (see the module docstring)."""
    hq, hk, form = config.num_heads, config.num_kv_heads, layout(config)
    if form.new_decoder_architecture:
        g = hq // hk
        return [b for j in range(hk) for b in [*(("q", j * g + i) for i in range(g)), ("k", j), ("v", j)]]
    if form.multi_query:
        return [*(("q", h) for h in range(hq)), ("k", 0), ("v", 0)]
    return [(kind, h) for h in range(hq) for kind in "qkv"]


def _norms(config: ModelConfig) -> tuple[str, ...]:
    form = layout(config)
    if form.parallel_attn and form.num_ln_in_parallel_attn == 2:
        return LN_ATTN, LN_MLP
    return (INPUT_NORM,) if form.parallel_attn else (INPUT_NORM, POST_NORM)


def layer_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    h, d, hq, hk = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    inter = config.intermediate_size
    t = [row for norm in _norms(config) for row in norm_rows(p + norm, h, "layer", layer, True)]
    t += linear_rows(p + QKV, (hq + 2 * hk) * d, h, "fused_qkv", layer, config.qkv_bias)
    t += linear_rows(p + DENSE, h, hq * d, "row", layer, config.o_bias)
    t += linear_rows(p + UP, inter, h, "column", layer, config.mlp_bias)
    return t + linear_rows(p + DOWN, h, inter, "row", layer, config.mlp_bias)


def final_norm_tensors(config: ModelConfig, name: str) -> list[TensorShape]:
    return norm_rows(name, config.hidden_size, "final_norm", None, True)


# ---- wiring ---------------------------------------------------------------------------------------

def _norm(config: ModelConfig, w: Weights, name: str) -> LayerNorm:
    return LayerNorm(w(name + ".weight"), w(name + ".bias"), config.norm_eps)


def build_final_norm(config: ModelConfig, name: str, w: Weights) -> LayerNorm:
    return _norm(config, w, name)


def unpack_qkv(config: ModelConfig, fused: torch.Tensor, tp_size: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[Hq*D, ...]``, k and v ``[Hk*D, ...]`` out of one rank's fused weight ``[out, hidden]`` or
    bias ``[out]`` (``Hq``, ``Hk``: the rank's query and KV heads)."""
    hq, hk, d = config.num_heads // tp_size, kv_heads_per_rank(config, tp_size), config.head_dim
    rest = fused.shape[1:]
    if fused.shape[0] != (hq + 2 * hk) * d:
        raise ValueError(f"falcon: query_key_value has {fused.shape[0]} rows, expected {(hq + 2 * hk) * d} for "
                         f"{hq} query and {hk} KV heads of {d} (tp_size={tp_size})")
    form = layout(config)
    if form.new_decoder_architecture:
        g = hq // hk
        x = fused.view(hk, g + 2, d, *rest)
        q, k, v = x[:, :g], x[:, g], x[:, g + 1]
    elif form.multi_query:
        x = fused.view(hq + 2, d, *rest)
        q, k, v = x[:hq], x[hq], x[hq + 1]
    else:
        x = fused.view(hq, 3, d, *rest)
        q, k, v = x[:, 0], x[:, 1], x[:, 2]
    return q.reshape(hq * d, *rest), k.reshape(hk * d, *rest), v.reshape(hk * d, *rest)


class FalconLayer(nn.Module):
    """Parallel: ``h + (mlp(ln_mlp(h)) + attn(ln_attn(h)))``; sequential: ``h += attn(ln(h)); h += mlp(ln2(h))``.

    Parallel: ``attn`` and ``mlp`` end in row-parallel linears without bias or reduction (partial
    sums); the layer reduces their sum with ``all_reduce`` (None: one rank) and adds ``bias``, the
    sum of their biases, once."""

    def __init__(self, attn: Attention, mlp: PlainMLP, ln_attn: LayerNorm, ln_mlp: LayerNorm | None,
                 parallel: bool, all_reduce: AllReduce | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.attn, self.mlp, self.ln_attn, self.ln_mlp, self.parallel = attn, mlp, ln_attn, ln_mlp, parallel
        self.all_reduce = all_reduce
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: StepBatch, meta: KVMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, None]:
        a_in, h = self.ln_attn(x, residual)  # h: the whole hidden state
        if self.parallel:
            m_in = a_in if self.ln_mlp is None else self.ln_mlp(h)[0]
            attn = self.attn(a_in, batch, meta, kv)
            y = self.mlp(m_in) + attn
            if self.all_reduce is not None:
                y = self.all_reduce(y)
            return (y if self.bias is None else y + self.bias) + h, None
        h = self.attn(a_in, batch, meta, kv) + h
        return self.mlp(self.ln_mlp(h)[0]) + h, None


def _sum_biases(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b


def build_layer(config: ModelConfig, layer: int, p: str, w: Weights, stage: StageBuild) -> FalconLayer:
    """Decoder layer ``layer`` from this rank's weights (its shard for TP rank ``stage.groups.tp.rank``)."""
    groups = stage.groups
    tp, parallel = groups.tp.size, layout(config).parallel_attn
    qkv_b = w.get(p + QKV + ".bias")
    qkv = Linear.fused(unpack_qkv(config, w(p + QKV + ".weight"), tp),
                       None if qkv_b is None else unpack_qkv(config, qkv_b, tp))
    dense_w, dense_b = w(p + DENSE + ".weight"), w.get(p + DENSE + ".bias")
    down_w, down_b = w(p + DOWN + ".weight"), w.get(p + DOWN + ".bias")
    reduce = tp_all_reduce(groups.tp)
    if parallel:  # partial sums, reduced (and biased) once by the layer
        dense, down = RowParallelLinear(dense_w), RowParallelLinear(down_w)
    else:
        dense, down = RowParallelLinear(dense_w, dense_b, reduce), RowParallelLinear(down_w, down_b, reduce)
    attn = Attention(config, layer, qkv, dense, stage.rotary, groups=groups)
    mlp = PlainMLP(Linear(w(p + UP + ".weight"), w.get(p + UP + ".bias")), down, config.activation)
    norms = [_norm(config, w, p + n) for n in _norms(config)]
    if not parallel:
        return FalconLayer(attn, mlp, norms[0], norms[1], False)
    return FalconLayer(attn, mlp, norms[0], norms[1] if len(norms) == 2 else None, True, reduce,
                       _sum_biases(dense_b, down_b))


def _work(config: ModelConfig, layer: int) -> LayerWork:
    return LayerWork("plain")


ARCHITECTURE = Architecture(
    name="falcon",
    hf_defaults={"falcon": dict(max_position_embeddings=2048, bos_token_id=11, eos_token_id=11)},
    parse=_parse,
    own_fields=FalconLayout,
    prefix="transformer.", layers="h", embedding="word_embeddings.weight", final_norm="ln_f",
    layer_tensors=layer_tensors, final_norm_tensors=final_norm_tensors,
    build_layer=build_layer, build_final_norm=build_final_norm,
    layer_work=_work,
    decode_stack="LayerNorms with biases, and attention beside the MLP rather than before it; the C++ loop "
                 "runs pre-norm RMSNorm layers only",
    fused_qkv_heads=qkv_heads,
)
