"""`stagewise bench transport --tiny` over tcp: a row per size and checksum setting, in JSON and Markdown."""

from __future__ import annotations

import json

from stagewise.bench.cli import main


def test_transport_bench_writes_rows(tmp_path):
    assert main(["transport", "--tiny", "--transports", "tcp", "--threads", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-transport.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["transport"], r["checksum"], r["bytes"]) for r in rows] == [
        ("tcp", True, 8192), ("tcp", True, 65536), ("tcp", False, 8192), ("tcp", False, 65536)]
    assert all(r["one_way_us"] > 0 and r["stream_gbps"] > 0 for r in rows)
    assert "| tcp | off | 64 KB |" in path.with_suffix(".md").read_text()
    assert main(["transport", "--tiny", "--transports", "udp", "--out", str(tmp_path)]) == 2
