"""Planner memory: the rough capacity-planning tables of Qwen3-VL-235B-A22B exactly, exact tensor
counts against transformers, what the edge stages own, and stage-local KV."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.model import shapes
from stagewise.model.config import ModelConfig, MoEConfig
from stagewise.model.hf_config import parse_config_file
from stagewise.parallel.plan import StagePlan
from stagewise.planner import cli
from stagewise.planner.memory import kv_bytes, nominal_params, stage_memory
from stagewise.planner.models import MODELS_DIR

QWEN3_VL = MODELS_DIR / "qwen3-vl-235b-a22b.json"

# The rough tables for Qwen3-VL-235B-A22B (94 layers, even partition, BF16, batch 1, KV at
# max_ctx = 262,144 tokens, ~235B params by name) the planner must print, cell for cell.
ROUGH_TABLES = {
    2: """
| 0 | [0, 47)  | 47 | ~235 GB | ~23.5 GiB |
| 1 | [47, 94) | 47 | ~235 GB | ~23.5 GiB |""",
    4: """
| 0 | [0, 24)  | 24 | ~120 GB | ~12.0 GiB |
| 1 | [24, 48) | 24 | ~120 GB | ~12.0 GiB |
| 2 | [48, 71) | 23 | ~115 GB | ~11.5 GiB |
| 3 | [71, 94) | 23 | ~115 GB | ~11.5 GiB |""",
    8: """
