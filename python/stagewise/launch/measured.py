"""``--partition measured``: the layers split by what each stage's node can do.

Before any weight loads, the run's launcher starts a probe in place of every stage rank (as
``stagewise doctor`` does); each stage leader's probe measures its node with the planner's profile
primitives (:func:`stagewise.measure.node.node_profile`: seconds, then cached for the host, device and
threads; ``remeasure`` measures again, and the log says of each node whether its profile was
measured now or read from the cache, naming the file and when it was measured). The planner's
operator model (:mod:`stagewise.planner.compute`) turns each node's profile into the decode-step
time of every decoder layer there (batch 1, the context ``context``), plus the
embedding on stage 0 and the LM head and sampling on the last stage; the split is the contiguous
one whose slowest stage is fastest (:func:`stagewise.parallel.plan.min_max_ranges`; each stage's
time also holds its role's fixed cost per step, which weighs the first and the last) among those in
which every stage's weights and KV fit ``memory_fraction`` of its node's free memory (stages on one
node share it equally). A stage the launcher placed itself (Ray) is then pinned to the node it was
measured on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from stagewise.parallel.plan import PipelineStageInfo, min_max_ranges
from stagewise.parallel.runplan import RunPlan


@dataclass(frozen=True, slots=True)
class Split:
    ranges: list[tuple[int, int]]
    stage_s: list[float]
    """Each stage's predicted decode-step time, seconds: its operators, the framework's cost per
    layer and its role's fixed cost per step (stage 0's also taking the tokens back)."""
    stage_bytes: list[float]
    """Each stage's weights and KV, bytes."""
    memory: list[int]
    """Each stage node's free memory when measured, bytes."""

    @property
    def tpot_s(self) -> float:
        """Batch 1: the stages one after another (hops not counted)."""
        return sum(self.stage_s)


