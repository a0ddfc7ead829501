"""Start-up as a user meets it (`stagewise bench e2e`'s start-up rows): fresh processes, timed from
the launch to the first byte they print, median of the runs.

- ``generate``: ``stagewise generate MODEL --chat --prompt TEXT`` until its first token's text;
- ``pipeline``: a 3-stage :class:`stagewise.Pipeline` (what ``make demo`` starts) until it is ready;
- ``llama.cpp`` (with that baseline): llama-cpp-python loading the same GGUF file, decoding the same
  prompt's token ids and printing the first token.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

PROMPT = "What is the capital of France?"

_PIPELINE = """
import stagewise
pipe = stagewise.Pipeline({model!r}, stages={stages}, partition="balanced", max_model_len=1024, max_num_seqs=4)
print("ready", flush=True)
pipe.close()
"""

_LLAMA_CPP = """
import sys
from stagewise.bench import llama_cpp
lib = llama_cpp.find_or_install(False)
engine = llama_cpp.LlamaCpp(lib, {path!r}, {threads}, 1, {max_len})
ttft, _, tokens = engine.generate([{ids!r}], 1)
print(tokens[0][0], flush=True)
"""


def first_output_s(argv: list[str], env: dict | None = None, timeout: float = 300) -> float:
    """Seconds from starting ``argv`` to its first byte on stdout (the process is then let finish)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        first = proc.stdout.read(1)
        elapsed = time.perf_counter() - start
        proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not first or proc.returncode != 0:
        raise RuntimeError(f"bench e2e start-up: {' '.join(argv[:6])} ... printed nothing or failed "
                           f"(exit {proc.returncode})")
    return elapsed


def measure(model: str, threads: int, repeats: int, *, llama_cpp_path: str | None = None,
            prompt_ids: list[int] | None = None, log=print) -> dict:
    """Medians (and every run) of the start-up times, seconds; runs of the kinds take turns."""
    env = {"OMP_NUM_THREADS": str(threads)}
    kinds = {
        "generate": lambda: first_output_s([sys.executable, "-m", "stagewise.cli", "generate", model, "--chat",
                                            "--prompt", PROMPT, "--max-new-tokens", "2"], env),
        "pipeline_3_stages": lambda: first_output_s([sys.executable, "-c", _PIPELINE.format(model=model, stages=3)]),
    }
    if llama_cpp_path is not None and prompt_ids:
        code = _LLAMA_CPP.format(path=llama_cpp_path, threads=threads, max_len=len(prompt_ids) + 8, ids=prompt_ids)
        kinds["llama.cpp"] = lambda: first_output_s([sys.executable, "-c", code], env)
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats):
        for kind, fn in kinds.items():
            runs[kind].append(fn())
        log(f"  start-up run {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()))
    return {kind: {"median_s": statistics.median(v), "runs_s": v} for kind, v in runs.items()}