| 0 | [0, 12)  | 12 | ~60 GB  | ~6.0 GiB |
| 1 | [12, 24) | 12 | ~60 GB  | ~6.0 GiB |
| 2 | [24, 36) | 12 | ~60 GB  | ~6.0 GiB |
| 3 | [36, 48) | 12 | ~60 GB  | ~6.0 GiB |
| 4 | [48, 60) | 12 | ~60 GB  | ~6.0 GiB |
| 5 | [60, 72) | 12 | ~60 GB  | ~6.0 GiB |
| 6 | [72, 83) | 11 | ~55 GB  | ~5.5 GiB |
| 7 | [83, 94) | 11 | ~55 GB  | ~5.5 GiB |""",
}
ROUGH_HEADER = "| Stage | Decoder layers | #layers | Weights (BF16, rough) | KV @ max_ctx (BF16, rough) |"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_rough_tables_reproduced_by_the_cli(capsys):
    assert cli.main(["memory", str(QWEN3_VL), "--stages", "2", "4", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    headers = [i for i, line in enumerate(out) if line.startswith("| Stage | Decoder layers | #layers | Weights (BF16, rough)")]
    assert len(headers) == 3
    for i, S in zip(headers, (2, 4, 8)):
        assert _cells(out[i]) == _cells(ROUGH_HEADER)
        expected = [_cells(line) for line in ROUGH_TABLES[S].strip().splitlines()]
        assert [_cells(line) for line in out[i + 2:i + 2 + S]] == expected
        assert not out[i + 2 + S].startswith("| ")  # exactly S rows


def test_kv_formula_and_json():
    # 2 (K+V) * 4 heads * 128 * 2 bytes = 2048 bytes per layer and token; 47 layers at 262144 tokens.
    config = parse_config_file(QWEN3_VL)
    assert kv_bytes(config, range(47), tokens=262_144) == 2048 * 47 * 262_144
    assert kv_bytes(config, range(47), tokens=262_144, batch=3, kv_bytes_per_elem=1) == 2048 // 2 * 47 * 262_144 * 3
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        kv_bytes(config, range(4), tokens=-1)


def test_memory_json_schema(capsys):
    assert cli.main(["memory", str(QWEN3_VL), "--stages", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [plan] = data["plans"]
    assert plan["num_stages"] == 4
    s2 = plan["stages"][2]
    keys = {"stage", "start_layer", "end_layer", "num_layers", "weight_bytes_rough", "weight_bytes_exact", "kv_bytes"}
    assert keys <= set(s2)
    assert (s2["start_layer"], s2["end_layer"], s2["num_layers"]) == (48, 71, 23)
    assert s2["weight_bytes_rough"] == 235e9 * 2 * 23 // 94 == 115e9
    assert s2["kv_bytes"] == 2048 * 23 * 262_144
    assert sum(s["weight_bytes_exact"] for s in plan["stages"]) == 2 * 235_670_022_896


def test_nominal_params_from_names():
    assert nominal_params("qwen3-vl-235b-a22b") == 235e9
    assert nominal_params("Qwen3-VL-235B-A22B-Instruct") == 235e9
    assert nominal_params("falcon-40b") == 40e9
    assert nominal_params("qwen3-4b.json") == 4e9
    assert nominal_params("qwen3") is None and nominal_params(None) is None


def _hf_param_count(path) -> int:
    """Parameters of the transformers model built from the same config (meta device: no memory)."""
    transformers = pytest.importorskip("transformers")
    d = json.loads(path.read_text())
    cfg = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        if d["model_type"].startswith("qwen3_vl"):
            model = transformers.AutoModelForImageTextToText.from_config(cfg)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-vl-235b-a22b"])
def test_exact_count_equals_transformers(name):
    path = MODELS_DIR / f"{name}.json"
    config = parse_config_file(path)
    assert shapes.count(config, shapes.model_tensors(config)) == _hf_param_count(path)


def test_falcon_count_equals_transformers(tmp_path):
    # Falcon-40B's layout (new decoder architecture, grouped KV, two layer norms), small.
    d = json.loads((MODELS_DIR / "falcon-40b.json").read_text())
    d.update(hidden_size=256, num_attention_heads=8, num_kv_heads=2, num_hidden_layers=3, vocab_size=1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    config = parse_config_file(path)
    assert shapes.count(config, shapes.model_tensors(config)) == _hf_param_count(path)


def _tiny(**kw) -> ModelConfig:
    base = dict(architecture="qwen3", vocab_size=100, hidden_size=16, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=8, intermediate_size=32, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


def test_stage_ownership_and_hand_counts():
    # Per layer: norms 2*16, q 32*16, k 16*16, v 16*16, o 16*32, q/k norm 2*8, gate/up/down 3*32*16
    layer = 2 * 16 + 32 * 16 + 16 * 16 + 16 * 16 + 16 * 32 + 2 * 8 + 3 * 32 * 16
    emb, head, norm = 100 * 16, 100 * 16, 16
    config = _tiny()
    plan = StagePlan.build(4, 3, "even")  # 2, 1, 1 layers
    assert shapes.stage_param_counts(config, plan.ranges) == [emb + 2 * layer, layer, layer + norm + head]
    one = StagePlan.build(4, 1)
    assert shapes.stage_param_counts(config, one.ranges) == [emb + 4 * layer + norm + head]
    tied = _tiny(tie_word_embeddings=True)
    # Tied: one stage stores the matrix once; a pipeline's last stage holds its own copy.
    assert shapes.stage_param_counts(tied, one.ranges) == [emb + 4 * layer + norm]
    assert shapes.stage_param_counts(tied, plan.ranges)[-1] == layer + norm + head


def test_tensor_parallel_shards_by_hand():
    config = _tiny()
    s2 = shapes.Sharding(tp=2)
    # q, o, gate, up, down halved; k, v: 1 of 2 KV heads; norms replicated; embedding, LM head vocab-split.
    layer = 2 * 16 + 16 * 16 + 8 * 16 + 8 * 16 + 16 * 16 + 2 * 8 + 3 * 16 * 16
    assert shapes.count(config, shapes.layer_tensors(config, 0), s2) == layer
    s4 = shapes.Sharding(tp=4)  # TP beyond the 2 KV heads: each rank keeps one KV head
    layer4 = 2 * 16 + 8 * 16 + 8 * 16 + 8 * 16 + 16 * 8 + 2 * 8 + 3 * 8 * 16
    assert shapes.count(config, shapes.layer_tensors(config, 0), s4) == layer4
    assert shapes.count(config, shapes.lm_head_tensors(config), shapes.Sharding(tp=3)) == 34 * 16
    with pytest.raises(ValueError, match="tp=3 must divide num_attention_heads=4"):
        shapes.check_sharding(config, shapes.Sharding(tp=3))


def test_moe_layer_counts_and_expert_parallel():
    config = _tiny(architecture="qwen3_moe",
                   moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=4, mlp_only_layers=(0,)))
    attn = 2 * 16 + 32 * 16 + 16 * 16 + 16 * 16 + 16 * 32 + 2 * 8
    assert shapes.count(config, shapes.layer_tensors(config, 0)) == attn + 3 * 32 * 16  # dense by mlp_only_layers
    moe = attn + 8 * 16 + 8 * 3 * 4 * 16
    assert shapes.count(config, shapes.layer_tensors(config, 1)) == moe
    assert shapes.count(config, shapes.layer_tensors(config, 1), shapes.Sharding(ep=4)) == attn + 8 * 16 + 2 * 3 * 4 * 16
    # A decoded token reads the dense weights, the router and 2 of the 8 experts.
    assert shapes.decode_read_params(config, 1) == attn - 2 * 16 - 2 * 8 + 8 * 16 + 2 * 3 * 4 * 16


def test_kv_only_counts_the_stage_layers_and_empty_stages():
    config = _tiny(num_layers=3)
    plan = StagePlan.build(3, 5, "ceil", allow_empty=True)  # S > L leaves later stages empty
    mem = stage_memory(config, plan, tokens=10, batch=2)
    per_layer_token = 2 * 2 * 8 * 2
    assert [m.kv_bytes for m in mem] == [per_layer_token * 10 * 2] * 3 + [0, 0]
    assert [m.num_layers for m in mem] == [1, 1, 1, 0, 0]
    assert mem[3].weight_bytes_exact == 0 and mem[4].owns == ("final_norm", "lm_head")
    assert mem[4].weight_bytes_exact == 2 * (16 + 100 * 16)
