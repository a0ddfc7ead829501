"""Qwen3-VL as a pipeline of stage processes against transformers: greedy tokens identical with 2
and 3 stages (the DeepStack levels straddling a boundary, a stage past the last level, the
balanced partition), with stages of two tensor-parallel ranks, under prefill context parallelism
(one and two stages) and decode context parallelism, images in some rows of a batch; and what
crosses a boundary: the named extra tensors of a step frame (golden bytes), none on decode frames,
DeepStack levels only to the stages that add them; the balanced partition weighs the vision tower
on stage 0."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from helpers.vl_models import END, IMAGE, START, WIDE, assert_logprobs_close, build, hf_greedy, random_image, save

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

import stagewise  # noqa: E402
from stagewise.model.batch import StepBatch  # noqa: E402
from stagewise.pipeline import protocol  # noqa: E402
from stagewise.pipeline.protocol import StageShape, Step  # noqa: E402
from stagewise.transport import decode_frame, encode_frame  # noqa: E402

NEW = 6
_image = random_image
PROMPTS = [([5, 6, START, IMAGE, END, 7, 8], [_image(37, 29, 0)]), ([11, 12, 13], []),
           ([START, IMAGE, END, 21, START, IMAGE, END, 22], [_image(19, 61, 1), _image(70, 40, 2)])]
# WIDE's pixel bounds are 4096 to 16384: an image under them, one within and one over.
WIDE_PROMPTS = [([5, 6, START, IMAGE, END, 7, 8], [_image(97, 61, 0)]), ([11, 12, 13], []),
                ([START, IMAGE, END, 21, START, IMAGE, END, 22], [_image(40, 30, 1), _image(200, 130, 2)])]


def _saved(kind: str, folder, shape=None, prompts=PROMPTS):
    """The model saved (MoE: the published expert layout), the prompts, and transformers' greedy
    tokens and log-probabilities for each."""
    hf = build(kind) if shape is None else build(kind, shape)
    folder = save(hf, folder, published_experts=kind == "moe") if shape is None else \
        save(hf, folder, shape=shape, published_experts=True)
    return folder, prompts, [hf_greedy(hf, folder, ids, images, NEW) for ids, images in prompts]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _saved("moe", tmp_path_factory.mktemp("vl-moe"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _saved("dense", tmp_path_factory.mktemp("vl-dense"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The MoE model of vl_models.WIDE: the config, images and checkpoint layout a Qwen3-VL-MoE
    answered differently from transformers with, its router's renormalisation missing."""
    return _saved("moe", tmp_path_factory.mktemp("vl-wide"), WIDE, WIDE_PROMPTS)


@pytest.mark.parametrize(("kind", "stages", "partition", "tp", "pcp", "dcp", "budget"), [
    ("moe", 2, "balanced", 1, 1, 1, None), ("moe", 3, "0-1,1-3,3-4", 1, 1, 1, None),
    ("dense", 2, "0-2,2-4", 1, 1, 1, None), ("moe", 2, "even", 2, 1, 1, None), ("dense", 1, "even", 1, 2, 1, None),
    ("moe", 2, "0-1,1-4", 1, 2, 1, None), ("dense", 1, "even", 4, 1, 2, None), ("moe", 2, "0-1,1-4", 2, 1, 1, 5),
    ("wide", 2, "even", 1, 1, 1, None), ("wide", 3, "even", 1, 1, 1, None), ("wide", 2, "0-1,1-3", 2, 1, 1, 6),
    ("wide", 2, "0-2,2-3", 1, 2, 1, None)])
