"""What a stage process sets up once, before it serves: its rank's weights on its device, how many
KV blocks it can hold, and the sizes of the rings it sends on (and, for its stats, its collectives'
counters). Kept apart from the IO loop (:mod:`stagewise.pipeline.process`) so that a stage that
rejoins a new driver reuses all of it."""

from __future__ import annotations

import torch

from stagewise.kv.cache import num_cache_blocks
from stagewise.model.stage import cache_spec
from stagewise.parallel.runplan import RunPlan
from stagewise.pipeline.messages import Setup
from stagewise.transport import registry


def load_weights(plan: RunPlan, index: int, rank: int, checkpoint, device: torch.device):
    """Rank ``rank`` of stage ``index``: its torch threads and CUDA device set, its layers' weights
    (its tensor-parallel shard) read. Returns (weights, dtype)."""
    from stagewise.model.loader import load_stage_weights, resolve_dtype

    spec = plan.stages[index]
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if device.type == "cuda":
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(f"device {spec.device!r}: this host has {found} CUDA device(s)"
                             + ("" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"))
        torch.cuda.set_device(device)  # this process's GPU: the ring, the streams and NCCL use it
    dtype = resolve_dtype(plan.dtype, checkpoint.config.dtype)
    weights = load_stage_weights(checkpoint, spec.start_layer, spec.end_layer, tp_rank=rank % spec.tp,
                                 tp_size=spec.tp, dtype=dtype, quantized=plan.quantized,
                                 linear_precision=plan.linear_precision)
    return weights, dtype


def checked(setup, hop: str) -> Setup:
    """The driver's :class:`Setup`, once it agrees with this stage's own plan (its outgoing
    ``hop``) on whether the run's hops are on a world transport (``torch``): that decides which
    torch.distributed world the stage joins, and a stage started by hand with another plan's transport would otherwise
    wait in a world of another size until it times out. Which other transport a hop runs is the
    driver's to say."""
    if not isinstance(setup, Setup):
        raise ValueError(f"expected the driver's setup, got {type(setup).__name__}")
    if registry.is_world(setup.transport) != registry.is_world(hop):
        raise ValueError(f"the driver runs this stage's outgoing hop over {setup.transport!r}, but this stage's "
                         f"plan makes it {hop!r}: the stage was started with another plan's transport; start "
                         "it from the driver's plan")
    return setup


def kv_capacity(plan: RunPlan, index: int, cfg, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> int:
    """How many full-attention KV blocks stage ``index``'s rank can hold on ``device``, its
    sliding-window pools beside them (a context-parallel rank stores 1/cp of each request's tokens)."""
    spec = plan.stages[index]
    ranks = plan.stage_ranks()[index]
    cache = cache_spec(cfg, spec.start_layer, spec.end_layer, tp_size=spec.tp, block_size=plan.block_size,
                       dtype=dtype, kv_cache_dtype=plan.kv_cache_dtype)
    return num_cache_blocks(cache, device, max_num_seqs=plan.max_num_seqs, max_model_len=max_model_len,
                            kv_cache_bytes=plan.kv_cache_bytes, max_num_tokens=plan.max_num_tokens,
                            cp_world_size=ranks.pcp * ranks.dcp)


def ring_size(plan: RunPlan, index: int, hidden_size: int, dtype: torch.dtype, max_model_len: int,
              activations: bool = False) -> tuple[int, int]:
    """Slots of stage ``index``'s outgoing ring: a step's hidden states (at most
    ``max_prefill_tokens`` prompt tokens and a decode token per row; a step that does not fit goes
    over TCP) or, from the last stage (unless ``activations``), token ids; enough slots that the S
    steps in flight and the frees rarely wait."""
    s = plan.num_stages
    if index == s - 1 and not activations:
        return 1 << 20, s + 2
    tokens = min(plan.max_prefill_tokens, plan.max_num_seqs * max_model_len) + plan.max_num_seqs
    need = tokens * hidden_size * dtype.itemsize + (256 << 10)
    return min(max(need, 1 << 20), 32 << 20), 2 * s + 2


def head_engine(executor, plan: RunPlan, setup: Setup):
    """Stage 0's :class:`~stagewise.engine.engine.Engine` over its ``executor``, as the plan and
    the driver's setup say."""
    from stagewise.engine.engine import Engine
    from stagewise.engine.speculative import SpeculativeConfig

    return Engine(executor, max_num_seqs=plan.max_num_seqs, num_groups=setup.microbatches,
                  max_prefill_tokens=plan.max_prefill_tokens, prefix_cache=plan.prefix_cache,
                  tpot_target_s=None if plan.tpot_target_ms is None else plan.tpot_target_ms / 1e3,
                  speculative=SpeculativeConfig.of(plan.speculative, plan.num_speculative_tokens))


def step_counters(executor) -> tuple[float, int, int, float, int, float]:
    """(collective seconds, bytes, calls, fan-out seconds, bytes, constraint seconds) of a stage
    rank's ``executor`` so far (zeros before it has one)."""
    if executor is None:
        return (0.0, 0, 0, 0.0, 0, 0.0)
    g = executor.model.groups
    groups = list({id(x): x for x in (g.tp, g.dcp, g.pcp)}.values())
    mirror = executor.mirror
    return (sum(getattr(x, "seconds", 0.0) for x in groups), sum(getattr(x, "bytes", 0) for x in groups),
            sum(getattr(x, "calls", 0) for x in groups), getattr(mirror, "seconds", 0.0),
            getattr(mirror, "bytes", 0), executor.constraint_s)
