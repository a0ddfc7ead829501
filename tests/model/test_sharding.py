"""Tensor-parallel shards from the loader, for every split kind of the table, on tiny random models of
each architecture saved by transformers: each rank's shard has the size the table counts for it
(shapes.rank_numel), all ranks' shards reassemble the whole tensor, a rank reads only its share,
and decoder layers built from the shards, their partial sums added across ranks, compute what the
whole layer computes."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stagewise.kv import KVCache, KVCacheManager, KVCacheSpec
from stagewise.model import shapes
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.collectives import StageGroups
from stagewise.model.layers.linear import Linear, RowParallelLinear
from stagewise.model.layers.rotary import Rotary
from stagewise.model.loader import load_stage_weights, open_checkpoint
from stagewise.model import architectures
from stagewise.model.architectures.base import StageBuild
from stagewise.model.architectures.falcon import unpack_qkv
from stagewise.model.rows import SPLITS, kv_heads_per_rank
from stagewise.model.weights import Weights

transformers = pytest.importorskip("transformers")

# 4 query heads; vocab 50 leaves the last of 4 vocab-parallel ranks 11 rows and 2 of padding.
SMALL = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
MODELS = {
    # GQA, 2 KV heads: split at tp 2, each held by two ranks at tp 4. Biases everywhere.
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=48, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False)),
    "llama-mqa-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=1, intermediate_size=48, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=48, tie_word_embeddings=False)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    "falcon-40b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False)),
    "falcon-7b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True)),
    "falcon-rw": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True)),
}
TP_SIZES = (2, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> folder of the model saved by transformers (experts one tensor each, as it writes them)."""
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = make().eval()
        with torch.no_grad():  # norms and biases off their init values, so that every value matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = folder
    return out