def test_pipeline_tokens_equal_transformers(request, kind, stages, partition, tp, pcp, dcp, budget):
    """3 stages: stage 0 holds one of the three DeepStack layers, stage 1 the other two, stage 2 none.
    Dense: the later stage decodes in the C++ layer loop at the rope-shifted positions. tp 2: stage
    0's leader hands its other rank the image embeddings and DeepStack features with each step.
    pcp 2: each rank prefills its head-tail share of every prompt, image tokens and DeepStack
    features among them, on both sides of a stage boundary that splits the DeepStack layers. pcp 2
    and dcp 2: the decode rows of a request with images carry rope positions shifted by its rope
    delta, while its KV shards follow its sequence positions. A prefill budget of 5 tokens: every
    prompt in chunks, each image's tokens and DeepStack features split over steps and stages of two
    TP ranks. Wide: the MoE of vl_models.WIDE with images under, within and over its pixel bounds,
    in 2 and 3 stages, stages of two TP ranks (prompts in chunks of 6), and pcp 2. Each step's
    log-probabilities are transformers' within 1e-4."""
    folder, prompts, expected = request.getfixturevalue(kind)
    options = {} if budget is None else {"max_prefill_tokens": budget}
    with stagewise.Pipeline(str(folder), stages=stages, partition=partition, tp=tp, pcp=pcp, dcp=dcp,
                            max_model_len=128, **options) as pipe:
        got = pipe.generate(prompt_token_ids=[ids for ids, _ in prompts], images=[im for _, im in prompts],
                            max_new_tokens=NEW, ignore_eos=True, logprobs=3)
        assert [c.error for c in got] == [None] * 3
        assert [c.token_ids for c in got] == [tokens for tokens, _ in expected]
        for c, (_, logprobs) in zip(got, expected):
            assert_logprobs_close(c, logprobs, atol=1e-4)
        if partition == "balanced":  # the vision tower's weight moves layers off stage 0
            assert [tuple(r) for r in pipe.plan.stage_plan.ranges] == [(0, 1), (1, 4)]


def _vl_step(levels: int = 3) -> StepBatch:
    """A prefill of 4 tokens (2 of them image tokens) and a decode row, after stage 0's layer."""
    return StepBatch(request_ids=[7, 9], num_prefills=1, query_lens=[4, 1], context_lens=[0, 12],
                     positions=torch.tensor([0, 1, 1, 3, 10]), hidden_states=torch.ones(5, 2),
                     mrope_positions=torch.tensor([[0, 1, 1, 3, 10], [0, 1, 1, 3, 10], [0, 1, 2, 3, 10]]),
                     visual_rows=torch.tensor([1, 2]), deepstack=torch.arange(levels * 4.0).view(levels, 2, 2))


def test_deepstack_goes_only_to_the_stages_that_add_it():
    shape = StageShape(index=2, hidden_size=2, dtype=torch.float32, max_model_len=64, device=torch.device("cpu"))
    batch = _vl_step()
    after_one = batch.for_next_stage(batch.hidden_states, layers=1)  # stage 0 ran one layer: two levels left
    frame = decode_frame(encode_frame(protocol.to_frame(Step(step_id=1, group=0, batch=after_one), stage_from=1,
                                                        stage_to=2)))
    assert list(frame.tensors) == ["hidden", "positions", "mrope_positions", "visual_rows", "deepstack"]
    got = protocol.from_frame(frame, shape).batch
    assert torch.equal(got.deepstack, batch.deepstack[1:]) and torch.equal(got.visual_rows, batch.visual_rows)
    assert torch.equal(got.mrope_positions, batch.mrope_positions) and torch.equal(got.positions, batch.positions)
    spent = got.for_next_stage(got.hidden_states, layers=2)  # the next stage is past the last level
    frame = protocol.to_frame(Step(step_id=1, group=0, batch=spent), stage_from=2, stage_to=3)
    assert "deepstack" not in frame.tensors and "visual_rows" not in frame.tensors
    decode = StepBatch(request_ids=[9], num_prefills=0, query_lens=[1], context_lens=[12],
                       positions=torch.tensor([10]), hidden_states=torch.ones(1, 2))
    frame = protocol.to_frame(Step(step_id=2, group=0, batch=decode), stage_from=1, stage_to=2)
    assert list(frame.tensors) == ["hidden", "positions"]  # the rope delta: no image data
    plain = StepBatch(request_ids=[9], num_prefills=0, query_lens=[1], context_lens=[12],
                      positions=torch.tensor([12]), hidden_states=torch.ones(1, 2))
    assert list(protocol.to_frame(Step(step_id=2, group=0, batch=plain), stage_from=1, stage_to=2).tensors) == [
        "hidden"]


