"""The command line, tried as a new user would: every argument problem named at once and before
anything heavy loads, what the model's config rules out named before the weights load, the
version, prompt files in and JSON lines out, the sampling options, and failed requests that keep
what they produced."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from stagewise import __version__
from stagewise.cli import main as cli_main

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128, eos_token_id=None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(path)
    return path


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagewise.cli", *argv], capture_output=True, text=True, timeout=300)


def test_version():
    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"stagewise {__version__}"


def test_argument_problems_are_named_together_before_torch_is_imported():
    """The arguments alone decide these: all of them in one message, exit status 2, and nothing
    heavy imported (the check runs in well under a second)."""
    code = ("import sys; from stagewise.cli import main; "
            "rc = main(['generate', 'some-model', '--prompt', 'x', '--temperature', '-1', '--top-p', '2', "
            "'--partition', 'even', '--max-num-seqs', '0', '--max-prefill-tokens', '0', '--logprobs', '30', '--tpot-target', '0']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    err = run.stderr
    assert "8 problems" in err, err
    for fragment in ("temperature must be a finite number >= 0", "top_p must be a number in (0, 1]",
                     "--partition applies to processes", "--max-num-seqs must be >= 1",
                     "--max-prefill-tokens must be >= 1, got 0", "--tpot-target must be a finite number of milliseconds > 0 (or none), got 0.0",
                     "logprobs must be None or an int in [0, 20]", "--logprobs needs --json or --prompt-file"):
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("argv, fragments", [
    (["--prompt-ids", "-1,2,500"], ["token ids must be in [0, vocab_size=101), got [-1, 500]"]),
    (["--prompt-ids", "1,2", "--max-new-tokens", "1000000000"], ["max_new_tokens 1000000000 leaves no room"]),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "126"], ["3 prompt tokens + max_new_tokens 126 exceed"]),
    (["--prompt", "x", "--max-model-len", "129"], ["--max-model-len 129 is above the model's max_position_embeddings"]),
    (["--prompt-ids", "1", "--stages", "4"], ["--stages 4: the model has 3 layers"]),
    (["--prompt-ids", "1", "--stages", "2", "--partition", "0-1,2-3"], ["--partition '0-1,2-3'", "gap"]),
    (["--prompt-ids", "1", "--tp", "3"], ["--tp 3 --dcp 1: tp=3 does not split num_attention_heads=", "valid tp sizes: 1"]),
    (["--prompt-ids", "1", "--tp", "2", "--dcp", "2"], ["dcp=2 at tp=2", "valid dcp sizes at tp=2: 1"]),
    (["--prompt-ids", "1", "--image", __file__], ["--image: the model is text-only (llama, no vision tower)"]),
])
def test_what_the_config_rules_out_is_named_before_loading(folder, argv, fragments, capsys):
    assert cli_main(["generate", str(folder), *argv]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("argv, fragments", [
    (["--prompt", ""], ["prompt 0: the prompt is empty"]),
    (["--prompt", "fine", "--prompt", ""], ["prompt 1: the prompt is empty"]),
    (["--prompt", "word " * 9000, "--chat"], ["prompt 0: 90", "exceed the model length 8192"]),
    (["--prompt-file", "{empty}"], ["empty.jsonl:2: the prompt is empty"]),
])
def test_text_prompts_are_checked_before_loading(argv, fragments, tmp_path, capsys, monkeypatch):
    """Text prompts are encoded with the checkpoint's tokenizer (and chat template) before the
    weights load: an empty or too long one is named at once, not after the model loaded."""
    from stagewise.cli import generate

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    monkeypatch.setattr(generate, "open_pipeline", lambda *_: pytest.fail("the model was loaded"))
    assert cli_main(["generate", "smollm2-135m", *[a.format(empty=empty) for a in argv]]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_a_misspelled_option_is_named_by_its_command(capsys):
    """The command's own usage and the option meant, not the top-level usage."""
    with pytest.raises(SystemExit) as end:
        cli_main(["generate", "smollm2-135m", "--prompt", "hi", "--temprature", "0.5", "stray"])
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: stagewise generate") and "stagewise generate: error: unrecognized arguments: " \
        "--temprature 0.5 stray (--temprature: did you mean --temperature?)" in err
    with pytest.raises(SystemExit):
        cli_main(["serve", "smollm2-135m", "--prot=8000"])
    assert "stagewise serve: error" in (err := capsys.readouterr().err) and "did you mean --port?" in err


