"""A compact KV cache in the planner (``--kv-cache-dtype int8`` / ``fp8_e4m3``): one-byte codes and
a float16 scale per token and KV head, ``head_dim + 2`` bytes a row instead of ``head_dim x 4``
for a float32 model, priced by the runtime's own formula; the larger batch that fits; the flag, the
serving YAML's key, the reports and the validation record."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.cli import main as stagewise_main
from stagewise.kv.cache import KV_CACHE_DTYPES, KVCacheSpec
from stagewise.model import shapes
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import compute, memory
from stagewise.planner.estimate import Workload, estimate_layout
from stagewise.planner.models import resolve_model
from stagewise.planner.profiles import load_profile
from stagewise.planner.validate import Validation

# The search's workload at 4k context: 3,584 prompt and 512 new tokens a sequence.
AT_4K = ["--input-length", "3584", "--output-length", "512"]


@pytest.fixture(scope="module")
def configs() -> dict:
    """SmolLM2-135M (head_dim 64, 3 KV heads, 30 layers) and Qwen3-4B (128, 8, 36)."""
    return {name: resolve_model(name)[0] for name in ("smollm2-135m", "qwen3-4b")}


def _run(capsys, *argv):
    code = stagewise_main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_compact_kv_bytes_per_token_are_d_plus_2_over_4d_of_float32s(configs, kv_cache_dtype):
    for name, ratio in (("smollm2-135m", 66 / 256), ("qwen3-4b", 130 / 512)):
        config = configs[name]
        d = config.head_dim
        assert ratio == (d + 2) / (4 * d)
        f32 = shapes.kv_bytes_per_token_layer(config, 4)
        compact = shapes.kv_bytes_per_token_layer(config, 4, kv_cache_dtype=kv_cache_dtype)
        assert compact == 2 * config.num_kv_heads * (d + 2) and compact / f32 == ratio
        # The dtype a compact cache replaces does not matter: its codes are one byte whatever it was.
        assert shapes.kv_bytes_per_token_layer(config, 2, kv_cache_dtype=kv_cache_dtype) == compact
    assert 66 / 256 == pytest.approx(0.258, abs=5e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planner_prices_the_bytes_the_runtime_allocates(configs, dtype):
    """One block of the whole model's layers is what the planner says 16 tokens take, for each
    kv_cache_dtype: both sides size a row by kv_row_bytes."""
    config = configs["smollm2-135m"]
    for kv_cache_dtype in KV_CACHE_DTYPES:
        spec = KVCacheSpec(layer_start=0, layer_end=config.num_layers, num_kv_heads=config.num_kv_heads,
                           head_dim=config.head_dim, block_size=16, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        planned = memory.kv_bytes(config, range(config.num_layers), tokens=16, kv_bytes_per_elem=dtype.itemsize,
                                  kv_cache_dtype=kv_cache_dtype)
        assert planned == spec.bytes_per_block()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        memory.kv_bytes(config, range(2), tokens=16, kv_cache_dtype="int4")


@pytest.mark.parametrize(("model", "budget_gib", "batches"), [("smollm2-135m", 8, (42, 165)),
                                                              ("qwen3-4b", 80, (57, 227))])
def test_int8_fits_over_3_5_times_float32s_batch_at_4k_context(configs, model, budget_gib, batches):
    """A float32 model on one stage, sequences of 4,096 tokens: the weights first, then as many
    sequences' KV as the rest of the budget holds (SmolLM2: 0.54 GB of weights in 8 GiB; Qwen3-4B:
    16.1 GB in 80 GiB)."""
    config = configs[model]
    plan = StagePlan.for_model(config, 1)
    got = []
    for kv_cache_dtype in ("auto", "int8"):
        mem = memory.stage_memory(config, plan, tokens=4096, weight_bytes=4, kv_bytes_per_elem=4,
                                  kv_cache_dtype=kv_cache_dtype)
        got.append(memory.max_batch(mem, budget_gib * 2**30))
    assert tuple(got) == batches and got[1] >= 3.5 * got[0]  # 3.93x and 3.98x


def test_the_search_shows_the_compact_cache_and_the_larger_batch(capsys):
    """Qwen3-4B in float32 on one H100 at 4k context: KV per rank at 130 / 512 of float32's, over
    3.5x the batch, the workload naming the cache, and the confidence saying the record ran none."""
    rows = {}
    for kv_cache_dtype in ("auto", "int8"):
        code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "1", "--weight-dtype", "fp32", *AT_4K,
                            "--kv-cache-dtype", kv_cache_dtype, "--json")
        assert code == 0
        data = json.loads(out)
        assert data["workload"]["kv_cache_dtype"] == kv_cache_dtype
        [rows[kv_cache_dtype]] = data["layouts"]
    assert rows["int8"]["kv_bytes_per_rank"] / rows["auto"]["kv_bytes_per_rank"] == 130 / 512
    assert rows["int8"]["max_batch"] >= 3.5 * rows["auto"]["max_batch"] > 0
    assert "KV cache int8 not validated (only auto)" in rows["int8"]["confidence"]["not_validated_because"]
    assert not any("KV cache" in r for r in rows["auto"]["confidence"]["not_validated_because"])
    code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "1", *AT_4K, "--kv-cache-dtype", "fp8_e4m3")
    assert code == 0 and "KV fp8_e4m3 (+ float16 scales)" in out and "max batch" in out


def test_compact_rows_make_decode_attention_read_fewer_bytes(configs):
    """The cache an attention reads and a KV write stores, row by row as the cache keeps them."""
    config = configs["qwen3-4b"]
    ops = {}
    for kv_cache_dtype in ("auto", "int8"):
        prec = compute.Precision(weight=4, act=4, kv=4, compute_dtype="float32", kv_cache_dtype=kv_cache_dtype)
        ops[kv_cache_dtype] = {op.name: op for op in compute.layer_ops(
            config, 0, rows=1, new_tokens=1, context=4095, prec=prec, sharding=shapes.Sharding())}
    assert ops["int8"]["attention"].cache_bytes / ops["auto"]["attention"].cache_bytes == 130 / 512
    hk, d = config.num_kv_heads, config.head_dim
    assert ops["int8"]["kv_write"].bytes == 2 * hk * (d * 4 + d + 2)  # activations read, codes and scale stored
    profile, layout = load_profile("h100-sxm"), ParallelConfig(world_size=1)
    plain, compact = (estimate_layout(config, layout, Workload(input_length=3584, output_length=512, batch=16,
                                                               kv_cache_dtype=k), profile) for k in ("auto", "int8"))
    assert compact.tpot_s < plain.tpot_s  # decode streams the cache: fewer bytes, a shorter step
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        Workload(input_length=4, output_length=4, kv_cache_dtype="int4")


def test_plan_memory_names_the_cache_and_the_batch_that_fits(capsys):
    code, out, _ = _run(capsys, "memory", "smollm2-135m", "--stages", "1", "--max-ctx", "4096", "--weight-dtype",
                        "fp32", "--memory-gib", "8", "--json")
    assert code == 0
    plain = json.loads(out)
    code, out, _ = _run(capsys, "memory", "smollm2-135m", "--stages", "1", "--max-ctx", "4096", "--weight-dtype",
                        "fp32", "--memory-gib", "8", "--kv-cache-dtype", "int8", "--json")
    assert code == 0
    data = json.loads(out)
    assert (plain["kv_cache_dtype"], plain["kv_bytes_per_token_row"]) == ("auto", 256)
    assert (data["kv_cache_dtype"], data["kv_bytes_per_token_row"]) == ("int8", 66)
    [a], [b] = plain["plans"][0]["stages"], data["plans"][0]["stages"]
    assert b["kv_bytes"] / a["kv_bytes"] == 66 / 256 and b["kv_bytes"] == 30 * 2 * 3 * 66 * 4096
    assert (plain["plans"][0]["max_batch"], data["plans"][0]["max_batch"]) == (42, 165)
    code, out, _ = _run(capsys, "memory", "smollm2-135m", "--stages", "1", "--max-ctx", "4096", "--weight-dtype",
                        "fp32", "--memory-gib", "8", "--kv-cache-dtype", "int8")
    assert code == 0
    assert "KV as int8 codes and a float16 scale, 66 bytes a token row of a KV head" in out
    assert "| KV @ T=4096 (INT8, bytes) |" in out and "In 8 GiB a rank holds 165 sequences of 4,096 tokens." in out


@pytest.mark.parametrize("argv", [["qwen3-4b", "--num-devices", "1"], ["memory", "qwen3-4b", "--stages", "1"],
                                  ["validate", "smollm2-135m"]])
def test_a_bad_kv_cache_dtype_is_refused_naming_the_choices(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        stagewise_main(["plan", *argv, "--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int4' (choose from 'auto', 'int8', 'fp8_e4m3')" in err


@pytest.mark.parametrize("argv", [["qwen3-4b", "--num-devices", "1"], ["memory", "qwen3-4b", "--stages", "1"]])
def test_kv_dtype_beside_a_compact_cache_is_refused(capsys, argv):
    code, _, err = _run(capsys, *argv, "--kv-dtype", "fp32", "--kv-cache-dtype", "int8")
    assert code == 2 and "--kv-dtype fp32 and kv_cache_dtype int8 both say what K/V are stored as" in err
    code, _, err = _run(capsys, "memory", "qwen3-4b", "--stages", "1", "--memory-gib", "0")
    assert code == 2 and "--memory-gib must be a positive number, got 0.0" in err


def test_the_serving_yaml_kv_cache_dtype_is_honoured_and_the_command_line_wins(capsys, tmp_path):
    layout = "parallel_config:\n  world_size: 1\n"
    plain, compact, bad = (tmp_path / f"{n}.yaml" for n in ("plain", "compact", "bad"))
    plain.write_text(f"model: qwen3-4b\n{layout}")
    compact.write_text(f"model: qwen3-4b\nkv_cache_dtype: int8\n{layout}")
    bad.write_text(f"model: qwen3-4b\nkv_cache_dtype: int4\n{layout}")

    def kv(path, *extra) -> tuple[str, int]:
        code, out, err = _run(capsys, "--config", str(path), "--json", *extra)
        assert code == 0, err
        data = json.loads(out)
        return data["workload"]["kv_cache_dtype"], data["layouts"][0]["kv_bytes_per_rank"]

    (d0, auto), (d1, int8) = kv(plain), kv(compact)
    assert (d0, d1) == ("auto", "int8") and int8 / auto == 130 / (2 * 128)  # bf16 model: 2 bytes a value
    assert kv(compact, "--kv-cache-dtype", "auto") == ("auto", auto)
    assert kv(plain, "--kv-cache-dtype", "int8") == ("int8", int8)
    code, _, err = _run(capsys, "--config", str(bad))
    assert code == 2
    assert "field kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'" in err and str(bad) in err
    code, _, err = _run(capsys, "--config", str(compact), "--kv-dtype", "bf16")
    assert code == 2 and "--kv-dtype bf16 and kv_cache_dtype int8" in err


def test_a_record_of_int8_runs_covers_int8_predictions_only():
    base = {"range": {"stages": [1, 1], "batch": [1, 1], "input_length": [16, 16], "output_length": [4, 4],
                      "architectures": ["llama"], "profiles": ["p"]}, "expected_error_pct": {"tpot": 5.0},
            "model": "m", "date_utc": "today"}
    case = dict(tp=1, pp=1, batch=1, input_length=16, output_length=4, architecture="llama", profile_name="p",
                profile_kind="cpu")
    old = Validation(base)  # a record from before compact caches: K/V in the activations' dtype
    assert old.confidence(**case).validated
    assert old.confidence(**case, kv_cache_dtype="int8").not_validated_because == (
        "KV cache int8 not validated (only auto)",)
    record = Validation({**base, "workload": {"kv_cache_dtype": "int8"}})
    assert record.confidence(**case, kv_cache_dtype="int8").validated
    assert "KV cache auto not validated (only int8)" in record.confidence(**case).not_validated_because
    assert "int8 KV cache" in record.describe() and "KV cache" not in old.describe()
