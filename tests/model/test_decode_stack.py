"""The C++ layer loop (model/decode_stack.py, csrc/bindings/decoder_stack.cpp) against the Python
layers it stands in for: the same ops in the same order, so decode steps and steps with prompt
rows give the same bits — the logits, the hidden states a stage sends on, and every K/V it writes.
Weights: dense (float32 and bfloat16, Llama with biases, Qwen3's q/k norms) and GGUF blocks (exact
and int8), stages first, middle and last, with decode rows at different context lengths. A step
that mixes runs of tokens after their request's cache (verifying drafts, a later prompt chunk)
with a decode row attends the runs through extend_attention, the step's K/V written first, in
both: the same bits too, over a float32 cache and a compact int8 one."""

from __future__ import annotations

import pytest
import torch

from stagewise import ops
from stagewise.measure.framework import tiny_config, tiny_weights
from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.hf_config import parse_hf_config
from stagewise.model.quant import QuantizedWeight
from stagewise.model.stage import StageModel

BLOCK = 4
PROMPTS = ([5, 9, 2, 7, 1, 3], [4], [8, 8, 6, 1, 2, 9, 9, 3, 2, 1, 5])


def _hf_weights(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=64)
    if kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=32))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, attention_bias=True, mlp_bias=True))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return parse_hf_config(hf.config.to_dict()), hf.state_dict()


def _model(kind: str):
    """(config, weights, dtype) of a case."""
    if kind in ("q4_1", "q4_1-int8"):
        cfg = tiny_config(3, hidden=128, intermediate=256, heads=4, kv_heads=2)
        weights = tiny_weights(cfg)
        if kind.endswith("int8"):
            weights = {k: w.with_precision("int8") if isinstance(w, QuantizedWeight) else w for k, w in weights.items()}
        # Tied: a last stage that does not embed reads the LM head under its own name, as the loader gives it.
        return cfg, {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}, torch.float32
    cfg, weights = _hf_weights("qwen3" if kind == "qwen3" else "llama")
    return cfg, weights, torch.bfloat16 if kind == "llama-bf16" else torch.float32


