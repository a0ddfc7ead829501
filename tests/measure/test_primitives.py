"""The node measurements' arithmetic (stagewise.measure.primitives): splitting a kernel's time into
its per-weight and per-output parts, also when the machine's noise swamps the difference."""

from __future__ import annotations

import json

import pytest

from stagewise.measure.primitives import split_time
from stagewise.planner.profiles import BUILTIN_DIR, builtin_profiles, profile_from_dict


def test_two_shapes_give_back_the_costs_they_were_made_of():
    per_weight, per_output, weights = 2e-10, 3e-8, 1 << 20
    narrow, wide = 256, 4096
    t = [weights * per_weight + out * per_output for out in (narrow, wide)]
    assert split_time(*t, narrow, wide, weights) == (pytest.approx(per_weight), pytest.approx(per_output))


@pytest.mark.parametrize(("t_wide", "all_per_weight"), [(1e-4, True), (2e-2, True), (9e-3, False)],
                         ids=["wide-faster", "per-weight-negative", "both-positive"])
def test_noise_leaves_every_cost_positive(t_wide, all_per_weight):
    """A wide matrix timed faster than the narrow one, or so much slower that the narrow one's
    per-output part would exceed its whole time: everything goes per weight. Either way the parts
    add up to the narrow matrix's time."""
    per_weight, per_output = split_time(1e-3, t_wide, 256, 4096, 1 << 20)
    assert per_weight > 0 and per_output >= 0
    assert (per_output == 0.0) == all_per_weight
    assert 256 * per_output + (1 << 20) * per_weight == pytest.approx(1e-3)


def test_a_profile_of_split_times_is_accepted():
    """The split's figures pass the profile's own checks (a zero per-weight cost was refused)."""
    rows = {str(r): split_time(1e-3, 2e-2, 256, 4096, 1 << 20) for r in (1, 2)}
    quant = {"q4_1": {"s_per_weight": 1e-10, "flops": 1e10,
                      "rows_s_per_weight": {r: w for r, (w, _) in rows.items()},
                      "rows_s_per_output": {r: o for r, (_, o) in rows.items()}}}
    d = json.loads((BUILTIN_DIR / f"{builtin_profiles()[0]}.json").read_text())
    profile = profile_from_dict({**d, "quant": quant}, "test")
    assert profile.quant["q4_1"]["rows_s_per_weight"]["1"] > 0
