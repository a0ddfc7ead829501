"""Run plans: which process runs which layers, where it listens, and how stages talk.

A run plan is a YAML (or JSON) file::

    model: smollm2-135m          # a folder, a .gguf file or a built-in name, valid on every host
    dtype: auto
    transport: auto              # auto | tcp | shm | cuda-ipc | torch
    checksum: true
    max_num_seqs: 32
    max_prefill_tokens: 8192     # prompt tokens per step: a longer prompt is prefilled in chunks
    tpot_target_ms: 20           # optional: new prompts wait, or run in chunks, so that streams keep this pace
    prefix_cache: true           # a prompt's beginning that earlier requests computed reuses their KV
    kv_cache_dtype: auto         # auto | int8 | fp8_e4m3: K/V as one-byte codes with a scale per token and head
    speculative: ngram           # optional: draft tokens by prompt lookup, verified in one step
    num_speculative_tokens: 3    # most drafts per request and step
    max_model_len: 2048          # optional
    kv_cache_bytes: 268435456    # optional, per stage
    tp: 1                        # tensor-parallel ranks per stage (a stage may give its own)
    dcp: 1                       # decode context parallel: ranks of the TP group sharding a KV head's sequence
    pcp: 1                       # prefill context parallel: extra ranks per stage, each a part of the prompt
    interleave_size: 1           # tokens in a row on one context-parallel rank (divides block_size)
    launcher: local              # local | ray: `stagewise launch` places the stages on a Ray cluster
    placement: spread            # with launcher ray: spread | pack | strict_spread
    tls: {cert: /etc/sw/node.crt, key: /etc/sw/node.key, ca: /etc/sw/ca.crt}   # optional: mutual TLS between hosts
    stages:
      - {host: 10.0.0.1, listen: "10.0.0.1:7100", layers: "0-15", device: cpu, threads: 8}
      - {host: 10.0.0.2, listen: "10.0.0.2:7100", layers: "15-30", device: "cuda:0", tp: 2}

``layers`` may be left out of every stage and ``partition`` (even, ceil, balanced) given
instead; the ranges then come from :mod:`stagewise.parallel.plan`, the same code the planner
uses. ``listen`` defaults to ``127.0.0.1:0`` (loopback, any free port).

A stage of ``pcp * tp`` ranks is that many processes (:meth:`RunPlan.stage_ranks` numbers them);
rank 0, its leader, listens at ``listen`` and talks to the other stages; rank ``r`` listens at
the same host on port ``port + r`` (any free port when the port is 0) and, on a GPU, runs on
``cuda:(index + r)`` of the stage's ``device``. Stages may differ in ``tp``; ``dcp``, ``pcp`` and
``interleave_size`` are the run's, since every stage's KV blocks mirror stage 0's scheduler.

With ``launcher: ray``, Ray places each stage (its ``host`` and port) and a stage's ``resources``
join its bundle (docs/cluster.md). ``partition: measured`` splits by the nodes' measured speed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stagewise.parallel.plan import PARTITION_POLICIES, StagePlan
from stagewise.parallel.plan_options import OPTION_KEYS, option_problems, problem
from stagewise.parallel.ranks import StageRanks, stage_ranks

PROTOCOL_VERSION = 1


def _fail(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"run plan: {what} must be {expected}, got {value!r}")


def parse_address(text: str, what: str = "listen") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) -> (host, port)."""
    if not isinstance(text, str) or ":" not in text:
        raise _fail(what, text, "'host:port'")
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 <= int(port) < 65536:
        raise _fail(what, text, "'host:port' with a port in [0, 65535]")
    return host, int(port)


