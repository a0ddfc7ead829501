"""bench profile's pipeline hop: a step's one-way time over the real shm and tcp links between two
processes, positive and larger for the 1 MiB step than for the decode row's, and nothing left
behind (the receiver process, ring segments)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from stagewise.bench.profile import hop
from stagewise.transport.rings import SHM_DIR


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_step_crosses_the_link_and_leaves_nothing(kind, monkeypatch):
    monkeypatch.setattr(hop, "LINK_FRAMES", 6)
    before = set(os.listdir(SHM_DIR))
    got = hop.measure_hop(kind)
    small, big = (str(rows * hop.HIDDEN * 4) for rows in hop.LINK_ROWS)
    assert 0 < got["one_way_s"][small] < got["one_way_s"][big] < 5.0
    assert got["bandwidth"] > 0 and 0 <= got["latency_s"] <= got["one_way_s"][small]
    assert not mp.active_children()
    assert set(os.listdir(SHM_DIR)) <= before
