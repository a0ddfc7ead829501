"""The runtime's Python and dispatch cost per decode step, for the planner's CPU model: what a node
profile (:mod:`stagewise.measure.node`) and ``stagewise bench profile`` both measure (the bench's
``framework`` group adds the Python layer loop's cost and the DCP combine on top).

``streamed_layer_s``: a synthetic llama whose weights stream through the caches
(:data:`STREAM_MODEL`): the step's wall time minus its kernels' self time (torch profiler), over
the layers. ``role_overheads``: the fixed part of one step per role, from a llama of negligible
width (hidden 64, vocab 512, Q4_1 linears, Q8_0 tied embedding) whose arithmetic is a few
microseconds: ``engine`` (the single-process engine: schedule, metadata, model, sample, record),
``head`` (stage 0's launch: schedule, metadata, embedding, its layers), ``middle`` and ``last`` (a
later stage's executor: KV bookkeeping, metadata, layers; the last also final norm, LM head and
sampling) and ``tokens`` (stage 0 taking a step's sampled tokens back).
"""

from __future__ import annotations

import statistics
import time

import torch

from stagewise.measure.primitives import random_blocks

LAYERS_HI = 5
"""The larger of the two layer counts whose step times differ by the layers alone (the other: 1)."""


def tiny_config(num_layers: int, hidden: int = 64, intermediate: int = 128, heads: int = 2, kv_heads: int = 1):
    """A synthetic llama (head dim ``hidden / heads``); the default is of negligible width."""
    from stagewise.model.hf_config import parse_hf_config

    return parse_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "hidden_act": "silu"})


def tiny_weights(config) -> dict:
    """HF-named weights: Q4_1 linears, a Q8_0 tied embedding, float32 norms."""
    from stagewise import ops
    from stagewise.model.quant import QuantizedWeight

    gen = torch.Generator().manual_seed(0)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q4, q8 = ops.QTYPES["Q4_1"], ops.QTYPES["Q8_0"]

    def q(out: int, inp: int, qtype: int = q4) -> QuantizedWeight:
        return QuantizedWeight(random_blocks(out, inp, qtype, gen), qtype, inp)

    embedding = q(config.vocab_size, h, q8)
    # Tied, as the loader gives it: a last stage without the embedding holds the matrix as its LM head.
    w = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding, "model.norm.weight": torch.ones(h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        w |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": q(config.num_heads * d, h),
              p + "self_attn.k_proj.weight": q(config.num_kv_heads * d, h),
              p + "self_attn.v_proj.weight": q(config.num_kv_heads * d, h),
              p + "self_attn.o_proj.weight": q(h, config.num_heads * d),
              p + "mlp.gate_proj.weight": q(i, h), p + "mlp.up_proj.weight": q(i, h),
              p + "mlp.down_proj.weight": q(h, i)}
    return w


def median_step_s(fn, steps: int, before=None) -> float:
    """Median wall time of ``steps`` calls of ``fn``, each after an untimed ``before()`` when given."""
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tiny_engine(cfg, prompt: int, steps: int, weights: dict | None = None, python_loop: bool = False):
    """``python_loop``: decode steps through the Python layer loop, as a stage of several ranks
    runs them (the C++ decode loop cannot all-reduce), instead of the C++ one."""
    from stagewise.engine.engine import Engine
    from stagewise.engine.params import SamplingParams
    from stagewise.model.stage import StageModel

    weights = tiny_weights(cfg) if weights is None else weights
    model = StageModel.from_weights(cfg, 0, cfg.num_layers, weights)
    if python_loop:
        model.decode_stack = None
    eng = Engine.for_model(model, max_num_seqs=1, max_model_len=prompt + 2 * steps + 16)
    eng.add_request(0, list(range(1, prompt + 1)), SamplingParams(max_new_tokens=2 * steps + 8, temperature=0.0,
                                                                   ignore_eos=True))
    eng.step()  # prefill
    for _ in range(2):
        eng.step()
    return eng


def engine_step_s(layers: int, prompt: int, steps: int, python_loop: bool = False) -> float:
    """Median seconds of a decode step of the single-process engine on a negligible-width llama of
    ``layers`` layers (``python_loop``: through the Python layer loop)."""
    return median_step_s(_tiny_engine(tiny_config(layers), prompt, steps, python_loop=python_loop).step, steps)


KERNELS = ("stagewise::quant_linear", "stagewise::decode_attention")
"""The ops the planner times with their own primitives (``quant``, ``attention_decode``)."""
STREAM_MODEL = {"hidden": 512, "intermediate": 1536, "heads": 8, "kv_heads": 2, "layers": 24}
"""A synthetic llama whose Q4_1 weights (about 1.9 MB a layer, 45 MB in all) exceed the caches."""


