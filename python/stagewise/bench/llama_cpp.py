"""llama.cpp as the baseline of `stagewise bench e2e --baseline llama.cpp`: the same GGUF file,
threads and prompt token ids, greedy, through llama-cpp-python's low-level API (an optional
dependency of the benchmark only; :func:`find_or_install` installs it when asked).

A batch of B prompts is one ``llama_decode`` of every prompt token (B sequences, the logits of
each sequence's last token), then one ``llama_decode`` per step with B tokens, one per sequence:
llama.cpp's batch API for parallel sequences. Tokens are picked by llama.cpp's greedy sampler
(in C, as its own tools do). Every run starts from an empty KV cache.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

REQUIREMENT = "llama-cpp-python>=0.3.30"
GGML_ISA = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
            "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
            "avx512_bf16": "AVX512_BF16"}
"""The CPU flags (``/proc/cpuinfo``) a build of ggml turns on, each its ``GGML_*`` option."""


def build_args(cpuinfo: str | None = None) -> str:
    """CMake flags of the install: ggml built for every ISA extension this CPU reports, as a user who
    builds llama-cpp-python from PyPI for speed would, but never its AMX kernels (on machines that
    report AMX they die with SIGILL) and so not ``GGML_NATIVE``, which would turn them on. Where the
    CPU's flags cannot be read (not Linux x86), a native build."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if not flags & set(GGML_ISA):
        return "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
    isa = " ".join(f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for flag, name in GGML_ISA.items())
    return f"-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF {isa} -DLLAMA_CURL=OFF"


def find_or_install(install: bool, log=print, suite: str = "e2e"):
    """The ``llama_cpp`` module; with ``install``, ``pip install`` it first when missing (a source
    build from PyPI, several minutes). ImportError naming the command otherwise (``suite``: the
    benchmark that asks, for the message)."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        if not install:
            raise ImportError(f"bench {suite}'s llama.cpp baseline needs llama-cpp-python: "
                              f'CMAKE_ARGS="{build_args()}" pip install "{REQUIREMENT}" '
                              f"(or pass --install-baseline)") from None
    args = build_args()
    log(f"bench {suite}: installing {REQUIREMENT} (CMAKE_ARGS={args}; a source build, several minutes)")
    env = dict(os.environ, CMAKE_ARGS=args)
    subprocess.run([sys.executable, "-m", "pip", "install", REQUIREMENT], env=env, check=True)
    importlib.invalidate_caches()
    return importlib.import_module("llama_cpp")


_QUIET = []  # the log callback, kept alive as long as llama.cpp may call it


def quiet(lib) -> None:
    """Drop llama.cpp's log lines (every tensor it loads, on stderr) so the benchmark's own show."""
    if not _QUIET:
        _QUIET.append(lib.llama_log_callback(lambda level, text, user_data: None))
        lib.llama_log_set(_QUIET[0], None)


def system_info(lib) -> str:
    """llama.cpp's own line of the CPU features it was built for and uses ("AVX2 = 1 | ...")."""
    return lib.llama_print_system_info().decode(errors="replace").strip()


KV_TYPES = {"f16": 1, "q8_0": 8}
"""llama.cpp's KV cache types a benchmark may ask for (GGML type ids): its default, and q8_0 (blocks
of 32 values with an f16 scale, which needs flash attention for V)."""


class LlamaCpp:
    """One model and one context sized for ``max_seqs`` sequences of ``max_len`` tokens; ``kv_type``
    (None: llama.cpp's default context) sets K and V's cache type, with flash attention on and each
    sequence's KV apart (not one unified cache every sequence's attention scans)."""

    def __init__(self, lib, path: str | Path, threads: int, max_seqs: int, max_len: int,
                 kv_type: str | None = None) -> None:
        self.lib, self.max_seqs = lib, max_seqs
        quiet(lib)
        lib.llama_backend_init()
        start = time.perf_counter()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {str(path)!r}")
        cparams = lib.llama_context_default_params()
        cparams.n_seq_max = max_seqs
        cparams.n_ctx = max_seqs * max_len
        cparams.n_batch = max(512, max_seqs * max_len)  # a whole batch of prompts in one llama_decode
        cparams.n_threads = cparams.n_threads_batch = threads
        if kv_type is not None:
            cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
            cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            cparams.kv_unified = False
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self.load_s = time.perf_counter() - start
        """Model load and context creation, seconds."""
        self.sampler = lib.llama_sampler_init_greedy()
        self.batch = lib.llama_batch_init(cparams.n_batch, 0, 1)

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_sampler_free(self.sampler)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """The batch: (token, position, sequence, wants logits) per entry."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits

    def _decode(self) -> None:
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama.cpp: llama_decode returned {rc}")

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Every prompt into an empty cache, one sequence each; the greedy token after each."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries, outputs = [], []
        for s, p in enumerate(prompts):
            entries += [(tok, pos, s, pos == len(p) - 1) for pos, tok in enumerate(p)]
            outputs.append(len(entries) - 1)
        self._fill(entries)
        self._decode()
        return [self.lib.llama_sampler_sample(self.sampler, self.ctx, i) for i in outputs]

    def step(self, tokens: list[int], positions: list[int]) -> list[int]:
        """One decode step of every sequence (``tokens[s]`` at ``positions[s]``); the next tokens."""
        self._fill([(tok, pos, s, True) for s, (tok, pos) in enumerate(zip(tokens, positions))])
        self._decode()
        return [self.lib.llama_sampler_sample(self.sampler, self.ctx, s) for s in range(len(tokens))]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
        """Greedy ``new_tokens`` tokens after each prompt (EOS ignored): (TTFT seconds, seconds from
        the first token to the last, the tokens of each row)."""
        rows = len(prompts)
        if rows > self.max_seqs:
            raise ValueError(f"llama.cpp baseline: {rows} prompts, the context holds {self.max_seqs}")
        start = time.perf_counter()
        out = [[tok] for tok in self.prefill(prompts)]
        first = time.perf_counter()
        for step in range(1, new_tokens):
            nxt = self.step([o[-1] for o in out], [len(p) + step - 1 for p in prompts])
            for o, tok in zip(out, nxt):
                o.append(tok)
        return first - start, time.perf_counter() - first, out
