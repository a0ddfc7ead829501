"""Tiny GGUF files for the tests, written from random HF models as llama.cpp's converter writes
them (names, the Q/K row permutation, block types)."""

import numpy as np
import torch
import transformers
import gguf
from gguf import GGMLQuantizationType as Q

from stagewise.model.loader import load_stage_weights, open_checkpoint

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# Stored types of the tiny file: F32 by default, these F16 or Q8_0 (one of them a permuted attn_q).
TYPES = {"blk.0.attn_k.weight": Q.F16, "blk.0.attn_v.weight": Q.F16,
         "blk.1.ffn_down.weight": Q.Q8_0, "blk.2.attn_q.weight": Q.Q8_0}


def byte_chars():
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are written in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


TOKENS = ["<s>", "</s>"] + [byte_chars()[b] for b in range(256)] + ["hi"]


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def permute(w, n_head, n_head_kv):
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (for its adjacent-pair rope)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch="llama", tied=False, types=TYPES, intermediate=96, perturbed=False):
    """A tiny random HF model of ``arch`` (llama, qwen2 or qwen3) written as llama.cpp's converter
    would (stored types ``types``, F32 otherwise); with ``perturbed`` every weight moved off its init
    value (biases at 0, norms at 1), so that each matters. Returns its state_dict."""
    torch.manual_seed(0)
    kw = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=intermediate, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=50000.0,
              max_position_embeddings=256, tie_word_embeddings=tied)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif arch == "qwen2":  # q/k/v biases, stored as attn_{q,k,v}.bias and not permuted
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw, head_dim=32))
    if perturbed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(3)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    add_tokenizer(w)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for name, tensor in state.items():
        data = tensor.numpy()
        g = gguf_name(name)
        if arch == "llama" and g.endswith("attn_q.weight"):
            data = permute(data, 4, 4)
        if arch == "llama" and g.endswith("attn_k.weight"):
            data = permute(data, 4, 2)
        add_tensor(w, g, data, types.get(g, Q.F32))
    finish(w)
    return state


def add_tokenizer(w: "gguf.GGUFWriter") -> None:
    """The tests' byte-level BPE tokenizer: :data:`TOKENS`, one merge, bos 0 and eos 1."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * 257)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def add_tensor(w: "gguf.GGUFWriter", name: str, data: np.ndarray, kind: Q) -> None:
    """``data`` (float32) stored as ``kind``: F32, F16, I32 or Q8_0 blocks."""
    if kind == Q.F16:
        w.add_tensor(name, data.astype(np.float16))
    elif kind == Q.I32:
        w.add_tensor(name, data.astype(np.int32))
    elif kind == Q.Q8_0:
        w.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
    else:
        w.add_tensor(name, data)


def finish(w: "gguf.GGUFWriter") -> None:
    """Writes the header, the metadata and the tensors, and closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_as_hf(path):
    """transformers' model of the GGUF file's config, with the file's exact (dequantised) weights."""
    ckpt = open_checkpoint(path)
    keys = dict(ckpt.hf_config)
    config = transformers.AutoConfig.for_model(keys.pop("model_type"), **keys)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(load_stage_weights(ckpt, 0, ckpt.config.num_layers, quantized=False), strict=True)
    return hf
