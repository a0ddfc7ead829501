"""Results of ``stagewise bench shm``: console table, JSON and Markdown."""

from __future__ import annotations

import json
from pathlib import Path

from stagewise.bench.report import machine_info


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def format_table(rows: list, idle: list, summary: dict) -> str:
    rows = [r if isinstance(r, dict) else _asdict(r) for r in rows]
    tcp = {r["nbytes"]: r for r in rows if r["transport"] == "tcp"}
    lines = [
        "| transport | size | one-way µs (median) | one-way µs (min) | GB/s | GB/s vs tcp |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = tcp.get(r["nbytes"])
        vs = f"{r['gbps'] / base['gbps']:.2f}x" if r["gbps"] and base and base["gbps"] else "—"
        lines.append(
            f"| {r['transport']} | {_size(r['nbytes'])} | {_num(r['one_way_us'], '.1f')} | "
            f"{_num(r['one_way_us_min'], '.1f')} | {_num(r['gbps'], '.2f')} | {vs} |"
        )
    if idle:
        lines += ["", "| waiting end | waited s | CPU s | CPU use |", "|---|---|---|---|"]
        for i in idle:
            lines.append(f"| {i['transport']} | {i['waited_s']:.2f} | {i['cpu_s']:.4f} | {100 * i['cpu_fraction']:.2f}% |")
    lines += ["", *_verdict(summary)]
    return "\n".join(lines)


def _verdict(summary: dict) -> list[str]:
    """The issue's targets in words: shm >= 3x tcp GB/s at >= 1 MB, <= 20 us one-way at 8 KB."""
    out = []
    for t, ratios in summary["gbps_ratio_over_tcp"].items():
        got = ", ".join(f"{_size(int(n))} {r:.1f}x" for n, r in ratios.items())
        met = "met" if summary["bandwidth_target_met"][t] else "not met"
        out.append(f"- {t} GB/s over tcp at >= 1 MB (target >= 3x): {got}: {met}")
    if summary["shm_one_way_us_8k"] is not None:
        met = "met" if summary["latency_target_met"] else "not met"
        out.append(f"- shm one-way at 8 KB (target <= 20 µs): {summary['shm_one_way_us_8k']:.1f} µs: {met}")
    return out


def _asdict(row) -> dict:
    return {k: getattr(row, k) for k in row.__slots__}


def write(out_dir: str, config: dict, rows: list[dict], idle: list, summary: dict, info: dict | None = None):
    """Write <device>-shm.json and .md under out_dir; `info` (machine, date, commit) defaults to now."""
    if info is None:
        info = machine_info("cpu")
        info.update(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{info['device']}-shm"
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"machine": info, "rows": rows, "idle": idle, "summary": summary}, indent=1) + "\n")
    md = [
        "# stagewise transport: shared-memory ring vs sockets",
        "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, shared with other work; "
        f"torch {info['torch']}, Python {info['python']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Ring: {config['num_slots']} slots of the largest size, spin {config['spin_us']} µs then futex; "
        f"median of {config['repeats']} rounds after a warm-up round. Load average (1 min) before and "
        f"after the run: {config['load_average_1m'][0]:.1f}, {config['load_average_1m'][1]:.1f} (other processes "
        f"shared the 2 cores; the transports took turns round by round so that the load touched them alike).",
        "",
        "One-way = ping-pong round trip / 2 (the echo copies the message once each way). GB/s = a stream of "
        "messages sent back to back, the last one answered with one byte. shm: sender copies into the slot, "
        "receiver reads the slot in place; shm+copy: the receiver also copies each message out; shm/ops: through the torch ops "
        "(dispatcher); tcp: loopback, TCP_NODELAY; unix: a Unix stream socketpair. Sockets carry raw "
        "payloads with no framing.",
        "",
        format_table(rows, idle, summary),
        "",
    ]
    md_path.write_text("\n".join(md))
    return json_path, md_path
