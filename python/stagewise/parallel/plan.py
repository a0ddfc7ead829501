"""Which decoder layers each pipeline stage runs: the one source of truth for the runtime and
the planner.

Policies (``partition_layers``):

- ``even``: ``L // S`` layers per stage, the first ``L % S`` stages one more.
- ``ceil``: ``ceil(L / S)`` per stage, earlier stages first, the last clamped;
  with ``S`` close to ``L`` later stages may be empty.
- ``balanced``: contiguous ranges that minimise the largest stage cost, where a stage's cost is
  its layers' costs plus, on stage 0, the embedding and, on the last stage, the final norm and LM
  head (the parts those stages own). Costs default to :func:`decode_layer_costs` (weights read per
  decode token); ties go to the earliest split that reaches the optimum.
- explicit ranges: ``"0-10,10-22,22-30"`` (or a sequence of ``(start, end)``) covering
  ``[0, L)`` with no gap, overlap or empty stage.

Stage 0 owns the embedding, the last stage the final norm, LM head and sampler.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagewise.model.config import ModelConfig

PARTITION_POLICIES = ("even", "ceil", "balanced")
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class PipelineStageInfo:
    """One stage of a plan: layers ``[start_layer, end_layer)`` of ``total_layers``."""

    stage_id: int
    num_stages: int
    start_layer: int
    end_layer: int
    total_layers: int

    @property
    def enabled(self) -> bool:
        """Pipeline parallelism is on (more than one stage)."""
        return self.num_stages > 1

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def active_layer_indices(self) -> range:
        return range(self.start_layer, self.end_layer)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns_layer(self, layer_idx: int) -> bool:
        return self.start_layer <= layer_idx < self.end_layer

    @property
    def owns_embedding(self) -> bool:
        return self.is_first_stage

    @property
    def owns_lm_head(self) -> bool:
        """Final norm, LM head and sampling."""
        return self.is_last_stage


def _check_counts(total_layers: int, num_stages: int) -> None:
    for name, value in (("total_layers", total_layers), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"partition_layers: {name} must be an int >= 1, got {value!r}")


def _parse_ranges(spec: str | Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    if isinstance(spec, str):
        ranges = []
        for part in spec.split(","):
            m = _RANGE.match(part)
            if m is None:
                raise ValueError(f"partition: explicit ranges look like '0-10,10-22,22-30', got {spec!r} "
                                 f"(bad part {part.strip()!r})")
            ranges.append((int(m.group(1)), int(m.group(2))))
        return ranges
    return [(int(a), int(b)) for a, b in spec]


def _explicit(total_layers: int, spec: str | Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    ranges = _parse_ranges(spec)
    if not ranges:
        raise ValueError("partition: explicit ranges must name at least one stage, got none")
    expected_start = 0
    for i, (start, end) in enumerate(ranges):
        if end <= start:
            raise ValueError(f"partition: stage {i} range {start}-{end} is empty (end must exceed start)")
        if start < expected_start:
            raise ValueError(f"partition: stage {i} range {start}-{end} overlaps the previous stage, "
                             f"which ends at layer {expected_start}")
        if start > expected_start:
            raise ValueError(f"partition: layers {expected_start}-{start} belong to no stage "
                             f"(gap before stage {i} range {start}-{end})")
        expected_start = end
    if expected_start != total_layers:
        raise ValueError(f"partition: the ranges end at layer {expected_start} but the model has "
                         f"{total_layers} layers (they must cover 0-{total_layers})")
    return ranges


def _even(total_layers: int, num_stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(total_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _ceil(total_layers: int, num_stages: int) -> list[tuple[int, int]]:
    per = math.ceil(total_layers / num_stages)
    return [(min(s * per, total_layers), min((s + 1) * per, total_layers)) for s in range(num_stages)]


def _balanced(num_stages: int, layer_costs: Sequence[float], first_cost: float,
              last_cost: float) -> list[tuple[int, int]]:
    """Contiguous non-empty ranges minimising the largest stage cost (exact dynamic programme)."""
    n = len(layer_costs)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(stage: int, start: int, end: int) -> float:
        c = prefix[end] - prefix[start]
        if stage == 0:
            c += first_cost
        if stage == num_stages - 1:
            c += last_cost
        return c

    return min_max_ranges(num_stages, n, cost)


def min_max_ranges(num_stages: int, num_layers: int, cost) -> list[tuple[int, int]]:
    """Contiguous non-empty ranges of ``num_layers`` layers over ``num_stages`` stages minimising the
    largest ``cost(stage, start, end)`` (exact dynamic programme; ``inf``: a range the stage cannot
    hold). ValueError when every split has such a range."""
    inf = float("inf")
    n = num_layers
    # best[s][e]: the smallest max cost of stages 0..s-1 covering layers [0, e).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for e in range(s, n - (num_stages - s) + 1):
            for b in range(s - 1, e):
                if best[s - 1][b] == inf:
                    continue
                value = max(best[s - 1][b], cost(s - 1, b, e))
                if value < best[s][e] - 1e-12 * max(1.0, abs(value)):
                    best[s][e], cut[s][e] = value, b
    if best[num_stages][n] == inf:
        raise ValueError(f"partition: no split of {n} layers over {num_stages} stages fits every stage")
    ranges, e = [], n
    for s in range(num_stages, 0, -1):
        b = cut[s][e]
        ranges.append((b, e))
        e = b
    return ranges[::-1]


def decode_layer_costs(config: ModelConfig) -> tuple[list[float], float, float]:
    """Weights read per decoded token (parameters, active experts only) of each decoder layer,
    of stage 0's extras (one embedding row, and a multimodal model's whole vision tower: its weights
    sit on stage 0 and it runs there for every image) and of the last stage's extras (final norm +
    LM head). The counts come from the tensor shapes of :mod:`stagewise.model.shapes`."""
    from stagewise.model import shapes  # here: importing stagewise.model loads torch, which plans do not need

    costs = [float(shapes.decode_read_params(config, layer)) for layer in range(config.num_layers)]
    first = config.hidden_size + shapes.count(config, shapes.vision_tensors(config))
    last = shapes.count(config, shapes.final_norm_tensors(config) + shapes.lm_head_tensors(config))
    return costs, float(first), float(last)


def partition_layers(total_layers: int, num_stages: int, policy: str | Sequence[tuple[int, int]] = "even", *,
                     costs: tuple[Sequence[float], float, float] | None = None,
                     allow_empty: bool = False) -> list[tuple[int, int]]:
    """``[(start, end)]`` per stage. ``policy`` is a policy name or explicit ranges; ``balanced``
    needs ``costs = (per_layer, first_stage_extra, last_stage_extra)``. An empty stage is an error
    unless ``allow_empty`` (the planner evaluates ``ceil`` plans with ``S > L``)."""
    _check_counts(total_layers, num_stages)
    if not isinstance(policy, str) or policy not in PARTITION_POLICIES:
        ranges = _explicit(total_layers, policy)
        if len(ranges) != num_stages:
            raise ValueError(f"partition: {len(ranges)} explicit ranges given for {num_stages} stages")
        return ranges
    if policy == "balanced":
        if costs is None:
            raise ValueError("partition: the 'balanced' policy needs layer costs (see decode_layer_costs)")
        per_layer, first, last = costs
        if len(per_layer) != total_layers:
            raise ValueError(f"partition: {len(per_layer)} layer costs given for {total_layers} layers")
        if num_stages > total_layers:
            raise ValueError(f"partition: 'balanced' cannot split {total_layers} layers into {num_stages} "
                             f"non-empty stages")
        return _balanced(num_stages, per_layer, first, last)
    ranges = _even(total_layers, num_stages) if policy == "even" else _ceil(total_layers, num_stages)
    empty = [i for i, (a, b) in enumerate(ranges) if a == b]
    if empty and not allow_empty:
        raise ValueError(f"partition: policy {policy!r} leaves stage(s) {empty} without layers "
                         f"({total_layers} layers over {num_stages} stages)")
    return ranges


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Every stage of one pipeline, with the policy that made it."""

    stages: tuple[PipelineStageInfo, ...]
    policy: str

    @classmethod
    def from_ranges(cls, ranges: Sequence[tuple[int, int]], total_layers: int, policy: str = "explicit") -> StagePlan:
        n = len(ranges)
        return cls(tuple(PipelineStageInfo(i, n, a, b, total_layers) for i, (a, b) in enumerate(ranges)), policy)

    @classmethod
    def build(cls, total_layers: int, num_stages: int, policy: str | Sequence[tuple[int, int]] = "even", *,
              costs: tuple[Sequence[float], float, float] | None = None, allow_empty: bool = False) -> StagePlan:
        ranges = partition_layers(total_layers, num_stages, policy, costs=costs, allow_empty=allow_empty)
        name = policy if isinstance(policy, str) and policy in PARTITION_POLICIES else "explicit"
        return cls.from_ranges(ranges, total_layers, name)

    @classmethod
    def for_model(cls, config: ModelConfig, num_stages: int, policy: str | Sequence[tuple[int, int]] = "even",
                  *, allow_empty: bool = False) -> StagePlan:
        """A plan for ``config``'s decoder layers; ``balanced`` weighs them by :func:`decode_layer_costs`."""
        costs = decode_layer_costs(config) if policy == "balanced" else None
        return cls.build(config.num_layers, num_stages, policy, costs=costs, allow_empty=allow_empty)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def total_layers(self) -> int:
        return self.stages[0].total_layers

    def stage(self, stage_id: int) -> PipelineStageInfo:
        if not 0 <= stage_id < self.num_stages:
            raise ValueError(f"StagePlan: stage must be in [0, {self.num_stages}), got {stage_id}")
        return self.stages[stage_id]

    get_stage = stage

    def stage_of_layer(self, layer: int) -> int:
        for info in self.stages:
            if info.owns_layer(layer):
                return info.stage_id
        raise ValueError(f"StagePlan: layer must be in [0, {self.total_layers}), got {layer}")

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start_layer, s.end_layer) for s in self.stages]

    @property
    def send_recv_edges(self) -> list[tuple[int, int]]:
        """Activation hops ``(src, dst)``; the token feedback edge (last -> 0) is not listed."""
        return [(i, i + 1) for i in range(self.num_stages - 1)]

    def __str__(self) -> str:
        return ",".join(f"{a}-{b}" for a, b in self.ranges)
