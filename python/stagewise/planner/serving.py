"""The serving YAML of ``stagewise plan --config`` (``examples/serving.yaml``):

    model: qwen3-4b            # optional here; a MODEL argument wins
    input_length: 2048         # optional
    output_length: 512         # optional
    batch: 8                   # optional, sequences per replica
    prefix_share: 0.5          # optional: the share of each prompt found in the prefix cache
    device_profile: h100-sxm   # optional
    kv_cache_dtype: int8       # optional: auto (default) | int8 | fp8_e4m3, as a run plan's key
    parallel_config:
      world_size: 8
      tp_size: 2
      pp_size: 2               # default 1
      dp_size: 2               # default world_size // (tp_size * pp_size)
      ep_size: 1               # optional (MoE), default 1
      moe_dp_size: 1           # optional (MoE), default 1
      pcp_size: 1              # optional, prefill context parallel, default 1
      dcp_size: 1              # optional, decode context parallel (divides tp_size), default 1

``world_size == tp_size * pcp_size * pp_size * dp_size`` is checked; the layout becomes a
:class:`~stagewise.parallel.ranks.ParallelConfig`, the same object the search evaluates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagewise.kv.cache import check_kv_cache_dtype
from stagewise.parallel.ranks import ParallelConfig

PARALLEL_KEYS = ("world_size", "tp_size", "pp_size", "dp_size", "ep_size", "moe_dp_size", "pcp_size", "dcp_size")
TOP_KEYS = ("model", "input_length", "output_length", "batch", "device_profile", "parallel_config", "prefix_share",
            "kv_cache_dtype")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    parallel: ParallelConfig
    model: str | None = None
    input_length: int | None = None
    output_length: int | None = None
    batch: int | None = None
    device_profile: str | None = None
    prefix_share: float | None = None
    kv_cache_dtype: str | None = None
    """What the stages store K/V as (a run plan's ``kv_cache_dtype``); None: not given."""


def _int(where: str, d: dict, key: str, default: Any = None) -> Any:
    value = d.get(key, default)
    if value is default and key not in d:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def parse_serving(data: Any, where: str = "serving config") -> ServingConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {list(TOP_KEYS)}")
    pc = data.get("parallel_config")
    if not isinstance(pc, dict):
        raise ValueError(f"{where}: field 'parallel_config' must be a mapping with world_size, tp_size, pp_size, "
                         f"dp_size; got {pc!r}")
    unknown = sorted(set(pc) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) parallel_config.{unknown}; expected some of {list(PARALLEL_KEYS)}")
    pw = f"{where}: parallel_config"
    if "world_size" not in pc:
        raise ValueError(f"{pw}: field 'world_size' is required")
    world, tp, pp = _int(pw, pc, "world_size"), _int(pw, pc, "tp_size", 1), _int(pw, pc, "pp_size", 1)
    dp, pcp = _int(pw, pc, "dp_size", None), _int(pw, pc, "pcp_size", 1)
    cp, cp_name = (f"{pcp} * ", "pcp_size * ") if pcp != 1 else ("", "")
    if dp is None:
        if world % (tp * pcp * pp):
            raise ValueError(f"{pw}: tp_size * {cp_name}pp_size = {tp * pcp * pp} does not divide world_size={world}")
        dp = world // (tp * pcp * pp)
    if tp * pcp * pp * dp != world:
        raise ValueError(f"{pw}: world_size={world} must equal tp_size * {cp_name}pp_size * dp_size = {tp} * {cp}{pp} "
                         f"* {dp} = {tp * pcp * pp * dp}")
    parallel = ParallelConfig(world_size=world, tp=tp, pp=pp, dp=dp, ep=_int(pw, pc, "ep_size", 1),
                              moe_dp=_int(pw, pc, "moe_dp_size", 1), pcp=pcp, dcp=_int(pw, pc, "dcp_size", 1))
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{where}: field 'model' must be a string, got {model!r}")
    profile = data.get("device_profile")
    if profile is not None and not isinstance(profile, str):
        raise ValueError(f"{where}: field 'device_profile' must be a string, got {profile!r}")
    share = data.get("prefix_share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
        raise ValueError(f"{where}: field 'prefix_share' must be a number in [0, 1], got {share!r}")
    kv_cache_dtype = data.get("kv_cache_dtype")
    if kv_cache_dtype is not None:
        try:
            check_kv_cache_dtype(kv_cache_dtype)
        except ValueError as err:
            raise ValueError(f"{where}: field {err}") from None
    return ServingConfig(parallel=parallel, model=model, input_length=_int(where, data, "input_length"),
                         output_length=_int(where, data, "output_length"), batch=_int(where, data, "batch"),
                         device_profile=profile, prefix_share=share, kv_cache_dtype=kv_cache_dtype)


def load_serving_yaml(path: str | Path) -> ServingConfig:
    from stagewise.yamlfile import read_yaml

    data = read_yaml(path, "serving config")
    return parse_serving(data, f"serving config {str(path)!r}")