def _run(stage: StageModel, dtype, hidden_in: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A prefill of every prompt, then 4 decode steps of every row; (step outputs, final cache)."""
    cfg = stage.config
    manager = KVCacheManager(block_size=BLOCK, num_blocks=32, max_blocks_per_seq=8)
    cache = KVCache(stage.kv_cache_spec(BLOCK, dtype), num_blocks=32)
    cache.storage.fill_(float("nan"))  # slots nobody wrote must never be read
    g = torch.Generator().manual_seed(3)
    outs, lens = [], [len(p) for p in PROMPTS]
    for step in range(5):
        prefill = step == 0
        n = sum(lens) if prefill else len(PROMPTS)
        positions = torch.cat([torch.arange(k) for k in lens]) if prefill else torch.tensor(lens)
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        inputs = (dict(hidden_states=torch.randn(n, cfg.hidden_size, generator=g).to(dtype),
                       residual=torch.randn(n, cfg.hidden_size, generator=g).to(dtype)) if hidden_in
                  else dict(token_ids=tokens))
        batch = StepBatch(request_ids=[0, 1, 2], num_prefills=3 if prefill else 0,
                          query_lens=lens if prefill else [1, 1, 1], context_lens=[0, 0, 0] if prefill else lens,
                          positions=positions, **inputs)
        for rid, k in enumerate(lens):
            manager.add(rid, k) if prefill else manager.append(rid)
        outs.append(stage(batch, cache, KVMetadata.build(batch, manager, "cpu")))
        if not prefill:
            lens = [k + 1 for k in lens]
    return outs, cache.storage


@pytest.mark.parametrize("part", ["whole", "first", "middle", "last"])
@pytest.mark.parametrize("kind", ["q4_1", "q4_1-int8", "llama-bias", "llama-bf16", "qwen3"])
def test_decode_stack_equals_python_layers(kind, part):
    cfg, weights, dtype = _model(kind)
    start, end = {"whole": (0, 3), "first": (0, 2), "middle": (1, 2), "last": (1, 3)}[part]
    stage = StageModel.from_weights(cfg, start, end, weights, dtype=dtype)
    assert stage.decode_stack is not None and stage.decode_stack.num_layers() == end - start
    fast = _run(stage, dtype, hidden_in=start > 0)
    stack, stage.decode_stack = stage.decode_stack, None
    slow = _run(stage, dtype, hidden_in=start > 0)
    stage.decode_stack = stack
    for a, b in zip(fast[0], slow[0]):
        assert torch.equal(a, b)
    assert torch.equal(fast[1].nan_to_num(), slow[1].nan_to_num())  # the same K/V, written in the same slots
    assert fast[0][-1].isfinite().all()


def _verify_step(stage: StageModel, hidden_in: bool, kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts, then one step in which request 0 verifies 3 drafts, request 1 one, request 2
    decodes; (that step's output, the cache's storage)."""
    cfg = stage.config
    manager = KVCacheManager(block_size=BLOCK, num_blocks=32, max_blocks_per_seq=8)
    cache = KVCache(stage.kv_cache_spec(BLOCK, torch.float32, kv_cache_dtype), num_blocks=32)
    cache.storage.fill_(float("nan") if kv_cache_dtype == "auto" else 0)
    g = torch.Generator().manual_seed(5)
    lens = [len(p) for p in PROMPTS]
    out = None
    for prefill, query, drafts in ((True, lens, None), (False, [4, 2, 1], ((1, 2, 3), (4,), ()))):
        n = sum(query)
        positions = torch.cat([torch.arange(k) for k in lens]) if prefill else \
            torch.cat([torch.arange(c, c + q) for c, q in zip(lens, query)])
        inputs = (dict(hidden_states=torch.randn(n, cfg.hidden_size, generator=g)) if hidden_in
                  else dict(token_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g)))
        batch = StepBatch(request_ids=[0, 1, 2], num_prefills=3 if prefill else 2, query_lens=query,
                          context_lens=[0, 0, 0] if prefill else lens, positions=positions, draft_tokens=drafts,
                          **inputs)
        for rid, (c, q) in enumerate(zip(lens, query)):
            manager.add(rid, c) if prefill else manager.append(rid, q)
        out = stage(batch, cache, KVMetadata.build(batch, manager, "cpu"))
    return out, cache.storage


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("part", ["whole", "last", "middle"])
@pytest.mark.parametrize("kind", ["q4_1", "llama-bias", "qwen3"])
def test_verifying_steps_through_the_stack_equal_the_python_layers(kind, part, kv_cache_dtype):
    cfg, weights, dtype = _model(kind)
    start, end = {"whole": (0, 3), "middle": (1, 2), "last": (1, 3)}[part]
    stage = StageModel.from_weights(cfg, start, end, weights, dtype=dtype)
    calls = []
    real = stage.decode_stack
    stage.decode_stack = type("Spy", (), {"__getattr__": lambda _, name: calls.append(name) or getattr(real, name)})()
    fast = _verify_step(stage, hidden_in=start > 0, kv_cache_dtype=kv_cache_dtype)
    assert calls == ["extend", "extend"]
    stage.decode_stack = None
    slow = _verify_step(stage, hidden_in=start > 0, kv_cache_dtype=kv_cache_dtype)
    if end == cfg.num_layers:
        assert fast[0].shape == (4 + 2 + 1, cfg.vocab_size)  # logits at every verified position
    assert torch.equal(fast[0], slow[0])
    assert torch.equal(fast[1].nan_to_num(), slow[1].nan_to_num())


