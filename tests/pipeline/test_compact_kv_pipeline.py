"""A compact KV cache (``kv_cache_dtype`` int8, and e4m3 once) across processes, against one process
with the same cache: stages (2 and 3), tensor parallel (KV heads split and replicated), TP x DCP
and PCP, prompts in chunks, each run twice (the second after the blocks the first left cached, on
every rank), for tiny random Llama, Qwen3 and Qwen3-MoE models; Qwen3-VL with images over 2
stages; a stage killed mid-generation resuming to the undisturbed run's tokens; and a
kv_cache_dtype the runtime does not have, refused by Pipeline and the command line.

Greedy tokens must be the single process's, every log-probability within
:data:`helpers.compact_kv.LAYOUT_ATOL` (1e-2; e4m3: 3e-2) and at least one request's within the
float cache's 1e-4: float rounding that the float cache's layouts show as ~1e-6 now and then
moves a K/V element of a request to the neighbouring code, and that request's later
log-probabilities by up to 4e-3 (see helpers/compact_kv.py). The reference prompts are those
whose greedy steps keep a margin no such difference can close. The engine in one process:
tests/engine/test_compact_kv_engine.py."""

from __future__ import annotations

import os
import random
import signal

import pytest

import stagewise

from helpers.processes import alive, gone

transformers = pytest.importorskip("transformers")

from helpers.compact_kv import (FP8_LAYOUT_ATOL, LAYOUT_ATOL, MODELS, as_run, assert_same_run,  # noqa: E402
                                clear_prompts, greedy, prompts)
from helpers.hf_models import save_random  # noqa: E402

