"""Tiny random Qwen3-VL models (dense and MoE) built and saved by transformers, for the tests that
hold the vision path against it. Every weight is moved off its init value so that all of them
matter. Three sources of configs:

- :data:`SMALL`: a ViT of depth 4 with three DeepStack levels and 4-pixel patches, four decoder
  layers with ``heads * head_dim == hidden``, MoE with four experts;
- :data:`WIDE`: ``heads * head_dim != hidden``, three layers, an untied LM head, M-RoPE bands
  [6, 5, 5] at theta 1e6, a ViT of 16-pixel patches with 576 learned positions (interpolated to
  every grid), two heads, DeepStack from blocks 1 and 2, and Qwen3-VL's pixel bounds scaled down;
- :func:`draw`: a config drawn at random from the space both span, saved with some of the keys
  transformers would fill in left out of ``config.json`` and ``preprocessor_config.json``.

None of them names ``norm_topk_prob``: transformers' Qwen3-VL-MoE config has no such field (its
router always renormalises), and a checkpoint it saves carries none.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

IMAGE, VIDEO, START, END = 120, 121, 118, 119
IM_START, IM_END, USER, ASSISTANT = 116, 117, 101, 102


@dataclass(frozen=True)
class Shape:
    """The keyword arguments of transformers' configs and image processor for one model."""

    vision: dict
    text: dict
    moe: dict
    processor: dict
    top: dict = field(default_factory=dict)
    """Keys of the composite config (``tie_word_embeddings``)."""
    minimal: int | None = None
    """Seed of the keys left out when saved (None: the files as transformers writes them)."""


SMALL = Shape(
    vision=dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=4,
                temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1, 2], in_channels=3),
    text=dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=96, max_position_embeddings=256,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                   mrope_interleaved=True)),
    moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1),
    # Pixel bounds small enough for test images of tens of pixels: 8 x 8 pixels per merged token.
    processor=dict(patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 256, "longest_edge": 2048},
                   image_mean=[0.5, 0.45, 0.4], image_std=[0.25, 0.3, 0.28]))

WIDE = Shape(
    vision=dict(depth=3, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=64, patch_size=16,
                temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=576,
                deepstack_visual_indexes=[1, 2]),
    text=dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=96, max_position_embeddings=4096,
              rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[6, 5, 5],
                                   mrope_interleaved=True)),
    moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
             mlp_only_layers=[]),
    # 32 x 32 pixels per merged token; images under 4096 pixels are scaled up, over 16384 down.
    processor=dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                   size={"shortest_edge": 4096, "longest_edge": 16384}),
    top=dict(tie_word_embeddings=False))


