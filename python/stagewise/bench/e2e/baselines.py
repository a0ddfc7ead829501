"""The baselines `stagewise bench e2e` runs beside stagewise on the same checkpoint, threads and
prompt token ids: transformers ``generate`` (in ours' dtype, float32 by default: the reference of
every model) and llama.cpp (``--baseline llama.cpp``: the same GGUF file through llama-cpp-python,
its batch API for parallel sequences). Each answers :meth:`run` with a :class:`Run`: time to first
token, decode time, tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stagewise.model.loader import Checkpoint

BASELINES = ("transformers", "llama.cpp")


@dataclass(kw_only=True, slots=True)
class Run:
    """One timed generate call of a whole batch."""

    ttft_s: float
    decode_s: float
    decode_tokens: int
    """Generated tokens after each row's first, summed over the batch."""
    token_ids: list[list[int]]


class _Clock:
    """A transformers streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # first call: the prompt; then one call per generated step
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())


def load_transformers(ckpt: Checkpoint, dtype: torch.dtype, device: str):
    """The same checkpoint through transformers (a GGUF file is dequantized by transformers itself),
    set up for greedy decoding that never stops at EOS."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = ckpt.path
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    elif ckpt.config.vision_config is not None:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    # Greedy, exactly new_tokens per row: no EOS and no sampling defaults. generate() fills every
    # unset value from model.generation_config, so that is the one to change.
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    config.update(do_sample=False, eos_token_id=None, temperature=None, top_k=None, top_p=None, pad_token_id=pad)
    return model


def run_transformers(model, prompts: list[list[int]], new_tokens: int, extra: dict | None = None) -> Run:
    """``extra``: more inputs of generate (a vision model's pixel_values, image_grid_thw, ...)."""
    # All prompts have one length, so the left-padded batch has no padding; the mask is explicit anyway.
    ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    mask = torch.ones_like(ids)
    clock = _Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, streamer=clock, **(extra or {}))
    end = time.perf_counter()  # the streamer's end() came after the last token's copy to the host
    if out.shape != (len(prompts), ids.size(1) + new_tokens):
        raise RuntimeError(f"bench e2e: transformers returned shape {tuple(out.shape)}, "
                           f"expected {(len(prompts), ids.size(1) + new_tokens)}")
    first = clock.times[1]  # times[0] is the prompt itself
    return Run(ttft_s=first - start, decode_s=end - first, decode_tokens=len(prompts) * (new_tokens - 1),
               token_ids=out[:, ids.size(1):].tolist())


class TransformersBaseline:
    name, label = "transformers", "hf"

    def __init__(self, ckpt: Checkpoint, device: str, dtype: torch.dtype = torch.float32) -> None:
        self.model = load_transformers(ckpt, dtype, device)
        self.info = {"transformers": __import__("transformers").__version__,
                     "dtype": str(self.model.dtype).removeprefix("torch.")}
        self.images = None
        """(ImageInputs, image token id) of every row, when the prompts hold an image."""
        self.image_token_id = None if ckpt.config.vision_config is None else ckpt.config.vision_config.image_token_id

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        extra = None
        if self.images is not None:
            from stagewise.bench.e2e.images import transformers_inputs

            extra = transformers_inputs(prompts, self.images, self.image_token_id, self.model.device)
        return run_transformers(self.model, prompts, new_tokens, extra)

    def close(self) -> None:
        self.model = None


class LlamaCppBaseline:
    """llama.cpp on the checkpoint's GGUF file, ``threads`` threads, room for ``max_seqs`` rows."""

    name, label = "llama.cpp", "llama.cpp"

    def __init__(self, ckpt: Checkpoint, threads: int, max_seqs: int, max_len: int, install: bool, log=print) -> None:
        from stagewise.bench import llama_cpp

        if ckpt.path.suffix != ".gguf":
            raise ValueError(f"bench e2e: the llama.cpp baseline needs a GGUF model, got {str(ckpt.path)!r}")
        lib = llama_cpp.find_or_install(install, log=log)
        self.engine = llama_cpp.LlamaCpp(lib, ckpt.path, threads, max_seqs, max_len)
        self.info = {"llama_cpp_python": getattr(lib, "__version__", "unknown"), "system_info": llama_cpp.system_info(lib),
                     "threads": threads, "load_s": self.engine.load_s}

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        ttft, decode, tokens = self.engine.generate(prompts, new_tokens)
        return Run(ttft_s=ttft, decode_s=decode, decode_tokens=len(prompts) * (new_tokens - 1), token_ids=tokens)

    def close(self) -> None:
        self.engine.close()


def open_baseline(name: str, ckpt: Checkpoint, *, device: str, threads: int, max_seqs: int, max_len: int,
                  install: bool, dtype: torch.dtype = torch.float32, log=print):
    """The baseline called ``name`` (:data:`BASELINES`), loaded; ``dtype``: transformers' (llama.cpp
    runs the GGUF file as it is)."""
    if name == "transformers":
        return TransformersBaseline(ckpt, device, dtype)
    if name == "llama.cpp":
        if device != "cpu":
            raise ValueError(f"bench e2e: the llama.cpp baseline runs on the CPU here, got --device {device}")
        return LlamaCppBaseline(ckpt, threads, max_seqs, max_len, install, log=log)
    raise ValueError(f"bench e2e: --baseline takes {', '.join(BASELINES)}, got {name!r}")
