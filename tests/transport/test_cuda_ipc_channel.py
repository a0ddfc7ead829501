"""GPU stages of one pipeline on one host: two and three stages exchange activations through CUDA
IPC rings (cuda-ipc); two stages on one GPU over torch.distributed (the torch transport, whose world
runs gloo there: NCCL takes one rank to a GPU). Token-exact against one process. Needs a GPU
(marked ``cuda``)."""

from __future__ import annotations

import pytest
import torch

import stagewise

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("stages, transport", [(2, "cuda-ipc"), (3, "cuda-ipc"), (2, "torch")])
def test_gpu_stages_equal_one_process(tmp_path, stages, transport):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, max_position_embeddings=128)).eval()
    hf.save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    with stagewise.Pipeline(str(tmp_path), device="cuda", max_model_len=64) as single:
        want = [c.token_ids for c in single.generate(prompt_token_ids=prompts, max_new_tokens=6, ignore_eos=True)]
    assert [len(t) for t in want] == [6, 6, 6]  # a step that failed on both sides would compare equal
    with stagewise.Pipeline(str(tmp_path), stages=stages, device="cuda", transport=transport, max_model_len=64) as pipe:
        got = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=6, ignore_eos=True)]
    assert got == want