def draw(seed: int) -> Shape:
    """A config drawn from the space of sizes, bands, DeepStack levels, patch and grid sizes, MoE
    layouts and left-out keys that :data:`SMALL` and :data:`WIDE` are two points of."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    head_dim, hidden = rng.choice([8, 16, 32]), rng.choice([32, 64])
    half = head_dim // 2
    h, w = rng.randint(0, half // 2), rng.randint(0, half // 2)
    rope = dict(rope_type="default", mrope_section=[half - h - w, h, w], mrope_interleaved=True)
    if rng.random() < 0.3:
        del rope["mrope_section"]  # transformers' [24, 20, 20], whatever head_dim is
    if rng.random() < 0.6:
        rope["rope_theta"] = rng.choice([1e4, 1e6])
    layers = rng.randint(2, 4)
    text = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]), head_dim=head_dim,
                intermediate_size=rng.choice([48, 80]), rms_norm_eps=rng.choice([1e-6, 1e-5]), rope_parameters=rope)
    if rng.random() < 0.5:
        text["max_position_embeddings"] = 1024
    experts = rng.choice([3, 4, 6])
    moe = dict(num_experts=experts, num_experts_per_tok=rng.randint(1, 3), moe_intermediate_size=rng.choice([16, 48]),
               decoder_sparse_step=rng.choice([1, 1, 2]),
               mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, 1))))
    if rng.random() < 0.3:
        moe["norm_topk_prob"] = rng.random() < 0.5  # a key transformers keeps but its router never reads
    depth, vhidden = rng.randint(2, 4), rng.choice([32, 64])
    patch = rng.choice([4, 8, 16])
    vision = dict(depth=depth, hidden_size=vhidden, num_heads=rng.choice([n for n in (1, 2, 4) if vhidden // n >= 8]),
                  intermediate_size=rng.choice([48, 96]), out_hidden_size=hidden, patch_size=patch,
                  num_position_embeddings=rng.choice([16, 64, 144, 576]),
                  deepstack_visual_indexes=sorted(rng.sample(range(depth), rng.randint(0, min(depth, layers, 3)))))
    factor = (2 * patch) ** 2
    processor = dict(patch_size=patch, temporal_patch_size=2, merge_size=2,
                     size={"shortest_edge": factor * rng.choice([1, 4]), "longest_edge": factor * rng.choice([12, 40])})
    if rng.random() < 0.5:
        processor.update(image_mean=[0.5, 0.45, 0.4], image_std=[0.25, 0.3, 0.28])
    return Shape(vision=vision, text=text, moe=moe, processor=processor,
                 top=dict(tie_word_embeddings=rng.random() < 0.5), minimal=seed)


def build(kind: str, shape: Shape = SMALL):
    """A transformers Qwen3-VL model of ``kind`` ('dense' or 'moe') and ``shape``, float32, eval mode."""
    import transformers

    torch.manual_seed(0 if kind == "dense" else 1)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "dense":
        model = transformers.Qwen3VLForConditionalGeneration(
            transformers.Qwen3VLConfig(vision_config=shape.vision, text_config=shape.text, **tokens, **shape.top))
    else:
        model = transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(
            vision_config=shape.vision, text_config={**shape.text, **shape.moe}, **tokens, **shape.top))
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# Qwen's chat template in short: an image part becomes vision start, one placeholder, vision end.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(folder: Path) -> None:
    """Words ``w1`` .. ``w100`` are ids 1 .. 100; the special tokens have the ids of the config."""
    import tokenizers

    special = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|vision_start|>": START, "<|vision_end|>": END,
               "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO}
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 101)}, "user": USER, "assistant": ASSISTANT, **special}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def _leave_out(saved: dict, defaults: dict, rng: random.Random) -> dict:
    """``saved`` without about half of the keys whose values are ``defaults``' (nested configs too)."""
    out = {}
    for key, value in saved.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            out[key] = _leave_out(value, default, rng)
        elif key not in ("model_type", "architectures") and key in defaults and value == default and rng.random() < .5:
            continue
        else:
            out[key] = value
    return out


def _minimal(folder: Path, model, processor: dict, seed: int) -> None:
    """Rewrite the saved configs without some keys that transformers fills in with the same values
    (the text model's head_dim, rope theta, eps, positions, DeepStack levels ...), as many
    published checkpoints are."""
    rng = random.Random(seed)
    config = type(model.config)()
    defaults = json.loads(config.to_json_string(use_diff=False))
    path = folder / "config.json"
    path.write_text(json.dumps(_leave_out(json.loads(path.read_text()), defaults, rng), indent=1))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil().to_dict()
    path = folder / "preprocessor_config.json"
    saved = json.loads(path.read_text())
    keep = {k: v for k, v in saved.items() if k in processor or k not in hf or rng.random() < .5}
    path.write_text(json.dumps(keep, indent=1))


