"""Starting stage processes: run plans (plan files), local spawn, multi-host commands."""

from stagewise.launch.planfile import RunPlan, StageSpec

__all__ = ["RunPlan", "StageSpec"]
