"""The synthetic llama the runtime's own costs are timed on (a node profile, `stagewise bench
profile`): its weights build every stage role (stage 0, a middle stage, the last stage without the
tied embedding)."""

from __future__ import annotations

import pytest

from stagewise.measure.framework import tiny_config, tiny_weights
from stagewise.model.stage import StageModel


@pytest.mark.parametrize("start, end", [(0, 3), (0, 1), (1, 2), (1, 3)])
def test_the_synthetic_weights_build_every_stage_role(start, end):
    config = tiny_config(3)
    model = StageModel.from_weights(config, start, end, tiny_weights(config))
    assert (model.embedding is not None) == (start == 0)
    assert (model.lm_head is not None) == (end == 3)
