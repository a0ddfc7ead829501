"""apply_token_bitmask: structured output's token mask applied to the logits in place.

Held against stagewise.ops.reference.apply_token_bitmask (bit for bit: kept logits untouched,
the others -inf) and against llguidance's own bitmask of a real constraint; rows not named are
not written; bad arguments are named.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import DEVICES, DTYPES, strided

import stagewise.ops as ops
from stagewise.ops import reference


def random_bitmask(rows: int, words: int) -> torch.Tensor:
    """Random words, with an all-allowed and an all-refused word in every row."""
    bits = torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int64).to(torch.int32)
    bits[:, 0], bits[:, -1] = -1, 0
    return bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, words", [(64, 2), (100, 4), (100, 3), (49152, 1536), (77, 5)],
                         ids=["exact", "last-word-part", "mask-short", "smollm2", "mask-long"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_matches_the_reference_and_leaves_other_rows(device, dtype, vocab, words, index_dtype):
    batch = 5
    logits = strided(torch.randn(batch, vocab).to(dtype).to(device))
    bitmask = random_bitmask(3, words).to(device)
    rows = torch.tensor([3, 0, 4], dtype=index_dtype, device=device)
    want = reference.apply_token_bitmask(logits.cpu(), bitmask.cpu(), rows.cpu())
    ops.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits.cpu(), want)  # -inf == -inf; kept values untouched, bit for bit
    assert torch.isinf(want[3]).any() and torch.isfinite(want[3]).any()
    assert torch.equal(logits[1].cpu(), want[1]) and torch.isfinite(want[[1, 2]]).all()
    ops.apply_token_bitmask(logits, bitmask[:0], rows[:0])  # no rows: nothing happens
    assert torch.equal(logits.cpu(), want)


def test_llguidances_mask_of_a_real_constraint():
    pytest.importorskip("llguidance")
    import numpy as np

    from stagewise.engine.constraints import Constraint, vocabulary
    from stagewise.engine.params import SamplingParams
    from stagewise.model.loader import open_checkpoint

    ckpt = open_checkpoint("smollm2-135m")
    vocab = vocabulary(("test", str(ckpt.path)), ckpt.tokenizer, ckpt.config.vocab_size, ckpt.config.eos_token_ids)
    c = Constraint(vocab, SamplingParams(choice=["yes", "no"]), "r")
    raw = np.frombuffer(c.matcher.deep_copy().compute_bitmask(), dtype=np.uint8)
    allowed = torch.from_numpy(np.unpackbits(raw, bitorder="little")[: vocab.n_vocab].astype(bool))
    logits = torch.randn(1, vocab.n_vocab)
    out = logits.clone()
    ops.apply_token_bitmask(out, torch.from_numpy(raw.copy().view(np.int32)).view(1, -1), torch.tensor([0]))
    assert torch.equal(torch.isfinite(out[0]), allowed) and 0 < int(allowed.sum()) < 100
    assert torch.equal(out[0][allowed], logits[0][allowed])


@pytest.mark.parametrize("args, error, message", [
    (lambda: (torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0])), TypeError,
     "argument 'bitmask' must be int32"),
    (lambda: (torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0])), ValueError,
     "argument 'rows' dim 0"),
    (lambda: (torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2])), ValueError,
     r"rows\[0\] = 2 is not a row of logits"),
    (lambda: (torch.randn(2, 64).t(), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0])), ValueError,
     "contiguous last dim"),
    (lambda: (torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0.0])), TypeError,
     "argument 'rows' must be int32 or int64"),
])
def test_bad_arguments_are_named(args, error, message):
    with pytest.raises(error, match=message):
        ops.apply_token_bitmask(*args())
