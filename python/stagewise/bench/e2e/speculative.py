"""`stagewise bench e2e --speculative ngram,draft`: decode with drafts against decode without, on a
task where prompt lookup is known to help and one where it is not, beside llama.cpp with and
without its own prompt lookup (llama-cpp-python's ``LlamaPromptLookupDecoding``) on the same GGUF.
The drafts come from prompt lookup (``ngram``) or a draft model (``draft``: ``--draft-model``,
by default the model itself with its linears in the int8 mode).

The tasks (chat-templated, greedy, ``--new-tokens`` each):

- ``rewrite``: rewrite a given text of about 500 tokens (this project's own README, so nothing
  third-party ships with the benchmark): the answer repeats its input, the drafts come from it;
- ``chat``: an open question: nothing to look up but the answer's own repetitions.

For every stage count of ``--stages`` (default 1) and every ``--num-speculative-tokens`` K, ours
runs without drafts and with them, the configurations taking turns ``--repeats`` times; the
table gives decode tokens/s (median), the speed-up over the same layout without drafts, tokens
per decode step, the acceptance, and whether the greedy tokens equal those without drafts (they
must). llama.cpp runs with ``--threads`` threads (default: the cores), ours with the same in one
process and one per stage in a pipeline.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

TASKS = {
    "rewrite": "Rewrite the following text in plain words for a newcomer, keeping its order and every "
               "sentence's meaning:\n\n{text}",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _rewrite_text(words: int = 380) -> str:
    """About 500 tokens of this project's README, from its first paragraph (fences left out)."""
    readme = Path(__file__).resolve().parents[4] / "README.md"
    kept, inside = [], False
    for line in readme.read_text().splitlines()[1:]:
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside and line.strip() and not line.startswith(("#", "|", "<!--")):
            kept.append(line.strip())
    return " ".join(" ".join(kept).split()[:words])


def _prompts(pipe, text: str) -> dict[str, list[int]]:
    """Each task's chat-templated prompt; a model without a tokenizer (a random test model) gets
    fixed ids instead: the rewrite a text of ids said twice, the chat a short run of them."""
    from stagewise.bench.e2e.prompts import make_prompts
    from stagewise.frontend.prompts import encode_prompts

    try:
        return {name: encode_prompts(pipe.tokenizer, [task.format(text=text)], None, chat=True,
                                     render=pipe.render_chat)[0] for name, task in TASKS.items()}
    except (FileNotFoundError, ValueError, AttributeError, TypeError):
        ids = make_prompts(pipe.checkpoint, 1, 24)[0]
        return {"rewrite": ids + ids, "chat": ids[:6]}


