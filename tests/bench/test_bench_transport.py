"""`stagewise bench transport --tiny`: over tcp, a row per size and checksum setting, in JSON and
Markdown; cuda-ipc recorded as skipped with the reason where it cannot run, its failures reported
(not hung), its targets and table; and on a GPU (marked ``cuda``), its rows."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.bench.cli import main
from stagewise.bench.transport import cuda_ipc
from stagewise.bench.transport.channels import MEASURED, TRANSPORTS


def test_transport_bench_writes_rows(tmp_path):
    assert main(["transport", "--tiny", "--transports", "tcp", "--threads", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-transport.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["transport"], r["checksum"], r["bytes"]) for r in rows] == [
        ("tcp", True, 8192), ("tcp", True, 65536), ("tcp", False, 8192), ("tcp", False, 65536)]
    assert all(r["one_way_us"] > 0 and r["stream_gbps"] > 0 for r in rows)
    assert "| tcp | off | 64 KB |" in path.with_suffix(".md").read_text()
    assert main(["transport", "--tiny", "--transports", "udp", "--out", str(tmp_path)]) == 2


# ---- cuda-ipc -------------------------------------------------------------------------------------

CUDA_IPC_WHY = cuda_ipc.unavailable()


@pytest.mark.skipif(CUDA_IPC_WHY is None, reason="cuda-ipc can run here: checks its skip where it cannot")
def test_cuda_ipc_is_recorded_as_skipped_with_the_reason(tmp_path, capsys):
    assert main(["transport", "--tiny", "--transports", "cuda-ipc", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-transport.json")
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["cuda-ipc"] is None
    assert data["skipped"] == [{"transport": "cuda-ipc", "why": CUDA_IPC_WHY}]
    assert f"Skipped cuda-ipc: {CUDA_IPC_WHY}" in path.with_suffix(".md").read_text()
    assert f"cuda-ipc: skipped: {CUDA_IPC_WHY}" in capsys.readouterr().err


@pytest.mark.skipif(cuda_ipc._has_cuda_kernel("cuda_ring_wait"), reason="the extension here has its CUDA kernels")
def test_an_extension_without_cuda_kernels_is_a_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine with this build
    assert cuda_ipc.unavailable() == ("the stagewise extension was built without CUDA kernels "
                                      "(stagewise::cuda_ring_wait has none)")


def test_the_default_list_names_cuda_ipc():
    assert TRANSPORTS[-1] == cuda_ipc.NAME and set(MEASURED) < set(TRANSPORTS)


@pytest.mark.skipif(CUDA_IPC_WHY is None, reason="needs a machine where the measuring process fails at once")
def test_a_failing_cuda_ipc_process_is_reported_not_hung(tmp_path, monkeypatch):
    """Where it cannot run, asked anyway: the measuring process fails at its first CUDA call, the run
    reports why (exit status 1), writes the results, and leaves no process behind."""
    import multiprocessing as mp

    monkeypatch.setattr(cuda_ipc, "unavailable", lambda: None)
    assert main(["transport", "--tiny", "--transports", "cuda-ipc", "--out", str(tmp_path)]) == 1
    (path,) = tmp_path.glob("*-transport.json")
    section = json.loads(path.read_text())["cuda-ipc"]
    assert section["error"] and section["rows"] == [] and section["targets"]["one_way_us"]["met"] is None
    assert "**Failed**" in path.with_suffix(".md").read_text()
    assert not mp.active_children()


def test_the_targets_and_the_markdown_of_a_cuda_ipc_section():
    d2d = [{"bytes": 8 << 10, "gbps": 2.0}, {"bytes": 64 << 10, "gbps": 20.0}, {"bytes": 32 << 20, "gbps": 1500.0}]
    rows = [{"bytes": 8 << 10, "one_way_us": 6.0, "pingpong_gbps": 1.4, "stream_gbps": 1.9, "pct_d2d": 95.0},
            {"bytes": 64 << 10, "one_way_us": 12.5, "pingpong_gbps": 5.2, "stream_gbps": 15.0, "pct_d2d": 75.0},
            {"bytes": 32 << 20, "one_way_us": 30.0, "pingpong_gbps": 1100.0, "stream_gbps": 1300.0,
             "pct_d2d": 86.7}]
    t = cuda_ipc.targets(rows)
    assert (t["one_way_us"]["worst"], t["one_way_us"]["at"], t["one_way_us"]["met"]) == (12.5, 64 << 10, False)
    assert (t["pct_d2d"]["worst"], t["pct_d2d"]["at"], t["pct_d2d"]["met"]) == (86.7, 32 << 20, True)
    assert cuda_ipc.targets(rows[:1])["pct_d2d"]["met"] is None  # no frame of 8 MB or more
    section = {"gpu": "NVIDIA H200", "d2d": d2d, "rows": rows, "targets": t, "error": None}
    text = "\n".join(cuda_ipc.markdown(section))
    assert "| 32 MB | 30.0 | 1100.00 | 1300.00 | 1500.0 | 87% |" in text
    assert "<= 10 µs one way for frames <= 64 KB: NOT met (worst 12.5 µs at 64 KB)" in text
    assert ">= 80 % of the D2D copy for frames >= 8 MB: met (worst 86.7 % at 32 MB)" in text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_rows_on_one_gpu(tmp_path):
    assert main(["transport", "--tiny", "--transports", "cuda-ipc", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-transport.json")
    section = json.loads(path.read_text())["cuda-ipc"]
    assert section["error"] is None, section["error"]
    assert [r["bytes"] for r in section["rows"]] == [8192, 65536] == [d["bytes"] for d in section["d2d"]]
    assert all(r["one_way_us"] > 0 and r["stream_gbps"] > 0 and r["pct_d2d"] > 0 for r in section["rows"])
    assert section["targets"]["one_way_us"]["met"] in (True, False)
    assert "## cuda-ipc: two processes on one GPU" in path.with_suffix(".md").read_text()
