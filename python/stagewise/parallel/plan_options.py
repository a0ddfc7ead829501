"""A run plan's run options (every key but ``model``, ``stages`` and the layout): their names and
their checks, each bad value named (:func:`option_problems`)."""

from __future__ import annotations

import math
from typing import Any

from stagewise.transport.registry import TRANSPORTS

LAUNCHERS = ("local", "ray")
"""Where a plan's processes start: here (or by hand, or over ssh), or as actors on a Ray cluster."""
PLACEMENTS = ("spread", "pack", "strict_spread")
"""How a Ray launch places the stages (Ray's SPREAD, PACK and STRICT_SPREAD placement groups)."""
OPTION_KEYS = ("dtype", "transport", "checksum", "max_num_seqs", "max_prefill_tokens", "tpot_target_ms", "prefix_cache",
               "kv_cache_dtype", "speculative", "num_speculative_tokens",
               "max_model_len", "kv_cache_bytes", "max_num_tokens", "block_size", "quantized", "linear_precision",
               "pcp", "dcp", "interleave_size", "launcher", "placement", "tls", "sampling")


def problem(what: str, value: Any, expected: str) -> str:
    return f"{what} must be {expected}, got {value!r}"


def tpot_target_problem(value: Any, what: str) -> str | None:
    """What is wrong with a TPOT target in milliseconds (None: nothing; None is no target)."""
    if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf):
        return None
    return problem(what, value, "a finite number of milliseconds > 0 (or none)")


def speculative_problems(method: object, num_tokens: object) -> list[str]:
    """What is wrong with the ``speculative`` and ``num_speculative_tokens`` options (each named)."""
    problems = []
    if method is not None and not (method == "ngram" or isinstance(method, str) and method.startswith("draft:")
                                   and len(method) > len("draft:")):
        problems.append(f"speculative must be ngram or draft:PATH (a draft model; or none), got {method!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        problems.append(f"num_speculative_tokens must be an int >= 1, got {num_tokens!r}")
    return problems


def option_problems(options: dict[str, Any]) -> list[str]:
    """Every problem of the plan's run options (absent ones keep their defaults)."""
    problems = []
    get = options.get
    if get("dtype", "auto") not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(problem("dtype", get("dtype"), "auto, float32, bfloat16 or float16"))
    if get("transport", "auto") not in TRANSPORTS:
        problems.append(problem("transport", get("transport"), f"one of {TRANSPORTS}"))
    for name in ("checksum", "prefix_cache"):
        if not isinstance(get(name, True), bool):
            problems.append(problem(name, get(name), "true or false"))
    if get("quantized") is not None and not isinstance(get("quantized"), bool):
        problems.append(problem("quantized", get("quantized"), "true, false or null"))
    if get("launcher", "local") not in LAUNCHERS:
        problems.append(problem("launcher", get("launcher"), f"one of {LAUNCHERS}"))
    if get("tls") is not None:
        from stagewise.transport.tls import TlsConfig

        try:
            TlsConfig.from_dict(get("tls"))
        except ValueError as err:
            problems.append(str(err))
    if get("placement", "spread") not in PLACEMENTS:
        problems.append(problem("placement", get("placement"), f"one of {PLACEMENTS}"))
    if get("kv_cache_dtype", "auto") not in ("auto", "int8", "fp8_e4m3"):
        problems.append(problem("kv_cache_dtype", get("kv_cache_dtype"), "auto, int8 or fp8_e4m3"))
    if get("linear_precision", "exact") not in ("exact", "int8"):
        problems.append(problem("linear_precision", get("linear_precision"), "'exact' or 'int8'"))
    for name in ("max_num_seqs", "max_prefill_tokens", "block_size", "pcp", "dcp", "interleave_size"):
        value = get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(problem(name, value, "an int >= 1"))
    for name in ("max_model_len", "kv_cache_bytes", "max_num_tokens"):
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(problem(name, value, "an int >= 1 or null"))
    if (why := tpot_target_problem(get("tpot_target_ms"), "tpot_target_ms")) is not None:
        problems.append(why)
    problems += speculative_problems(get("speculative"), get("num_speculative_tokens", 3))
    block, inter = get("block_size", 16), get("interleave_size", 1)
    if isinstance(block, int) and isinstance(inter, int) and inter >= 1 and block % inter:
        problems.append(f"interleave_size={inter} must divide block_size={block} (a context-parallel rank's "
                        "tokens fill whole slots of a block)")
    if get("kv_cache_bytes") is not None and get("max_num_tokens") is not None:
        problems.append("give at most one of kv_cache_bytes and max_num_tokens")
    sampling = get("sampling")
    if sampling is not None:
        if not isinstance(sampling, dict):
            problems.append(problem("sampling", sampling, "a mapping of sampling fields"))
        else:
            from stagewise.engine.params import SAMPLING_FIELDS, unknown_field, value_problem

            for name, value in sampling.items():
                if name not in SAMPLING_FIELDS:
                    problems.append(f"sampling: {unknown_field(str(name))}")
                elif (why := value_problem(name, value)) is not None:
                    problems.append(f"sampling.{name} {why}")
    return problems
