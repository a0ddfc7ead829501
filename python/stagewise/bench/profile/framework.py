"""The runtime's Python and dispatch cost per decode step, for the planner's CPU model (the
``framework`` group of `stagewise bench profile`): the part a node profile measures too
(:mod:`stagewise.measure.framework`: ``layer_s`` with the weights streaming through the caches, the
fixed part of each stage role's step), and what only the full profile adds: ``python_layer_s``
(through the Python layer loop, as a rank of a TP/CP stage runs its layers) and ``cp_layer_s``,
what a decode-context-parallel layer's attention adds besides its kernel and its collectives (the
log-sum-exp weights, the float32 sums, the copies: :func:`cp_combine_s`).
"""

from __future__ import annotations

import torch

from stagewise.measure.framework import LAYERS_HI, engine_step_s, median_step_s, role_overheads, streamed_layer_s


def framework_overheads(log=print, prompt: int = 128, steps: int = 40, repeats: int = 5) -> dict:
    """Per decode step (batch 1): ``layer_s`` and the fixed part of each role (see the module doc);
    each the least disturbed of ``repeats`` medians (this machine is shared)."""
    roles = role_overheads(prompt, steps, repeats)
    raw, lo, hi = roles.pop("raw"), 1, LAYERS_HI
    hot_layer = raw["hot_layer_s"]
    # The Python layer loop's extra cost per layer (what a rank of a TP/CP stage runs).
    py = {n: min(engine_step_s(n, prompt, steps, python_loop=True) for _ in range(repeats)) for n in (lo, hi)}
    python_extra = max((py[hi] - py[lo]) / (hi - lo) - hot_layer, 0.0)
    # Per layer with the weights streaming; the engine's fixed part from the negligible-width model.
    streamed = streamed_layer_s(prompt)
    layer = max((streamed["framework_s"] - roles["engine_s"]) / streamed["layers"], 0.0)
    cp = cp_combine_s()
    tokens = roles["tokens_s"]
    out = {"layer_s": layer, "python_layer_s": layer + python_extra, "cp_layer_s": cp, **roles,
           "raw": {**raw, "python_loop_step_s": py, "streamed": streamed}}
    log(f"  framework per decode step: {layer * 1e6:.0f} us/layer with streamed weights "
        f"({out['python_layer_s'] * 1e6:.0f} through the Python layer loop) "
        f"({hot_layer * 1e6:.0f} with hot caches); fixed: engine {out['engine_s'] * 1e6:.0f} us, "
        f"head {out['head_s'] * 1e6:.0f}, middle {out['middle_s'] * 1e6:.0f}, last {out['last_s'] * 1e6:.0f}, "
        f"tokens back {tokens * 1e6:.0f} us; DCP attention combine {cp * 1e6:.0f} us/layer")
    return out


class _Mirror:
    """A group of two ranks played by one process, the other rank holding the same tensors: the
    collectives' callers do all their own tensor work, nothing is sent."""

    size, rank = 2, 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([t, t], dim)

    def gather(self, t: torch.Tensor, dim: int = 0, dst: int = 0) -> torch.Tensor:
        return torch.cat([t, t], dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, 0, t.size(dim) // 2).contiguous()


def cp_combine_s(rows: int = 1, heads: int = 4, head_dim: int = 64, context: int = 144, calls: int = 200) -> float:
    """Seconds a DCP decode layer spends on its attention besides the kernel and the collectives:
    :func:`~stagewise.model.layers.context_parallel.decode_attention_cp` over a two-rank group
    played here (:class:`_Mirror`) minus its ``decode_attention`` call alone, each call after the
    work a step does in between (:class:`~stagewise.bench.profile.runtime.StepWork`: in a tight
    loop the small ops would find their caches hot); the least disturbed of several medians."""
    from stagewise import ops
    from stagewise.bench.profile.runtime import StepWork
    from stagewise.model.collectives import SINGLE, StageGroups
    from stagewise.kv.cache import LayerKV
    from stagewise.model.layers.context_parallel import decode_attention_cp

    block = 16
    nblocks = -(-context // block)
    k, v = (torch.randn(rows * nblocks, block, 1, head_dim) for _ in range(2))
    tables = torch.arange(rows * nblocks, dtype=torch.int32).view(rows, nblocks)
    lens = torch.full((rows,), context // 2, dtype=torch.int32)
    q = torch.randn(rows, heads, head_dim)
    groups = StageGroups(tp=_Mirror(), dcp=_Mirror(), pcp=SINGLE)
    q2 = torch.cat([q, q], 1)
    work = StepWork()
    cp = min(median_step_s(lambda: decode_attention_cp(q, LayerKV(k, v), tables, lens, 0.125, groups), calls, work)
             for _ in range(5))
    alone = min(median_step_s(lambda: ops.decode_attention(q2, k, v, tables, lens, 0.125), calls, work)
                for _ in range(5))
    return max(cp - alone, 0.0)
