"""Qwen3-VL (dense and MoE) against transformers on tiny random models it builds and saves, of two
shapes (vl_models.SMALL and WIDE): the vision tower, M-RoPE and DeepStack in float32 logits, greedy
generation through :class:`stagewise.Pipeline` with images under, within and above the pixel
bounds (in batches with text-only prompts, several images in one prompt) with each step's
log-probabilities, the checkpoint layouts of the fused experts, and the errors of bad image inputs."""

from __future__ import annotations

import pytest
import torch

from helpers.vl_models import (END, IMAGE, SMALL, START, WIDE, assert_logprobs_close, build, hf_greedy, hf_inputs,
                       prefill_logits, save)
from helpers.vl_models import random_image as _image

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from stagewise import Pipeline  # noqa: E402

SHAPES = {"small": SMALL, "wide": WIDE}


@pytest.fixture(scope="module", params=["dense-small", "moe-small", "moe-wide", "dense-wide"])
def vl(request, tmp_path_factory):
    """(transformers model, its saved folder); the MoE ones' experts stored as published checkpoints
    do in one shape and as transformers 5 saves them in the other."""
    kind, shape = request.param.split("-")
    hf = build(kind, SHAPES[shape])
    folder = save(hf, tmp_path_factory.mktemp(request.param), shape=SHAPES[shape],
                  published_experts=request.param == "moe-small")
    return hf, folder


PROMPTS = [  # (token ids with one placeholder per image, images): SMALL's bounds are 256 to 2048 pixels
    ([5, 6, START, IMAGE, END, 7, 8, 9], [_image(37, 29, 0)]),  # WIDE's are 4096 to 16384
    ([11, 12, 13, 14, 15], []),
    ([START, IMAGE, END, 21, START, IMAGE, END, 22, 23], [_image(19, 61, 1), _image(70, 40, 2)]),
    ([31, START, IMAGE, END, 32], [_image(200, 130, 4)]),
]
_hf_inputs = hf_inputs


def test_prefill_logits_match_transformers(vl):
    """Four requests in one step, three with images (one of them two) and one text-only: every
    position's logits."""
    hf, folder = vl
    logits, expected, batch = prefill_logits(hf, folder, PROMPTS)
    assert batch.deepstack.shape[0] == len(hf.config.vision_config.deepstack_visual_indexes)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def _hf_greedy(hf, folder, ids, images, n: int) -> list[int]:
    return hf_greedy(hf, folder, ids, images, n)[0]


@pytest.mark.parametrize("budget", [8192, 4], ids=["whole", "chunked"])
def test_greedy_generation_matches_transformers(vl, budget):
    """Images as PIL images, file paths and uint8 tensors, in one batch with a text-only prompt; with
    a small prefill budget every prompt is chunked, an image's tokens split over steps (the vision
    tower's output kept from a prompt's first chunk to its last). Each step's log-probabilities
    are transformers' within 1e-4."""
    import numpy as np

    hf, folder = vl
    expected = [hf_greedy(hf, folder, ids, images, 8) for ids, images in PROMPTS]
    path = folder / "second.png"
    PROMPTS[2][1][0].save(path)
    given = [PROMPTS[0][1][0], None, [str(path), torch.from_numpy(np.array(PROMPTS[2][1][1]))], PROMPTS[3][1]]
    with Pipeline(folder, max_prefill_tokens=budget) as pipe:
        out = pipe.generate(prompt_token_ids=[ids for ids, _ in PROMPTS], images=given, max_new_tokens=8,
                            ignore_eos=True, logprobs=3)
    assert [c.error for c in out] == [None] * len(PROMPTS)
    assert [c.token_ids for c in out] == [tokens for tokens, _ in expected]
    for c, (_, logprobs) in zip(out, expected):
        assert_logprobs_close(c, logprobs, atol=1e-4)