def split_layers(config, profiles, *, prec, dtype: str = "float32", context: int = 512, kv_tokens: int = 2048,
                 memory_fraction: float = 0.9) -> Split:
    """The split of ``config``'s layers over one stage per profile (a
    :class:`~stagewise.planner.profiles.DeviceProfile` each, in stage order)."""
    from stagewise.model import shapes
    from stagewise.planner.compute import framework_time, layer_ops, op_time, stage_ops
    from stagewise.planner.memory import kv_tokens as kv_tokens_of

    n, s_count = config.num_layers, len(profiles)

    def ops_s(ops, profile) -> float:
        return sum(op_time(op, profile, dtype)[0] for op in ops)

    per_layer = [[ops_s(layer_ops(config, layer, rows=1, new_tokens=1, context=context, prec=prec,
                              sharding=shapes.Sharding()), p)
                  + p.framework.get("layer_s", 0.0) for layer in range(n)] for p in profiles]
    edge = [PipelineStageInfo(0, 2, 0, 0, n), PipelineStageInfo(1, 2, 0, 0, n)]  # no layers: the extras only
    first = [ops_s(stage_ops(config, edge[0], rows=1, new_tokens=1, context=context, prec=prec), p) for p in profiles]
    last = [ops_s(stage_ops(config, edge[1], rows=1, new_tokens=1, context=context, prec=prec), p) for p in profiles]
    # Each role's fixed step cost (scheduling, metadata, sampling; stage 0 also takes the tokens back).
    fixed = ([framework_time(profiles[0], "engine", 0)] if s_count == 1 else
             [framework_time(profiles[0], "head", 0) + framework_time(profiles[0], "tokens", 0)]
             + [framework_time(p, "middle", 0) for p in profiles[1:-1]] + [framework_time(profiles[-1], "last", 0)])
    per_token = shapes.kv_bytes_per_token_layer(config, prec.kv, kv_cache_dtype=prec.kv_cache_dtype)
    layer_bytes = [shapes.count(config, shapes.layer_tensors(config, layer)) * prec.weight_bytes(1, prec.weight_quant)
                   + per_token * kv_tokens_of(config, range(layer, layer + 1), tokens=kv_tokens) for layer in range(n)]
    first_bytes = shapes.count(config, shapes.embedding_tensors(config) + shapes.vision_tensors(config)) \
        * prec.weight_bytes(1, prec.embed_quant)
    last_bytes = shapes.count(config, shapes.final_norm_tensors(config) + shapes.lm_head_tensors(config)) \
        * prec.weight_bytes(1, prec.embed_quant)
    prefix_s = [[0.0] for _ in profiles]
    for s in range(s_count):
        for c in per_layer[s]:
            prefix_s[s].append(prefix_s[s][-1] + c)
    prefix_b = [0.0]
    for b in layer_bytes:
        prefix_b.append(prefix_b[-1] + b)

    def time_of(s: int, a: int, b: int) -> float:
        return (prefix_s[s][b] - prefix_s[s][a] + fixed[s] + (first[s] if s == 0 else 0.0)
                + (last[s] if s == s_count - 1 else 0.0))

    def bytes_of(s: int, a: int, b: int) -> float:
        return prefix_b[b] - prefix_b[a] + (first_bytes if s == 0 else 0.0) + (last_bytes if s == s_count - 1 else 0.0)

    def cost(s: int, a: int, b: int) -> float:
        return time_of(s, a, b) if bytes_of(s, a, b) <= memory_fraction * profiles[s].memory_bytes else float("inf")

    try:
        ranges = min_max_ranges(s_count, n, cost)
    except ValueError:
        free = ", ".join(f"stage {s}: {p.memory_bytes / 2**20:.0f} MiB" for s, p in enumerate(profiles))
        raise ValueError(f"--partition measured: no split of the {n} layers fits the nodes' free memory ({free}; "
                         f"{sum(layer_bytes) / 2**20:.0f} MiB of layers and KV in all, plus the embedding's "
                         f"{first_bytes / 2**20:.0f} and the LM head's {last_bytes / 2**20:.0f})") from None
    return Split(ranges, [time_of(s, a, b) for s, (a, b) in enumerate(ranges)],
                 [bytes_of(s, a, b) for s, (a, b) in enumerate(ranges)], [p.memory_bytes for p in profiles])


def measure_nodes(plan: RunPlan, types: tuple[str, ...], start, token: str | None = None,
                  remeasure: bool = False) -> list[dict]:
    """Each stage's node profile dict, measured by its leader's probe (its cached profile unless
    ``remeasure``: then each node is measured again, once, the stages after the first on it
    reading what it measured); ``start(plan, extra=...)`` starts the run's processes
    (:func:`stagewise.launch.start.start_stages` with its launcher, and the run's auth ``token``,
    which the probes then ask for)."""
    from stagewise.launch.probe import Connection, say_bye

    procs, placed, addresses = start(plan, extra=["--probe"])
    try:
        out, measured_now = [], set()
        for index in range(plan.num_stages):
            address = addresses[plan.members.index((index, 0))]
            spec = placed.stages[index]
            node = (spec.host, spec.device, spec.threads)  # where the launcher put it: one cache entry
            with Connection(address, token, timeout=300) as c:
                got = c.ask({"op": "measure", "types": list(types), "fresh": remeasure and node not in measured_now})
            measured_now.add(node)
            if "error" in got:
                raise RuntimeError(f"stage {index} on {plan.stages[index].host} could not measure its node: "
                                   f"{got['error']}")
            got["measured"]["address"] = placed.stages[index].host  # where the launcher put it
            out.append(got)
        return out
    finally:
        say_bye(addresses, token)
        procs.stop(2.0)


def measured_plan(plan: RunPlan, checkpoint, start, log=None, token: str | None = None,
                  remeasure: bool = False) -> RunPlan:
    """``plan`` with its layers split by its nodes' measured speed (its partition says ``measured``),
    the probes started by ``start`` with the run's ``token`` (see :func:`measure_nodes`); where each
    node's profile came from and the split are said through ``log`` (default: on stderr)."""
    return measured_split(plan, checkpoint, start, log, token, remeasure)[0]


