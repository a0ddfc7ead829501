"""int_tensor gives what torch.tensor gives for lists of ints: values, dtype, shape (also empty),
a tensor that owns its values, and an error for a value its dtype cannot hold."""

from __future__ import annotations

import pytest
import torch

from stagewise.int_tensors import int_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("values", [[], [7], [0, -1, 2**31 - 1, 5], list(range(1000))])
def test_matches_torch_tensor(values, dtype):
    got = int_tensor(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)


def test_takes_any_iterable_and_keeps_its_values():
    t = int_tensor(x * 2 for x in range(4))
    del_me = [t.clone()]
    t.add_(1)  # writable, and its own memory
    assert t.tolist() == [1, 3, 5, 7] and del_me[0].tolist() == [0, 2, 4, 6]


def test_refuses_what_does_not_fit():
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
    with pytest.raises(ValueError, match="dtype must be torch.int64 or torch.int32"):
        int_tensor([1], torch.float32)
