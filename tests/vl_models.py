"""Tiny random Qwen3-VL models (dense and MoE) built and saved by transformers, for the tests that
hold the vision path against it: a ViT of depth 4 with three DeepStack levels, four decoder layers,
MoE with four experts. Every weight is moved off its init value so that all of them matter."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE, VIDEO, START, END = 120, 121, 118, 119
VISION = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1, 2], in_channels=3)
TEXT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                 mrope_interleaved=True))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, norm_topk_prob=True)
# Pixel bounds small enough for test images of tens of pixels: 8 x 8 pixels per merged token.
PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 256, "longest_edge": 2048},
                 image_mean=[0.5, 0.45, 0.4], image_std=[0.25, 0.3, 0.28])


def build(kind: str):
    """A transformers Qwen3-VL model of ``kind`` ('dense' or 'moe'), float32, eval mode."""
    import transformers

    torch.manual_seed(0 if kind == "dense" else 1)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "dense":
        model = transformers.Qwen3VLForConditionalGeneration(
            transformers.Qwen3VLConfig(vision_config=VISION, text_config=TEXT, **tokens))
    else:
        model = transformers.Qwen3VLMoeForConditionalGeneration(
            transformers.Qwen3VLMoeConfig(vision_config=VISION, text_config={**TEXT, **MOE}, **tokens))
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


IM_START, IM_END, USER, ASSISTANT = 116, 117, 101, 102
# Qwen's chat template in short: an image part becomes vision start, one placeholder, vision end.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(folder: Path) -> None:
    """Words ``w1`` .. ``w100`` are ids 1 .. 100; the special tokens have the ids of the config."""
    import json

    import tokenizers

    special = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|vision_start|>": START, "<|vision_end|>": END,
               "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO}
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 101)}, "user": USER, "assistant": ASSISTANT, **special}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def save(model, folder: Path, *, published_experts: bool = False) -> Path:
    """``model`` saved in ``folder`` with its image processor config and a word-level tokenizer with
    a chat template; ``published_experts`` stores the fused experts as published Qwen3-VL-MoE
    checkpoints do (``[E, H, 2I]``, ``[E, I, H]``)."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(folder)
    _tokenizer(folder)
    if published_experts:
        path = folder / "model.safetensors"
        tensors = load_file(path)
        tensors = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


def image_tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // 4
