"""The last stage's side of speculative decoding: which drafts a step's logits accept, and the
token after them, so that every token is distributed exactly as without speculation (the rule
and why it is exact: :mod:`stagewise.engine.speculative`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.engine.sampling import History, Sampler, apply_penalties, inverse_cdf, token_logprobs, uniforms


@dataclass(kw_only=True, slots=True)
class Verified:
    """What :func:`verify` accepted for each request: its tokens (1 to ``k + 1``) and, where asked,
    their log-probabilities."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


def verify(logits: torch.Tensor, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], histories: Sequence[History | None],
           raw: torch.Tensor | None = None) -> Verified:
    """Accept each request's drafts (see the module doc). ``logits [sum(len(d) + 1), V]``: the rows
    of each request's positions, request after request (a structured-output mask applied where one
    holds); ``histories``: each request's tokens so far, for its penalties (None where it has
    none); ``raw``: the logits before any mask, which log-probabilities are read from (default:
    ``logits``)."""
    spans, at = [], 0
    for d in drafts:
        spans.append((at, len(d) + 1))
        at += len(d) + 1
    if logits.size(0) != at:
        raise ValueError(f"verify: {logits.size(0)} rows of logits for {at} positions")
    row_params = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    scores = logits
    if any(p.penalised for p in params):
        row_hist: list[History | None] = []
        for p, h, d in zip(params, histories, drafts):
            for j in range(len(d) + 1):
                row_hist.append(_extended(h, d[:j]) if p.penalised else None)
        scores = apply_penalties(logits, row_params, row_hist)
    greedy_ids = scores.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(row_params) if not p.greedy]
    probs = Sampler.filtered_probs(scores[sampled_rows], [row_params[i] for i in sampled_rows]) \
        if sampled_rows else None
    prob_row = {row: j for j, row in enumerate(sampled_rows)}
    out_tokens: list[list[int]] = []
    for (start, n), d, p, gen in zip(spans, drafts, params, generators):
        if p.greedy:
            a = 0
            while a < n - 1 and greedy_ids[start + a] == d[a]:
                a += 1
            out_tokens.append([*d[:a], greedy_ids[start + a]])
            continue
        rows = probs[[prob_row[start + j] for j in range(n)]]
        chances = rows[torch.arange(n - 1), torch.tensor(d, dtype=torch.long)].tolist() if n > 1 else []
        tokens = []
        for j, chance in enumerate(chances):
            if uniforms(1, [gen], logits.device).item() < chance:
                tokens.append(d[j])
                continue
            rest = rows[j].clone()
            rest[d[j]] = 0.0
            tokens.append(int(inverse_cdf(rest.unsqueeze(0), uniforms(1, [gen], logits.device))[0]))
            break
        else:
            tokens.append(int(inverse_cdf(rows[n - 1:], uniforms(1, [gen], logits.device))[0]))
        out_tokens.append(tokens)
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(drafts)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asking:
        rows = [spans[i][0] + j for i in asking for j in range(len(out_tokens[i]))]
        picked = torch.tensor([t for i in asking for t in out_tokens[i]], dtype=torch.long, device=logits.device)
        flat = token_logprobs((logits if raw is None else raw)[rows], picked, [params[i].logprobs for i in asking for _ in out_tokens[i]])
        for i in asking:
            logprobs[i], flat = flat[:len(out_tokens[i])], flat[len(out_tokens[i]):]
    return Verified(tokens=out_tokens, logprobs=logprobs)


def _extended(history: History | None, drafts: Sequence[int]) -> History:
    """``history`` with ``drafts`` counted as output (the penalties of the position after them)."""
    out = History(())
    if history is not None:
        out.prompt = history.prompt
        out.output = history.output.copy()
    for t in drafts:
        out.append(t)
    return out
