"""A stage's steps with the layer loop in C++: :func:`build_decode_stack` hands a stage's
decoder layers to ``torch.classes.stagewise.DecoderStack`` (csrc/bindings/decoder_stack.cpp), which
runs the same ops as the Python layers, in the same order, from C++.

Why: at batch 1 a layer's kernels take tens of microseconds and driving them from Python costs
about as much again (``stagewise bench profile`` measures the framework's cost per layer). The
stack serves every step without images: decode steps (``decode``) and steps with prompt rows
(``extend``: each prompt row a run of tokens after its request's cache, a prompt from its first
token included, attended by ``extend_attention``; the step's decode rows beside them). It runs the
pre-norm :class:`~stagewise.model.layers.decoder.DecoderLayer` with RMSNorms and a dense gated MLP,
on one tensor-parallel rank on the CPU. Which stages get one is decided by
``StageModel.python_loop_reason``: an architecture whose entry says the loop takes its layers
(``Architecture.decode_stack`` is None) must give layers it runs, and a layer it cannot run is an
error here, never a quiet fallback to the slower Python loop.
"""

from __future__ import annotations

import torch

from stagewise.model.layers.attention import Attention
from stagewise.model.layers.decoder import DecoderLayer
from stagewise.model.layers.linear import Linear, RowParallelLinear
from stagewise.model.layers.mlp import GatedMLP
from stagewise.model.layers.norm import RMSNorm
from stagewise.model.quant import QuantizedWeight

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3}
"""Activation name -> the stack's code (decoder_stack.cpp); the ones GatedMLP knows."""


def _misfit(layer: torch.nn.Module, activation: str) -> str | None:
    """What of ``layer`` the C++ loop cannot run (None: nothing)."""
    if activation not in _ACTIVATIONS:
        return f"activation {activation!r} (it runs {sorted(_ACTIVATIONS)})"
    if not isinstance(layer, DecoderLayer):
        return f"a {type(layer).__name__} (it runs DecoderLayer)"
    attn, mlp = layer.attn, layer.mlp
    parts = [("input_norm", layer.input_norm, RMSNorm), ("post_norm", layer.post_norm, RMSNorm),
             ("attn", attn, Attention), ("mlp", mlp, GatedMLP)]
    wrong = [f"{name} is a {type(m).__name__} (it runs {kind.__name__})" for name, m, kind in parts
             if not isinstance(m, kind)]
    if wrong:
        return "; ".join(wrong)
    if not (isinstance(attn.qkv, Linear) and isinstance(mlp.gate_up, Linear)
            and isinstance(attn.o, RowParallelLinear) and isinstance(mlp.down, RowParallelLinear)):
        return "linears other than Linear (qkv, gate_up) and RowParallelLinear (o, down)"
    if attn.o.all_reduce is not None or mlp.down.all_reduce is not None:
        return "row-parallel linears that all-reduce (a tensor-parallel rank's layer)"
    if attn.window is not None:
        return f"attention over a sliding window of {attn.window} tokens (it attends over every cached token)"
    if layer.input_norm.unit_offset or layer.post_norm.unit_offset or attn.unit_offset_qk_norm:
        return "norms that scale by 1 + w (unit_offset; it runs Llama's)"
    return None


def _linear_args(module: Linear | RowParallelLinear) -> tuple:
    """(weight, qtype, int8, out_features, bias) of DecoderStack.set_linear."""
    w, bias = module.weight, module.bias
    if isinstance(w, QuantizedWeight):
        if w.precision == "int8":
            return w.for_linear().packed, w.qtype, True, w.shape[0], bias
        return w.data, w.qtype, False, w.shape[0], bias
    return w, -1, False, w.shape[0], bias


def build_decode_stack(layers: list[torch.nn.Module], activation: str):
    """The C++ stack of ``layers`` (a stage's, in order; None for no layers). ValueError naming the
    first layer it cannot run and why (see the module docstring)."""
    if not layers:
        return None
    for i, layer in enumerate(layers):
        why = _misfit(layer, activation)
        if why is not None:
            raise ValueError(f"build_decode_stack: the C++ layer loop cannot run layer {i} of the stage: {why}. "
                             "An architecture whose layers it does not run says why in its entry "
                             "(Architecture.decode_stack)")
    first = layers[0]
    attn, rotary = first.attn, first.attn.rotary
    stack = torch.classes.stagewise.DecoderStack(attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.eps,
                                                 rotary.is_neox, attn.scale, rotary.cos_sin_cache,
                                                 _ACTIVATIONS[activation])
    for i, layer in enumerate(layers):
        a = layer.attn
        if (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) != (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                                   attn.scale) or a.rotary is not rotary:
            raise ValueError(f"build_decode_stack: layer {i}'s attention differs from layer 0's (heads, head_dim, "
                             "scale or rotary table); the C++ loop runs layers of one shape")
        if layer.input_norm.eps != rotary.eps or layer.post_norm.eps != rotary.eps:
            raise ValueError(f"build_decode_stack: layer {i}'s norms' eps ({layer.input_norm.eps}, "
                             f"{layer.post_norm.eps}) differ from the q/k norms' {rotary.eps}; the C++ loop has "
                             "one eps")
        index = stack.add_layer(layer.input_norm.weight, layer.post_norm.weight, a.q_norm, a.k_norm)
        for slot, module in enumerate((a.qkv, a.o, layer.mlp.gate_up, layer.mlp.down)):
            stack.set_linear(index, slot, *_linear_args(module))
    return stack
