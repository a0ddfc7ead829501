"""The table of ``stagewise bench kernels``: a row per case, the console table, and
<device>-kernels.json and .md."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from stagewise.bench.report import isa_line


@dataclass(kw_only=True, slots=True)
class Row:
    op: str
    case: str
    dtype: str
    nbytes: int
    """Least bytes the op must read plus write."""
    ours_ms: float | None = None
    ref_ms: float | None = None
    """The pure-torch baseline (eager)."""
    compile_ms: float | None = None
    """The same baseline under torch.compile."""
    flashinfer_ms: float | None = None
    sdpa_ms: float | None = None
    """Attention: torch's SDPA over each sequence's pages gathered into contiguous K/V (the gather timed)."""
    flex_ms: float | None = None
    """Attention: FlexAttention (compiled) over the same gathered K/V, the lengths a block mask."""
    max_err: float | None = None
    """Max abs error of ours against stagewise.ops.reference, checked once before timing."""
    gbps: float | None = None
    pct_copy: float | None = None
    """Ours' GB/s as a percentage of the measured copy bandwidth."""
    pct_read: float | None = None
    """Ours' GB/s as a percentage of the measured read bandwidth (the ceiling of ops that mostly read)."""
    error: str | None = None
    """Why ours has no timing (it raised)."""
    notes: dict | None = None
    """Why a baseline has no timing, and other details (repeats, compile seconds, ``<other>_max_err``:
    a further baseline's max abs error against ours)."""


OTHERS = ("sdpa", "flex")
"""The further baselines a case may have (``Case.others``), each with its ``<name>_ms`` field."""


def ratio(baseline_ms: float | None, ours_ms: float | None) -> float | None:
    """Speed-up of ours over a baseline (> 1: ours is faster)."""
    return baseline_ms / ours_ms if baseline_ms and ours_ms else None


COLUMNS = ["op", "case", "dtype", "ours ms", "ref ms", "ref/ours", "compile ms", "compile/ours",
           "flashinfer ms", "sdpa ms", "sdpa/ours", "flex ms", "flex/ours",
           "bytes", "GB/s", "% copy BW", "% read BW", "max err"]  # fmt: skip


def _ms(v):
    return "-" if v is None else f"{v:.4g}"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _timing(row: Row, name: str) -> str:
    """A baseline's time, or the reason it has none (shortened)."""
    ms = getattr(row, f"{name}_ms")
    return _ms(ms) if ms is not None else (row.notes or {}).get(name, "-")[:24]


def cells(row: Row) -> list[str]:
    """The table cells of one row."""
    ours = "ERROR" if row.error else _ms(row.ours_ms)
    return [
        row.op, row.case, row.dtype, ours,
        _timing(row, "ref"), _x(ratio(row.ref_ms, row.ours_ms)),
        _timing(row, "compile"), _x(ratio(row.compile_ms, row.ours_ms)),
        _timing(row, "flashinfer"),
        *(c for name in OTHERS for c in (_timing(row, name), _x(ratio(getattr(row, f"{name}_ms"), row.ours_ms)))),
        _bytes(row.nbytes),
        "-" if row.gbps is None else f"{row.gbps:.1f}",
        "-" if row.pct_copy is None else f"{row.pct_copy:.0f}%",
        "-" if row.pct_read is None else f"{row.pct_read:.0f}%",
        "-" if row.max_err is None else f"{row.max_err:.1e}",
    ]  # fmt: skip


def format_table(rows: list[Row]) -> str:
    table = [COLUMNS] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    errors = [f"{r.op} {r.case} {r.dtype}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + (["", "Errors:"] + errors if errors else []))


def _header(info: dict, copy_bw: dict, read_bw: dict | None) -> list[str]:
    return [
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
        f"{info['torch_threads']} torch threads; torch {info['torch']}"
        + (f", CUDA {info['cuda']}" if info.get("cuda") else "")
        + (f", FlashInfer {info['flashinfer']}" if info.get("flashinfer") else ""),
        *([isa_line(info)] if info.get("cpu_isa") else []),
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit'] or 'unknown'}",
        f"Copy bandwidth (read + write): {copy_bw['gbps']:.1f} GB/s "
        f"({_bytes(copy_bw['bytes'])} in {copy_bw['median_ms']:.3g} ms)",
        *([f"Read bandwidth (a sum): {read_bw['gbps']:.1f} GB/s ({_bytes(read_bw['bytes'])} in "
           f"{read_bw['median_ms']:.3g} ms)"] if read_bw else []),
    ]


def write_markdown(path: Path, info: dict, copy_bw: dict, rows: list[Row], read_bw: dict | None = None) -> None:
    lines = ["# stagewise kernels", ""] + [f"{h}  " for h in _header(info, copy_bw, read_bw)] + [""]
    lines += [
        "Median times; ours = stagewise.ops, ref = pure-torch baseline (stagewise.ops.reference; "
        "a vectorised gather for decode_attention), compile = torch.compile of ref; "
        "sdpa and flex (attention) = torch's scaled_dot_product_attention and FlexAttention (compiled once) over "
        "each sequence's pages gathered into contiguous K/V, the gather timed, their output checked against ours. "
        "Ratios > 1 mean ours is faster. Bytes = least bytes the op must read + write; "
        "% copy BW = ours' GB/s over the measured copy bandwidth (a DRAM-sized copy: cases that fit "
        "in cache can exceed 100%); % read BW the same over the measured read bandwidth (a DRAM-sized sum), "
        "the ceiling of ops that mostly read, such as the linears of a decode step.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in rows]
    notes = [f"- {r.op} {r.case} {r.dtype}: {r.error}" for r in rows if r.error]
    notes += [f"- {r.op} {r.case} {r.dtype}: {k}: {v}" for r in rows for k, v in (r.notes or {}).items()
              if k in ("ref", "compile", "flashinfer", *OTHERS) and v.startswith("n/a")]  # fmt: skip
    checked = []
    for r in rows:
        errs = [f"{name} {r.notes[f'{name}_max_err']:.1e}" for name in OTHERS if f"{name}_max_err" in (r.notes or {})]
        if errs:
            checked.append(f"- {r.op} {r.case} {r.dtype}: {', '.join(errs)}")
    if checked:
        lines += ["", "Max abs error of the further baselines against ours:", ""] + checked
    if notes:
        lines += ["", "Errors and missing baselines:", ""] + notes
    path.write_text("\n".join(lines) + "\n")


def write_json(path: Path, info: dict, copy_bw: dict, rows: list[Row], read_bw: dict | None = None) -> None:
    out = []
    for r in rows:
        d = asdict(r)
        d["ref_speedup"] = ratio(r.ref_ms, r.ours_ms)
        d["compile_speedup"] = ratio(r.compile_ms, r.ours_ms)
        d["flashinfer_speedup"] = ratio(r.flashinfer_ms, r.ours_ms)
        for name in OTHERS:
            d[f"{name}_speedup"] = ratio(getattr(r, f"{name}_ms"), r.ours_ms)
        out.append(d)
    path.write_text(json.dumps({"machine": info, "copy_bandwidth": copy_bw, "read_bandwidth": read_bw, "rows": out},
                               indent=2) + "\n")
