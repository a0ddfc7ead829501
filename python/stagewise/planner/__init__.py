"""The planner: memory and latency of any TP/PP/DP/EP layout from a config.json, checked
against measured runs of the runtime.

- :mod:`~stagewise.planner.memory`: per-stage weights (rough and exact) and KV;
- :mod:`~stagewise.planner.compute`: the per-operator model of a stage (prefill, decode);
- :mod:`~stagewise.planner.pipeline`: PP send/recv, fill-drain latency, bubble, breakdown line;
- :mod:`~stagewise.planner.estimate`: one layout end to end; :mod:`~stagewise.planner.search`: the space;
- :mod:`~stagewise.planner.profiles`: device profiles; :mod:`~stagewise.planner.serving`: serving YAML;
- :mod:`~stagewise.planner.timeline`: predicted timelines (Chrome trace, PNG);
- :mod:`~stagewise.planner.validate`: predictions against measured runs; :mod:`~stagewise.planner.cli`.
"""

from stagewise.planner.estimate import LayoutEstimate, Workload, estimate_layout
from stagewise.planner.profiles import DeviceProfile, load_profile
from stagewise.planner.search import resolve_search_sizes, search

__all__ = ["DeviceProfile", "LayoutEstimate", "Workload", "estimate_layout", "load_profile", "resolve_search_sizes",
           "search"]
