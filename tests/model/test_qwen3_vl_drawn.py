"""Qwen3-VL configs drawn at random (vl_models.draw) against transformers, so that a whole class of
differences is covered rather than the points SMALL and WIDE are: head sizes that do or do not
multiply to the hidden size, M-RoPE bands of any sizes or none, rope theta given or left to the
class's default, tied or untied heads, ViT depths, widths, heads, patch sizes and learned-position
grids, any DeepStack levels (none included), MoE routers of 1 to 3 of 3 to 6 experts with dense
layers among them, both expert layouts, and configs saved with some of the keys transformers fills
in left out. Each draw: a prompt batch's logits within 1e-4, and greedy tokens and
log-probabilities through :class:`stagewise.Pipeline` with images under, within and above the
pixel bounds, whole or in chunks that split the images.

And the int8 mode on the same path: every quantised matmul (the vision tower's among them)
checked against the int8 reference on its real input, and the int8 run's log-probabilities held to
the float run's."""

from __future__ import annotations

import math
import random

import pytest

from helpers.quant_cases import checked_int8_linear
from helpers.vl_models import (END, IMAGE, SMALL, START, WIDE, assert_logprobs_close, build, draw, hf_greedy, prefill_logits,
                       random_image, save)

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

import torch  # noqa: E402

from stagewise import Pipeline  # noqa: E402

DRAWS = [("dense", seed) for seed in range(4)] + [("moe", seed) for seed in range(4, 10)]


def _bounded_images(shape, rng: random.Random) -> list:
    """Three images: under the processor's smallest pixel count, between, and over its largest."""
    size = shape.processor["size"]
    lo, hi = size["shortest_edge"], size["longest_edge"]
    images = []
    for i, pixels in enumerate([lo / 3, (lo + hi) / 2, hi * 2.5]):
        aspect = rng.uniform(0.5, 2.0)
        w = max(2, round(math.sqrt(pixels * aspect)))
        images.append(random_image(w, max(2, round(pixels / w)), rng.randint(0, 1 << 30) + i))
    return images


@pytest.mark.parametrize(("kind", "seed"), DRAWS, ids=[f"{k}-{s}" for k, s in DRAWS])
def test_drawn_config_matches_transformers(kind, seed, tmp_path):
    shape = draw(seed)
    hf = build(kind, shape)
    folder = save(hf, tmp_path, shape=shape, published_experts=kind == "moe" and seed % 2 == 0)
    rng = random.Random(seed)
    small, middle, large = _bounded_images(shape, rng)
    prompts = [([5, START, IMAGE, END, 6, 7], [small]), ([8, 9, 10], []),
               ([START, IMAGE, END, 11, START, IMAGE, END, 12], [middle, large])]
    logits, expected, _ = prefill_logits(hf, folder, prompts)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)

    greedy = [hf_greedy(hf, folder, ids, images, 4) for ids, images in prompts]
    with Pipeline(folder, max_prefill_tokens=rng.choice([8192, 7])) as pipe:
        out = pipe.generate(prompt_token_ids=[ids for ids, _ in prompts], images=[im for _, im in prompts],
                            max_new_tokens=4, ignore_eos=True, logprobs=2)
    assert [c.error for c in out] == [None] * len(prompts)
    assert [c.token_ids for c in out] == [tokens for tokens, _ in greedy]
    for c, (_, logprobs) in zip(out, greedy):
        assert_logprobs_close(c, logprobs, atol=1e-4)


# Q8_0 weights and int8 activations each carry up to 1/254 relative error per element. Through
# these models (a 3- or 4-block ViT, 3 or 4 decoder layers) the first step's log-probabilities moved
# by at most 0.07 from the float run's on SMALL and WIDE, and by at most 0.14 over six drawn MoE
# configs, where a token routed to another expert moves them most (2026-11-28, AMD EPYC, AVX2). Later
# steps of MoE models moved by up to 0.4 when a generated token's routing flipped, so they are held
# to the float run's top tokens only. This bound catches gross faults of the int8 path (the ViT's qkv
# rows out of order moved them by 0.23 to 0.72); a matmul's own maths is the per-call check's.
INT8_ATOL = 0.2


@pytest.mark.parametrize("shape", [SMALL, WIDE], ids=["small", "wide"])
def test_int8_mode_with_images_in_chunks(shape, tmp_path, monkeypatch):
    """linear_precision="int8" on the MoE model with images, every prompt in chunks of 5 tokens that
    split its images: each quantised matmul, the vision tower's and the LM head's included, agrees
    with the pure-torch int8 reference on its real input; the first step's log-probabilities are
    the float run's within INT8_ATOL, and at each step up to the first token the two runs choose
    differently, the int8 run's most likely token is among the float run's four."""
    from stagewise.model.quant import QuantizedWeight

    hf = build("moe", shape)
    folder = save(hf, tmp_path, shape=shape, published_experts=shape is WIDE)
    prompts = [([5, 6, START, IMAGE, END, 7, 8, 9], [random_image(37, 29, 0)]), ([11, 12, 13], []),
               ([START, IMAGE, END, 21, START, IMAGE, END, 22], [random_image(19, 61, 1), random_image(200, 130, 2)])]
    args = dict(prompt_token_ids=[ids for ids, _ in prompts], images=[im for _, im in prompts], max_new_tokens=6,
                ignore_eos=True, logprobs=4)
    with Pipeline(folder, dtype="float32") as pipe:
        exact = pipe.generate(**args)
    seen = set()
    with Pipeline(folder, dtype="float32", linear_precision="int8", max_prefill_tokens=5) as pipe:
        monkeypatch.setattr(QuantizedWeight, "linear", checked_int8_linear(seen))
        int8 = pipe.generate(**args)
        monkeypatch.undo()
    vision = shape.vision
    assert ("int8", (3 * vision["hidden_size"], vision["hidden_size"])) in seen  # the ViT's fused qkv
    assert ("int8", (shape.text["vocab_size"], shape.text["hidden_size"])) in seen  # the LM head
    assert [c.error for c in int8] == [None] * len(prompts)
    for a, b in zip(exact, int8):
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            theirs = dict(x.top)
            assert y.top[0][0] in theirs, (step, y.top, x.top)
            if step == 0:
                for token, logprob in y.top:
                    if token in theirs:
                        assert abs(logprob - theirs[token]) <= INT8_ATOL, (token, logprob, theirs[token])
            if x.token != y.token:
                break
