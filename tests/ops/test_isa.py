"""The one instruction-set dispatch of the CPU kernels (csrc/cpu/isa.h): STAGEWISE_CPU_ISA caps the
level, read once per process, so every copy of every kernel runs here, each in a process of its own,
against the same tests as the default level: the dense linear, the quantised linears (exact and int8,
every block type), attention (decode and extend), merge, the norms and rope. The levels are those this CPU has, but the
one this process runs, which is the rest of the suite (a level the CPU lacks runs where the CPU has
it: STAGEWISE_CPU_ISA only caps the level)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagewise.ops as ops

LEVELS = ["baseline", "avx2", "avx512", "avx512vnni"]
TESTS = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["test_dense_linear.py", "test_quant_linear.py", "test_quant_linear_int8.py", "test_attention.py",
                "test_extend_attention.py",
                "test_compact_kv.py",
                "test_merge.py", "test_norm.py", "test_rope.py"]


def _run(level: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, STAGEWISE_CPU_ISA=level, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=TESTS, env=env, capture_output=True, text=True, timeout=timeout)


OTHER_LEVELS = [level for level in LEVELS[: LEVELS.index(ops.cpu_isa_supported()) + 1] if level != ops.cpu_isa()]


@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_kernels_at_level(level):
    check = _run(level, "-c", "import stagewise.ops as o; print(o.cpu_isa())")
    assert check.returncode == 0 and check.stdout.strip() == level, check.stderr[-2000:]
    done = _run(level, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not cuda",
                *[f"ops/{name}" for name in KERNEL_TESTS])
    assert done.returncode == 0, f"STAGEWISE_CPU_ISA={level}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"


def test_cap_above_the_cpu_keeps_the_cpu_level():
    done = _run("avx512vnni", "-c", "import stagewise.ops as o; print(o.cpu_isa(), o.cpu_isa_supported())")
    assert done.returncode == 0 and done.stdout.split() == [ops.cpu_isa_supported()] * 2, done.stderr[-2000:]


def test_unknown_level_is_refused():
    code = "import torch, stagewise.ops as o; o.cpu_isa()"
    done = _run("avx1024", "-c", code)
    assert done.returncode != 0
    assert ("STAGEWISE_CPU_ISA must be one of baseline, avx2, avx512, avx512vnni (or unset: the CPU's best, here "
            f"{ops.cpu_isa_supported()}), got 'avx1024'") in done.stderr
    # A kernel call says so too, rather than running some level.
    done = _run("avx1024", "-c", "import torch, stagewise.ops as o; o.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)")
    assert done.returncode != 0 and "STAGEWISE_CPU_ISA must be one of" in done.stderr
