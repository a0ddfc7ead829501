"""What every suite's results say of the machine (its device slug, CPU model and ISA, torch, the
commit), where results go (a dated folder of their own unless ``--out``), and the two files a suite
writes (:func:`write_results`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch


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
