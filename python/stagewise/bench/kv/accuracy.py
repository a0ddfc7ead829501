"""``stagewise bench kv --parts accuracy``: the error of the compact KV cache (int8, fp8_e4m3) against
the cache in the activations' dtype (``auto``), beside llama.cpp's q8_0 cache against its f16 one.

The text (``us_constitution.txt`` beside this module) is the Constitution of the United States, its
seven articles, the signatures and the 27 amendments, as transcribed by the US National Archives:
a work of the US government, in the public domain. It was written into the package from memory of
that transcription (spelling such as "chuse" and "Controul" kept); a slip in it would change the
figures' baseline, never the comparison, which runs every cache on the same token ids.

What is measured, each cache on the same ids (the text's own tokens, SmolLM2's tokenizer):

- perplexity, teacher-forced: the text's first 8,192 tokens (SmolLM2's whole context, at most
  ``max_position_embeddings``; the text repeated when shorter) fed as one request in steps of 1
  token, then 256 tokens each (decode-style: every step after the first attends over the tokens
  before it through the cache, so a compact cache is read, its own step's K/V included), logits
  of every token. Ours drives the :class:`~stagewise.model.stage.StageModel` with its paged cache
  directly (the runtime has no prompt logprobs), as ``tests/model`` do; llama.cpp runs
  ``llama_decode`` on the same steps with logits on every token, flash attention on (its quantised
  V cache needs it);
- the logprob error of those tokens against the float cache over two windows of positions:
  1k-2k and 7k-8k tokens of context (mean and max absolute difference, and how often the most
  likely next token is the same);
- greedy agreement: the 8 chat questions of ``bench e2e`` (:data:`~stagewise.bench.e2e.compare.QUESTIONS`),
  64 tokens each through :class:`stagewise.Pipeline` with each cache: the tokens identical before
  the first divergence, and whether the whole answer is.

``--tiny``: 384 tokens in steps of 128, one question, 8 tokens (the numbers mean nothing).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

TEXT_PATH = Path(__file__).with_name("us_constitution.txt")
TEXT_SOURCE = ("the Constitution of the United States with its 27 amendments (a US government work, public "
               "domain), as transcribed by the National Archives")
CHUNK, NEW_TOKENS, MAX_TOKENS = 256, 64, 8192
TINY = {"tokens": 384, "chunk": 128, "questions": 1, "new_tokens": 8}


def text_ids(tokenizer) -> list[int]:
    """The shipped text's token ids (no special tokens)."""
    return tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"), add_special_tokens=False).ids


def step_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """The steps of a teacher-forced pass over ``n`` tokens: the first token alone, then ``chunk``
    tokens each, so that every later token reads the cache (its own step's K/V included)."""
    edges = [0, 1, *range(1 + chunk, n, chunk), n]
    return list(zip(edges, edges[1:]))


