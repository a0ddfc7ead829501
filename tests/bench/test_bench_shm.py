"""Smoke test of `stagewise bench shm` (small sizes, one round; no timing assertions): every
transport runs between two processes, the files and the summary are written."""

from __future__ import annotations

import json

import pytest

from stagewise.bench.cli import main
from stagewise.bench.transport import shm


def test_transport_bench_writes_rows_and_summary(tmp_path):
    rc = main(["shm", "--sizes", "8192,65536", "--repeats", "1", "--transports", "shm,shm/ops,tcp",
               "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (json_path,) = tmp_path.glob("*-shm.json")
    data = json.loads(json_path.read_text())
    rows = {(r["transport"], r["nbytes"]): r for r in data["rows"]}
    assert set(rows) == {(t, n) for t in ("shm", "shm/ops", "tcp") for n in (8192, 65536)}
    for (t, n), r in rows.items():
        assert r["one_way_us"] > 0 and r["repeats"] == 1
        assert (r["gbps"] is None) == (t == "shm/ops"), "shm/ops measures latency only"
    assert {i["transport"] for i in data["idle"]} == {"shm", "tcp"}
    assert set(data["summary"]) >= {"gbps_ratio_over_tcp", "shm_one_way_us_8k", "latency_target_met"}
    assert "| shm | 8 KB |" in json_path.with_suffix(".md").read_text()


def test_unknown_transport_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="transport must be one of"):
        shm.measure_shm([8192], 1, transports=("carrier-pigeon",))
    assert main(["shm", "--tiny", "--transports", "carrier-pigeon", "--out", str(tmp_path)]) == 2
    assert "transport must be one of" in capsys.readouterr().err
