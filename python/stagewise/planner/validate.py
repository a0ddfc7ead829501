"""Predictions checked against measured runs of the runtime, and what the planner learns from them.

``stagewise plan validate MODEL --stages 1 2 3 [--tp 1 2 --dcp 1 2]`` runs the real pipeline for each
stage count (and stages of several TP ranks, DCP among them),
predicts the same run with a measured device profile, and prints predicted vs measured per-stage
busy time, TPOT, TTFT and bubble with the error in %. The results go to
``bench/results/<device>-plan-validate.{json,md}`` and, as the planner's latest validation, to
``planner/validation.json`` (:data:`STORE`), which every later ``stagewise plan`` reads: a
prediction whose case the validation covers carries the errors measured there, any other says
"not validated" and why (:meth:`Validation.confidence`).

Measurement lives in :mod:`stagewise.bench.plan_validate` (it runs the pipeline); this module
only sees :class:`MeasuredRun`. Definitions (both sides): ``ttft_s`` = submit to first token (the prefill);
``tpot_s`` = decode time / decode steps; ``per_stage_busy_s`` = seconds each stage computes per
decode step of all microbatches (the stages' ``busy_s``: their step without receiving and
sending; predicted: the stage's compute time times the microbatches); with stages of several ranks,
``collectives`` = per decode step, the stage leaders' time in their collectives summed over the
stages (a diagnostic: the leader waits there for the other ranks too), predicted: the comm-bound
ops' time; ``bubble_s`` = per decode
step, the time beyond one microbatch's stage work (compute and send), the pipeline's latency
minus the sum of its stage times: measured ``tpot - sum(busy + send) / m``, predicted from the
steady-state estimate. Bubble errors are stated in % of TPOT, as the bubble itself may be zero.

The prediction is made from the device profile only (primitive costs measured by
``stagewise bench profile``); nothing of a validation run feeds back into the model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STORE = Path(__file__).resolve().parent / "validation.json"


@dataclass(kw_only=True, slots=True)
class MeasuredRun:
    stages: int
    per_stage_busy_s: list[float]
    tpot_s: float
    ttft_s: float
    bubble_s: float
    details: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    """Ranks of each stage (tensor parallel) ..."""
    dcp: int = 1
    """... of which ``dcp`` shard each KV head's sequence."""


def _err(pred: float, meas: float) -> float | None:
    return None if meas == 0 else 100.0 * (pred - meas) / meas


def compare(predicted, measured: MeasuredRun) -> list[dict]:
    """Rows ``{stages, tp, dcp, metric, predicted_s, measured_s, error_pct}`` for one configuration;
    ``predicted`` is a :class:`~stagewise.planner.estimate.LayoutEstimate`."""
    dec = predicted.decode.pipeline
    m = dec.num_microbatches
    rows = [{"metric": "ttft", "predicted_s": predicted.ttft_s, "measured_s": measured.ttft_s},
            {"metric": "tpot", "predicted_s": predicted.tpot_s, "measured_s": measured.tpot_s}]
    for i, (p, b) in enumerate(zip(dec.stage_compute_times_s, measured.per_stage_busy_s)):
        rows.append({"metric": f"stage{i}_busy", "predicted_s": p * m, "measured_s": b})
    rows.append({"metric": "bubble", "predicted_s": predicted.decode_bubble_s, "measured_s": measured.bubble_s})
    if "collective_per_step_s" in measured.details:
        # Stages of several ranks: the collectives of a decode step, every stage's (the leaders' own
        # time in them, waiting for the other ranks included) against the comm-bound ops' time.
        rows.append({"metric": "collectives", "predicted_s": predicted.decode.op_bound.get("comm", 0.0) * m,
                     "measured_s": measured.details["collective_per_step_s"]})
    return finish_rows(rows, measured)


