"""Memory of each pipeline stage: weights and KV cache.

Two weight estimates per stage:

- ``rough``: layer-proportional, ``total_params * bytes * L_s / L``, where
  ``total_params`` is the nominal size in the model's name ("235B") when there is one;
- ``exact``: the tensors the stage stores (:mod:`stagewise.model.shapes`): its decoder layers,
  plus embedding and vision tower on stage 0, final norm and LM head on the last stage.

KV cache: only the stage's own layers,
``2 * kv_heads * row * batch * sum over its layers of the tokens each keeps`` per rank, ``row`` the
bytes of one token of one KV head as the cache stores it (:func:`stagewise.kv.cache.kv_row_bytes`,
the runtime's own formula): ``head_dim * bytes`` with ``kv_cache_dtype`` ``auto``, ``head_dim + 2``
(one-byte codes and a float16 scale) with ``int8`` or ``fp8_e4m3``; ``kv_heads`` those of one TP
rank (:func:`~stagewise.model.rows.kv_heads_per_rank`); a full-attention layer keeps
``ceil(T / (pcp * dcp))`` tokens, context parallel spreading every sequence over the
``pcp * dcp`` ranks that share a KV head (the interleaved mapping); a sliding-window layer keeps
``min(T, window)``, the tokens its window reaches (the runtime gives the others' blocks back,
:mod:`stagewise.kv.window`), and cannot be context parallel. DCP reuses the TP ranks that hold
copies of one KV head, so ``dcp`` must divide ``max(1, tp // num_kv_heads)``
(:func:`check_layout`). Weights do not depend on ``pcp`` or ``dcp``. A rank must hold its stage's
weights and KV: the largest stage is what a layout needs per rank.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from stagewise.model import architectures, shapes
from stagewise.model.config import ModelConfig
from stagewise.parallel.plan import StagePlan

_NOMINAL = re.compile(r"(?:^|[-_/\s])(\d+(?:\.\d+)?)[bB](?=$|[-_/\s.])")


def nominal_params(name: str | None) -> float | None:
    """Parameters a model's name states (``Qwen3-VL-235B-A22B`` -> 235e9; ``A22B`` is the active
    count and is skipped); None when the name states none."""
    if not name:
        return None
    m = _NOMINAL.search(str(name))
    return float(m.group(1)) * 1e9 if m else None


@dataclass(frozen=True, slots=True)
class StageMemory:
    stage: int
    start_layer: int
    end_layer: int
    num_layers: int
    weight_bytes_rough: int
    weight_bytes_exact: int
    kv_bytes: int
    kv_bytes_per_sequence: int
    """KV of one sequence (``kv_bytes`` is ``batch`` of them): what each more sequence costs."""
    owns: tuple[str, ...]
    """Non-layer parts: vision, embedding, final_norm, lm_head."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["owns"] = list(self.owns)
        return d


def check_layout(config: ModelConfig, sharding: shapes.Sharding) -> None:
    """ValueError when ``config`` cannot be split as ``sharding`` asks: heads, KV heads and experts
    (:func:`~stagewise.model.shapes.check_sharding`) and, with context parallel, a ``dcp`` that
    does not divide the ranks holding each KV head (the message names the valid sizes)."""
    shapes.check_sharding(config, sharding)
    if sharding.pcp * sharding.dcp > 1 and (windowed := architectures.windowed_layers(config)):
        raise ValueError(f"layers {windowed[:8]}{' ...' if len(windowed) > 8 else ''} attend over a sliding window, "
                         f"which context parallel (pcp={sharding.pcp}, dcp={sharding.dcp}) does not shard")
    if sharding.dcp > 1:
        problems = shapes.parallel_problems(config, sharding.tp, sharding.dcp)
        if problems:
            raise ValueError("; ".join(problems))