def windows(n: int) -> dict[str, tuple[int, int]]:
    """The positions (each predicting the token after it) the logprob error is taken over:
    n/8 .. n/4 ("1k": 1,024 - 2,047 of 8,192) and the last eighth ("8k": 7,168 - 8,190; the last
    token predicts nothing)."""
    return {"1k": (n // 8, n // 4), "8k": (n - n // 8, n - 1)}


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its target and its most likely token."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, targets[:, None]).squeeze(1).double(), lp.argmax(dim=-1)


def ours_logprobs(stage, ids: list[int], chunk: int, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probabilities of ``ids[1:]`` and each position's argmax, the stage run on
    one request's steps (:func:`step_bounds`) over a paged cache stored as ``kv_cache_dtype``."""
    from stagewise.engine.engine import DEFAULT_BLOCK_SIZE
    from stagewise.engine.executor import model_dtype
    from stagewise.kv import KVCache, KVCacheManager
    from stagewise.model.batch import StepBatch
    from stagewise.model.kv_metadata import KVMetadata

    n, bs = len(ids), DEFAULT_BLOCK_SIZE
    blocks = -(-n // bs)
    manager = KVCacheManager(block_size=bs, num_blocks=blocks, max_blocks_per_seq=blocks)
    cache = KVCache(stage.kv_cache_spec(bs, model_dtype(stage), kv_cache_dtype), num_blocks=blocks, device="cpu")
    tokens = torch.tensor(ids)
    lps, tops = [], []
    for a, b in step_bounds(n, chunk):
        batch = StepBatch(request_ids=[0], num_prefills=1, query_lens=[b - a], context_lens=[a],
                          positions=torch.arange(a, b), token_ids=tokens[a:b], all_logits=True)
        manager.add(0, b - a) if a == 0 else manager.append(0, b - a)
        logits = stage(batch, cache, KVMetadata.build(batch, manager, "cpu"))
        m = min(b, n - 1) - a  # the last token predicts nothing
        lp, top = _score(logits[:m], tokens[a + 1 : a + 1 + m])
        lps.append(lp)
        tops.append(top)
    return torch.cat(lps), torch.cat(tops)


class LlamaCppScorer:
    """llama.cpp (llama-cpp-python's low-level API) on a GGUF file: the same teacher-forced steps."""

    def __init__(self, lib, path: Path, threads: int) -> None:
        from stagewise.bench.llama_cpp import quiet

        self.lib, self.threads = lib, threads
        quiet(lib)
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {str(path)!r}")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def logprobs(self, ids: list[int], chunk: int, cache: str) -> tuple[torch.Tensor, torch.Tensor]:
        """As :func:`ours_logprobs`, the KV cache in ``cache`` ("f16" or "q8_0")."""
        import numpy as np

        lib, n = self.lib, len(ids)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n, 1, True
        params.n_batch = params.n_ubatch = chunk
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = {"f16": lib.GGML_TYPE_F16, "q8_0": lib.GGML_TYPE_Q8_0}[cache]
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a context with a {cache} KV cache")
        batch = lib.llama_batch_init(chunk, 0, 1)
        tokens, lps, tops = torch.tensor(ids), [], []
        try:
            for a, b in step_bounds(n, chunk):
                batch.n_tokens = b - a
                for i, pos in enumerate(range(a, b)):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = ids[pos], pos, 1, True
                    batch.seq_id[i][0] = 0
                if (rc := lib.llama_decode(ctx, batch)) != 0:
                    raise RuntimeError(f"llama.cpp: llama_decode returned {rc}")
                rows = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=((b - a) * self.vocab,))
                logits = torch.from_numpy(rows.reshape(b - a, self.vocab).copy())
                m = min(b, n - 1) - a
                lp, top = _score(logits[:m], tokens[a + 1 : a + 1 + m])
                lps.append(lp)
                tops.append(top)
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
        return torch.cat(lps), torch.cat(tops)

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


def perplexity(lp: torch.Tensor) -> float:
    return math.exp(-lp.mean().item())


def error(run: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], n: int) -> dict:
    """Per window of :func:`windows`: mean and max |logprob - the reference's| and the share of
    positions whose most likely token is the reference's."""
    out = {}
    for name, (a, b) in windows(n).items():
        diff = (run[0][a:b] - ref[0][a:b]).abs()
        out[name] = {"positions": [a, b], "mean_abs": diff.mean().item(), "max_abs": diff.max().item(),
                     "argmax_agree": (run[1][a:b] == ref[1][a:b]).double().mean().item()}
    return out


def _ppl_entry(lp: torch.Tensor, ref: float | None, seconds: float) -> dict:
    ppl = perplexity(lp)
    out = {"perplexity": ppl, "seconds": seconds}
    if ref is not None:
        out.update(delta=ppl - ref, delta_pct=100 * (ppl - ref) / ref)
    return out


def greedy(model: str, dtypes: list[str], questions: list[str], new_tokens: int, log) -> dict:
    """Each question (chat template) answered greedily, at most ``new_tokens`` tokens (EOS ends an
    answer), with the auto cache and each compact one."""
    from stagewise.api import Pipeline
    from stagewise.bench.e2e.compare import common_prefix

    answers = {}
    for dt in ["auto", *dtypes]:
        with Pipeline(model, kv_cache_dtype=dt, max_num_seqs=len(questions), max_model_len=512) as pipe:
            answers[dt] = [c.token_ids for c in pipe.generate(questions, chat=True, max_new_tokens=new_tokens)]
            if dt == "auto":
                texts = [pipe.tokenizer.decode(t) for t in answers[dt]]
        log(f"bench kv accuracy: greedy answers with the {dt} cache done")
    rows = []
    for i, q in enumerate(questions):
        ref = answers["auto"][i]
        rows.append({"question": q, "auto_tokens": len(ref), "auto_text": texts[i],
                     **{dt: {"tokens": len(answers[dt][i]), "common_prefix": common_prefix(ref, answers[dt][i]),
                             "identical": answers[dt][i] == ref} for dt in dtypes}})
    summary = {dt: {"identical": sum(r[dt]["identical"] for r in rows), "questions": len(rows),
                    "mean_common_prefix": sum(r[dt]["common_prefix"] for r in rows) / len(rows)} for dt in dtypes}
    return {"new_tokens": new_tokens, "eos_ends": True, "rows": rows, "summary": summary}


def run_accuracy(args, dtypes: list[str], info: dict, log) -> tuple[dict, list[str]]:
    """Measure (module docstring); the JSON data and the Markdown lines."""
    from stagewise.bench.e2e.compare import QUESTIONS
    from stagewise.model.loader import open_checkpoint
    from stagewise.model.stage import load_stage

    start = time.perf_counter()
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    all_ids = text_ids(ckpt.tokenizer())
    n = TINY["tokens"] if args.tiny else min(cfg.max_position_embeddings, MAX_TOKENS)
    chunk = TINY["chunk"] if args.tiny else CHUNK
    ids = (all_ids * -(-n // len(all_ids)))[:n]  # repeated only when the text is shorter than n
    log(f"bench kv accuracy: the text has {len(all_ids)} tokens; {n} evaluated in steps of 1 + {chunk}")
    stage = load_stage(ckpt, 0, cfg.num_layers)
    runs, ppl, seconds = {}, {"ours": {}, "llama.cpp": {}}, {}
    for dt in ["auto", *dtypes]:
        t = time.perf_counter()
        runs[("ours", dt)] = ours_logprobs(stage, ids, chunk, dt)
        seconds[("ours", dt)] = time.perf_counter() - t
        log(f"bench kv accuracy: ours, {dt} cache: perplexity {perplexity(runs[('ours', dt)][0]):.4f} "
            f"({seconds[('ours', dt)]:.1f} s)")
    del stage
    baseline = {"name": args.baseline, "skipped": None}
    if args.baseline == "llama.cpp":
        baseline.update(_llama_cpp(args, ckpt, ids, chunk, runs, seconds, log))
    for (side, cache), run in runs.items():
        ref = None if cache in ("auto", "f16") else perplexity(runs[(side, "auto" if side == "ours" else "f16")][0])
        ppl[side][cache] = _ppl_entry(run[0], ref, seconds[(side, cache)])
    errors = {"ours": {dt: error(runs[("ours", dt)], runs[("ours", "auto")], n) for dt in dtypes}}
    if ("llama.cpp", "q8_0") in runs:
        errors["llama.cpp"] = {"q8_0": error(runs[("llama.cpp", "q8_0")], runs[("llama.cpp", "f16")], n)}
        errors["ours_auto_vs_llama_cpp_f16"] = error(runs[("ours", "auto")], runs[("llama.cpp", "f16")], n)
    questions = QUESTIONS[: TINY["questions"]] if args.tiny else QUESTIONS
    agree = greedy(args.model, dtypes, questions, TINY["new_tokens"] if args.tiny else NEW_TOKENS, log)
    data = {"suite": "kv-accuracy", "model": str(args.model), "model_path": str(ckpt.path), "tiny": bool(args.tiny),
            "dtypes": dtypes, "threads": torch.get_num_threads(),
            "text": {"source": TEXT_SOURCE, "file": TEXT_PATH.name, "tokens": len(all_ids), "evaluated_tokens": n,
                     "repeated": n > len(all_ids), "context": cfg.max_position_embeddings, "first_step": 1,
                     "chunk": chunk},
            "perplexity": ppl, "logprob_error": errors, "greedy": agree, "baseline": baseline,
            "seconds": time.perf_counter() - start}
    return data, markdown(data, info)


def _llama_cpp(args, ckpt, ids, chunk, runs, seconds, log) -> dict:
    """llama.cpp's f16 and q8_0 caches on the same steps, into ``runs``; what to record of it."""
    from stagewise.bench import llama_cpp

    if ckpt.path.suffix != ".gguf":
        log("bench kv accuracy: llama.cpp needs a GGUF model; skipped")
        return {"skipped": f"not a GGUF model: {ckpt.path}"}
    try:
        lib = llama_cpp.find_or_install(args.install_baseline, log=log, suite="kv")
    except ImportError as err:
        log(f"bench kv accuracy: {err}; llama.cpp skipped")
        return {"skipped": str(err)}
    scorer = LlamaCppScorer(lib, ckpt.path, torch.get_num_threads())
    try:
        for cache in ("f16", "q8_0"):
            t = time.perf_counter()
            runs[("llama.cpp", cache)] = scorer.logprobs(ids, chunk, cache)
            seconds[("llama.cpp", cache)] = time.perf_counter() - t
            log(f"bench kv accuracy: llama.cpp, {cache} cache: perplexity "
                f"{perplexity(runs[('llama.cpp', cache)][0]):.4f} ({seconds[('llama.cpp', cache)]:.1f} s)")
    finally:
        scorer.close()
    return {"llama_cpp_python": getattr(lib, "__version__", "unknown"), "system_info": llama_cpp.system_info(lib),
            "threads": torch.get_num_threads(), "flash_attn": True}


def _cell(text: str, width: int = 48) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(data: dict, info: dict) -> list[str]:
    """The report: header, the three tables, and a reading of them."""
    from stagewise.bench.report import isa_line

    t, ppl, err, dtypes = data["text"], data["perplexity"], data["logprob_error"], data["dtypes"]
    lines = ["# Compact KV cache: accuracy (`stagewise bench kv --parts accuracy`)", "",
             f"Machine: {info['device_name']} ({info['cpu_count']} CPUs, {data['threads']} threads), "
             f"torch {info['torch']}  ", f"{isa_line(info)}  ",
             f"Date: {info['date_utc']}, commit {info.get('git_commit')}  ",
             f"Model: {data['model']} (`{Path(data['model_path']).name}`), float32 activations: our `auto` cache "
             "stores float32, llama.cpp's `f16` float16", "",
             f"Text: {t['source']} (`{t['file']}`): **{t['tokens']} tokens** with the model's tokenizer. "
             + (f"It is repeated to {t['evaluated_tokens']} tokens" if t["repeated"] else
                f"Its first {t['evaluated_tokens']} tokens are scored (the model's context: {t['context']})")
             + f", teacher-forced as one request in steps of {t['first_step']} token then {t['chunk']} tokens, "
             "logits of every token: each step after the first attends over the cache, its own K/V included, so "
             "a compact cache is read. llama.cpp runs the same token ids in the same steps (`llama_decode`, "
             "flash attention on)."]
    if data["tiny"]:
        lines += ["", "**--tiny: toy sizes; the numbers mean nothing.**"]
    if data["baseline"].get("skipped"):
        lines += ["", f"llama.cpp skipped: {data['baseline']['skipped']}"]
    lines += ["", "## Perplexity", "", "| engine | KV cache | perplexity | Δ vs its float cache | Δ % | seconds |",
              "|---|---|---|---|---|---|"]
    for side, caches in ppl.items():
        for cache, e in caches.items():
            delta = (f"{e['delta']:+.4f} | {e['delta_pct']:+.3f}%") if "delta" in e else "— | —"
            lines.append(f"| {side} | {cache} | {e['perplexity']:.4f} | {delta} | {e['seconds']:.1f} |")
    lines += ["", "## Logprob error against the float cache", "",
              "Absolute difference of each text token's log-probability (natural log), over the positions of "
              "each window; 'same top token': the share of those positions whose most likely next token is "
              "the reference's.", "",
              "| engine | cache vs reference | positions | mean abs | max abs | same top token |",
              "|---|---|---|---|---|---|"]
    rows = [("ours", f"{dt} vs auto", e) for dt, e in err["ours"].items()]
    if "llama.cpp" in err:
        rows += [("llama.cpp", "q8_0 vs f16", err["llama.cpp"]["q8_0"]),
                 ("ours vs llama.cpp", "auto vs llama.cpp f16 (two float runs)", err["ours_auto_vs_llama_cpp_f16"])]
    for side, what, e in rows:
        for w in e.values():
            lines.append(f"| {side} | {what} | {w['positions'][0]}-{w['positions'][1] - 1} | {w['mean_abs']:.2e} | "
                         f"{w['max_abs']:.2e} | {100 * w['argmax_agree']:.2f}% |")
    g = data["greedy"]
    lines += ["", "## Greedy agreement on the chat questions", "",
              f"Each question with the chat template, greedy, at most {g['new_tokens']} tokens (EOS ends an answer); "
              "per compact cache: the tokens identical to auto's before the first divergence, and whether the "
              "whole answer is identical.", "",
              "| question | auto's answer | tokens | "
              + " | ".join(f"{dt} same start | {dt} identical" for dt in dtypes) + " |",
              "|---|---|---|" + "---|---|" * len(dtypes)]
    for r in g["rows"]:
        cells = [f"{r[dt]['common_prefix']} | {'yes' if r[dt]['identical'] else 'no'}" for dt in dtypes]
        lines.append(f"| {_cell(r['question'], 40)} | {_cell(r['auto_text'])} | {r['auto_tokens']} | "
                     + " | ".join(cells) + " |")
    return lines + ["", "## Reading", "", *reading(data)]


def reading(data: dict) -> list[str]:
    """A few plain sentences on the tables: each compact cache's error next to llama.cpp q8_0's."""
    ppl, err, g = data["perplexity"], data["logprob_error"], data["greedy"]["summary"]
    q8 = ppl["llama.cpp"].get("q8_0")
    out = []
    for dt in data["dtypes"]:
        e, we = ppl["ours"][dt], err["ours"][dt]
        s = (f"- **{dt}**: perplexity {e['perplexity']:.4f} against {ppl['ours']['auto']['perplexity']:.4f} with the "
             f"float32 cache ({e['delta_pct']:+.3f}%)")
        if q8:
            s += f"; llama.cpp's q8_0 moves its own by {q8['delta_pct']:+.3f}%"
            worse = abs(e["delta_pct"]) > abs(q8["delta_pct"])
            s += (". Ours moves perplexity more." if worse else ". Ours moves it no more than llama.cpp's q8_0.")
        out.append(s + f" {g[dt]['identical']}/{g[dt]['questions']} greedy answers identical to auto's "
                       f"(mean {g[dt]['mean_common_prefix']:.1f} tokens before the first difference).")
        for w in ("1k", "8k"):
            a = we[w]["mean_abs"]
            s = f"  - {w} context: mean |Δ logprob| {a:.2e}, max {we[w]['max_abs']:.2e}"
            if "llama.cpp" in err:
                b = err["llama.cpp"]["q8_0"][w]["mean_abs"]
                ratio = a / b if b > 0 else math.inf
                s += (f" against llama.cpp q8_0's {b:.2e}: ours is "
                      + (f"**worse**, {ratio:.1f}x its error" if ratio > 1.1 else
                         f"better, {ratio:.2f}x its error" if ratio < 0.9 else "about the same"))
            out.append(s + ".")
    if "llama.cpp" in err:
        ref = err["ours_auto_vs_llama_cpp_f16"]
        gap = ref["8k"]["mean_abs"]
        below = [dt for dt in err["ours"] if err["ours"][dt]["8k"]["mean_abs"] < gap]
        above = [dt for dt in err["ours"] if dt not in below]
        out.append(f"- For scale: our float32 run and llama.cpp's f16 run of the same GGUF differ by "
                   f"{ref['1k']['mean_abs']:.2e} (1k) and {gap:.2e} (8k) mean |Δ logprob| (their kernels differ: "
                   "llama.cpp quantises the activations to 8 bits for its Q4_1 matmuls); at 8k "
                   + "; ".join(part for part in (
                       f"{', '.join(below)} changes ours less than that" if below else "",
                       f"{', '.join(above)} changes ours more than that" if above else "") if part) + ".")
        out.append("- The references differ: ours is a float32 cache, llama.cpp's an f16 one (already rounded), "
                   "and the quantisation too: ours one scale per token and KV head (64 values), q8_0 one per 32 "
                   "values (and llama.cpp's attention quantises Q to 8 bits to multiply with q8_0 keys).")
    return out + ["- A perplexity change of a few tenths of a percent can fall either way (llama.cpp's q8_0 may "
                  "even lower it); the logprob error is the steadier measure. Greedy answers of a 135M model flip "
                  "at near-ties, so one divergence early in an answer changes the rest; llama.cpp's greedy "
                  "agreement is not measured here."]