def finish_rows(rows: list[dict], measured: MeasuredRun) -> list[dict]:
    """Rows ``{metric, predicted_s, measured_s}`` of one configuration (metrics ``ttft``, ``tpot``,
    ``stage<i>_busy``, ``bubble``, ``collectives``) with the run's layout, the least disturbed run
    and the errors added."""
    best = measured.details.get("best_run")
    if best:
        for r in rows:
            m = r["metric"]
            if m == "collectives":
                continue
            r["measured_best_s"] = (best["per_stage_busy_s"][int(m[5:-5])] if m.startswith("stage")
                                    else best[f"{m}_s"])
    for r in rows:
        r["stages"] = measured.stages
        r["tp"], r["dcp"] = measured.tp, measured.dcp
        for key, err, tpot in (("measured_s", "error_pct", measured.tpot_s),
                               ("measured_best_s", "error_best_pct", best and best["tpot_s"])):
            if key not in r:
                continue
            if r["metric"] == "bubble":  # relative to the step: the bubble itself may be 0
                r[err] = 100.0 * (r["predicted_s"] - r[key]) / tpot
                r["error_of"] = "tpot"
            else:
                r[err] = _err(r["predicted_s"], r[key])
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a markdown table; columns TP and DCP where any row has a stage of several ranks."""
    ranks = any(r.get("tp", 1) > 1 or r.get("dcp", 1) > 1 for r in rows)
    extra_head, extra_rule = (" TP | DCP |", "---:|---:|") if ranks else ("", "")
    lines = [f"| batch | S |{extra_head} metric | predicted ms | measured ms (median) | error % | "
             "least disturbed run ms | error % |",
             f"|---:|---:|{extra_rule}:---|---:|---:|---:|---:|---:|"]

    def err(value) -> str:
        return "-" if value is None else f"{value:+.1f}"

    for r in rows:
        of = " (of TPOT)" if r.get("error_of") else ""
        best = r.get("measured_best_s")
        layout = f" {r.get('tp', 1)} | {r.get('dcp', 1)} |" if ranks else ""
        lines.append(f"| {r.get('batch', '-')} | {r['stages']} |{layout} {r['metric']} | {1e3 * r['predicted_s']:.3f} | "
                     f"{1e3 * r['measured_s']:.3f} | {err(r['error_pct'])}{of} | "
                     f"{'-' if best is None else f'{1e3 * best:.3f}'} | "
                     f"{err(r.get('error_best_pct'))}{of if best is not None else ''} |")
    return "\n".join(lines)


def _largest_errors(rows: list[dict]) -> dict[str, float]:
    """The largest absolute error per metric (every stage's busy time counts as ``stage_busy``)."""
    worst: dict[str, float] = {}
    for r in rows:
        if r.get("error_pct") is None or r["metric"] == "collectives":  # a diagnostic, not a prediction's band
            continue
        key = "stage_busy" if r["metric"].startswith("stage") else r["metric"]
        worst[key] = max(worst.get(key, 0.0), abs(r["error_pct"]))
    return worst


def summary(rows: list[dict], *, model: str, architecture: str, profile: dict, workload: dict,
            machine: dict) -> dict:
    """The store's content: the rows, the range they cover and the largest errors per metric."""
    stages = sorted({r["stages"] for r in rows})
    tps, dcps = sorted({r.get("tp", 1) for r in rows}) or [1], sorted({r.get("dcp", 1) for r in rows}) or [1]
    batches = workload["batch"] if isinstance(workload["batch"], list) else [workload["batch"]]
    return {"date_utc": machine.get("date_utc"), "machine": machine, "model": model, "profile": profile,
            "workload": workload, "rows": rows, "expected_error_pct": _largest_errors(rows),
            "range": {"stages": [stages[0], stages[-1]], "tp": [tps[0], tps[-1]], "dcp": [dcps[0], dcps[-1]], "batch": [min(batches), max(batches)],
                      "input_length": [workload["input_length"]] * 2,
                      "output_length": [workload["output_length"]] * 2,
                      "architectures": [architecture], "device_kind": profile.get("kind"),
                      "profiles": [profile.get("name")]}}


SHOWN = ("ttft", "tpot")
"""The metrics whose error a prediction's band states (the record also holds per-stage busy time
and the bubble)."""


def _band(errors: dict[str, float]) -> str:
    return ", ".join(f"{k.upper()} ±{errors[k]:.{0 if errors[k] >= 10 else 1}f}%" for k in SHOWN if k in errors) \
        or "error unknown"


def _weights(weight_quant: str, embed_quant: str, dtype: str | None) -> str:
    if weight_quant or embed_quant:
        return f"{weight_quant or 'dense'} linears, {embed_quant or 'dense'} embedding" + (f", {dtype} compute"
                                                                                         if dtype else "")
    return f"dense {dtype} weights" if dtype else "dense weights"


@dataclass(frozen=True, slots=True)
class Confidence:
    """How far one prediction can be trusted: inside the validated range, the errors measured
    there; outside it, why not."""

    error_pct: dict[str, float] | None
    """Largest absolute error per metric (``ttft``, ``tpot``, ``stage_busy``, ``bubble``) where the
    case was validated; None when it was not."""
    error_from: str = ""
    """Which measurements the errors come from."""
    not_validated_because: tuple[str, ...] = ()

    @property
    def validated(self) -> bool:
        return self.error_pct is not None

    def label(self) -> str:
        return _band(self.error_pct) if self.error_pct is not None else "not validated"

    def to_dict(self) -> dict:
        return {"validated": self.validated, "expected_error_pct": self.error_pct, "error_from": self.error_from or None,
                "not_validated_because": list(self.not_validated_because)}


NO_RECORD = Confidence(None, not_validated_because=("no validation on record",))


@dataclass(frozen=True, slots=True)
class Validation:
    data: dict

    @property
    def expected_error_pct(self) -> dict[str, float]:
        return self.data.get("expected_error_pct", {})

    def _quant(self) -> tuple[str, str, str | None]:
        w = self.data.get("workload", {})
        return w.get("weight_quant") or "", w.get("embed_quant") or "", w.get("dtype")

    def _kv_cache_dtype(self) -> str:
        """What the validated runs stored K/V as; a record from before compact caches: ``auto``."""
        return self.data.get("workload", {}).get("kv_cache_dtype") or "auto"

    def describe(self) -> str:
        """The validated range and the largest errors measured in it, in one line."""
        r = self.data.get("range", {})

        def span(key: str, default: list) -> str:
            lo, hi = r.get(key, default)
            return f"{lo}" if lo == hi else f"{lo}..{hi}"

        dcp = "" if list(r.get("dcp", [1, 1])) == [1, 1] else f"DCP {span('dcp', [1, 1])}, "
        kv = "" if self._kv_cache_dtype() == "auto" else f", {self._kv_cache_dtype()} KV cache"
        return (f"latest validation ({self.data.get('date_utc', '?')}) covers {self.data.get('model')} "
                f"({', '.join(r.get('architectures', ['?']))}) on {', '.join(r.get('profiles', ['?']))}: "
                f"PP {span('stages', [1, 1])}, TP {span('tp', [1, 1])}, {dcp}batch {span('batch', [1, 1])}, "
                f"input {span('input_length', ['?', '?'])}, output {span('output_length', ['?', '?'])}, "
                f"{_weights(*self._quant())}{kv}; largest errors there: {_band(self.expected_error_pct)}")

    def confidence(self, *, tp: int, pp: int, batch: int, input_length: int, output_length: int,
                   architecture: str, profile_name: str, profile_kind: str, weight_quant: str = "",
                   embed_quant: str = "", weight_dtype: str | None = None, pcp: int = 1,
                   dcp: int = 1, prefix_share: float = 0.0, kv_cache_dtype: str = "auto") -> Confidence:
        """The band of one prediction when the validation covers its case, else why it does not."""
        r, why = self.data.get("range", {}), []
        for name, value, key in (("PP", pp, "stages"), ("TP", tp, "tp"), ("PCP", pcp, "pcp"), ("DCP", dcp, "dcp"),
                                 ("batch", batch, "batch"), ("input", input_length, "input_length"),
                                 ("output", output_length, "output_length")):
            # a record without them ran pipelines of one rank a stage: TP, PCP and DCP 1
            lo, hi = r.get(key, [1, 1] if key in ("tp", "pcp", "dcp") else [value, value])
            if not lo <= value <= hi:
                why.append(f"{name}={value} outside validated {lo}..{hi}")
        archs = r.get("architectures", [architecture])
        if architecture not in archs:
            why.append(f"{architecture} not validated (only {', '.join(archs)})")
        profiles = r.get("profiles", [profile_name])
        if profile_name not in profiles:
            kind = r.get("device_kind")
            why.append(f"profile {profile_name} not validated (only {', '.join(profiles)}"
                       + (f", a {kind} profile)" if kind and kind != profile_kind else ")"))
        v_weight, v_embed, v_dtype = self._quant()
        if (weight_quant, embed_quant) != (v_weight, v_embed) or (
                weight_dtype is not None and v_dtype is not None and weight_dtype != v_dtype):
            why.append(f"{_weights(weight_quant, embed_quant, weight_dtype)} not validated "
                       f"(only {_weights(v_weight, v_embed, v_dtype)})")
        v_kv = self._kv_cache_dtype()
        if kv_cache_dtype != v_kv:
            why.append(f"KV cache {kv_cache_dtype} not validated (only {v_kv})")
        if prefix_share:  # validation runs compute every prompt whole
            why.append(f"a prefix-cache share of {prefix_share:.0%} not validated (only whole prompts)")
        if why:
            return Confidence(None, not_validated_because=tuple(why))
        measured = [row for row in self.data.get("rows", []) if row.get("stages") == pp and row.get("batch") == batch
                    and row.get("tp", 1) == tp and row.get("dcp", 1) == dcp and pcp == 1]
        if measured:
            layout = f"PP={pp}" + (f", TP={tp}" if tp > 1 else "") + (f", DCP={dcp}" if dcp > 1 else "")
            return Confidence(_largest_errors(measured), f"its runs at {layout}, batch {batch}")
        return Confidence(self.expected_error_pct, "over its whole range: this case was not run")


def load_latest(path: Path | None = None) -> Validation | None:
    """The planner's latest validation (None if it has none or the file is unreadable)."""
    path = path or STORE
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return Validation(data) if isinstance(data, dict) else None


def measured_to_dict(m: MeasuredRun) -> dict:
    return asdict(m)