def test_vision_tensors_golden_bytes():
    """docs/wire-format.md's tensor table for a step frame with the Qwen3-VL tensors, written by hand."""
    batch = _vl_step(levels=1)
    raw = encode_frame(protocol.to_frame(Step(step_id=3, group=1, batch=batch), stage_from=1, stage_to=2),
                       checksum=False)
    table = 80 + 2 * 24
    entry = "<24sBBHIQQ8I"
    want = [(b"hidden", 1, 2, 0, 40, (5, 2)), (b"positions", 5, 1, 64, 40, (5,)),
            (b"mrope_positions", 5, 2, 128, 120, (3, 5)), (b"visual_rows", 5, 1, 256, 16, (2,)),
            (b"deepstack", 1, 3, 320, 16, (1, 2, 2))]
    for i, (name, dtype, ndim, offset, nbytes, dims) in enumerate(want):
        got = raw[table + 80 * i: table + 80 * (i + 1)]
        assert got == struct.pack(entry, name, dtype, ndim, 0, 0, offset, nbytes, *dims, *[0] * (8 - len(dims)))
    payload = len(raw) - 336
    assert raw[payload + 128: payload + 248] == struct.pack("<15q", 0, 1, 1, 3, 10, 0, 1, 1, 3, 10, 0, 1, 2, 3, 10)
    assert raw[payload + 256: payload + 272] == struct.pack("<2q", 1, 2)
    assert raw[payload + 320:] == struct.pack("<4f", 0, 1, 2, 3)


def test_bad_vision_tensors_are_refused():
    shape = StageShape(index=2, hidden_size=2, dtype=torch.float32, max_model_len=64, device=torch.device("cpu"))
    frame = decode_frame(encode_frame(protocol.to_frame(Step(step_id=1, group=0, batch=_vl_step()), stage_from=1,
                                                        stage_to=2)))
    for name, value, message in [("deepstack", torch.zeros(3, 3, 2), "deepstack"),
                                 ("mrope_positions", torch.zeros(2, 5, dtype=torch.int64), "mrope_positions"),
                                 ("visual_rows", torch.tensor([1, 9]), r"visual_rows.*\[0, 5\)")]:
        bad = dict(frame.tensors, **{name: value})
        with pytest.raises(protocol.ProtocolError, match=message):
            protocol.from_frame(dataclasses.replace(frame, tensors=bad), shape)


def test_balanced_partition_weighs_the_vision_tower(moe):
    from stagewise.model.hf_config import parse_config_file
    from stagewise.model.shapes import count, vision_tensors
    from stagewise.parallel import decode_layer_costs

    cfg = parse_config_file(moe[0])
    _, first, _ = decode_layer_costs(cfg)
    assert first == cfg.hidden_size + count(cfg, vision_tensors(cfg))


@pytest.mark.parametrize("stages", [1, 2])
def test_cli_generate_with_an_image(moe, stages, tmp_path, capsys):
    import json

    from stagewise.cli import main as cli_main

    folder, _, expected = moe
    ids, [image] = PROMPTS[0]
    image.save(tmp_path / "cat.png")
    argv = ["generate", str(folder), "--prompt-ids", ",".join(map(str, ids)), "--image", str(tmp_path / "cat.png"),
            "--max-new-tokens", str(NEW), "--ignore-eos", "--json", "--stages", str(stages)]
    assert cli_main(argv) == 0
    [completion] = json.loads(capsys.readouterr().out)["completions"]
    assert completion["token_ids"] == expected[0][0]
    assert cli_main([*argv[:4], "--image", str(tmp_path / "missing.png"), *argv[6:]]) == 2
    assert f"--image {tmp_path / 'missing.png'}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("stages", [1, 3])