OPTIONS = dict(max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(name, kv_cache_dtype) -> (folder, prompts, the single process's greedy run of them), the
    prompts some of them over a 32-position virtual block (dcp or pcp 2), built on first use."""
    folders, cache = {}, {}

    def get(name: str, kv_cache_dtype: str = "int8"):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            save_random(MODELS[name], folders[name])
        if (name, kv_cache_dtype) not in cache:
            atol = LAYOUT_ATOL if kv_cache_dtype == "int8" else FP8_LAYOUT_ATOL
            candidates = prompts(16, seed=1, longest=60)
            keep, run = clear_prompts(folders[name], candidates, 5, atol=atol, kv_cache_dtype=kv_cache_dtype,
                                      **OPTIONS)
            rows = [candidates[i] for i in keep]
            assert max(map(len, rows)) > 32, [len(r) for r in rows]
            cache[name, kv_cache_dtype] = folders[name], rows, run
        return cache[name, kv_cache_dtype]

    return get


# The last column: prompt tokens per step (chunked prefill; the single process prefills whole prompts).
@pytest.mark.parametrize(("name", "kv_cache_dtype", "stages", "tp", "dcp", "pcp", "chunk"), [
    ("llama", "int8", 2, 1, 1, 1, 8192),
    ("llama", "int8", 3, 1, 1, 1, 8192),
    ("llama", "int8", 1, 2, 1, 1, 8192),   # one KV head a rank
    ("llama-mqa", "int8", 1, 2, 2, 1, 7),  # the one KV head's sequence over both ranks; prompts in chunks of 7
    ("llama", "int8", 1, 1, 1, 2, 5),      # every prompt chunk split head-tail over 2 ranks
    ("qwen3", "int8", 2, 1, 1, 1, 7),
    ("qwen3", "int8", 3, 1, 1, 1, 8192),
    ("qwen3", "int8", 1, 2, 1, 1, 8192),   # the one KV head on both ranks
    ("qwen3", "int8", 1, 2, 2, 1, 8192),
    ("qwen3", "int8", 1, 1, 1, 2, 8192),
    ("qwen3-moe", "int8", 2, 2, 1, 1, 8192),  # experts split over TP ranks, on both stages
    ("qwen3", "fp8_e4m3", 1, 2, 2, 1, 7),
])
def test_compact_cache_layouts_equal_the_single_process(tiny_models, name, kv_cache_dtype, stages, tp, dcp, pcp,
                                                        chunk):
    folder, rows, want = tiny_models(name, kv_cache_dtype)
    atol = LAYOUT_ATOL if kv_cache_dtype == "int8" else FP8_LAYOUT_ATOL
    cp = dict(interleave_size=4) if dcp * pcp > 1 else {}
    with stagewise.Pipeline(str(folder), stages=stages, tp=tp, dcp=dcp, pcp=pcp, kv_cache_dtype=kv_cache_dtype,
                            max_prefill_tokens=chunk, **cp, **OPTIONS) as pipe:
        assert len(pipe.driver.processes.pids) == stages * tp * pcp and pipe.plan.kv_cache_dtype == kv_cache_dtype
        assert_same_run(greedy(pipe, rows), want, atol, "first run")
        again = greedy(pipe, rows)  # after the blocks the first run left cached (a block: 16 positions a CP rank)
        assert_same_run(again, want, atol, "after cached blocks")
        block = 16 * dcp * pcp
        assert again.cached_tokens == [(len(p) - 1) // block * block for p in rows]


def test_qwen3_vl_with_images_over_two_stages_of_an_int8_cache_equals_the_single_process(tmp_path):
    """Qwen3-VL-MoE: the vision tower on stage 0, DeepStack levels on both sides of the boundary,
    prompts in chunks of 5 (an image's tokens over several steps and both stages) against one
    process prefilling them whole."""
    from helpers.vl_models import END, IMAGE, START, build, random_image, save

    folder = save(build("moe"), tmp_path / "vl-moe", published_experts=True)
    rng, rows, images = random.Random(3), [], []
    for i in range(10):  # prompts of 2 to 8 words and 0 to 2 images of 16 to 72 pixels a side
        ids, pictures = [rng.randrange(1, 101) for _ in range(rng.randint(2, 8))], []
        for j in range(rng.randint(0, 2)):
            at = rng.randint(0, len(ids))
            ids[at:at] = [START, IMAGE, END]
            pictures.append(random_image(rng.randint(16, 72), rng.randint(16, 72), 10 * i + j))
        rows.append(ids)
        images.append(pictures)
    keep, want = clear_prompts(folder, rows, 3, kv_cache_dtype="int8", max_model_len=128, images=images)
    rows, images = [rows[i] for i in keep], [images[i] for i in keep]
    assert sum(map(len, images)) >= 3, images
    with stagewise.Pipeline(str(folder), stages=2, partition="0-1,1-4", kv_cache_dtype="int8", max_model_len=128,
                            max_prefill_tokens=5) as pipe:
        assert_same_run(greedy(pipe, rows, images=images), want)


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """helpers.compact_kv's random Llama with a word-per-token tokenizer (text streams as the
    tokens come back)."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("llama-words")
    save_random(MODELS["llama"], path)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 101)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_a_stage_killed_mid_generation_resumes_to_the_undisturbed_int8_runs_tokens(worded):
    """Stage 1 of 2 killed after 12 streamed tokens: started again, the running requests resume
    from their tokens so far (their prompts and tokens prefilled anew into its int8 cache) and end
    with the undisturbed run's tokens, log-probabilities within LAYOUT_ATOL."""
    new = 12
    candidates = prompts(10, seed=11, longest=20)
    keep, want = clear_prompts(worded, candidates, 3, new=new, kv_cache_dtype="int8", **OPTIONS)
    rows = [candidates[i] for i in keep]
    with stagewise.Pipeline(str(worded), stages=2, max_restarts=1, kv_cache_dtype="int8", **OPTIONS) as pipe:
        pids = list(pipe.driver.processes.pids)
        seen = {"n": 0}

        def on_text(i, text):
            seen["n"] += 1
            if seen["n"] == 12:
                os.kill(pids[1], signal.SIGKILL)

        outs = pipe.generate(prompt_token_ids=rows, max_new_tokens=new, ignore_eos=True, logprobs=2, on_text=on_text)
        assert pipe.restarts == 1 and gone([pids[1]]), "the killed stage was not started again"
        assert [c.finish_reason for c in outs] == ["length"] * 3, [c.error for c in outs]
        assert_same_run(as_run(outs), want, what="resumed")
        new_pids = list(pipe.driver.processes.pids)
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1] and all(alive(p) for p in new_pids)
        assert_same_run(greedy(pipe, rows, new), want, what="the repaired pipeline")
    assert gone(new_pids)


def test_pipeline_refuses_a_kv_cache_dtype_it_does_not_have(tiny_models):
    folder = tiny_models("qwen3")[0]
    for stages in (1, 2):
        with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8_e4m3, got 'int4'"):
            stagewise.Pipeline(str(folder), stages=stages, kv_cache_dtype="int4")
    from stagewise.parallel.runplan import RunPlan

    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8_e4m3, got 'int4'"):
        RunPlan.from_dict({"model": str(folder), "kv_cache_dtype": "int4",
                           "stages": [{"layers": "0-2"}, {"layers": "2-4"}]})


def test_the_command_line_refuses_a_kv_cache_dtype_it_does_not_have(tiny_models, capsys):
    from stagewise.cli import main

    folder = tiny_models("qwen3")[0]
    for command in (["generate", str(folder), "--prompt-ids", "4,5,6"], ["serve", str(folder)]):
        with pytest.raises(SystemExit) as end:
            main([*command, "--kv-cache-dtype", "int4"])
        assert end.value.code == 2
        err = capsys.readouterr().err
        assert f"stagewise {command[0]}: error: argument --kv-cache-dtype: invalid choice: 'int4'" in err
        assert all(choice in err for choice in ("auto", "int8", "fp8_e4m3")), err
