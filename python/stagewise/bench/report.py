"""Results of `stagewise bench kernels`: rows, machine description, JSON, Markdown, console table."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


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
    """Why a baseline has no timing, and other details (repeats, compile seconds)."""


def ratio(baseline_ms: float | None, ours_ms: float | None) -> float | None:
    """Speed-up of ours over a baseline (> 1: ours is faster)."""
    return baseline_ms / ours_ms if baseline_ms and ours_ms else None


def device_slug(device: str) -> str:
    """A short file-name slug of the device: 'h100', 'h200', 'cpu-amd-epyc-2c-avx512vnni' (a CPU's
    model, core count and the ISA level the kernels ran at: an AVX2-only CPU of the same model
    name gets another slug)."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        words = [w for w in re.split(r"[\s\-_]+", name.lower()) if w not in ("nvidia", "geforce", "tesla", "")]
        # Keep words up to the first one with a digit: 'h100 80gb hbm3' -> 'h100', 'rtx 4090' -> 'rtx-4090'.
        first_digit = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), len(words) - 1)
        return _slug("-".join(words[: first_digit + 1])) or "cuda"
    model = cpu_model()
    for noise in (r"\(r\)", r"\(tm\)", r"\bcpu\b", r"\bprocessor\b", r"@.*$", r"\d+-core", r"\bwith\b.*$"):
        model = re.sub(noise, " ", model, flags=re.IGNORECASE)
    model = "-".join(model.split()[:4])
    return "-".join(p for p in ("cpu", _slug(model), f"{os.cpu_count()}c", cpu_isa()) if p)


def cpu_isa() -> str:
    """The ISA level the CPU kernels run at (stagewise.ops.cpu_isa: the CPU's best, capped by
    STAGEWISE_CPU_ISA)."""
    from stagewise import ops

    return ops.cpu_isa()


def cpu_features() -> list[str]:
    """The vector extensions of /proc/cpuinfo's flags that matter to the kernels and to llama.cpp."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
              "avx512_bf16", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [w for w in wanted if w in flags]


def isa_line(info: dict) -> str:
    """The results header's ISA line."""
    if info.get("cpu_isa") is None:
        return ""
    forced = "" if info["cpu_isa"] == info["cpu_isa_supported"] else \
        f" (capped by STAGEWISE_CPU_ISA; the CPU has {info['cpu_isa_supported']})"
    # torch's own kernels (ATEN_CPU_CAPABILITY caps them) and MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS)
    others = ""
    if info.get("torch_cpu_capability"):
        others = f"; torch kernels at {info['torch_cpu_capability'].lower()}"
        if info.get("mkl_instructions"):
            others += f", MKL capped at {info['mkl_instructions'].lower()}"
    return (f"ISA: stagewise kernels at {info['cpu_isa']}{forced}{others}; CPU flags: "
            f"{' '.join(info.get('cpu_features') or []) or 'none of avx2/avx512'}")


def write_results(out: Path, name: str, data: dict, lines: list[str], log=print) -> Path:
    """A suite's results: ``out/name.json`` (``data``) and ``out/name.md`` (``lines``), said on
    ``log``; returns their common stem."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / name
    Path(f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    Path(f"{stem}.md").write_text("\n".join(lines))
    log(f"wrote {stem}.json and {stem}.md")
    return stem


def default_out(device_name: str) -> Path:
    """Where a suite writes when no --out is given: a folder of its own for this device and day
    (bench/results/<device>-<YYYY-MM-DD>), so that a run never overwrites committed results."""
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return Path("bench/results") / f"{device_name}-{day}"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_info(device: str) -> dict:
    dev = torch.device(device)
    info = {
        "device": device_slug(device),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": _git_commit(),
    }
    if dev.type == "cpu":
        from stagewise import ops

        info.update(cpu_isa=ops.cpu_isa(), cpu_isa_supported=ops.cpu_isa_supported(), cpu_features=cpu_features(),
                    torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    mkl_instructions=os.environ.get("MKL_ENABLE_INSTRUCTIONS"))
    try:
        import flashinfer

        info["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except Exception:
        info["flashinfer"] = None
    return info


COLUMNS = ["op", "case", "dtype", "ours ms", "ref ms", "ref/ours", "compile ms", "compile/ours",
           "flashinfer ms", "bytes", "GB/s", "% copy BW", "% read BW", "max err"]  # fmt: skip


def _ms(v):
    return "-" if v is None else f"{v:.4g}"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def cells(row: Row) -> list[str]:
    """The table cells of one row; a missing timing shows its reason (shortened)."""
    notes = row.notes or {}
    ours = "ERROR" if row.error else _ms(row.ours_ms)
    return [
        row.op, row.case, row.dtype, ours,
        _ms(row.ref_ms) if row.ref_ms is not None else notes.get("ref", "-")[:24],
        _x(ratio(row.ref_ms, row.ours_ms)),
        _ms(row.compile_ms) if row.compile_ms is not None else notes.get("compile", "-")[:24],
        _x(ratio(row.compile_ms, row.ours_ms)),
        _ms(row.flashinfer_ms) if row.flashinfer_ms is not None else notes.get("flashinfer", "-")[:24],
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
        "a vectorised gather for decode_attention), compile = torch.compile of ref. "
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
              if k in ("ref", "compile", "flashinfer") and v.startswith("n/a")]  # fmt: skip
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
        out.append(d)
    path.write_text(json.dumps({"machine": info, "copy_bandwidth": copy_bw, "read_bandwidth": read_bw, "rows": out},
                               indent=2) + "\n")
