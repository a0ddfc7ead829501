"""GGUF weight blocks for the quantised-linear tests: real blocks from gguf.quants.quantize for the
types gguf can write (Q4_0, Q4_1, Q8_0), random valid blocks for the K-quants (gguf reads them but
does not write them), and gguf's own dequantisation as the independent reference of every layout."""

from __future__ import annotations

import gguf
import numpy as np
import torch

import stagewise.ops as ops

QTYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


def block_weights(name: str) -> int:
    return ops.QUANT_BLOCK_WEIGHTS[ops.QTYPES[name]]


def quantize(name: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """``[out_features, row bytes]`` uint8 blocks of type ``name``."""
    rng = np.random.default_rng(seed)
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        w = rng.standard_normal((out_features, in_features)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]).copy())
    qtype = ops.QTYPES[name]
    nblocks, nbytes = in_features // 256, ops.QUANT_BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (out_features, nblocks, nbytes), dtype=np.uint8)
    scales = lambda lo, hi: rng.uniform(lo, hi, (out_features, nblocks, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    if name == "Q4_K":  # d and dmin: 6-bit scales and mins multiply them
        blocks[..., 0:2] = scales(0.002, 0.02)
        blocks[..., 2:4] = scales(0.001, 0.01)
    else:  # Q6_K: d at the end, int8 scales multiply it
        blocks[..., 208:210] = scales(0.0005, 0.005)
    return torch.from_numpy(blocks.reshape(out_features, nblocks * nbytes))


def dequantize(qweight: torch.Tensor, name: str) -> torch.Tensor:
    """The GGUF project's own dequantisation: the independent reference of the block layout."""
    return torch.from_numpy(gguf.quants.dequantize(qweight.numpy(), gguf.GGMLQuantizationType[name]).copy())


def shapes(name: str) -> list[tuple[int, int]]:
    """(out_features, in_features): one block, odd block counts, output features off every panel
    and tile size."""
    if block_weights(name) == 256:
        return [(1, 256), (7, 512), (37, 768), (70, 256)]
    return [(1, 32), (7, 96), (37, 224), (70, 576)]


def checked_int8_linear(seen: set):
    """A stand-in for ``QuantizedWeight.linear`` in the int8 mode that checks each call on the
    model's real activations against the plain pure-torch reference of the int8 maths (up to
    float32 rounding), and that it differs from the exact op; ``seen`` collects each call's
    (precision, shape)."""
    from stagewise.model.quant import QuantizedWeight
    from stagewise.ops import reference as ref

    linear = QuantizedWeight.linear

    def checked(self, x, bias=None):
        out = linear(self, x, bias)
        if x.numel() == 0:  # the LM head of a step whose chunks sample nothing
            return out
        expected = ref.quant_linear_int8(x, self.data, self.qtype, bias)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
        assert not torch.equal(out, ref.quant_linear(x, self.data, self.qtype, bias))
        seen.add((self.precision, tuple(self.shape)))
        return out

    return checked
