"""What the mask costs the runtime: the same SmolLM2 requests decoded with and without a JSON
schema, at each batch size, alternating runs (the median of each kept). The schema (a long array
of small objects) never completes within the measured tokens, so every step of every constrained
row computes a real mask, and both runs generate exactly ``tokens`` per request
(``ignore_eos``). Two measures: the TPOT ratio of each back-to-back pair of runs (what a user
sees, within this machine's noise of several per cent), and the time the constrained runs' steps
spent on structured output (``last_stats["constraint_s"]``: masks, applying them, advancing the
constraints) per step, over the free run's TPOT (the same cost timed inside the step)."""

from __future__ import annotations

import statistics

LONG_ARRAY = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"},
                   "kind": {"enum": ["fruit", "tool", "animal"]}}}}
PROMPT = "List things you can find in a kitchen, as JSON: name, count and kind of each."


def measure(model: str, sizes: list[int], tokens: int, repeats: int, precision: str, log=print) -> list[dict]:
    from stagewise.api import Pipeline

    rows = []
    with Pipeline(model, max_num_seqs=max(sizes), linear_precision=precision) as pipe:
        for b in sizes:
            prompts = [f"{PROMPT} ({i})" for i in range(b)]
            runs: dict[str, list[float]] = {"free": [], "json_schema": []}
            held_step: list[float] = []
            for r in range(repeats + 1):  # the first pair warms up (and fills the prefix cache)
                for kind in ("free", "json_schema"):
                    extra = {"json_schema": LONG_ARRAY} if kind == "json_schema" else {}
                    outs = pipe.generate(prompts, chat=True, max_new_tokens=tokens, ignore_eos=True, **extra)
                    assert all(len(o.token_ids) == tokens for o in outs), [len(o.token_ids) for o in outs]
                    stats = pipe.last_stats
                    if r:
                        runs[kind].append(stats["decode_s"] / max(stats["decode_tokens"] / b, 1))
                        if extra:  # every request took one step a token
                            held_step.append(stats["constraint_s"] / tokens)
            free, held = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
            # Each repeat's pair ran back to back: the median of their ratios drifts less with the
            # machine's load than the ratio of the medians.
            ratio = statistics.median(h / f for f, h in zip(runs["free"], runs["json_schema"]))
            in_step = statistics.median(held_step)
            rows.append({"batch": b, "tpot_free_s": free, "tpot_json_schema_s": held, "overhead": ratio - 1,
                         "pair_ratios": [h / f for f, h in zip(runs["free"], runs["json_schema"])],
                         "constraint_step_s": in_step, "in_step_overhead": in_step / free})
            log(f"  batch {b}: TPOT {free * 1e3:.2f} ms free, {held * 1e3:.2f} ms with the schema: "
                f"{100 * (ratio - 1):+.1f} % (median of the pairs' ratios); inside the step "
                f"{in_step * 1e3:.2f} ms = {100 * in_step / free:.1f} % of the free TPOT")
    return rows


def markdown(rows: list[dict], tokens: int, repeats: int) -> list[str]:
    lines = [f"Decode time per token, SmolLM2, {tokens} tokens a request, the same requests free and held to a JSON "
             f"schema that does not complete (a long array of objects), {repeats} alternating runs each, medians; the "
             f"mask cost end to end is the median of each back-to-back pair's TPOT ratio; inside the step, the "
             f"constrained steps' time on masks, applying them and advancing the constraints (median of the runs) "
             f"over the free TPOT:", "",
             "| batch | TPOT free ms | TPOT with the schema ms | mask cost end to end | structured output in the step "
             "ms | mask cost in the step |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tpot_free_s'] * 1e3:.2f} | {r['tpot_json_schema_s'] * 1e3:.2f} | "
                     f"{100 * r['overhead']:+.1f} % | {r['constraint_step_s'] * 1e3:.2f} | "
                     f"{100 * r['in_step_overhead']:.1f} % |")
    return lines
