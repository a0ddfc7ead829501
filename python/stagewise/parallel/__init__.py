"""Parallel layouts: pipeline stage plans (partition policies); later rank groups, TP and CP."""

from stagewise.parallel.plan import (
    PARTITION_POLICIES,
    PipelineStageInfo,
    StagePlan,
    decode_layer_costs,
    partition_layers,
)

__all__ = ["PARTITION_POLICIES", "PipelineStageInfo", "StagePlan", "decode_layer_costs", "partition_layers"]