def profile_origin(measured: dict, now: float | None = None, hint: bool = True) -> str:
    """Where a node's profile came from (its ``measured`` section, :mod:`stagewise.measure.node`):
    measured now, or read from a cache file, with when it was measured (and with ``hint``, how to
    measure again)."""
    if not measured.get("from_cache"):
        saved = f", cached in {measured['cache']}" if measured.get("cache") else ""
        return f"measured now in {measured.get('seconds', 0.0):.1f} s{saved}"
    at = measured.get("at")
    if isinstance(at, (int, float)):
        age = max(0.0, (time.time() if now is None else now) - at)
        when = f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(at))}, {_age(age)} ago"
    else:
        when = "at an unknown time"
    return f"cached profile {measured.get('cache')}, measured {when}" + (" (--remeasure measures it again)"
                                                                          if hint else "")


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def measured_split(plan: RunPlan, checkpoint, start, log=None, token: str | None = None,
                   remeasure: bool = False) -> tuple[RunPlan, Split]:
    """:func:`measured_plan`, and the :class:`Split` it took with its prediction (what
    ``stagewise plan validate --partition measured`` checks against the run)."""
    if log is None:
        import sys

        def log(line: str) -> None:
            print(f"stagewise: {line}", file=sys.stderr, flush=True)

    from stagewise.model.quant import checkpoint_quant
    from stagewise.planner.estimate import Workload
    from stagewise.planner.profiles import profile_from_dict

    weight_quant, embed_quant = checkpoint_quant(checkpoint)
    types = tuple(sorted({t for t in (weight_quant, embed_quant) if t}))
    nodes = measure_nodes(plan, types, start, token, remeasure)
    for s, node in enumerate(nodes):
        m = node["measured"]
        log(f"stage {s}'s node ({m['host']}, {m['device']}, {m['threads']} threads): "
            f"{profile_origin(m, hint=not remeasure)}")
    profiles = [profile_from_dict(d, f"stage {i}'s node") for i, d in enumerate(nodes)]
    # Stages that share a node (its host and device) share its free memory, each an equal part.
    where = [(d["measured"]["host"], d["measured"]["device"]) for d in nodes]
    profiles = [dataclasses.replace(p, memory_bytes=p.memory_bytes // where.count(w)) for p, w in zip(profiles, where)]
    dtype = "float32" if plan.dtype == "auto" else plan.dtype
    prec = Workload(input_length=1, output_length=1, weight_dtype=dtype, kv_dtype=dtype, weight_quant=weight_quant,
                    embed_quant=embed_quant, kv_cache_dtype=plan.kv_cache_dtype).precision()
    context = min(512, plan.max_model_len or 512)
    split = split_layers(checkpoint.config, profiles, prec=prec, dtype=dtype, context=context,
                         kv_tokens=(plan.max_model_len or checkpoint.config.max_position_embeddings or 2048))
    # A stage the launcher placed (Ray) is pinned to the node it was measured on: `node:<address>`.
    pins = [None if d["measured"]["address"] == st.host else {**(st.resources or {}),
            f"node:{d['measured']['address']}": 0.001} for d, st in zip(nodes, plan.stages)]
    placed = dataclasses.replace(plan, partition="measured", stages=tuple(
        dataclasses.replace(st, start_layer=a, end_layer=b, resources=pin or st.resources)
        for st, (a, b), pin in zip(plan.stages, split.ranges, pins)))
    for s, ((a, b), t) in enumerate(zip(split.ranges, split.stage_s)):
        node = nodes[s]["measured"]
        log(f"stage {s}: layers {a}-{b} ({b - a}), predicted {1e3 * t:.2f} ms a decode step on "
            f"{node['host']} ({node['device']}, {node['threads']} threads)")
    log(f"predicted TPOT at batch 1: {1e3 * split.tpot_s:.2f} ms (hops not counted)")
    return placed.validated(), split
