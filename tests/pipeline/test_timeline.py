"""A decode token's cycle cut into segments from the stages' spans: on hand-made spans whose
segments are known, through 2 and 3 stages, with a prefill first and spans of other kinds around."""

from __future__ import annotations

import pytest

from stagewise.pipeline.timeline import format_segments, median_timeline, token_segments

MS = 1e-3


def _stages(num_stages: int, cycles: int, hop: float, *, jitter: float = 0.0) -> list[dict]:
    """Spans of a prefill and ``cycles`` decode tokens: each stage computes 10 ms (stage 0 from 0),
    waits 0.2 ms before sending (0.1 ms), each hop takes ``hop`` and 0.3 ms pass from a receive to
    the compute; stage 0 computes again 0.4 ms after the token is back."""
    trace = [[] for _ in range(num_stages)]
    t = 0.0
    for c in range(cycles + 1):
        for i in range(num_stages):
            if i > 0:
                trace[i].append(("recv-wait", t - 5 * MS, 5 * MS + hop, 0))
                t += hop + 0.3 * MS
            compute = (10 + (jitter * c if i == 0 else 0)) * MS
            trace[i].append(("compute", t, compute, 0))
            t += compute + 0.2 * MS
            trace[i].append(("send", t, 0.1 * MS, 0))
            t += 0.1 * MS
        trace[0].append(("recv-wait", t - 2 * MS, 2 * MS + hop, 0))
        t += hop + 0.4 * MS
    return [{"stage": i, "trace": spans} for i, spans in enumerate(trace)]


@pytest.mark.parametrize("num_stages", [2, 3])
def test_the_segments_of_a_cycle_are_found_and_add_up(num_stages):
    t = token_segments(_stages(num_stages, cycles=4, hop=0.15 * MS))
    seg = dict(t.segments)
    assert t.tokens == 3  # 4 decode computes of stage 0 after the prefill: 3 whole cycles
    assert seg["stage 0 compute"] == pytest.approx(10_000) and seg["stage 0 compute -> send"] == pytest.approx(200)
    assert seg["stage 0 send"] == pytest.approx(100) and seg["hop 0 -> 1"] == pytest.approx(150)
    assert seg["stage 1 recv -> compute"] == pytest.approx(300)
    assert seg[f"hop {num_stages - 1} -> 0"] == pytest.approx(150)
    assert seg["stage 0 recv -> next compute"] == pytest.approx(400)
    assert list(seg)[-1] == "stage 0 recv -> next compute" and len(seg) == 5 * num_stages
    assert sum(seg.values()) == pytest.approx(t.cycle_us)
    assert t.overhead_us == pytest.approx(t.cycle_us - 10_000 * num_stages)


def test_medians_over_tokens_and_runs_and_the_table():
    a = token_segments(_stages(2, cycles=6, hop=0.1 * MS, jitter=0.5))  # stage 0 slower every token
    assert a.tokens == 5 and dict(a.segments)["stage 0 compute"] == pytest.approx(11_500)  # of 10.5 .. 12.5 ms
    b = token_segments(_stages(2, cycles=3, hop=0.3 * MS))
    both = median_timeline([a, b, b])
    assert dict(both.segments)["hop 0 -> 1"] == pytest.approx(300) and both.tokens == a.tokens + 2 * b.tokens
    table = format_segments({2: both, 3: token_segments(_stages(3, cycles=3, hop=0.3 * MS))}, base_tpot_us=20_000)
    assert "| stage 2 compute | - | 10000 |" in table and "| hop 0 -> 1 | 300 | 300 |" in table
    assert f"| cycle - TPOT of S = 1 (20000) | {both.cycle_us - 20_000:+.0f} |" in table


def test_too_few_spans_are_named():
    with pytest.raises(ValueError, match="stage 0 has 2 compute spans; a prefill and two decode steps"):
        token_segments(_stages(2, cycles=1, hop=0.1 * MS))
    stages = _stages(2, cycles=3, hop=0.1 * MS)
    stages[1]["trace"] = [s for s in stages[1]["trace"] if s[0] != "send"]
    with pytest.raises(ValueError, match="no decode step went through every stage"):
        token_segments(stages)