def run(args, log=print) -> int:
    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.launch.local import usable_cores
    from stagewise.model.loader import open_checkpoint

    methods = [m.strip() for m in str(args.speculative).split(",") if m.strip()]
    try:
        counts = sorted({int(s) for s in str(args.stages or "1").split(",") if s.strip()})
        ks = sorted({int(k) for k in str(args.num_speculative_tokens).split(",") if k.strip()})
    except ValueError:
        counts, ks = [], []
    if not methods or set(methods) - {"ngram", "draft"} or not counts or min(counts) < 1 or not ks or min(ks) < 1 \
            or args.new_tokens < 2:
        print(f"stagewise bench e2e: --speculative takes ngram,draft (got {args.speculative!r}); --stages stage "
              "counts >= 1; --num-speculative-tokens counts >= 1 such as 3,5; --new-tokens >= 2", file=sys.stderr)
        return 2
    draft_model = args.draft_model or str(args.model)
    threads = args.threads or usable_cores()
    repeats = args.repeats or 3
    info = report.machine_info("cpu")
    text = _rewrite_text(60 if args.tiny else 380)
    max_len = min(2048, open_checkpoint(args.model).config.max_position_embeddings)
    configs = [(s, None, None) for s in counts] + [(s, m, k) for s in counts for m in methods for k in ks]
    pipes: dict[tuple, Pipeline] = {}
    baselines = {}
    try:
        for s, method, k in configs:
            log(f"starting S={s} {'without drafts' if method is None else f'{method} K={k}'} ...")
            spec = None if method is None else "ngram" if method == "ngram" else f"draft:{draft_model}"
            pipes[(s, method, k)] = Pipeline(args.model, stages=s, max_num_seqs=4, max_model_len=max_len,
                                             speculative=spec, num_speculative_tokens=k or 3,
                                             **({"threads": 1} if s > 1 else {}))
        first = next(iter(pipes.values()))
        prompts = _prompts(first, text)
        if "llama.cpp" in str(args.baseline) and "ngram" in methods:
            for k in [None, *ks]:
                baselines[k] = PromptLookupLlama(first.checkpoint, threads, k, args.install_baseline, log)
        samples: dict[tuple, list[dict]] = {}
        outputs: dict[tuple, object] = {}
        for pipe in pipes.values():  # warm-up
            pipe.generate(prompt_token_ids=[prompts["chat"]], max_new_tokens=4)
        for rep in range(repeats):
            for name, ids in prompts.items():
                for (s, method, k), pipe in pipes.items():
                    [out] = pipe.generate(prompt_token_ids=[ids], max_new_tokens=args.new_tokens, ignore_eos=True)
                    samples.setdefault((name, "ours", s, method, k), []).append(dict(pipe.last_stats))
                    outputs[(name, "ours", s, method, k)] = out.token_ids
                    log(f"  run {rep + 1}/{repeats} {name} S={s} {method or '-'} K={k}: "
                        f"{pipe.last_stats['decode_tokens_per_s']:.1f} tok/s")
                for k, llama in baselines.items():
                    st, text_out = llama.generate(ids, args.new_tokens)
                    key = (name, "llama.cpp", 1, None if k is None else "ngram", k)
                    samples.setdefault(key, []).append(st)
                    outputs[key] = text_out
                    log(f"  run {rep + 1}/{repeats} {name} llama.cpp K={k}: {st['decode_tokens_per_s']:.1f} tok/s")
    finally:
        for closable in [*pipes.values(), *baselines.values()]:
            closable.close()
    rows = []
    for (name, who, s, method, k), runs in samples.items():
        base = samples[(name, who, s, None, None)]
        speed = statistics.median(r["decode_tokens_per_s"] for r in runs)
        row = {"task": name, "engine": who, "stages": s, "method": method, "k": k, "decode_tok_s": speed,
               "speedup": speed / statistics.median(r["decode_tokens_per_s"] for r in base),
               "tokens_equal_no_drafts": outputs[(name, who, s, method, k)] == outputs[(name, who, s, None, None)]}
        if method is not None and who == "ours":
            row.update(tokens_per_step=statistics.median(r.get("tokens_per_step", 1.0) for r in runs),
                       acceptance=statistics.median(r.get("acceptance", 0.0) for r in runs))
        rows.append(row)
    info.update(model=str(args.model), draft_model=draft_model if "draft" in methods else None, threads=threads,
                repeats=repeats, new_tokens=args.new_tokens,
                prompt_tokens={name: len(ids) for name, ids in prompts.items()})
    if baselines:
        info["llama_cpp"] = next(iter(baselines.values())).info
    table = format_table(rows)
    print(table)
    report.write_results(args.out, f"{info['device']}-e2e-speculative", {"machine": info, "rows": rows}, [
        "# stagewise end to end: speculative decoding", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, {threads} threads (one per "
        f"stage in a pipeline); torch {info['torch']}  ", f"Date (UTC): {info['date_utc']}; commit: "
        f"{info['git_commit']}  ", f"Model: {info['model']}, greedy, EOS ignored, {args.new_tokens} new tokens; "
        f"prompts {info['prompt_tokens']} tokens; median of {repeats} runs, configurations taking turns. Draft model "
        f"(method draft): {info['draft_model'] or '-'}, its linears in the int8 mode, in stage 0's process", "",
        "speed-up = decode tokens/s over the same engine and layout without drafts; tokens/step: of ours' decode "
        "steps (1 + the accepted drafts); tokens = no drafts: greedy output identical to that without drafts. "
        "llama.cpp: llama-cpp-python's Llama with LlamaPromptLookupDecoding(num_pred_tokens=K) (prompt lookup; it "
        "has no draft-model drafter of its own to compare the draft method with).", "", table, ""], log)
    return 0


def format_table(rows: list[dict]) -> str:
    head = ["task", "engine", "S", "drafts", "K", "decode tok/s", "speed-up", "tokens/step", "acceptance",
            "tokens = no drafts"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|" + "---:|" * (len(head) - 4)]
    for r in rows:
        drafted = (f"{r['tokens_per_step']:.2f}", f"{100 * r['acceptance']:.0f} %") if "acceptance" in r else ("-", "-")
        cells = [r["task"], r["engine"], r["stages"], r["method"] or "-", r["k"] or "-", f"{r['decode_tok_s']:.1f}",
                 f"{r['speedup']:.2f}x", *drafted, "yes" if r["tokens_equal_no_drafts"] else "NO"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


class PromptLookupLlama:
    """llama.cpp through llama-cpp-python's high-level ``Llama``, with ``LlamaPromptLookupDecoding``
    drafting ``k`` tokens (None: without drafts), greedy, one sequence."""

    def __init__(self, ckpt, threads: int, k: int | None, install: bool, log=print) -> None:
        from stagewise.bench import llama_cpp

        if ckpt.path.suffix != ".gguf":
            raise ValueError(f"bench e2e: the llama.cpp baseline needs a GGUF model, got {str(ckpt.path)!r}")
        lib = llama_cpp.find_or_install(install, log=log)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = None if k is None else LlamaPromptLookupDecoding(num_pred_tokens=k)
        # With a draft model the Llama keeps every position's logits, but sizes their buffer by its
        # logits_all argument: asked for explicitly, or a prompt past n_batch tokens overflows it.
        self.llm = lib.Llama(str(ckpt.path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                             draft_model=draft, logits_all=draft is not None, verbose=False)
        self.info = {"llama_cpp_python": getattr(lib, "__version__", "unknown"), "system_info": llama_cpp.system_info(lib),
                     "threads": threads}

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[dict, str]:
        """(its timings, its text): the text is what the runs with and without drafts compare."""
        self.llm.reset()
        start, first, out = time.perf_counter(), None, []
        for chunk in self.llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, stream=True,
                                                logprobs=None):
            first = first or time.perf_counter()
            out.append(chunk)
        end = time.perf_counter()
        text = "".join(c["choices"][0]["text"] for c in out)
        n = max(len(self.llm.tokenize(text.encode(), add_bos=False, special=True)), 1)  # it may stop at EOS
        return {"ttft_s": first - start, "decode_tokens_per_s": (n - 1) / max(end - first, 1e-9)}, text

    def close(self) -> None:
        self.llm.close()
