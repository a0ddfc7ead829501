"""KV handoff out of stages of several ranks: a rank's share of a request's KV (its KV heads, the
positions its CP rank owns) against the slot-mapping op, the shares cut from and merged back into
the whole, the frame of a share, and an executor of one rank of a TP x DCP stage taking a whole
handoff and giving back its share. Real ranks storing real steps' KV are compared with the single
process in tests/model/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.groups import NoCollectives

from stagewise import ops
from stagewise.engine.executor import Executor
from stagewise.engine.handoff import KVHandoff, KVShard, merge_handoffs, split_handoff
from stagewise.engine.params import SamplingParams
from stagewise.model.collectives import StageGroups
from stagewise.model.stage import load_stage
from stagewise.pipeline import handoff_frames
from stagewise.pipeline.protocol import ProtocolError
from stagewise.transport import decode_frame, encode_frame

# (tp, dcp, pcp, model KV heads, interleave): heads split, replicated, and sharded along the sequence.
LAYOUTS = [(2, 1, 1, 4, 1), (4, 1, 1, 2, 1), (2, 2, 1, 1, 4), (4, 2, 1, 2, 2), (1, 1, 2, 2, 8), (2, 2, 2, 1, 1),
           (1, 1, 3, 1, 2)]


def _shards(tp: int, dcp: int, pcp: int, hk: int, interleave: int) -> list[KVShard]:
    """Every rank's share, in the stage's rank order (PCP-major, then TP; DCP ranks are adjacent TP ranks)."""
    out = []
    for p in range(pcp):
        for t in range(tp):
            head = t * hk // tp if hk < tp else t * (hk // tp)
            width = max(1, hk // tp)
            out.append(KVShard(kv_heads=(head, head + width), num_kv_heads=hk, cp_world_size=pcp * dcp,
                               cp_rank=p * dcp + t % dcp, interleave_size=interleave))
    return out


def _whole(hk: int, n: int = 53, layers: int = 2, d: int = 8) -> KVHandoff:
    g = torch.Generator().manual_seed(n)
    return KVHandoff(request_id=7, layers=(3, 3 + layers), num_tokens=n, k=torch.randn(layers, n, hk, d, generator=g),
                     v=torch.randn(layers, n, hk, d, generator=g), sampling=SamplingParams(seed=3))


@pytest.mark.parametrize("cp,interleave", [(2, 1), (2, 4), (3, 2), (4, 16)])
def test_a_share_holds_the_positions_the_slot_mapping_gives_its_rank_in_slot_order(cp, interleave):
    block, n = 16, 150
    blocks = -(-n // (block * cp))
    table = torch.arange(blocks, dtype=torch.int32)[None]
    positions = torch.arange(n, dtype=torch.int64)
    held = []
    for rank in range(cp):
        slots = ops.slot_mapping(table, torch.zeros(n, dtype=torch.int32), positions, block, cp, rank, interleave)
        mine = slots >= 0
        order = torch.argsort(slots[mine])  # local slots in the order the rank fills them
        want = positions[mine][order]
        assert torch.equal(slots[mine][order], torch.arange(int(mine.sum())))  # filled without gaps
        got = KVShard(kv_heads=(0, 1), num_kv_heads=1, cp_world_size=cp, cp_rank=rank,
                      interleave_size=interleave).positions(n)
        assert torch.equal(got, want)
        held += got.tolist()
    assert sorted(held) == list(range(n))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_shares_of_every_rank_merge_back_into_the_whole(layout):
    whole = _whole(layout[3])
    shares = [split_handoff(whole, s) for s in _shards(*layout)]
    merged = merge_handoffs(shares[::-1])  # any order
    assert merged.shard is None and merged.num_tokens == whole.num_tokens
    assert torch.equal(merged.k, whole.k) and torch.equal(merged.v, whole.v)
    assert merged.sampling == whole.sampling
    # through the wire codec, as a KV_HANDOFF frame each
    frames = [handoff_frames.handoff_from_frame(decode_frame(encode_frame(handoff_frames.handoff_frame(s, stage=2))))
              for s in shares]
    assert [f.shard for f in frames] == [s.shard for s in shares]
    assert torch.equal(merge_handoffs(frames).k, whole.k)


def test_a_missing_or_foreign_share_is_named():
    whole = _whole(2)
    shares = [split_handoff(whole, s) for s in _shards(4, 2, 1, 2, 2)]
    with pytest.raises(ValueError, match=r"no share holds \(KV head, cp_rank\) \[\(1, 1\)\]"):
        merge_handoffs([s for s in shares if s.shard.kv_heads != (1, 2) or s.shard.cp_rank != 1])
    other = split_handoff(_whole(2, n=20), shares[0].shard)
    with pytest.raises(ValueError, match="is not a part of request 7 .* 53 tokens"):
        merge_handoffs([*shares, other])
    with pytest.raises(ValueError, match="already the share"):
        split_handoff(shares[0], shares[1].shard)
    with pytest.raises(ValueError, match="has 2 KV heads, the share .* is of 4"):
        split_handoff(whole, KVShard(kv_heads=(0, 1), num_kv_heads=4))
    with pytest.raises(ValueError, match=r"'k' must be \[layers, 27, 1, dim\] for 53 tokens"):
        KVHandoff(request_id=1, layers=(0, 2), num_tokens=53, k=whole.k[:, :, :1], v=whole.v[:, :, :1],
                  shard=shares[0].shard)
    with pytest.raises(ValueError, match="kv_heads .* within the model's 2"):
        KVShard(kv_heads=(1, 3), num_kv_heads=2)
    frame = handoff_frames.handoff_frame(shares[0], stage=1)
    frame.control["shard"]["cp_rank"] = 5
    with pytest.raises(ProtocolError, match=r"control\['shard'\]: KVShard: cp_rank 5 of cp_world_size 2"):
        handoff_frames.handoff_from_frame(frame)
    frame = handoff_frames.handoff_frame(shares[0], stage=1)
    frame.token_index = 52  # the share holds the positions of 53 tokens
    with pytest.raises(ProtocolError, match="tensors 'k'/'v'"):
        handoff_frames.handoff_from_frame(frame)


@pytest.fixture(scope="module")
def mqa_folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("mqa")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_rank_of_a_tp_dcp_stage_takes_its_share_of_a_whole_handoff_and_gives_it_back(mqa_folder):
    """A whole request (e.g. from a stage of one process) moves into rank (tp 1, dcp 1) of a
    tp=2, dcp=2 stage of an MQA model: the rank keeps the positions it owns, and exports them."""
    groups = StageGroups(tp=NoCollectives(2, 1), dcp=NoCollectives(2, 1))
    rank = Executor(load_stage(mqa_folder, 0, 2, dtype="float32", groups=groups), num_blocks=8, block_size=4,
                    max_model_len=64, interleave_size=2)
    assert rank.shard() == KVShard(kv_heads=(0, 1), num_kv_heads=1, cp_world_size=2, cp_rank=1, interleave_size=2)
    whole = _whole(1, n=21, d=8)
    whole = KVHandoff(request_id=3, layers=(0, 2), num_tokens=21, k=whole.k, v=whole.v,
                      sampling=SamplingParams(temperature=0.5, seed=9))
    rank.import_request(whole)
    assert rank.manager.num_tokens(3) == 21 and len(rank.manager.block_ids(3)) == 3  # virtual blocks of 8
    share = rank.export_request(3)
    assert share.shard == rank.shard() and share.num_tokens == 21
    assert share.sampling is None  # rank 1 does not sample: the leader keeps the sampling state
    expected = split_handoff(whole, rank.shard())
    assert torch.equal(share.k, expected.k) and torch.equal(share.v, expected.v)
    assert share.k.size(1) == 10  # positions 2, 3, 6, 7, ..., 18, 19
    rank.free([3])
    rank.import_request(share)  # the same share comes back to the same rank
    with pytest.raises(ValueError, match="the handoff is the share .* this rank holds .*merge the shares"):
        rank.import_request(split_handoff(KVHandoff(request_id=4, layers=(0, 2), num_tokens=21, k=whole.k,
                                                    v=whole.v), KVShard(kv_heads=(0, 1), num_kv_heads=1,
                                                                        cp_world_size=2, cp_rank=0,
                                                                        interleave_size=2)))
    assert 4 not in rank.manager
