"""The results of `stagewise bench e2e` (:mod:`stagewise.bench.e2e`): the Markdown table (also
the console's), and <device>-e2e.json / .md with the machine, its ISA, the load and the notes."""

from __future__ import annotations

import json
from pathlib import Path

from stagewise.bench.report import isa_line

AGREEMENT_TOKENS = (8, 24)
_OURS = ["batch", "prompt", "new", "linears", "ours TTFT ms", "ours tok/s"]
_FLOOR = ["floor tok/s", "ours % floor", "MB/step"]


def _columns(rows: list[dict]) -> list[str]:
    labels = [b for b in (rows[0]["baselines"] if rows else {})]
    cols = list(_OURS)
    for name in labels:
        cols += [f"{name} TTFT ms", f"{name} tok/s", f"decode x {name}", f"TTFT x {name}", f"rows = {name}",
                 f"prefix {name}"]
    return cols + _FLOOR


def format_table(rows: list[dict]) -> str:
    """A Markdown table (also what the console shows)."""
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        o, f = r["ours"], r["floor"]
        prompt = r["prompt_len"] if "image" not in r else f"{r['prompt_len']} ({r['image']}: {r['image_tokens']})"
        cells = [r["batch"], prompt, r["new_tokens"], r["linear_precision"], f"{o['ttft_ms']:.1f}",
                 f"{o['decode_tokens_per_s']:.1f}"]
        for b in r["baselines"].values():
            cells += [f"{b['ttft_ms']:.1f}", f"{b['decode_tokens_per_s']:.1f}", f"{b['decode_speedup']:.2f}x",
                      f"{b['ttft_speedup']:.2f}x", f"{b['rows_matching']}/{r['batch']}", f"{b['mean_common_prefix']:.1f}"]
        cells += [f"{f['floor_tokens_per_s']:.1f}", f"{r['ours_pct_floor']:.0f}%", f"{f['bytes_per_step_mean'] / 1e6:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def agreement_lines(agree: dict) -> list[str]:
    lines = []
    for name, per_mode in agree.items():
        if not per_mode:
            continue
        n = next(iter(per_mode.values()))["questions"]
        lines += [f"Greedy agreement with {name} on {n} chat questions ({AGREEMENT_TOKENS[-1]} tokens each, EOS "
                  f"ignored):", ""]
        for mode, a in per_mode.items():
            firsts = ", ".join(f"first {k} tokens equal {a[f'first_{k}_equal']}/{a['questions']}" for k in AGREEMENT_TOKENS)
            lines.append(f"- {mode}: {firsts}; mean shared start {a['mean_common_prefix']:.1f} tokens")
        lines.append("")
    return lines


def startup_lines(startup: dict) -> list[str]:
    if not startup:
        return []
    what = {"generate": "`stagewise generate MODEL --chat --prompt ...`, launch to its first token's text",
            "pipeline_3_stages": "a 3-stage `stagewise.Pipeline` (what `make demo` starts), launch to ready",
            "llama.cpp": "llama-cpp-python: import, load the same GGUF file, decode the same prompt ids, print the "
                         "first token"}
    lines = ["Start-up (fresh processes, median of the runs; seconds):", "",
             "| what | median s | runs s |", "|---|---|---|"]
    for kind, v in startup.items():
        lines.append(f"| {what.get(kind, kind)} | {v['median_s']:.2f} | {', '.join(f'{s:.2f}' for s in v['runs_s'])} |")
    return lines + [""]


def write(out: Path, info: dict, copy_bw: dict, rows: list[dict], agree: dict, startup: dict) -> Path:
    """<out>/<device>-e2e-t<threads>.json and .md (one pair per ISA level and thread count);
    returns their stem."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{info['device']}-e2e-t{info['torch_threads']}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "copy_bandwidth": copy_bw, "rows": rows,
                                                     "agreement": agree, "startup": startup}, indent=2) + "\n")
    baselines = ", ".join(f"{n} ({', '.join(f'{k} {v}' for k, v in b.items() if k != 'system_info')})"
                          for n, b in info.get("baselines", {}).items())
    systems = [f"llama.cpp system info: {b['system_info']}  " for b in info.get("baselines", {}).values()
               if b.get("system_info")]
    load = " / ".join(", ".join(f"{v:.2f}" for v in info["load_average"][k]) for k in ("start", "end"))
    text = [
        "# stagewise end to end: decode, TTFT and start-up", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, {info['torch_threads']} "
        f"torch threads; torch {info['torch']}  ",
        *([f"{isa_line(info)}  "] if info.get("cpu_isa") else []), *systems,
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, {info.get('dtype', 'float32')} activations, greedy, EOS ignored; median of "
        f"{info['repeats']} runs  ",
        f"Baselines: {baselines}  ",
        f"Copy bandwidth (read + write): {copy_bw['gbps']:.1f} GB/s  ",
        f"Load average (1, 5, 15 min) at start / end: {load}", "",
        "ours = stagewise.Pipeline; every baseline on the same weights, threads and prompt token ids, its runs "
        "taking turns with ours. TTFT = submit to first token; tok/s = tokens after each row's first, summed over "
        "the batch, over the time from first to last token; x = ours over the baseline (> 1: ours is faster). "
        "linears = ours' linear precision: exact (maths in the activations' dtype on the exact dequantised "
        "weights) or int8 (activations quantised to int8 per block of 32, llama.cpp's scheme: approximate). rows = B: rows whose "
        "tokens all equal the baseline's; prefix B: mean count of leading tokens equal to the baseline's. floor = "
        "tokens/s if each decode step only read its weights and KV cache at the copy bandwidth.", "",
        format_table(rows), "", *agreement_lines(agree), *startup_lines(startup)]
    stem.with_suffix(".md").write_text("\n".join(text))
    return stem
