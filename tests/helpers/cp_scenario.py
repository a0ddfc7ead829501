"""The context-parallel test scenario, shared by the test (single-process reference) and the rank
worker (tests/helpers/cp_worker.py): a two-layer attention stack from seeded random weights, and a
script of prefill, mixed and decode steps with a request freed and its blocks reused, and prompts
prefilled in chunks beside decodes.

A case is a dict of JSON values: ``tp``, ``dcp``, ``pcp``, ``heads``, ``kv_heads`` and the
``interleave`` sizes (one per replica of the case in the world: replicas run side by side).
"""

from __future__ import annotations

import torch

from stagewise.engine.handoff import read_kv
from stagewise.kv import KVCache, KVCacheManager, KVCacheSpec
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata, split_for_pcp
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.attention import Attention
from stagewise.model.layers.context_parallel import restore_pcp_rows
from stagewise.model.layers.linear import Linear, RowParallelLinear
from stagewise.model.layers.rotary import Rotary

HIDDEN, HEAD_DIM, LAYERS, BLOCK_SIZE, SEED = 32, 16, 2, 16, 1234

# Steps: (requests to free, prefills {id: prompt length, or (cached tokens, chunk length) for a later
# chunk}, decodes [ids]). Prompts cross several virtual blocks (16 x cp positions); "e" has one token
# (PCP ranks with none of it, DCP ranks holding none of its KV for a while). "f" is prefilled in
# three chunks (13, 24 and 33 tokens: across virtual blocks and interleave runs), "g" in chunks of
# 5, 1 (fewer tokens than PCP ranks) and 3.
SCRIPT: list[tuple[list[str], dict[str, int | tuple[int, int]], list[str]]] = [
    ([], {"a": 45, "b": 70}, []),
    ([], {}, ["a", "b"]),
    ([], {}, ["a", "b"]),
    ([], {"c": 9, "e": 1}, ["a", "b"]),
    ([], {}, ["a", "b", "c", "e"]),
    ([], {}, ["a", "b", "c", "e"]),
    (["b"], {}, ["a", "c", "e"]),
    ([], {"d": 33}, ["a", "c", "e"]),
    ([], {}, ["a", "c", "d", "e"]),
    ([], {}, ["a", "c", "d", "e"]),
    (["a"], {}, ["c", "d", "e"]),
    ([], {}, ["c", "d", "e"]),
    ([], {"f": 13}, ["c", "d", "e"]),
    ([], {"f": (13, 24), "g": 5}, ["c", "d", "e"]),
    (["c"], {"f": (37, 33), "g": (5, 1)}, ["d", "e"]),
    ([], {"g": (6, 3)}, ["d", "e", "f"]),
    ([], {}, ["d", "e", "f", "g"]),
]


def chunk(prefill: int | tuple[int, int]) -> tuple[int, int]:
    """(cached tokens, chunk length) of a SCRIPT prefill entry."""
    return (0, prefill) if isinstance(prefill, int) else prefill


def config(case: dict) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=64, hidden_size=HIDDEN, num_layers=LAYERS,
                       num_heads=case["heads"], num_kv_heads=case["kv_heads"], head_dim=HEAD_DIM,
                       intermediate_size=64, max_position_embeddings=512)


def _full_weights(cfg: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + layer)
    d, hq, hk = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rand = (lambda *shape: torch.randn(*shape, generator=g) * HIDDEN**-0.5)
    return {"q": rand(hq * d, HIDDEN), "k": rand(hk * d, HIDDEN), "v": rand(hk * d, HIDDEN), "o": rand(HIDDEN, hq * d)}


def build_layers(case: dict, tp_rank: int = 0, tp_size: int = 1,
                 groups: StageGroups = StageGroups()) -> list[Attention]:
    """The stack's layers for TP rank ``tp_rank``: its query heads, its KV head (replicated when
    ``tp > kv_heads``) and its columns of o."""
    cfg = config(case)
    d, hq, hk = cfg.head_dim, cfg.num_heads // tp_size, max(1, cfg.num_kv_heads // tp_size)
    first_kv = tp_rank * cfg.num_kv_heads // tp_size
    rotary = Rotary(cfg, torch.float32, "cpu")
    layers = []
    for layer in range(LAYERS):
        w = _full_weights(cfg, layer)
        q = w["q"][tp_rank * hq * d : (tp_rank + 1) * hq * d]
        k, v = (w[n][first_kv * d : (first_kv + hk) * d] for n in "kv")
        o = w["o"][:, tp_rank * hq * d : (tp_rank + 1) * hq * d]
        reduce = groups.tp.all_reduce if tp_size > 1 else None
        layers.append(Attention(cfg, layer, Linear.fused([q, k, v]), RowParallelLinear(o, None, reduce), rotary,
                                groups=groups))
    return layers


def run(case: dict, layers: list[Attention], groups: StageGroups = StageGroups(),
        interleave: int = 1) -> tuple[list[torch.Tensor], list[list[int]], dict[str, torch.Tensor]]:
    """Each step's output of the stack (full step rows, every rank); after each step, this rank's
    ``[blocks in use, token slots filled, tokens of live requests]``; and, at the end, this rank's
    share of each live request's K and V as its KV handoff reads them (``"<id>/k"``, ``"<id>/v"``)."""
    cfg = config(case)
    manager = KVCacheManager(block_size=BLOCK_SIZE, num_blocks=64, max_blocks_per_seq=8,
                             cp_world_size=groups.cp_size, cp_rank=groups.cp_rank, interleave_size=interleave)
    spec = KVCacheSpec(layer_start=0, layer_end=LAYERS, num_kv_heads=layers[0].num_kv_heads, head_dim=cfg.head_dim,
                       block_size=BLOCK_SIZE, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=64)
    cache.storage.fill_(float("nan"))  # no slot another rank owns, or nobody wrote, may be read
    outputs, usage = [], []
    g = torch.Generator().manual_seed(SEED)
    for free, prefills, decodes in SCRIPT:
        for rid in free:
            manager.free(rid)
        context = [manager.num_tokens(rid) for rid in decodes]
        chunks = [chunk(p) for p in prefills.values()]
        for rid, (ctx, n) in zip(prefills, chunks):
            manager.append(rid, n) if ctx else manager.add(rid, n)
        for rid in decodes:
            manager.append(rid)
        positions = [p for ctx, n in chunks for p in range(ctx, ctx + n)] + context
        batch = StepBatch(request_ids=(*prefills, *decodes), num_prefills=len(prefills),
                          query_lens=(*[n for _, n in chunks], *[1] * len(decodes)),
                          context_lens=(*[ctx for ctx, _ in chunks], *context),
                          positions=torch.tensor(positions), hidden_states=torch.randn(len(positions), HIDDEN,
                                                                                       generator=g))
        split = split_for_pcp(batch, groups.pcp.rank, groups.pcp.size) if groups.pcp.size > 1 else None
        meta = KVMetadata.build(batch, manager, "cpu", pcp=split)
        mine = batch if split is None else split.batch
        h = mine.hidden_states
        for i, layer in enumerate(layers):
            h = h + layer(h, mine, meta, cache.layer(i))
        outputs.append(h if split is None else restore_pcp_rows(h, split, groups.pcp))
        live = sum(manager.num_tokens(r) for r in manager.request_ids())
        usage.append([manager.num_used_blocks, manager.num_stored_tokens(), live])
    kv = {}
    for rid in manager.request_ids():
        kv[f"{rid}/k"], kv[f"{rid}/v"] = read_kv([manager], cache, rid, manager.num_local_tokens(rid))
    return outputs, usage, kv