def test_precomputed_pixel_values_and_prompt_without_placeholders(vl):
    hf, folder = vl
    ids, images = PROMPTS[0]
    inputs = _hf_inputs(folder, ids, images)
    bare = [t for t in ids if t not in (START, IMAGE, END)]
    with Pipeline(folder) as pipe:
        [given, placed] = pipe.generate(
            prompt_token_ids=[ids, bare], max_new_tokens=5, ignore_eos=True,
            images=[{"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}, images])
    assert given.token_ids == _hf_greedy(hf, folder, ids, images, 5)
    # No placeholder in the prompt: the image goes in front, as the chat template puts it.
    assert placed.prompt_token_ids[:3] == [START, IMAGE, IMAGE]
    assert placed.token_ids == _hf_greedy(hf, folder, [START, IMAGE, END, *bare], images, 5)


def test_chat_template_places_the_images(vl):
    """Text prompts with ``chat``: the template puts each image's vision start, placeholder and end
    in front of the text, and each placeholder becomes one token per merged patch."""
    from helpers.vl_models import ASSISTANT, IM_END, IM_START, USER

    hf, folder = vl
    images = PROMPTS[2][1]
    with Pipeline(folder) as pipe:
        [c] = pipe.generate(["w5 w6"], chat=True, images=[images], max_new_tokens=4, ignore_eos=True)
    ids = [IM_START, USER, START, IMAGE, END, START, IMAGE, END, 5, 6, IM_END, IM_START, ASSISTANT]
    inputs = _hf_inputs(folder, ids, images)
    assert c.error is None and c.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert c.token_ids == _hf_greedy(hf, folder, ids, images, 4)


def test_bad_images_end_their_prompt_only(vl, tmp_path):
    _, folder = vl
    corrupt, empty = tmp_path / "corrupt.png", tmp_path / "empty.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    empty.write_bytes(b"")
    good = PROMPTS[0]
    with Pipeline(folder, max_image_pixels=60 * 60) as pipe:
        out = pipe.generate(prompt_token_ids=[good[0]] * 6, max_new_tokens=3, ignore_eos=True,
                            images=[good[1], str(corrupt), str(empty), [good[1][0], good[1][0]], _image(61, 61, 3),
                                    None])
    assert out[0].error is None and len(out[0].token_ids) == 3
    assert [c.finish_reason for c in out[1:]] == ["error"] * 5
    assert "prompt 1: image 0:" in out[1].error and "corrupt.png" in out[1].error
    assert "prompt 2: image 0:" in out[2].error and "empty.png" in out[2].error
    assert "prompt 3" in out[3].error and "1 image placeholder(s) but 2 image(s)" in out[3].error
    assert "prompt 4: image 0:" in out[4].error and "above the limit of 3600" in out[4].error
    assert "placeholders" in out[5].error  # a placeholder without its image


def test_images_for_a_text_only_model(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=48)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    with Pipeline(tmp_path) as pipe:
        ok, bad = pipe.generate(prompt_token_ids=[[1, 2, 3], [1, 2, 3]], images=[None, _image(8, 8, 0)],
                                max_new_tokens=2, ignore_eos=True)
    assert ok.error is None and len(ok.token_ids) == 2
    assert bad.finish_reason == "error" and "prompt 1" in bad.error and "text-only" in bad.error


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("inter", [24, 32, 64], ids=["plain", "square-gate-up", "square-down"])
def test_expert_layouts_and_stage_bytes(tmp_path, inter):
    """The fused experts in transformers' layout, the published (transposed) one and one tensor per
    expert all load as the table's, also where one of the fused tensors is square (hidden 64 is
    twice or once the experts' width) and only the other one's shape tells the layouts apart; only
    the first stage reads vision bytes (its TP rank 0 only); a stage reads its layers and nothing
    else; a TP rank's cut of the transposed layout is its block."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from stagewise.model.loader import load_stage_weights
    from stagewise.model.loader.hf_folder import HFCheckpoint

    hf = build("moe", dataclasses.replace(SMALL, moe={**SMALL.moe, "moe_intermediate_size": inter}))
    state = {k: v for k, v in hf.state_dict().items()}
    own = save(hf, tmp_path / "own")
    published = save(hf, tmp_path / "published", published_experts=True)
    per_expert = save(hf, tmp_path / "per_expert")
    tensors = load_file(per_expert / "model.safetensors")
    for name in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        p, gate_up, down = name.removesuffix("gate_up_proj"), tensors.pop(name), tensors.pop(
            name.replace("gate_up_proj", "down_proj"))
        for e in range(gate_up.size(0)):
            gate, up = gate_up[e].chunk(2)
            tensors.update({f"{p}{e}.gate_proj.weight": gate.clone(), f"{p}{e}.up_proj.weight": up.clone(),
                            f"{p}{e}.down_proj.weight": down[e].clone()})
    save_file(tensors, per_expert / "model.safetensors", metadata={"format": "pt"})
    for folder in (own, published, per_expert):
        got = load_stage_weights(folder, 0, 4)
        for name, value in got.items():
            assert torch.equal(value, state[name]), (folder.name, name)
    on_disk = load_file(published / "model.safetensors")
    vision = _nbytes(v for k, v in on_disk.items() if k.startswith("model.visual."))
    ckpt = HFCheckpoint(published)
    later = load_stage_weights(ckpt, 2, 4)
    assert not any(k.startswith("model.visual.") for k in later)
    layers = _nbytes(v for k, v in on_disk.items() if ".layers.2." in k or ".layers.3." in k)
    tail = _nbytes(v for k, v in on_disk.items() if k in ("lm_head.weight", "model.language_model.norm.weight"))
    assert ckpt.bytes_read == layers + tail
    ckpt = HFCheckpoint(published)
    first = load_stage_weights(ckpt, 0, 1)
    assert sum(k.startswith("model.visual.") for k in first) == sum(k.startswith("model.visual.") for k in on_disk)
    head = _nbytes(v for k, v in on_disk.items() if ".layers.0." in k or "embed_tokens" in k)
    assert ckpt.bytes_read == vision + head
    assert not any(k.startswith("model.visual.") for k in load_stage_weights(published, 0, 1, tp_rank=1, tp_size=2))
    rank1 = load_stage_weights(published, 1, 2, tp_rank=1, tp_size=2)
    p = "model.language_model.layers.1.mlp.experts."
    gate, up = state[p + "gate_up_proj"].chunk(2, dim=1)
    half = inter // 2
    assert torch.equal(rank1[p + "gate_up_proj"], torch.cat([gate[:, half:], up[:, half:]], dim=1))
    assert torch.equal(rank1[p + "down_proj"], state[p + "down_proj"][:, :, half:])