def test_no_stack_where_the_architecture_says_why():
    """Falcon's entry states why the loop does not take its layers; the stage says so."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2))
    cfg = parse_hf_config(hf.config.to_dict())
    stage = StageModel.from_weights(cfg, 0, 2, hf.state_dict())
    assert stage.decode_stack is None
    assert stage.python_loop_reason.startswith("falcon: LayerNorms with biases")


def test_a_layer_the_stack_cannot_run_is_an_error():
    """Where the architecture says the loop takes its layers, a layer it cannot run fails loudly rather
    than falling back to the Python loop."""
    from stagewise.model.decode_stack import build_decode_stack

    cfg = tiny_config(2)
    stage = StageModel.from_weights(cfg, 0, 2, tiny_weights(cfg))
    assert stage.python_loop_reason is None and stage.decode_stack is not None
    layers = list(stage.layers)
    layers[1].post_norm = torch.nn.LayerNorm(cfg.hidden_size)
    with pytest.raises(ValueError, match=r"cannot run layer 1 of the stage: post_norm is a LayerNorm \(it runs "
                                         r"RMSNorm\)\. An architecture whose layers it does not run says why"):
        build_decode_stack(layers, cfg.activation)
    with pytest.raises(ValueError, match=r"layer 0 of the stage: activation 'gelu_fast'"):
        build_decode_stack(layers, "gelu_fast")
    layers[1].post_norm = stage.layers[0].post_norm
    layers[0].attn.unit_offset_qk_norm = True
    with pytest.raises(ValueError, match=r"layer 0 of the stage: norms that scale by 1 \+ w \(unit_offset"):
        build_decode_stack(layers, cfg.activation)


def test_stack_refuses_a_cache_of_other_layers():
    cfg = tiny_config(2)
    stage = StageModel.from_weights(cfg, 0, 2, tiny_weights(cfg))
    x = torch.zeros(1, cfg.hidden_size)
    kv = torch.zeros(3, 2, 4, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match=r"DecoderStack.decode: kv must be \[2, 2, blocks, block_size, Hk, D\]"):
        stage.decode_stack.decode(x, x.clone(), True, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                  torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), kv, None)
    kv = torch.zeros(2, 2, 4, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"DecoderStack.extend: the runs' 3 rows of x \(1\) and its other rows need"):
        stage.decode_stack.extend(x, x.clone(), True, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                  tables, lens, torch.tensor([0, 3], dtype=torch.int32), lens, kv, None)
    with pytest.raises(ValueError, match=r"DecoderStack.extend: query_start_loc must be a CPU tensor \[P \+ 1\] of "
                                         r"at least one run, got \[1\]"):
        stage.decode_stack.extend(x, x.clone(), True, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                  tables, lens, torch.zeros(1, dtype=torch.int32), lens, kv, None)
    assert ops.cpu_isa() in ("baseline", "avx2", "avx512", "avx512vnni")


def test_generation_never_reads_unwritten_kv():
    """The KV pool is not zeroed (kv/cache.py): requests that come and go over a NaN-filled pool,
    reusing each other's blocks, give the tokens they give over a zeroed one."""
    from stagewise.engine.engine import Engine
    from stagewise.engine.sampling import SamplingParams

    cfg = tiny_config(2)
    weights = tiny_weights(cfg)
    runs = []
    for fill in (0.0, float("nan")):
        engine = Engine.for_model(StageModel.from_weights(cfg, 0, 2, weights), max_num_seqs=2, max_model_len=64,
                                  max_num_tokens=96, block_size=BLOCK)
        engine.executor.kv_cache.storage.fill_(fill)
        done = []
        for rid, prompt in enumerate(([3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2, 3])):
            engine.add_request(rid, prompt, SamplingParams(max_new_tokens=6 + rid, temperature=0.0, ignore_eos=True))
            if rid % 2:
                while engine.has_unfinished():
                    done += engine.step()
        runs.append(sorted((o.request_id, o.token_ids) for o in done))
    assert runs[0] == runs[1] and len(runs[0]) == 4