def test_cli_generate_chat_with_an_image(wide, stages, tmp_path, capsys):
    """The command a user runs: ``stagewise generate DIR --chat --image IMG --json --dtype float32``
    on the wide MoE, an image over its pixel bounds, answered with transformers' tokens and
    log-probabilities (within 1e-4)."""
    import json

    from helpers.vl_models import ASSISTANT, IM_END, IM_START, USER

    from stagewise.cli import main as cli_main

    folder, _, _ = wide
    hf = build("moe", WIDE)
    image = _image(200, 130, 7)
    image.save(tmp_path / "picture.png")
    ids = [IM_START, USER, START, IMAGE, END, 5, 6, IM_END, IM_START, ASSISTANT]
    expected, logprobs = hf_greedy(hf, folder, ids, [image], NEW)
    argv = ["generate", str(folder), "--chat", "--prompt", "w5 w6", "--image", str(tmp_path / "picture.png"),
            "--json", "--dtype", "float32", "--max-new-tokens", str(NEW), "--ignore-eos", "--stages", str(stages),
            "--logprobs", "2"]
    assert cli_main(argv) == 0
    [completion] = json.loads(capsys.readouterr().out)["completions"]
    assert completion["token_ids"] == expected
    for step, want in zip(completion["logprobs"], logprobs, strict=True):
        for token, logprob in [(step["token"], step["logprob"]), *step["top"]]:
            assert abs(logprob - want[token].item()) <= 1e-4, (token, logprob, want[token].item())


def test_stages_started_apart_take_images_through_attach(dense, tmp_path):
    """Stages started on their own (here by torchrun, as on other hosts) and a driver attached to
    them: the images travel with the first step from the attached driver's stage 0 as from a local
    pipeline's, and the tokens are transformers'."""
    import json
    import socket
    import subprocess
    import sys

    from stagewise.launch.local import StageProcesses

    folder, _, expected = dense
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": str(folder), "max_model_len": 128,
                                "stages": [{"listen": "127.0.0.1:0", "layers": "0-2"},
                                           {"listen": "127.0.0.1:0", "layers": "2-4"}]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(port), "-m", "stagewise.cli", "stage", "--plan",
                            str(plan), "--torchrun"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with stagewise.Pipeline.attach(str(plan), store=f"127.0.0.1:{port}", connect_timeout=120) as pipe:
            got = pipe.generate(prompt_token_ids=[ids for ids, _ in PROMPTS], images=[im for _, im in PROMPTS],
                                max_new_tokens=NEW, ignore_eos=True)
        assert [c.error for c in got] == [None] * 3
        assert [c.token_ids for c in got] == [tokens for tokens, _ in expected]
        log, _ = run.communicate(timeout=60)
        assert run.returncode == 0, log
    finally:
        StageProcesses([run]).stop(grace_s=0.1)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_cached_prefix_with_an_image_is_reused_only_for_the_same_image(request, stages):
    """Text, an image, then text, over blocks of 16 tokens. The same prompt and image again starts
    after every block but the last token's; the same text with another image only after the blocks
    before the image's first token (an image's placeholders are the same tokens for any image of
    its size: its content is part of a block's identity). Tokens and logprobs are transformers'."""
    folder, _, _ = request.getfixturevalue("dense")
    hf = build("dense")  # the same seed as the saved model
    ids = [30 + i for i in range(20)] + [START, IMAGE, END] + [60 + i for i in range(20)]
    first, other = _image(37, 29, 0), _image(37, 29, 5)
    runs = [first, first, other]
    with stagewise.Pipeline(str(folder), stages=stages, max_model_len=128) as pipe:
        got = [pipe.generate(prompt_token_ids=[ids], images=[[im]], max_new_tokens=NEW, ignore_eos=True,
                             logprobs=3)[0] for im in runs]
    expanded = got[0].prompt_token_ids
    n, before_image = len(expanded), expanded.index(IMAGE) // 16 * 16
    assert before_image == 16 and n > 48
    assert [c.cached_tokens for c in got] == [0, (n - 1) // 16 * 16, before_image]
    for c, im in zip(got, runs):
        tokens, logprobs = hf_greedy(hf, folder, ids, [im], NEW)
        assert c.token_ids == tokens
        assert_logprobs_close(c, logprobs, atol=1e-4)