def loaded(folder, tp_size, start=0, end=None):
    ckpt = open_checkpoint(folder)
    end = ckpt.config.num_layers if end is None else end
    return ckpt.config, [load_stage_weights(folder, start, end, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]


def kv_groups(cfg, shards, tp_size):
    """One shard per distinct KV head block, in head order: with more ranks than KV heads,
    ``tp / Hk`` consecutive ranks hold the same head and must hold identical copies."""
    per = max(1, tp_size // cfg.num_kv_heads)
    for g in range(0, tp_size, per):
        for r in range(g + 1, g + per):
            assert torch.equal(shards[r], shards[g])
    return [shards[g] for g in range(0, tp_size, per)]


def reassembled(cfg, t, shards, tp_size):
    """The whole tensor rebuilt from every rank's shard of table entry ``t``."""
    if t.split == "replicated":
        assert all(torch.equal(s, shards[0]) for s in shards)
        return shards[0]
    if t.split == "column":
        return torch.cat(shards)
    if t.split == "row":
        return torch.cat(shards, 1)
    if t.split == "kv_column":
        return torch.cat(kv_groups(cfg, shards, tp_size))
    if t.split == "vocab":
        rows = torch.cat(shards)
        assert not rows[cfg.vocab_size:].any()  # padding rows are zeros
        return rows[: cfg.vocab_size]
    if t.split == "expert_column":
        halves = [s.chunk(2, dim=1) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1)
    if t.split == "expert_row":
        return torch.cat(shards, 2)
    if t.split == "fused_qkv":
        # Each rank's rows must unpack (in its own layout, with its own head counts) into its query
        # heads and its KV heads of the whole tensor's q, k and v.
        q, k, v = zip(*(unpack_qkv(cfg, s, tp_size) for s in shards))
        return [torch.cat(q), torch.cat(kv_groups(cfg, list(k), tp_size)), torch.cat(kv_groups(cfg, list(v), tp_size))]
    raise AssertionError(f"no reassembly for split {t.split!r}")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_shards_match_the_table_and_reassemble(saved, name, tp_size):
    (cfg, [full]), (_, shards) = loaded(saved[name], 1), loaded(saved[name], tp_size)
    table = shapes.model_tensors(cfg)
    rank = shapes.Sharding(tp=tp_size, moe_tp=tp_size)  # the loader splits experts like the dense MLP
    splits = set()
    for t in table:
        parts = [s[t.name] for s in shards]
        assert all(p.numel() == shapes.rank_numel(cfg, t, rank) for p in parts), (t.name, t.split)
        whole = reassembled(cfg, t, parts, tp_size)
        if t.split == "fused_qkv":
            assert all(torch.equal(a, b) for a, b in zip(whole, unpack_qkv(cfg, full[t.name]))), t.name
        else:
            assert torch.equal(whole, full[t.name]), (t.name, t.split)
        splits.add(t.split)
    assert set(full) == set(shards[0]) == {t.name for t in table} | ({shapes.LM_HEAD} if cfg.tie_word_embeddings else set())
    expected = {"replicated", "column", "row", "vocab"}  # vocab: the embedding (and an untied LM head)
    expected |= {"fused_qkv"} if cfg.architecture == "falcon" else {"kv_column"}
    expected |= {"expert_column", "expert_row"} if cfg.moe else set()
    assert splits == expected


def test_every_split_kind_is_covered(saved):
    covered = {t.split for folder in saved.values() for t in shapes.model_tensors(open_checkpoint(folder).config)}
    assert covered == set(SPLITS)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-moe", "falcon-40b", "falcon-7b"])
def test_a_rank_reads_only_its_share(saved, name):
    ckpt = open_checkpoint(saved[name])
    cfg = ckpt.config
    table = shapes.stage_tensors(cfg, range(1, 2), first=False, last=False)  # a middle stage: no vocab padding
    for r in range(4):
        before = ckpt.bytes_read
        load_stage_weights(ckpt, 1, 2, tp_rank=r, tp_size=4)
        assert ckpt.bytes_read - before == 4 * shapes.count(cfg, table, shapes.Sharding(tp=4, moe_tp=4))


def test_indivisible_split_is_an_error_naming_the_tensor(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=2, intermediate_size=50)
                                  ).save_pretrained(tmp_path)
    assert load_stage_weights(tmp_path, 0, 1, tp_rank=1, tp_size=2)["model.layers.0.mlp.up_proj.weight"].shape == (25, 32)
    with pytest.raises(ValueError, match=r"tp_size=4 must divide the 50 rows \(dim 0\) that tensor "
                                         r"'model.layers.0.mlp.gate_proj.weight' \[50, 32\] splits"):
        load_stage_weights(tmp_path, 0, 1, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="tp=8 must divide num_attention_heads=4"):
        load_stage_weights(tmp_path, 0, 1, tp_rank=0, tp_size=8)


class ThreadGroup:
    """An all-reduce among ``size`` ranks run as threads of this process: every rank gets the sum of
    all ranks' tensors, added in rank order (so every rank gets the same bits)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier, self.slots = threading.Barrier(size, timeout=60), [None] * size

    def groups(self, rank: int) -> StageGroups:
        """Rank ``rank``'s groups: its tp group is this one (only its all-reduce is used by the layers)."""
        return StageGroups(tp=ThreadRank(self, rank))

    def reduce(self, rank: int, y: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = y
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total += other
        self.barrier.wait()  # every rank has read the slots before the next call fills them
        return total

    def run(self, fns):
        with ThreadPoolExecutor(len(fns)) as pool:
            futures = [pool.submit(fn) for fn in fns]
            try:
                return [f.result() for f in futures]
            except BaseException:
                self.barrier.abort()
                raise


class ThreadRank:
    """One rank's view of a :class:`ThreadGroup`, as the model's Collectives protocol."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.size, self.rank = group, group.size, rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.copy_(self.group.reduce(self.rank, t))

    def all_gather(self, t, dim=0):
        raise NotImplementedError

    def gather(self, t, dim=0, dst=0):
        raise NotImplementedError

    def reduce_scatter(self, t, dim=0):
        raise NotImplementedError


def run_layer(cfg, layer, weights, groups, x, prompts):
    """Layer ``layer`` built from ``weights`` on one rank: a prefill of ``prompts`` (rows of ``x``),
    then one decode step of every request. Returns both steps' outputs (x + residual)."""
    stage = StageBuild(groups, Rotary(cfg, torch.float32, "cpu"), torch.float32, torch.device("cpu"))
    module = architectures.of(cfg).build_layer(cfg, layer, shapes.layer_prefix(cfg, layer),
                                               Weights(weights, torch.float32, "cpu"), stage)
    spec = KVCacheSpec(layer_start=layer, layer_end=layer + 1,
                       num_kv_heads=kv_heads_per_rank(cfg, groups.tp.size),
                       head_dim=cfg.head_dim, block_size=4, dtype=torch.float32)
    cache, manager = KVCache(spec, num_blocks=16), KVCacheManager(block_size=4, num_blocks=16, max_blocks_per_seq=8)
    ids, lens = list(range(len(prompts))), [len(p) for p in prompts]
    steps = [StepBatch(request_ids=ids, num_prefills=len(ids), query_lens=lens, context_lens=[0] * len(ids),
                       positions=torch.cat([torch.arange(n) for n in lens]), hidden_states=x[: sum(lens)]),
             StepBatch(request_ids=ids, num_prefills=0, query_lens=[1] * len(ids), context_lens=lens,
                       positions=torch.tensor(lens), hidden_states=x[sum(lens): sum(lens) + len(ids)])]
    outs = []
    for step, batch in enumerate(steps):
        for rid, n in zip(ids, lens):
            if step == 0:
                manager.add(rid, n)
            else:
                manager.append(rid)
        with torch.inference_mode():
            h, residual = module(batch.hidden_states.clone(), None, batch, KVMetadata.build(batch, manager, "cpu"),
                                 cache.layer(layer))
        outs.append(h if residual is None else h + residual)
    return outs


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_layers_sum_to_the_whole_layer(saved, name, tp_size):
    (cfg, [full]), (_, shards) = loaded(saved[name], 1), loaded(saved[name], tp_size)
    x = torch.randn(5 + 3 + 2, cfg.hidden_size)
    prompts = [list(range(5)), list(range(3))]
    for layer in range(cfg.num_layers):  # qwen3-moe: layer 1 dense, the others sparse
        want = run_layer(cfg, layer, full, StageGroups(), x, prompts)
        group = ThreadGroup(tp_size)
        got = group.run([lambda r=r: run_layer(cfg, layer, shards[r], group.groups(r), x, prompts)
                         for r in range(tp_size)])
        for rank_out in got:
            for a, b in zip(rank_out, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_row_parallel_bias_is_added_once_after_the_reduction():
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    whole = RowParallelLinear(w, b)
    assert torch.equal(whole(x), Linear(w, b)(x))  # one rank: exactly the plain linear
    partial = [x[:, :4] @ w[:, :4].T, x[:, 4:] @ w[:, 4:].T]
    ranks = [RowParallelLinear(w[:, r * 4:(r + 1) * 4], b, all_reduce=lambda y, r=r: partial[1 - r] + y)
             for r in range(2)]
    for r, layer in enumerate(ranks):
        torch.testing.assert_close(layer(x[:, r * 4:(r + 1) * 4]), x @ w.T + b)


def test_fused_linear_concatenates_its_parts():
    a, b, x = torch.randn(4, 8), torch.randn(2, 8), torch.randn(3, 8)
    ba, bb = torch.randn(4), torch.randn(2)
    torch.testing.assert_close(Linear.fused([a, b], [ba, bb])(x), torch.cat([x @ a.T + ba, x @ b.T + bb], -1))
    with pytest.raises(ValueError, match="every part has a bias or none"):
        Linear.fused([a, b], [ba, None])