def kv_tokens(config: ModelConfig, layers: range, *, tokens: int, cp: int = 1) -> int:
    """Tokens of one sequence of ``tokens`` that ``layers`` keep in all, on one of ``cp = pcp * dcp``
    context-parallel ranks: ``ceil(tokens / cp)`` a full-attention layer, ``min(tokens, window)`` a
    sliding-window one."""
    if tokens < 0:
        raise ValueError(f"kv_bytes: tokens must be >= 0, got {tokens}")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"kv_bytes: cp must be an int >= 1, got {cp!r}")
    return sum(-(-tokens // cp) if w is None else min(tokens, w) for w in architectures.layer_windows(config, layers))


def kv_bytes(config: ModelConfig, layers: range, *, tokens: int, batch: int = 1, kv_bytes_per_elem: int = 2,
             tp: int = 1, cp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """KV cache of ``layers`` for ``batch`` sequences of ``tokens`` tokens on one TP rank, each
    sequence spread over ``cp = pcp * dcp`` context-parallel ranks (:func:`kv_tokens`), stored as
    ``kv_cache_dtype`` says (:func:`stagewise.model.shapes.kv_bytes_per_token_layer`)."""
    if batch < 0:
        raise ValueError(f"kv_bytes: batch must be >= 0, got {batch}")
    per_token = shapes.kv_bytes_per_token_layer(config, kv_bytes_per_elem, tp, kv_cache_dtype)
    return per_token * batch * kv_tokens(config, layers, tokens=tokens, cp=cp)


def stage_memory(config: ModelConfig, plan: StagePlan, *, tokens: int, batch: int = 1, weight_bytes: int = 2,
                 kv_bytes_per_elem: int = 2, total_params: float | None = None,
                 sharding: shapes.Sharding = shapes.Sharding(), kv_cache_dtype: str = "auto") -> list[StageMemory]:
    """Per stage, one rank's weights (rough and exact) and KV at ``tokens`` tokens per sequence,
    stored as ``kv_cache_dtype`` says (ValueError when the model cannot take ``sharding``)."""
    check_layout(config, sharding)
    if batch < 0:
        raise ValueError(f"kv_bytes: batch must be >= 0, got {batch}")
    exact_total = shapes.count(config, shapes.model_tensors(config))
    total = exact_total if total_params is None else total_params
    out = []
    for info in plan.stages:
        tensors = shapes.stage_tensors(config, info.active_layer_indices, first=info.is_first_stage,
                                       last=info.is_last_stage)
        owns = tuple(p for p in ("vision", "embedding", "final_norm", "lm_head") if any(t.part == p for t in tensors))
        rough = round(total * weight_bytes * info.num_layers / config.num_layers / sharding.tp)
        one = kv_bytes(config, range(info.start_layer, info.end_layer), tokens=tokens,
                       kv_bytes_per_elem=kv_bytes_per_elem, tp=sharding.tp, cp=sharding.pcp * sharding.dcp,
                       kv_cache_dtype=kv_cache_dtype)
        out.append(StageMemory(
            stage=info.stage_id, start_layer=info.start_layer, end_layer=info.end_layer, num_layers=info.num_layers,
            weight_bytes_rough=rough, weight_bytes_exact=shapes.count(config, tensors, sharding) * weight_bytes,
            kv_bytes=one * batch, kv_bytes_per_sequence=one, owns=owns))
    return out


def max_batch(stages: list[StageMemory], budget_bytes: float) -> int:
    """The most sequences a rank of every stage holds in ``budget_bytes``: its weights, then as
    many sequences' KV (``kv_bytes_per_sequence``) as the rest takes, the tightest stage deciding;
    0 when some stage's weights alone overflow it. A compact KV cache raises it about as much as
    it shrinks a row (int8 beside float32: ``4 * head_dim / (head_dim + 2)`` times the room)."""
    if any(s.weight_bytes_exact > budget_bytes for s in stages):
        return 0
    # A stage without layers keeps no KV: only its weights limit it (checked above).
    fits = [int((budget_bytes - s.weight_bytes_exact) // s.kv_bytes_per_sequence)
            for s in stages if s.kv_bytes_per_sequence]
    if not fits:
        raise ValueError("max_batch: no stage keeps any KV (0 tokens per sequence?), so memory sets no batch limit")
    return min(fits)


def _rough_gb(nbytes: float) -> str:
    gb = nbytes / 1e9
    return f"~{gb:.0f} GB" if gb >= 10 else f"~{gb:.2g} GB"


def _rough_gib(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"~{gib:.1f} GiB" if gib >= 1 else f"~{gib:.3g} GiB"


def _exact(nbytes: int, unit: str = "GiB") -> str:
    return f"{nbytes:,} ({nbytes / 1e9:.2f} GB)" if unit == "GB" else f"{nbytes:,} ({nbytes / 2**30:.2f} GiB)"


def _md(header: list[str], rows: list[list[str]], align: list[str]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def format_tables(stages: list[StageMemory], *, weight_dtype: str, kv_dtype: str, ctx_label: str,
                  nominal_label: str, fit: str | None = None) -> str:
    """The rough, layer-proportional table followed by the exact count, Markdown (``fit``: a line
    after it, the batch that fits a rank's memory)."""
    wd, kd = weight_dtype.upper(), kv_dtype.upper()
    S = len(stages)
    rough = _md(["Stage", "Decoder layers", "#layers", f"Weights ({wd}, rough)", f"KV @ {ctx_label} ({kd}, rough)"],
                [[str(s.stage), f"[{s.start_layer}, {s.end_layer})", str(s.num_layers), _rough_gb(s.weight_bytes_rough),
                  _rough_gib(s.kv_bytes)] for s in stages], ["---:", ":---", "---:", "---:", "---:"])
    exact = _md(["Stage", "Decoder layers", "#layers", f"Weights ({wd}, exact bytes)", f"KV @ {ctx_label} ({kd}, bytes)",
                 "Non-layer parts"],
                [[str(s.stage), f"[{s.start_layer}, {s.end_layer})", str(s.num_layers), _exact(s.weight_bytes_exact, "GB"),
                  _exact(s.kv_bytes), ", ".join(s.owns) or "-"] for s in stages],
                ["---:", ":---", "---:", "---:", "---:", ":---"])
    largest = max(stages, key=lambda s: s.weight_bytes_exact + s.kv_bytes)
    return "\n".join([f"#### S = {S}", "", f"Rough (layer-proportional, {nominal_label}):", "", *rough, "",
                      "Exact (from the config's tensor shapes):", "", *exact, "",
                      f"Largest stage: {largest.stage} needs {_exact(largest.weight_bytes_exact + largest.kv_bytes)} "
                      "per rank (weights + KV)."] + ([fit] if fit else []))
