"""A stage's decode steps with the layer loop in C++: :func:`build_decode_stack` hands a stage's
decoder layers to ``torch.classes.stagewise.DecoderStack`` (csrc/bindings/decoder_stack.cpp), which
runs the same ops as the Python layers, in the same order, from C++.

Why: at batch 1 a layer's kernels take tens of microseconds and driving them from Python costs
about as much again (``stagewise bench profile`` measures the framework's cost per layer). The
stack serves steps whose rows all decode one token and steps of prompts that all start at
position 0 (without images); later chunks and mixed steps run the Python layers. It covers the
pre-norm layers of :mod:`stagewise.model.models.llama` (Llama, Mistral, Qwen3) with a dense gated
MLP on one tensor-parallel rank; other stages have none.
"""

from __future__ import annotations

import torch

from stagewise.model.layers.attention import Attention
from stagewise.model.layers.linear import Linear, RowParallelLinear
from stagewise.model.layers.mlp import GatedMLP
from stagewise.model.layers.norm import RMSNorm
from stagewise.model.models.llama import DecoderLayer
from stagewise.model.quant import QuantizedWeight

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3}
"""Activation name -> the stack's code (decoder_stack.cpp); the ones GatedMLP knows."""


def _fits(layer: torch.nn.Module, activation: str) -> bool:
    if not isinstance(layer, DecoderLayer) or activation not in _ACTIVATIONS:
        return False
    attn, mlp = layer.attn, layer.mlp
    return (isinstance(layer.input_norm, RMSNorm) and isinstance(layer.post_norm, RMSNorm)
            and isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
            and isinstance(attn.o, RowParallelLinear) and attn.o.all_reduce is None
            and isinstance(mlp.down, RowParallelLinear) and mlp.down.all_reduce is None
            and isinstance(attn.qkv, Linear) and isinstance(mlp.gate_up, Linear))


def _linear_args(module: Linear | RowParallelLinear) -> tuple:
    """(weight, qtype, int8, out_features, bias) of DecoderStack.set_linear."""
    w, bias = module.weight, module.bias
    if isinstance(w, QuantizedWeight):
        if w.precision == "int8":
            return w.for_linear().packed, w.qtype, True, w.shape[0], bias
        return w.data, w.qtype, False, w.shape[0], bias
    return w, -1, False, w.shape[0], bias


def build_decode_stack(layers: list[torch.nn.Module], activation: str, device: torch.device):
    """The C++ stack of ``layers`` (a stage's, in order), or None when they are not all plain
    pre-norm decoder layers of one rank (see the module docstring)."""
    if not layers or not all(_fits(layer, activation) for layer in layers):
        return None
    first = layers[0]
    attn, rotary = first.attn, first.attn.rotary
    stack = torch.classes.stagewise.DecoderStack(attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.eps,
                                                 rotary.is_neox, attn.scale, rotary.cos_sin_cache,
                                                 _ACTIVATIONS[activation])
    for layer in layers:
        a = layer.attn
        if (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) != (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                                   attn.scale) or a.rotary is not rotary:
            return None
        if layer.input_norm.eps != rotary.eps or layer.post_norm.eps != rotary.eps:
            return None
        i = stack.add_layer(layer.input_norm.weight, layer.post_norm.weight, a.q_norm, a.k_norm)
        for slot, module in enumerate((a.qkv, a.o, layer.mlp.gate_up, layer.mlp.down)):
            stack.set_linear(i, slot, *_linear_args(module))
    return stack
