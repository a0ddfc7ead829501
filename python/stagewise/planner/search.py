"""The layout search space: ``tp_sizes x pp_sizes x pcp_sizes x dcp_sizes x ep_sizes x moe_dp_sizes``.

Size arguments: ``None`` (not given) -> the default value alone (TP: every power of two up to
the device count, so a plain search compares TP sizes; PP, PCP, DCP, EP, MoE-DP: 1);
``[]`` (given without values) -> powers of two up to the device count; explicit values -> each
must be a positive integer not greater than the device count.

Candidate rules: ``N % (tp * pcp * pp) == 0``, ``dp = N // (tp * pcp * pp)``, ``tp % dcp == 0``
(DCP reuses the TP ranks), ``N % ep == 0``, ``N % (ep * moe_dp) == 0``, ``moe_tp = N // (ep * moe_dp)``;
then the model must accept the layout (heads divisible by TP, DCP dividing the ranks that hold each
KV head, no empty stage, ...). No candidate left: an error that says why.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.model.config import ModelConfig
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner.estimate import LayoutEstimate, Workload, estimate_layout, layout_sharding
from stagewise.planner.memory import check_layout
from stagewise.planner.profiles import DeviceProfile


def powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def resolve_search_sizes(values: Sequence[int] | None, num_devices: int, default: int | None,
                         name: str = "sizes") -> list[int]:
    """The sizes to try: ``values`` as given (each in ``[1, num_devices]``), powers of two up to
    ``num_devices`` for ``[]``, ``[default]`` for None (``default=None``: powers of two, TP's)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"--num-devices must be an int >= 1, got {num_devices!r}")
    if values is None:
        return powers_of_two(num_devices) if default is None else [default]
    if len(values) == 0:
        return powers_of_two(num_devices)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= num_devices]
    if bad:
        raise ValueError(f"--{name}: each value must be a positive integer not greater than --num-devices="
                         f"{num_devices}, got {bad}")
    return sorted(set(values))


class NoValidLayout(ValueError):
    """No candidate passed the rules; the message lists why each was rejected."""


@dataclass(frozen=True, slots=True)
class Rejected:
    tp: int
    pp: int
    ep: int
    moe_dp: int
    reason: str
    pcp: int = 1
    dcp: int = 1

    def label(self) -> str:
        cp = (f" PCP={self.pcp}" if self.pcp > 1 else "") + (f" DCP={self.dcp}" if self.dcp > 1 else "")
        return f"TP={self.tp} PP={self.pp}{cp} EP={self.ep} MOE_DP={self.moe_dp}"


def candidate_layouts(num_devices: int, tp_sizes: Sequence[int], pp_sizes: Sequence[int], ep_sizes: Sequence[int],
                      moe_dp_sizes: Sequence[int], pcp_sizes: Sequence[int] = (1,),
                      dcp_sizes: Sequence[int] = (1,)) -> tuple[list[ParallelConfig], list[Rejected]]:
    """The layouts passing the divisibility rules, and the rejected combinations with their reason."""
    ok, rejected = [], []
    n = num_devices
    for tp, pp, pcp, dcp, ep, moe_dp in itertools.product(tp_sizes, pp_sizes, pcp_sizes, dcp_sizes, ep_sizes,
                                                          moe_dp_sizes):
        reason = ""
        if n % (tp * pcp * pp):
            reason = f"{'tp * pcp * pp' if pcp > 1 else 'tp * pp'} = {tp * pcp * pp} does not divide {n} devices"
        elif tp % dcp:
            reason = f"dcp = {dcp} does not divide tp = {tp} (DCP reuses the TP ranks)"
        elif n % ep:
            reason = f"ep = {ep} does not divide {n} devices"
        elif n % (ep * moe_dp):
            reason = f"ep * moe_dp = {ep * moe_dp} does not divide {n} devices"
        if reason:
            rejected.append(Rejected(tp, pp, ep, moe_dp, reason, pcp, dcp))
        else:
            ok.append(ParallelConfig(world_size=n, tp=tp, pp=pp, dp=n // (tp * pcp * pp), ep=ep, moe_dp=moe_dp,
                                     pcp=pcp, dcp=dcp))
    return ok, rejected


def model_accepts(config: ModelConfig, layout: ParallelConfig, partition: str) -> str | None:
    """Why ``config`` cannot run ``layout`` (None: it can)."""
    try:
        check_layout(config, layout_sharding(config, layout))
        StagePlan.for_model(config, layout.pp, partition)
    except ValueError as err:
        return str(err)
    if config.moe is None and (layout.ep > 1 or layout.moe_dp > 1):
        return f"ep={layout.ep} / moe_dp={layout.moe_dp} need a mixture-of-experts model"
    return None


def search(config: ModelConfig, *, num_devices: int, workload: Workload, profile: DeviceProfile,
           tp_sizes: Sequence[int] | None = None, pp_sizes: Sequence[int] | None = None,
           ep_sizes: Sequence[int] | None = None, moe_dp_sizes: Sequence[int] | None = None,
           pcp_sizes: Sequence[int] | None = None, dcp_sizes: Sequence[int] | None = None,
           partition: str = "even", total_params: float | None = None) -> tuple[list[LayoutEstimate], list[Rejected]]:
    """Every valid layout, best first (fitting ones first, then tokens/s, then TPOT), and the rejected ones."""
    tps = resolve_search_sizes(tp_sizes, num_devices, None, "tp-sizes")
    pps = resolve_search_sizes(pp_sizes, num_devices, 1, "pp-sizes")
    eps = resolve_search_sizes(ep_sizes, num_devices, 1, "ep-sizes")
    mdps = resolve_search_sizes(moe_dp_sizes, num_devices, 1, "moe-dp-sizes")
    pcps = resolve_search_sizes(pcp_sizes, num_devices, 1, "pcp-sizes")
    dcps = resolve_search_sizes(dcp_sizes, num_devices, 1, "dcp-sizes")
    layouts, rejected = candidate_layouts(num_devices, tps, pps, eps, mdps, pcps, dcps)
    results = []
    for lay in layouts:
        reason = model_accepts(config, lay, partition)
        if reason:
            rejected.append(Rejected(lay.tp, lay.pp, lay.ep, lay.moe_dp, reason, lay.pcp, lay.dcp))
            continue
        results.append(estimate_layout(config, lay, workload, profile, partition=partition, total_params=total_params))
    if not results:
        lines = [f"  {r.label()}: {r.reason}" for r in rejected[:12]]
        more = f"\n  ... and {len(rejected) - 12} more" if len(rejected) > 12 else ""
        cp = (f" x PCP {pcps}" if pcps != [1] else "") + (f" x DCP {dcps}" if dcps != [1] else "")
        raise NoValidLayout(f"no valid layout for {num_devices} devices among TP {tps} x PP {pps}{cp} x EP {eps} x "
                            f"MOE_DP {mdps}:\n" + "\n".join(lines) + more)
    results.sort(key=lambda r: (not r.fits, -r.tokens_per_s, r.tpot_s))
    return results, rejected
