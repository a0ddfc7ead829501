"""Predictions checked against measured runs of the runtime, and what the planner learns from them.

``stagewise plan validate MODEL --stages 1 2 3`` runs the real pipeline for each stage count,
predicts the same run with a measured device profile, and prints predicted vs measured per-stage
busy time, TPOT, TTFT and bubble with the error in %. The results go to
``bench/results/<device>-plan-validate.{json,md}`` and, as the planner's latest validation, to
``planner/validation.json`` (:data:`STORE`), which every later ``stagewise plan`` reads to state
its expected error and to flag predictions outside the validated range.

Measurement lives in :mod:`stagewise.bench.plan_validate` (it runs the pipeline); this module
only sees :class:`MeasuredRun`. Definitions (both sides): ``ttft_s`` = submit to first token (the prefill);
``tpot_s`` = decode time / decode steps; ``per_stage_busy_s`` = seconds each stage computes per
decode step of all microbatches (the stages' ``busy_s``: their step without receiving and
sending; predicted: the stage's compute time times the microbatches); ``bubble_s`` = per decode
step, the time beyond one microbatch's stage work (compute and send), seed 001 §2.8's
``latency - sum(stage_times)``: measured ``tpot - sum(busy + send) / m``, predicted from the
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


def _err(pred: float, meas: float) -> float | None:
    return None if meas == 0 else 100.0 * (pred - meas) / meas


def compare(predicted, measured: MeasuredRun) -> list[dict]:
    """Rows ``{stages, metric, predicted_s, measured_s, error_pct}`` for one configuration;
    ``predicted`` is a :class:`~stagewise.planner.estimate.LayoutEstimate`."""
    dec = predicted.decode.pipeline
    m = dec.num_microbatches
    rows = [{"metric": "ttft", "predicted_s": predicted.ttft_s, "measured_s": measured.ttft_s},
            {"metric": "tpot", "predicted_s": predicted.tpot_s, "measured_s": measured.tpot_s}]
    for i, (p, b) in enumerate(zip(dec.stage_compute_times_s, measured.per_stage_busy_s)):
        rows.append({"metric": f"stage{i}_busy", "predicted_s": p * m, "measured_s": b})
    rows.append({"metric": "bubble", "predicted_s": predicted.decode_bubble_s, "measured_s": measured.bubble_s})
    best = measured.details.get("best_run")
    if best:
        for r in rows:
            m = r["metric"]
            r["measured_best_s"] = (best["per_stage_busy_s"][int(m[5:-5])] if m.startswith("stage")
                                    else best[f"{m}_s"])
    for r in rows:
        r["stages"] = measured.stages
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
    lines = ["| batch | S | metric | predicted ms | measured ms (median) | error % | least disturbed run ms | error % |",
             "|---:|---:|:---|---:|---:|---:|---:|---:|"]

    def err(value) -> str:
        return "-" if value is None else f"{value:+.1f}"

    for r in rows:
        of = " (of TPOT)" if r.get("error_of") else ""
        best = r.get("measured_best_s")
        lines.append(f"| {r.get('batch', '-')} | {r['stages']} | {r['metric']} | {1e3 * r['predicted_s']:.3f} | "
                     f"{1e3 * r['measured_s']:.3f} | {err(r['error_pct'])}{of} | "
                     f"{'-' if best is None else f'{1e3 * best:.3f}'} | "
                     f"{err(r.get('error_best_pct'))}{of if best is not None else ''} |")
    return "\n".join(lines)


def summary(rows: list[dict], *, model: str, architecture: str, profile: dict, workload: dict,
            machine: dict) -> dict:
    """The store's content: the rows, the range they cover and the largest errors per metric."""
    stages = sorted({r["stages"] for r in rows})
    batches = workload["batch"] if isinstance(workload["batch"], list) else [workload["batch"]]
    worst: dict[str, float] = {}
    for r in rows:
        if r["error_pct"] is None:
            continue
        key = "stage_busy" if r["metric"].startswith("stage") else r["metric"]
        worst[key] = max(worst.get(key, 0.0), abs(r["error_pct"]))
    return {"date_utc": machine.get("date_utc"), "machine": machine, "model": model, "profile": profile,
            "workload": workload, "rows": rows, "expected_error_pct": worst,
            "range": {"stages": [stages[0], stages[-1]], "batch": [min(batches), max(batches)],
                      "input_length": [workload["input_length"]] * 2,
                      "output_length": [workload["output_length"]] * 2,
                      "architectures": [architecture], "device_kind": profile.get("kind"),
                      "profiles": [profile.get("name")]}}


@dataclass(frozen=True, slots=True)
class Validation:
    data: dict

    @property
    def expected_error_pct(self) -> dict[str, float]:
        return self.data.get("expected_error_pct", {})

    def describe(self) -> str:
        e, r = self.expected_error_pct, self.data.get("range", {})
        errs = ", ".join(f"{k.upper()} ±{v:.0f}%" for k, v in sorted(e.items()) if k in ("ttft", "tpot", "bubble"))
        s = r.get("stages", [1, 1])
        return (f"expected error {errs or 'unknown'} (latest validation {self.data.get('date_utc', '?')}: "
                f"{self.data.get('model')} on {self.data.get('profile', {}).get('name')}, S={s[0]}..{s[1]})")

    def flags(self, *, stages: int, batch: int, input_length: int, output_length: int, architecture: str,
              profile_name: str, profile_kind: str) -> list[str]:
        """Why a prediction lies outside the validated range (empty: inside)."""
        r, out = self.data.get("range", {}), []
        for name, value in (("PP", stages), ("batch", batch), ("input", input_length), ("output", output_length)):
            key = {"PP": "stages", "input": "input_length", "output": "output_length"}.get(name, name)
            lo, hi = r.get(key, [value, value])
            if not lo <= value <= hi:
                out.append(f"{name}={value} outside validated {lo}..{hi}")
        if architecture not in r.get("architectures", [architecture]):
            out.append(f"{architecture} not validated")
        if profile_name not in r.get("profiles", [profile_name]):
            kind = r.get("device_kind")
            out.append(f"profile {profile_name} not validated" + (f" ({kind} only)" if kind != profile_kind else ""))
        return out


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