def test_remeasure_needs_a_measured_partition(capsys):
    assert cli_main(["generate", "smollm2-135m", "--prompt", "hi", "--stages", "2", "--remeasure"]) == 2
    assert "--remeasure applies to --partition measured" in capsys.readouterr().err


def test_a_bad_plan_is_a_usage_error(tmp_path, capsys):
    """generate --plan on a plan with a problem exits 2 naming it, as launch and doctor do."""
    plan = tmp_path / "bad.yaml"
    plan.write_text("model: smollm2-135m\nstages:\n  - listen: nothere\n")
    assert cli_main(["generate", "--plan", str(plan), "--prompt", "hi"]) == 2
    assert "stages[0].listen must be 'host:port', got 'nothere'" in capsys.readouterr().err
    assert cli_main(["generate", "--plan", str(tmp_path / "missing.yaml"), "--prompt", "hi"]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_prompt_file_in_json_lines_out(folder, tmp_path, capsys):
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"prompt_ids": [5, 6, 7], "max_new_tokens": 3}),
        "",
        json.dumps({"prompt_ids": [8, 9], "max_new_tokens": 2, "logprobs": 1}),
        json.dumps({"prompt_ids": [10], "temperature": 0.9, "seed": 4, "max_new_tokens": 4}),
    ]) + "\n")
    assert cli_main(["generate", str(folder), "--prompt-file", str(prompts), "--ignore-eos"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["index"], x["line"], len(x["token_ids"])) for x in lines] == [(0, 1, 3), (1, 3, 2), (2, 4, 4)]
    assert lines[1]["logprobs"][0]["token"] == lines[1]["token_ids"][0] and len(lines[1]["logprobs"][0]["top"]) == 1
    assert "logprobs" not in lines[0]
    # The same requests through the API give the same tokens.
    import stagewise

    with stagewise.Pipeline(str(folder)) as pipe:
        want = pipe.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [10]], ignore_eos=True,
                             overrides=[{"max_new_tokens": 3}, {"max_new_tokens": 2},
                                        {"temperature": 0.9, "seed": 4, "max_new_tokens": 4}])
    assert [x["token_ids"] for x in lines] == [c.token_ids for c in want]


def test_prompt_file_problems_name_their_lines(folder, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt_ids": [1], "top_k": -2}\nnot json\n{"prompt": "a", "prompt_ids": [1]}\n'
                       '{"prompt_ids": [1], "colour": "red"}\n')
    assert cli_main(["generate", str(folder), "--prompt-file", str(prompts)]) == 2
    err = capsys.readouterr().err
    for fragment in (f"{prompts}:1: top_k must be an int >= 0", f"{prompts}:2: not JSON",
                     f"{prompts}:3: give exactly one of prompt and prompt_ids", f"{prompts}:4: 'colour' is not a sampling option"):
        assert fragment in err, (fragment, err)


def test_json_output_carries_logprobs_and_the_sampling_options(folder, capsys):
    assert cli_main(["generate", str(folder), "--prompt-ids", "4,5,6", "--max-new-tokens", "4", "--json",
                     "--logprobs", "2", "--repetition-penalty", "1.5", "--presence-penalty", "0.5",
                     "--frequency-penalty", "0.25", "--ignore-eos"]) == 0
    [c] = json.loads(capsys.readouterr().out)["completions"]
    assert len(c["token_ids"]) == 4 and [e["token"] for e in c["logprobs"]] == c["token_ids"]
    import stagewise

    with stagewise.Pipeline(str(folder)) as pipe:
        [want] = pipe.generate(prompt_token_ids=[4, 5, 6], max_new_tokens=4, repetition_penalty=1.5,
                               presence_penalty=0.5, frequency_penalty=0.25, ignore_eos=True)
    assert c["token_ids"] == want.token_ids