def streamed_layer_s(prompt: int = 128, steps: int = 20, rounds: int = 7) -> dict:
    """The framework's cost per decoder layer when the layers' weights stream through the caches
    between its Python/dispatch work, as a real model's do (the negligible-width model keeps
    everything hot). Decode steps of :data:`STREAM_MODEL`, in ``rounds`` of two passes of
    ``steps / 2`` each of a new request (prompt ``prompt``): one timed (median wall time of a
    step), one under the torch profiler for the self time of :data:`KERNELS` per step (the profiler
    slows the Python around them, not the kernels); the median round's difference (over the layers:
    the caller's). Medians, as the validation compares with the median of runs."""
    from torch.profiler import ProfilerActivity, profile

    m = STREAM_MODEL
    cfg = tiny_config(m["layers"], m["hidden"], m["intermediate"], m["heads"], m["kv_heads"])
    weights = tiny_weights(cfg)
    step_runs, kernel_runs = [], []
    for _ in range(rounds):  # a new request each round: every round at the same contexts
        eng = _tiny_engine(cfg, prompt, steps, weights)
        step_runs.append(median_step_s(eng.step, steps // 2))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps // 2):
                eng.step()
        kernel_runs.append(sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in KERNELS) * 1e-6
                           / (steps // 2))
    per = sorted(a - b for a, b in zip(step_runs, kernel_runs))
    return {"step_s": statistics.median(step_runs), "kernels_s": statistics.median(kernel_runs),
            "framework_s": max(per[len(per) // 2], 0.0), "layers": m["layers"], "model": dict(m),
            "step_runs_s": step_runs, "kernel_runs_s": kernel_runs}


def _executor(cfg, start: int, end: int, max_model_len: int):
    from stagewise.engine.executor import Executor
    from stagewise.model.stage import StageModel

    model = StageModel.from_weights(cfg, start, end, tiny_weights(cfg))
    return Executor(model, num_blocks=64, block_size=16, max_model_len=max_model_len)


def _head_step_s(layers: int, prompt: int, steps: int) -> tuple[float, float]:
    """Stage 0 of a ``layers + 1``-layer model: (launch of a decode step, taking its tokens back)."""
    from stagewise.engine.engine import Engine
    from stagewise.engine.params import SamplingParams

    engine = Engine(_executor(tiny_config(layers + 1), 0, layers, prompt + steps + 8), max_num_seqs=1)
    engine.add_request(0, list(range(1, prompt + 1)), SamplingParams(max_new_tokens=steps + 8, temperature=0.0,
                                                                      ignore_eos=True))
    launch, back = [], []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        step, _ = engine.launch(0)
        t1 = time.perf_counter()
        engine.complete(0, step.step_id, step.batch.request_ids, [7] * len(step.batch.request_ids))
        t2 = time.perf_counter()
        if k >= 3:  # after the prefill and two warm-up decodes
            launch.append(t1 - t0)
            back.append(t2 - t1)
    return statistics.median(launch), statistics.median(back)


def _later_step_s(layers: int, last: bool, prompt: int, steps: int) -> float:
    """A later stage running ``layers`` layers (the last one: also final norm, LM head, sampling)."""
    from stagewise.engine.params import SamplingParams, SamplingRequest
    from stagewise.model.batch import StepBatch

    total = layers + 1 if last else layers + 2
    cfg = tiny_config(total)
    executor = _executor(cfg, 1, 1 + layers, prompt + steps + 8)
    h = cfg.hidden_size
    sampling = {0: SamplingRequest(SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True))}
    executor.run(StepBatch(request_ids=[0], num_prefills=1, query_lens=[prompt], context_lens=[0],
                           positions=torch.arange(prompt), hidden_states=torch.randn(prompt, h)), sampling)
    pos = [prompt]

    def one() -> None:
        executor.run(StepBatch(request_ids=[0], num_prefills=0, query_lens=[1], context_lens=[pos[0]],
                               positions=torch.tensor([pos[0]]), hidden_states=torch.randn(1, h)))
        pos[0] += 1

    for _ in range(2):
        one()
    return median_step_s(one, steps)


def role_overheads(prompt: int = 128, steps: int = 40, repeats: int = 5) -> dict:
    """The fixed part of one decode step (batch 1) of each stage role, ``engine_s``, ``head_s``,
    ``middle_s``, ``last_s`` and ``tokens_s`` (see the module doc), each the least disturbed of
    ``repeats`` medians (this machine is shared); ``raw``: what they come from, with the hot-cache
    cost of a layer (``hot_layer_s``) that separates a step's layers from its fixed part."""
    def med(fn):
        return min(fn() for _ in range(repeats))

    lo, hi = 1, LAYERS_HI
    eng = {n: med(lambda n=n: engine_step_s(n, prompt, steps)) for n in (lo, hi)}
    hot_layer = max((eng[hi] - eng[lo]) / (hi - lo), 0.0)
    head_runs = [_head_step_s(lo, prompt, steps) for _ in range(repeats)]
    head = min(r[0] for r in head_runs)
    tokens = min(r[1] for r in head_runs)
    middle = med(lambda: _later_step_s(lo, False, prompt, steps))
    last = med(lambda: _later_step_s(lo, True, prompt, steps))
    return {"engine_s": max(eng[lo] - lo * hot_layer, 0.0), "head_s": max(head - lo * hot_layer, 0.0),
            "middle_s": max(middle - lo * hot_layer, 0.0), "last_s": max(last - lo * hot_layer, 0.0),
            "tokens_s": tokens,
            "raw": {"engine_step_s": eng, "head_launch_s": head, "middle_run_s": middle, "last_run_s": last,
                    "model": "llama hidden 64, vocab 512, Q4_1 linears, Q8_0 embedding", "prompt": prompt,
                    "hot_layer_s": hot_layer}}