def read_plan_data(path: str | Path) -> Any:
    """The parsed YAML/JSON document of a plan file, not yet checked."""
    from stagewise.yamlfile import read_yaml

    return read_yaml(path, "run plan")


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage process."""

    index: int
    start_layer: int
    end_layer: int
    host: str = "127.0.0.1"
    """Where the process runs (for printing and --ssh)."""
    listen: str = "127.0.0.1:0"
    device: str = "cpu"
    threads: int | None = None
    """torch intra-op threads (None: torch's default), per rank."""
    tp: int = 1
    """Tensor-parallel ranks of this stage."""
    resources: dict[str, float] | None = None
    """Ray resources its placement-group bundle asks for besides CPUs and GPUs (``launcher: ray``)."""

    def rank_device(self, rank: int) -> str:
        """The device of stage rank ``rank``: ``cuda:(index + rank)`` on a GPU, else ``device``."""
        if rank == 0 or not self.device.startswith("cuda"):
            return self.device
        index = int(self.device.partition(":")[2] or 0)
        return f"cuda:{index + rank}"

    def rank_listen(self, rank: int) -> str:
        """Where stage rank ``rank`` listens: the leader's host, its port + ``rank`` (0: any)."""
        host, _, port = self.listen.rpartition(":")
        return f"{host}:{int(port) + rank if int(port) else 0}"


@dataclass(frozen=True, slots=True)
class RunPlan:
    model: str
    stages: tuple[StageSpec, ...]
    num_layers: int
    dtype: str = "auto"
    transport: str = "auto"
    checksum: bool = True
    max_num_seqs: int = 32
    max_prefill_tokens: int = 8192
    """Prompt tokens a step runs at most (stage 0's scheduler): a longer prompt is prefilled in
    chunks over several steps, decodes of other requests running beside them."""
    tpot_target_ms: float | None = None
    """A time per output token the running requests keep while new prompts start (stage 0's
    scheduler, :mod:`stagewise.engine.pacing`); None: prompts start as soon as they fit."""
    prefix_cache: bool = True
    """Stage 0's scheduler starts a request after the cached KV blocks of its prompt's beginning
    (:mod:`stagewise.engine.prefix_cache`); False: every prompt from its first token."""
    kv_cache_dtype: str = "auto"
    """What every stage stores a K/V value as (:data:`stagewise.kv.cache.KV_CACHE_DTYPES`): ``auto``,
    the activations' dtype; ``int8`` or ``fp8_e4m3``, one-byte codes with a float16 scale per token
    and KV head (about a quarter of float32's bytes)."""
    speculative: str | None = None
    """Stage 0 drafts tokens (``ngram``: prompt lookup) that one step verifies on every stage
    (:mod:`stagewise.engine.speculative`); None: one token per step."""
    num_speculative_tokens: int = 3
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    max_num_tokens: int | None = None
    block_size: int = 16
    quantized: bool | None = None
    """Block-quantised GGUF matrices stay in their blocks (None: when the stage runs float32)."""
    linear_precision: str = "exact"
    """How those blocks multiply: "exact" (float32 dequantised values) or "int8" (approximate)."""
    partition: str = "explicit"
    pcp: int = 1
    dcp: int = 1
    interleave_size: int = 1
    launcher: str = "local"
    placement: str = "spread"
    tls: dict[str, Any] | None = None
    """``{cert, key, ca}``: PEM paths (valid on every host) for mutual TLS on TCP links between
    hosts (:mod:`stagewise.transport.tls`)."""
    sampling: dict[str, Any] | None = None
    """Defaults for the requests sent to this plan's stages (``stagewise launch``, ``generate
    --plan``): sampling fields such as temperature, top_p, repetition_penalty; the command line's
    options replace them."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_ranks(self) -> list[StageRanks]:
        """The ranks of every stage, numbered over the whole run (``[PP, PCP, TP]``)."""
        return stage_ranks([(s.tp, self.pcp, self.dcp) for s in self.stages])

    @property
    def world_size(self) -> int:
        """Processes of the run: every stage's ``pcp * tp``."""
        return sum(s.tp for s in self.stages) * self.pcp

    @property
    def members(self) -> list[tuple[int, int]]:
        """(stage, stage rank) of every process of the run, in global rank order."""
        return [(i, r) for i, ranks in enumerate(self.stage_ranks()) for r in range(ranks.size)]

    def member_label(self, stage: int, rank: int) -> str:
        """How messages name a process: ``stage I``, or ``stage I rank R`` in a stage of several."""
        return f"stage {stage}" if self.stages[stage].tp * self.pcp == 1 else f"stage {stage} rank {rank}"

    @property
    def stage_plan(self) -> StagePlan:
        return StagePlan.from_ranges([(s.start_layer, s.end_layer) for s in self.stages], self.num_layers,
                                     self.partition)

    def fingerprint(self, model_config: dict[str, Any]) -> str:
        """What both ends of a connection must agree on: the model's config, the layer ranges,
        dtype, block size and protocol version (hosts, ports and devices may differ)."""
        body = {"version": PROTOCOL_VERSION, "config": model_config, "dtype": self.dtype, "quantized": self.quantized,
                "block_size": self.block_size, "ranges": [[s.start_layer, s.end_layer] for s in self.stages],
                "tp": [s.tp for s in self.stages], "pcp": self.pcp, "dcp": self.dcp,
                "interleave_size": self.interleave_size, "kv_cache_dtype": self.kv_cache_dtype}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [{"host": s.host, "listen": s.listen, "layers": f"{s.start_layer}-{s.end_layer}",
                        "device": s.device, "threads": s.threads, "tp": s.tp, "resources": s.resources}
                       for s in self.stages]
        return d

    def to_json(self) -> str:
        """The plan on one line; unset (null) options are left out, as in a plan file."""
        data = {k: v for k, v in self.to_dict().items() if v is not None}
        data["stages"] = [{k: v for k, v in s.items() if v is not None} for s in data["stages"]]
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    def with_stage(self, index: int, **changes: Any) -> RunPlan:
        stages = list(self.stages)
        stages[index] = replace(stages[index], **changes)
        return replace(self, stages=tuple(stages))

    @classmethod
    def build(cls, model: str, num_layers: int, num_stages: int, partition: Any = "even", *,
              costs=None, devices: list[str] | None = None, tp: int = 1, **options: Any) -> RunPlan:
        """A local plan: every stage on loopback with ``tp`` ranks, layers from ``partition``."""
        if partition == "balanced" and costs is None:
            raise ValueError("RunPlan.build: the 'balanced' policy needs layer costs")
        plan = StagePlan.build(num_layers, num_stages, partition, costs=costs)
        devices = devices or ["cpu"] * num_stages
        stages = tuple(StageSpec(index=s.stage_id, start_layer=s.start_layer, end_layer=s.end_layer,
                                 device=devices[s.stage_id], tp=tp) for s in plan.stages)
        return cls(model=model, stages=stages, num_layers=num_layers, partition=plan.policy, **options).validated()

    @classmethod
    def load(cls, path: str | Path, num_layers: int | None = None) -> RunPlan:
        """Read a YAML/JSON plan. ``num_layers`` (from the model's config) is needed when the plan
        uses ``partition`` instead of per-stage ``layers``, and checks them otherwise."""
        return cls.from_dict(read_plan_data(path), num_layers)

    @classmethod
    def from_dict(cls, data: Any, num_layers: int | None = None) -> RunPlan:
        """A plan from its parsed document; ValueError naming every problem found."""
        if not isinstance(data, dict):
            raise _fail("the document", type(data).__name__, "a mapping")
        data, problems = dict(data), []
        unknown = sorted(set(data) - KNOWN_KEYS)
        if unknown:
            problems.append(f"unknown keys {unknown}; expected some of {sorted(KNOWN_KEYS)}")
            for key in unknown:
                data.pop(key)
        model = data.pop("model", None)
        if not isinstance(model, str) or not model:
            problems.append(problem("model", model, "a path or model name"))
        raw = data.pop("stages", None)
        stated = data.pop("num_layers", None)
        partition = data.pop("partition", None)
        tp = data.pop("tp", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            problems.append(problem("tp", tp, "an int >= 1"))
            tp = 1
        total = num_layers if num_layers is not None else stated
        if not isinstance(raw, list) or not raw:
            problems.append(problem("stages", raw, "a non-empty list of stages"))
            raise _all(problems)
        plan, policy = None, partition or "explicit"
        layers_given = [isinstance(s, dict) and "layers" in s for s in raw]
        try:
            if all(layers_given):
                ranges_text = ",".join(str(s["layers"]) for s in raw)
                if total is None:
                    total = int(ranges_text.rsplit("-", 1)[-1]) if ranges_text else 0
                plan = StagePlan.build(total, len(raw), ranges_text)  # the ranges decide; a policy is recorded
            elif any(layers_given):
                problems.append("give 'layers' for every stage or for none (then 'partition' decides)")
            elif total is None:
                problems.append("without per-stage 'layers' the number of layers must be known")
            else:
                policy = partition or "even"
                if policy == "measured":  # even until the nodes are measured (stagewise.launch.measured)
                    plan = StagePlan.build(total, len(raw), "even")
                elif policy not in PARTITION_POLICIES:
                    problems.append(problem("partition", policy, f"one of {PARTITION_POLICIES}"))
                elif policy == "balanced":
                    problems.append("partition 'balanced' needs the model's config; use RunPlan.build or per-stage "
                                    "'layers'")
                else:
                    plan = StagePlan.build(total, len(raw), policy)
        except ValueError as err:
            problems.append(str(err))
        if stated is not None and total is not None and stated != total:
            problems.append(problem("num_layers", stated, f"{total} (the model's)"))
        stages = []
        for i, spec in enumerate(raw):
            stage = _stage(i, spec, None if plan is None else plan.stages[i], problems, tp)
            if stage is not None:
                stages.append(stage)
        if plan is None or len(stages) != len(raw) or problems:
            raise _all(problems + option_problems(data))
        return cls(model=model, stages=tuple(stages), num_layers=total, partition=policy, **data).validated()

    def validated(self) -> RunPlan:
        problems = option_problems({f: getattr(self, f) for f in OPTION_KEYS})
        for st in self.stages:
            try:
                parse_address(st.listen, f"stages[{st.index}].listen")
            except ValueError as err:
                problems.append(str(err).removeprefix("run plan: "))
            if not st.host or st.host.startswith("-") or any(c.isspace() or c in "'\"`$;&|<>" for c in st.host):
                problems.append(problem(f"stages[{st.index}].host", st.host, "a host name or address"))
            if isinstance(st.tp, bool) or not isinstance(st.tp, int) or st.tp < 1:
                problems.append(problem(f"stages[{st.index}].tp", st.tp, "an int >= 1"))
            elif self.dcp > 0 and st.tp % self.dcp:
                problems.append(f"dcp={self.dcp} must divide every stage's tp (DCP shards the KV inside the TP "
                                f"group); stages[{st.index}].tp is {st.tp}")
        if problems:
            raise _all(problems)
        return self


KNOWN_KEYS = frozenset({"model", "stages", "num_layers", "partition", "tp", *OPTION_KEYS})
STAGE_KEYS = frozenset({"host", "listen", "layers", "device", "threads", "tp", "resources"})


def _all(problems: list[str]) -> ValueError:
    if len(problems) == 1:
        return ValueError(f"run plan: {problems[0]}")
    return ValueError(f"run plan: {len(problems)} problems: " + "; ".join(problems))


def _stage(i: int, spec: Any, info, problems: list[str], tp: int) -> StageSpec | None:
    where = f"stages[{i}]"
    if not isinstance(spec, dict):
        problems.append(problem(where, spec, "a mapping"))
        return None
    extra = sorted(set(spec) - STAGE_KEYS)
    if extra:
        problems.append(f"{where} has unknown keys {extra}")
    listen, host = spec.get("listen", "127.0.0.1:0"), spec.get("host")
    try:
        bound = parse_address(listen, f"{where}.listen")[0]
    except ValueError as err:
        problems.append(str(err).removeprefix("run plan: "))
        bound = None
    threads = spec.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        problems.append(problem(f"{where}.threads", threads, "an int >= 1"))
    stage_tp = spec.get("tp", tp)
    if isinstance(stage_tp, bool) or not isinstance(stage_tp, int) or stage_tp < 1:
        problems.append(problem(f"{where}.tp", stage_tp, "an int >= 1"))
        return None
    resources = spec.get("resources")
    if resources is not None and (not isinstance(resources, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in resources.items())):
        problems.append(problem(f"{where}.resources", resources, "a mapping of Ray resource names to amounts > 0"))
        resources = None
    host = host if host is not None else bound
    if info is None or host is None:
        return None
    return StageSpec(index=i, start_layer=info.start_layer, end_layer=info.end_layer, host=str(host),
                     listen=str(listen), device=str(spec.get("device", "cpu")), threads=threads, tp=stage_tp,
                     resources=None if resources is None else {k: float(v) for k, v in resources.items()})
