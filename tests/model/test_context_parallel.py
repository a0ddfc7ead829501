"""Context-parallel attention: the pure pieces in one process (head-tail split and
restore, the LSE combine against plain softmax attention, local sequence lengths, the layout
rules), then real ranks over gloo: one world of 4 processes runs DCP (MQA and GQA, KV heads
replicated over TP), PCP and PCP x DCP stages of two attention layers through prefill, mixed and
decode steps with a request freed and prompts prefilled in chunks beside decodes, every step compared
with the single-process stack."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import cp_scenario
from helpers.groups import NoCollectives
from stagewise.engine.handoff import KVHandoff, KVShard, merge_handoffs, split_handoff
from stagewise.kv import KVCacheManager, KVCacheSpec
from stagewise.kv.cache import num_cache_blocks
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata, head_tail_ranges, split_for_pcp
from stagewise.model.collectives import SINGLE, StageGroups
from stagewise.model.layers.context_parallel import (_packed, check_groups, check_metadata, merge_partials,
                                                      valid_dcp_sizes)
from stagewise.model.loader.sharding import kv_heads_of_rank
from stagewise.parallel import comm

WORKER = Path(__file__).parents[1] / "helpers" / "cp_worker.py"

# ---- pure pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_head_tail_ranges_cover_each_prompt_once(size):
    for n in (1, 2, 7, 8, 45, 70):
        parts = [list(rg) for r in range(size) for rg in head_tail_ranges(n, r, size)]
        assert sorted(p for part in parts for p in part) == list(range(n))
        part = -(-n // (2 * size))
        for r in range(size):  # rank r: parts r and 2 * size - 1 - r of the padded prompt
            head, tail = head_tail_ranges(n, r, size)
            assert head.start == r * part and tail.start == (2 * size - 1 - r) * part


def _step(prompts: list[int], contexts: list[int]) -> StepBatch:
    positions = [p for n in prompts for p in range(n)] + contexts
    t = len(positions)
    return StepBatch(request_ids=tuple(range(len(prompts) + len(contexts))), num_prefills=len(prompts),
                     query_lens=(*prompts, *[1] * len(contexts)), context_lens=(*[0] * len(prompts), *contexts),
                     positions=torch.tensor(positions), hidden_states=torch.randn(t, 3))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_split_for_pcp_and_its_restore_order(size):
    batch = _step([45, 1, 7, 70], [12, 3])
    splits = [split_for_pcp(batch, r, size) for r in range(size)]
    p = batch.num_prefill_tokens
    for s in splits:  # the rank's rows, positions and inputs are those of the full step
        assert torch.equal(s.batch.hidden_states, batch.hidden_states[s.rows])
        assert torch.equal(s.batch.positions, batch.positions[s.rows])
        assert s.batch.num_tokens == s.rows.numel() and s.batch.num_tokens - s.batch.num_prefill_tokens == 2
        assert sum(n for _, n, _, _, _ in s.prefill_spans) == s.batch.num_prefill_tokens
    # What an all-gather of each rank's rows, padded, gives back, in the full order.
    gathered = torch.cat([torch.cat([batch.hidden_states[s.rows], torch.zeros(s.pad_rows - s.rows.numel(), 3)])
                          for s in splits])
    assert torch.equal(gathered[splits[0].restore], batch.hidden_states)
    prefill = torch.cat([torch.cat([batch.hidden_states[s.rows[: s.batch.num_prefill_tokens]],
                                    torch.zeros(s.prefill_pad - s.batch.num_prefill_tokens, 3)]) for s in splits])
    assert torch.equal(prefill[splits[-1].prefill_restore], batch.hidden_states[:p])
    # Balance: the longest prompt's tokens differ by at most one part between ranks.
    longest = [s.prefill_spans[3][1] for s in splits]
    assert max(longest) - min(longest) <= 2 * math.ceil(70 / (2 * size))


def test_split_for_pcp_gives_each_rank_its_image_tokens_and_their_features():
    """An image prompt's placeholder rows fall on both ranks: each gets those of its head-tail rows,
    with their embeddings and DeepStack features (tagged here by their index among the image tokens)."""
    ids = torch.tensor([5, 6, 1, 9, 9, 9, 9, 2, 7, 8, 3, 3, 3, 4])
    visual = (ids == 9).nonzero().flatten()
    tags = torch.arange(4.0)
    batch = StepBatch(request_ids=(0, 1), num_prefills=1, query_lens=(13, 1), context_lens=(0, 30),
                      positions=torch.tensor([*range(13), 30]), token_ids=ids,
                      mrope_positions=torch.tensor([*range(13), 30]).repeat(3, 1),
                      image_embeds=tags[:, None].repeat(1, 2), visual_rows=visual,
                      deepstack=tags[None, :, None].repeat(3, 1, 2))
    seen = []
    for rank in range(2):
        sub = split_for_pcp(batch, rank, 2).batch
        assert (sub.token_ids[sub.visual_rows] == 9).all()
        assert int((sub.token_ids == 9).sum()) == sub.visual_rows.numel()
        assert torch.equal(sub.image_embeds[:, 0], sub.deepstack[2, :, 0])
        seen += sub.image_embeds[:, 0].tolist()
    assert sorted(seen) == tags.tolist()
    with pytest.raises(ValueError, match="still holds pixel_values"):
        split_for_pcp(dataclasses.replace(batch, image_embeds=None, visual_rows=None, deepstack=None,
                                          pixel_values=torch.zeros(4, 6),
                                          image_grid_thw=torch.tensor([[1, 2, 2]])), 0, 2)


def _attend(q, k, v):
    """Plain softmax attention of ``q [B, H, D]`` over ``k, v [B, S, D]`` with its lse ``[B, H]``."""
    scores = torch.einsum("bhd,bsd->bhs", q, k)
    lse = torch.logsumexp(scores, dim=-1) if k.size(1) else torch.full(q.shape[:2], -math.inf)
    out = torch.einsum("bhs,bsd->bhd", torch.softmax(scores, dim=-1), v) if k.size(1) else torch.zeros_like(q)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_partials_equal_attention_over_all_keys_including_empty_shards(dtype):
    q, k, v = torch.randn(3, 6, 8), torch.randn(3, 20, 8), torch.randn(3, 20, 8)
    want, _ = _attend(q, k, v)
    cuts = [0, 0, 7, 7, 20, 20]  # shards of 0, 7, 0, 13 and 0 keys
    parts = [_attend(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    rows = torch.cat([_packed(o.to(dtype), s) for o, s in parts])  # what the all-gather hands every rank
    heads = slice(2, 4)  # this rank's heads among the group's 6
    out = merge_partials(rows, parts[0][0].to(dtype), heads)
    assert out.shape == (3, 2, 8) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want[:, heads], rtol=tol, atol=tol)
    empty = torch.cat([_packed(torch.zeros(3, 6, 8), torch.full((3, 6), -math.inf)) for _ in range(2)])
    assert torch.equal(merge_partials(empty, torch.zeros(3, 6, 8), heads), torch.zeros(3, 2, 8))


@pytest.mark.parametrize("cp, interleave", [(2, 1), (2, 4), (4, 8), (3, 16)])
def test_local_seq_lens_count_the_slots_each_rank_stores(cp, interleave):
    lengths = [1, 5, 33, 70, 97]
    total = [0] * len(lengths)
    for rank in range(cp):
        m = KVCacheManager(block_size=16, num_blocks=64, max_blocks_per_seq=8, cp_world_size=cp, cp_rank=rank,
                           interleave_size=interleave)
        for rid, n in enumerate(lengths):
            m.add(rid, n)
        meta = KVMetadata.build(_step(lengths, []), m, "cpu")
        per_request = (meta.slot_mapping >= 0).split(lengths)
        assert meta.local_seq_lens.tolist() == [int(s.sum()) for s in per_request]
        assert m.num_used_blocks == sum(-(-n // (16 * cp)) for n in lengths)
        assert m.num_stored_tokens() == sum(meta.local_seq_lens.tolist())
        total = [a + b for a, b in zip(total, meta.local_seq_lens.tolist())]
    assert total == lengths


def test_a_rank_sizes_its_cache_for_its_share_of_each_row():
    spec = KVCacheSpec(layer_start=0, layer_end=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    one = num_cache_blocks(spec, "cpu", max_num_seqs=4, max_model_len=1024)
    assert num_cache_blocks(spec, "cpu", max_num_seqs=4, max_model_len=1024, cp_world_size=4) == one // 4


def test_layout_rules_are_checked_with_the_valid_sizes():
    assert valid_dcp_sizes(num_kv_heads=2, tp_size=8) == [1, 2, 4]
    assert valid_dcp_sizes(num_kv_heads=8, tp_size=4) == [1]
    with pytest.raises(ValueError, match=r"dcp=4 must divide .* 4 / 2 .*valid dcp sizes: \[1, 2\]"):
        check_groups(StageGroups(tp=NoCollectives(4), dcp=NoCollectives(4)), num_kv_heads=2, tp_size=4, local_kv_heads=1)
    with pytest.raises(ValueError, match=r"valid dcp sizes: \[1\]"):
        check_groups(StageGroups(tp=NoCollectives(2), dcp=NoCollectives(2)), num_kv_heads=2, tp_size=2, local_kv_heads=1)
    check_groups(StageGroups(tp=NoCollectives(4), dcp=NoCollectives(2)), num_kv_heads=2, tp_size=4, local_kv_heads=1)
    with pytest.raises(ValueError, match="interleave_size must divide block_size=16"):
        KVCacheManager(block_size=16, num_blocks=4, max_blocks_per_seq=2, cp_world_size=2, interleave_size=6)
    m = KVCacheManager(block_size=16, num_blocks=4, max_blocks_per_seq=2)
    m.add(0, 3)
    meta = KVMetadata.build(_step([3], []), m, "cpu")
    with pytest.raises(ValueError, match=r"cp_world_size=1, cp_rank=0; .* need cp_world_size=2"):
        check_metadata(StageGroups(tp=NoCollectives(2), dcp=NoCollectives(2, 1)), meta)
    check_metadata(StageGroups(), meta)
    assert StageGroups().cp_size == 1 and SINGLE.size == 1


# ---- ranks over gloo -----------------------------------------------------------------------------

CASES = {
    # 2-rank stages, two replicas side by side with different interleaves.
    "dcp2_mqa": dict(tp=2, dcp=2, pcp=1, heads=4, kv_heads=1, interleave=[1, 4]),
    "pcp2_tp1": dict(tp=1, dcp=1, pcp=2, heads=4, kv_heads=2, interleave=[1, 8]),
    # 4-rank stages.
    "dcp2_gqa_tp4": dict(tp=4, dcp=2, pcp=1, heads=8, kv_heads=2, interleave=[4]),
    "dcp4_mqa": dict(tp=4, dcp=4, pcp=1, heads=8, kv_heads=1, interleave=[2]),
    "pcp2_dcp2": dict(tp=2, dcp=2, pcp=2, heads=4, kv_heads=1, interleave=[4]),
    "pcp2_tp2": dict(tp=2, dcp=1, pcp=2, heads=4, kv_heads=2, interleave=[1]),
    "pcp4_gqa": dict(tp=1, dcp=1, pcp=4, heads=4, kv_heads=2, interleave=[16]),
}
WORLD = 4


class RankFailed(RuntimeError):
    pass


def launch(world: int, cases: dict, out_dir: Path, *, fail_rank: int | None = None, timeout_s: float = 100.0,
           while_running=lambda: None) -> list[dict[str, torch.Tensor]]:
    """Run ``world`` worker processes on a store hosted here; every process is reaped on return,
    and on the first failed rank the others are killed (no waiting on a collective's timeout)."""
    store, address = comm.host_store("127.0.0.1", timeout_s=timeout_s)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    try:
        for rank in range(world):
            args = {"rank": rank, "world": world, "store": list(address), "out_dir": str(out_dir), "cases": cases,
                    "fail_rank": fail_rank}
            logs.append(open(out_dir / f"rank{rank}.log", "w+b"))
            procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(args)], env=env,
                                          stdout=logs[-1], stderr=subprocess.STDOUT))
        result = while_running()
        deadline = time.monotonic() + timeout_s
        while None in [p.poll() for p in procs]:  # a list: poll every process, not the first running one
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed or any(p.returncode is None for p in procs):
            tails = []
            for r in failed or range(world):
                logs[r].seek(0)
                tails.append(f"rank {r} (exit {procs[r].returncode}):\n" + logs[r].read().decode()[-3000:])
            what = f"ranks {failed} failed" if failed else f"timed out after {timeout_s} s"
            raise RankFailed("\n".join([what, *tails]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=10)
        for log in logs:
            log.close()
        del store
    return [load_file(out_dir / f"rank{r}.safetensors") for r in range(world)], result


def _references() -> dict[tuple[int, int], tuple]:
    """The single-process stack's outputs, usage and KV, per (heads, kv_heads): no CP, no TP."""
    out = {}
    for case in CASES.values():
        key = (case["heads"], case["kv_heads"])
        if key not in out:
            out[key] = cp_scenario.run(case, cp_scenario.build_layers(case))
    return out


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    return launch(WORLD, CASES, tmp_path_factory.mktemp("cp"), while_running=_references)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_matches_the_single_process_stack(world_run, name):
    ranks, references = world_run
    case = CASES[name]
    want = references[(case["heads"], case["kv_heads"])][0]
    for rank, got in enumerate(ranks):
        for step, expected in enumerate(want):
            # float32 throughout: the sums differ only in order (TP all-reduce, LSE combine).
            torch.testing.assert_close(got[f"{name}/{step}"], expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}, rank {rank}, step {step}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_stores_its_share_of_the_kv(world_run, name):
    ranks, _ = world_run
    case = CASES[name]
    cp, stage = case["pcp"] * case["dcp"], case["tp"] * case["pcp"]
    for first in range(0, WORLD, stage):
        # The ranks of one TP index's CP group (tp index 0) split every request's tokens.
        members = [first + p * case["tp"] + d for p in range(case["pcp"]) for d in range(case["dcp"])]
        usage = torch.stack([ranks[r][f"{name}/usage"] for r in members])  # [cp, steps, 3]
        assert torch.equal(usage[:, :, 1].sum(0), usage[0, :, 2])  # slots filled add up to the tokens
        lengths: dict[str, int] = {}
        for step, (free, prefills, decodes) in enumerate(cp_scenario.SCRIPT):
            for rid in free:
                del lengths[rid]
            lengths.update({rid: sum(cp_scenario.chunk(p)) for rid, p in prefills.items()})
            lengths.update({rid: lengths[rid] + 1 for rid in decodes})
            blocks = sum(-(-n // (cp_scenario.BLOCK_SIZE * cp)) for n in lengths.values())
            assert usage[:, step, 0].tolist() == [blocks] * cp, (name, step)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_hands_off_its_share_and_the_shares_merge_into_the_single_process_kv(world_run, name):
    """Every live request's KV leaves each rank as that rank's share (its KV heads, the positions its
    CP rank owns); the shares of one stage merge into the KV the single process holds, and the
    single process's KV cut into a rank's share is what that rank holds."""
    ranks, references = world_run
    case = CASES[name]
    whole_kv = references[(case["heads"], case["kv_heads"])][2]
    size, cfg = case["tp"] * case["pcp"], cp_scenario.config(case)
    live = sorted({key.split("/")[0] for key in whole_kv})
    assert live and all(f"{name}/kv/{rid}/k" in ranks[0] for rid in live)
    for replica, first in enumerate(range(0, WORLD, size)):
        interleave = case["interleave"][replica]
        for rid in live:
            whole = KVHandoff(request_id=0, layers=(0, cp_scenario.LAYERS), num_tokens=whole_kv[f"{rid}/k"].size(1),
                              k=whole_kv[f"{rid}/k"], v=whole_kv[f"{rid}/v"])
            shares = []
            for rank in range(first, first + size):
                tp_rank = (rank - first) % case["tp"]
                heads = kv_heads_of_rank(cfg, tp_rank, case["tp"])
                share = KVShard(kv_heads=(heads.start, heads.stop), num_kv_heads=case["kv_heads"],
                                cp_world_size=case["pcp"] * case["dcp"], cp_rank=int(ranks[rank][f"{name}/cp_rank"]),
                                interleave_size=interleave)
                shares.append(KVHandoff(request_id=0, layers=whole.layers, num_tokens=whole.num_tokens, shard=share,
                                        k=ranks[rank][f"{name}/kv/{rid}/k"], v=ranks[rank][f"{name}/kv/{rid}/v"]))
                cut = split_handoff(whole, share)
                torch.testing.assert_close(shares[-1].k, cut.k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(shares[-1].v, cut.v, rtol=1e-5, atol=1e-5)
            merged = merge_handoffs(shares)
            torch.testing.assert_close(merged.k, whole.k, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {rid}: {m}")
            torch.testing.assert_close(merged.v, whole.v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {rid}: {m}")


def test_a_failing_rank_is_reported_and_every_process_reaped(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 fails on purpose"):
        launch(2, {"dcp2_mqa": CASES["dcp2_mqa"]}, tmp_path, fail_rank=1, timeout_s=60)
    assert time.monotonic() - start < 30
