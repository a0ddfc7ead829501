"""The embedding and the LM head, vocab parallel: tensor-parallel rank ``r`` of ``tp`` holds rows
``[r * ceil(V / tp), (r + 1) * ceil(V / tp))`` of the ``[V, hidden]`` matrix, the last ranks'
blocks padded with zero rows by the loader, so that every rank holds ``ceil(V / tp)`` rows.

- :class:`VocabEmbedding` looks up the ids that fall in its rows (the others give zero vectors)
  and all-reduces: each id's vector comes from exactly one rank, so the sum is exact.
- :class:`LMHead` computes the logits of its rows and gathers them to TP rank 0, which cuts the
  padding off; the other ranks get None (sampling runs on TP rank 0 only).

With tied embeddings both hold the same rows of the one matrix. On one rank (``tp`` the group of
one) they are a plain lookup and a plain linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.model.collectives import SINGLE, Collectives
from stagewise.model.layers.linear import dense_linear
from stagewise.model.quant import QuantizedWeight


def _frozen(w: torch.Tensor | QuantizedWeight) -> nn.Parameter | QuantizedWeight:
    """A dense weight as a frozen parameter (one already a parameter, e.g. a tied head's, as it is)."""
    return w if isinstance(w, (QuantizedWeight, nn.Parameter)) else nn.Parameter(w.contiguous(), requires_grad=False)


def _check_rows(where: str, weight: torch.Tensor | QuantizedWeight, vocab_size: int, tp: Collectives) -> int:
    rows = -(-vocab_size // tp.size)
    if weight.shape[0] != rows:
        raise ValueError(f"{where}: TP rank {tp.rank} of {tp.size} must hold ceil({vocab_size} / {tp.size}) = {rows} "
                         f"rows of the vocabulary, got a weight of {list(weight.shape)}")
    return rows


class VocabEmbedding(nn.Module):
    """``ids [T]`` -> ``[T, hidden]`` from this rank's rows ``weight [ceil(V / tp), hidden]``, times
    ``scale`` when given (Gemma's sqrt(hidden)), which is rounded to the vectors' dtype first, as
    transformers does."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, vocab_size: int, tp: Collectives = SINGLE,
                 scale: float | None = None) -> None:
        super().__init__()
        self.rows = _check_rows("VocabEmbedding", weight, vocab_size, tp)
        self.weight, self.tp, self.scale = _frozen(weight), tp, scale
        self.first = tp.rank * self.rows
        """The first vocabulary id of this rank's rows."""

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.embedding(ids)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x = self._lookup(ids)
        else:
            local = ids - self.first
            outside = (local < 0) | (local >= self.rows)
            x = self._lookup(local.masked_fill(outside, 0))
            x = self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
        return x if self.scale is None else x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)


class LMHead(nn.Module):
    """``x [R, hidden]`` -> logits ``[R, V]`` on TP rank 0, None on the other ranks, from this rank's
    rows ``weight [ceil(V / tp), hidden]`` (a tied head: the embedding's own rows)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight | nn.Parameter, vocab_size: int,
                 tp: Collectives = SINGLE) -> None:
        super().__init__()
        _check_rows("LMHead", weight, vocab_size, tp)
        self.weight = weight.for_linear() if isinstance(weight, QuantizedWeight) else _frozen(weight)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        w = self.weight
        logits = w.linear(x) if isinstance(w, QuantizedWeight) else dense_linear(x, w)
        if self.tp.size == 1:
            return logits
        full = self.tp.gather(logits, dim=-1, dst=0)
        return None if full is None else full[..., : self.vocab_size].contiguous()
