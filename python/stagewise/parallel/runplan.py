"""Run plans: which process runs which layers, where it listens, and how stages talk.

A run plan is a YAML (or JSON) file::

    model: smollm2-135m          # a folder, a .gguf file or a built-in name, valid on every host
    dtype: auto
    transport: auto              # auto | tcp | shm | cuda-ipc | torch
    checksum: true
    max_num_seqs: 32
    max_model_len: 2048          # optional
    kv_cache_bytes: 268435456    # optional, per stage
    stages:
      - {host: 10.0.0.1, listen: "10.0.0.1:7100", layers: "0-15", device: cpu, threads: 8}
      - {host: 10.0.0.2, listen: "10.0.0.2:7100", layers: "15-30", device: "cuda:0"}

``layers`` may be left out of every stage and ``partition`` (even, ceil, balanced) given
instead; the ranges then come from :mod:`stagewise.parallel.plan`, the same code the planner
uses. ``listen`` defaults to ``127.0.0.1:0`` (loopback, any free port).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stagewise.parallel.plan import PARTITION_POLICIES, StagePlan
from stagewise.transport.select import TRANSPORTS
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
    """torch intra-op threads (None: torch's default)."""


@dataclass(frozen=True, slots=True)
class RunPlan:
    model: str
    stages: tuple[StageSpec, ...]
    num_layers: int
    dtype: str = "auto"
    transport: str = "auto"
    checksum: bool = True
    max_num_seqs: int = 32
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    max_num_tokens: int | None = None
    block_size: int = 16
    quantized: bool | None = None
    """Block-quantised GGUF matrices stay in their blocks (None: when the stage runs float32)."""
    linear_precision: str = "exact"
    """How those blocks multiply: "exact" (float32 dequantised values) or "int8" (approximate)."""
    partition: str = "explicit"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_plan(self) -> StagePlan:
        return StagePlan.from_ranges([(s.start_layer, s.end_layer) for s in self.stages], self.num_layers,
                                     self.partition)

    def fingerprint(self, model_config: dict[str, Any]) -> str:
        """What both ends of a connection must agree on: the model's config, the layer ranges,
        dtype, block size and protocol version (hosts, ports and devices may differ)."""
        body = {"version": PROTOCOL_VERSION, "config": model_config, "dtype": self.dtype, "quantized": self.quantized,
                "block_size": self.block_size, "ranges": [[s.start_layer, s.end_layer] for s in self.stages]}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [{"host": s.host, "listen": s.listen, "layers": f"{s.start_layer}-{s.end_layer}",
                        "device": s.device, "threads": s.threads} for s in self.stages]
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
              costs=None, devices: list[str] | None = None, **options: Any) -> RunPlan:
        """A local plan: every stage on loopback, layers from ``partition``."""
        if partition == "balanced" and costs is None:
            raise ValueError("RunPlan.build: the 'balanced' policy needs layer costs")
        plan = StagePlan.build(num_layers, num_stages, partition, costs=costs)
        devices = devices or ["cpu"] * num_stages
        stages = tuple(StageSpec(index=s.stage_id, start_layer=s.start_layer, end_layer=s.end_layer,
                                 device=devices[s.stage_id]) for s in plan.stages)
        return cls(model=model, stages=stages, num_layers=num_layers, partition=plan.policy, **options).validated()

    @classmethod
    def load(cls, path: str | Path, num_layers: int | None = None) -> RunPlan:
        """Read a YAML/JSON plan. ``num_layers`` (from the model's config) is needed when the plan
        uses ``partition`` instead of per-stage ``layers``, and checks them otherwise."""
        return cls.from_dict(read_plan_data(path), num_layers)

    @classmethod
    def from_dict(cls, data: Any, num_layers: int | None = None) -> RunPlan:
        if not isinstance(data, dict):
            raise _fail("the document", type(data).__name__, "a mapping")
        data = dict(data)
        known = {"model", "stages", "num_layers", "dtype", "transport", "checksum", "max_num_seqs", "max_model_len",
                 "kv_cache_bytes", "max_num_tokens", "block_size", "partition", "quantized",
                 "linear_precision"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"run plan: unknown keys {unknown}; expected some of {sorted(known)}")
        model = data.pop("model", None)
        if not isinstance(model, str) or not model:
            raise _fail("model", model, "a path or model name")
        raw = data.pop("stages", None)
        if not isinstance(raw, list) or not raw:
            raise _fail("stages", raw, "a non-empty list of stages")
        layers_given = ["layers" in s for s in raw if isinstance(s, dict)]
        stated = data.pop("num_layers", None)
        total = num_layers if num_layers is not None else stated
        partition = data.pop("partition", None)
        if all(layers_given) and layers_given:
            ranges_text = ",".join(str(s["layers"]) for s in raw)
            if total is None:
                total = int(ranges_text.rsplit("-", 1)[-1]) if ranges_text else 0
            plan = StagePlan.build(total, len(raw), ranges_text)
            policy = partition or "explicit"  # recorded only: the ranges decide
        elif any(layers_given):
            raise ValueError("run plan: give 'layers' for every stage or for none (then 'partition' decides)")
        else:
            if total is None:
                raise ValueError("run plan: without per-stage 'layers' the number of layers must be known")
            policy = partition or "even"
            if policy not in PARTITION_POLICIES:
                raise _fail("partition", policy, f"one of {PARTITION_POLICIES}")
            if policy == "balanced":
                raise ValueError("run plan: partition 'balanced' needs the model's config; "
                                 "use RunPlan.build or per-stage 'layers'")
            plan = StagePlan.build(total, len(raw), policy)
        if stated is not None and stated != total:
            raise _fail("num_layers", stated, f"{total} (the model's)")
        stages = []
        for i, (s, info) in enumerate(zip(raw, plan.stages)):
            if not isinstance(s, dict):
                raise _fail(f"stages[{i}]", s, "a mapping")
            extra = sorted(set(s) - {"host", "listen", "layers", "device", "threads"})
            if extra:
                raise ValueError(f"run plan: stages[{i}] has unknown keys {extra}")
            listen = s.get("listen", "127.0.0.1:0")
            host = s.get("host", parse_address(listen, f"stages[{i}].listen")[0])
            threads = s.get("threads")
            if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
                raise _fail(f"stages[{i}].threads", threads, "an int >= 1")
            stages.append(StageSpec(index=i, start_layer=info.start_layer, end_layer=info.end_layer, host=str(host),
                                    listen=str(listen), device=str(s.get("device", "cpu")), threads=threads))
        return cls(model=model, stages=tuple(stages), num_layers=total, partition=policy, **data).validated()

    def validated(self) -> RunPlan:
        if self.transport not in TRANSPORTS:
            raise _fail("transport", self.transport, f"one of {TRANSPORTS}")
        if not isinstance(self.checksum, bool):
            raise _fail("checksum", self.checksum, "true or false")
        if self.quantized is not None and not isinstance(self.quantized, bool):
            raise _fail("quantized", self.quantized, "true, false or null")
        if self.linear_precision not in ("exact", "int8"):
            raise _fail("linear_precision", self.linear_precision, "'exact' or 'int8'")
        for name in ("max_num_seqs", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(name, value, "an int >= 1")
        for name in ("max_model_len", "kv_cache_bytes", "max_num_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise _fail(name, value, "an int >= 1 or null")
        if self.kv_cache_bytes is not None and self.max_num_tokens is not None:
            raise ValueError("run plan: give at most one of kv_cache_bytes and max_num_tokens")
        for s in self.stages:
            parse_address(s.listen, f"stages[{s.index}].listen")
            if not s.host or s.host.startswith("-") or any(c.isspace() or c in "'\"`$;&|<>" for c in s.host):
                raise _fail(f"stages[{s.index}].host", s.host, "a host name or address")
        return self
