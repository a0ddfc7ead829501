"""llama.cpp GGUF conventions -> HF ones: tensor names, the config dict, Q/K row order, tokenizer.

Which architectures a file may hold, and their tensors' llama.cpp names, are their entries'
(``Architecture.gguf``, :mod:`stagewise.model.architectures`). GGUF stores each tensor with its dims
reversed (``[in, out]`` for a linear weight), which numpy already undoes (``reader.tensors[i].data``
is ``[out, in]`` like HF). For llama-arch models llama.cpp's converter also permutes the rows of
``attn_q``/``attn_k`` so that its rope rotates adjacent pairs (``GGUFNames.permuted_qk``);
:func:`unpermute_qk` restores HF's half-split order.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from stagewise.model import architectures
from stagewise.model.architectures.base import Architecture
from stagewise.model.shapes import LM_HEAD

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_QK = re.compile(r"blk\.\d+\.attn_[qk]\.(weight|bias)")

# llama.cpp pre-tokenizer name -> the split regexes it applies, in order, before byte-level BPE.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZERS = {
    "default": [_GPT2_REGEX],
    "gpt-2": [_GPT2_REGEX],
    "smollm": [r"\p{N}", _GPT2_REGEX],  # digits one by one, then GPT-2's split
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens


def hf_tensor_name(arch: Architecture, gguf_name: str) -> str | None:
    """HF name of a llama.cpp tensor of architecture ``arch``; None for tensors HF has no counterpart
    of (e.g. rope_freqs)."""
    if gguf_name == "token_embd.weight":
        return arch.prefix + arch.embedding
    if gguf_name == "output_norm.weight":
        return f"{arch.prefix}{arch.final_norm}.weight"
    if gguf_name == "output.weight":
        return LM_HEAD
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in arch.gguf.layer_tensors:
        return arch.layer_prefix(int(match.group(1))) + arch.gguf.layer_tensors[match.group(2)]
    return None


def needs_unpermute(arch: Architecture, gguf_name: str) -> bool:
    """Whether the converter permuted this tensor's rows: attn_q / attn_k (weights and biases) of an
    architecture whose entry says so (llama's)."""
    return arch.gguf.permuted_qk and _QK.fullmatch(gguf_name) is not None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's ``permute``: w [n_head * head_dim, ...] -> HF row order.

    The converter views each head's rows as (2, head_dim/2) and transposes them to
    (head_dim/2, 2); here each head's rows are viewed as (head_dim/2, 2) and transposed back.
    ``n_head`` is the head count of this tensor (kv heads for attn_k).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_config_from_gguf(meta: dict[str, Any], vocab_size: int | None, has_output: bool) -> dict[str, Any]:
    """HF-style config dict from GGUF metadata, for :func:`~stagewise.model.hf_config.parse_hf_config`.

    ``vocab_size``: length of the token list (when the file has one); ``has_output``:
    whether an ``output.weight`` tensor exists (absent: the LM head is tied to the embedding).
    """
    arch = meta.get("general.architecture")
    entry = architectures.for_gguf(arch)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ValueError(f"gguf: metadata key '{arch}.{name}' is required and missing")
        return value

    heads = key("attention.head_count", required=True)
    hf: dict[str, Any] = {
        "model_type": entry.gguf.model_type,
        "vocab_size": vocab_size or key("vocab_size", required=True),
        "hidden_size": key("embedding_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "intermediate_size": key("feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": key("context_length", 2048),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    hf.update({hf_key: value for name, hf_key in entry.gguf.metadata.items() if (value := key(name)) is not None})
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ValueError(f"gguf: {arch}.rope.scaling.type {scaling!r} is not supported; expected linear or yarn")
        hf["rope_scaling"] = {
            "rope_type": scaling,
            "factor": key("rope.scaling.factor", required=True),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
    return hf


def gpt2_tokenizer(meta: dict[str, Any], tokens: list[str], merges: list[str], token_types: list[int] | None):
    """A tokenizers.Tokenizer equal to llama.cpp's byte-level BPE ("gpt2") tokenizer of the file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ValueError(f"gguf: tokenizer.ggml.model {model!r} is not supported; only byte-level BPE ('gpt2') is")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"gguf: tokenizer.ggml.pre {pre!r} is not supported; expected one of {sorted(PRE_TOKENIZERS)}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = token_types or []
    # Added tokens are matched whole before BPE; control ones are also special (skipped by decode).
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        name = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos)])
    return tok


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """Copy out of the memory map (only this tensor's pages are read)."""
    return torch.from_numpy(np.array(array, copy=True))