def save(model, folder: Path, *, shape: Shape = SMALL, published_experts: bool = False) -> Path:
    """``model`` saved in ``folder`` with ``shape``'s image processor config and a word-level
    tokenizer with a chat template; ``published_experts`` stores the fused experts as published
    Qwen3-VL-MoE checkpoints do (``[E, H, 2I]``, ``[E, I, H]``); a drawn shape leaves keys out."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**shape.processor).save_pretrained(folder)
    _tokenizer(folder)
    if shape.minimal is not None:
        _minimal(folder, model, shape.processor, shape.minimal)
    if published_experts:
        path = folder / "model.safetensors"
        tensors = load_file(path)
        tensors = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


def image_tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w // 4


def random_image(w: int, h: int, seed: int):
    """A ``w`` x ``h`` PIL image of uniform noise."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def hf_inputs(folder: Path, ids: list[int], images: list) -> dict:
    """transformers' own processing of a prompt: its image processor read from ``folder``, and the
    prompt's placeholders expanded to one per merged patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = {}
    if images:
        px = Qwen2VLImageProcessorPil.from_pretrained(folder)(images=images, return_tensors="pt")
        counts = iter(image_tokens(tuple(g)) for g in px["image_grid_thw"].tolist())
        ids = [t for tok in ids for t in ([IMAGE] * next(counts) if tok == IMAGE else [tok])]
        out.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    input_ids = torch.tensor([ids])
    out.update(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).int())
    return out


def hf_greedy(hf, folder: Path, ids: list[int], images: list, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for a prompt and the float32 log-softmax of each step's logits."""
    inputs = hf_inputs(folder, ids, images)
    out = hf.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return (out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
            [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits])


def assert_logprobs_close(completion, expected: list[torch.Tensor], atol: float) -> None:
    """Each generated token's log-probability, and those of its position's most likely tokens,
    within ``atol`` of transformers' at that step."""
    assert len(completion.logprobs) == len(expected)
    for step, (got, want) in enumerate(zip(completion.logprobs, expected)):
        for token, logprob in ((got.token, got.logprob), *got.top):
            assert abs(logprob - want[token].item()) <= atol, (step, token, logprob, want[token].item())
        assert got.top[0][0] == int(want.argmax())


def prefill_logits(hf, folder: Path, prompts: list[tuple[list[int], list]]):
    """Every position's logits of ``prompts`` prefilled in one step of a stage holding the whole
    model, given transformers' pixel values, and transformers' own; and the step after the vision
    tower ran. Returns (ours, theirs, batch)."""
    from stagewise.engine.images import ImageInputs, prepare_images
    from stagewise.kv import KVCache, KVCacheManager
    from stagewise.model.batch import StepBatch
    from stagewise.model.kv_metadata import KVMetadata
    from stagewise.model.stage import load_stage

    stage = load_stage(folder, 0, hf.config.text_config.num_hidden_layers)
    rows, refs, prompt_ids, positions, given = [], [], [], [], []
    for rid, (ids, images) in enumerate(prompts):
        inputs = hf_inputs(folder, ids, images)
        with torch.no_grad():
            refs.append(hf(**inputs).logits[0])
        prompt = inputs["input_ids"][0].tolist()
        image = ImageInputs(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]) \
            if images else None
        prepared = prepare_images(stage.config, rid, prompt, image)
        positions.append(prepared.positions if prepared is not None else torch.arange(len(prompt)).expand(3, -1))
        prompt_ids += prompt
        given += [image] if image is not None else []
        rows.append(len(prompt))
    batch = StepBatch(request_ids=list(range(len(rows))), num_prefills=len(rows), query_lens=rows,
                      context_lens=[0] * len(rows), positions=torch.cat([torch.arange(n) for n in rows]),
                      token_ids=torch.tensor(prompt_ids), mrope_positions=torch.cat(positions, dim=1),
                      pixel_values=torch.cat([g.pixel_values for g in given]),
                      image_grid_thw=torch.cat([g.image_grid_thw for g in given]), all_logits=True)
    batch = stage.encode_images(batch)
    blocks = sum(-(-n // 4) for n in rows)
    manager = KVCacheManager(block_size=4, num_blocks=blocks, max_blocks_per_seq=max(-(-n // 4) for n in rows))
    for rid, n in enumerate(rows):
        manager.add(rid, n)
    logits = stage(batch, KVCache(stage.kv_cache_spec(4, torch.float32), num_blocks=blocks),
                   KVMetadata.build(batch, manager, "cpu"))
    return logits, torch.cat(refs), batch
