"""A draft model for speculative decoding (``--speculative draft:PATH``): a smaller model with the
target's vocabulary, run in stage 0's process, whose greedy continuation of each request is the
drafts.

It keeps each request's KV in its own paged cache. Before a step it rolls a request back to the
longest beginning of its tokens it still holds (the accepted drafts stay, the rejected ones go),
feeds the rest as one chunk, which gives the first draft, and then decodes one token a step for
the others: ``k`` steps of the draft per target step, all requests in one batch. A greedy draft is
a point mass, which is what the last stage's acceptance assumes
(:mod:`stagewise.engine.speculative`), so the output stays exactly the target's whatever the
draft proposes. On a CPU its linears run in the int8 mode (``linear_precision="int8"``): drafts
need to be likely, not exact, and it is the fastest the draft can run here.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import torch

from stagewise.engine.executor import Executor, model_dtype
from stagewise.engine.params import SamplingParams, SamplingRequest
from stagewise.int_tensors import int_tensor
from stagewise.kv.cache import num_cache_blocks
from stagewise.model.batch import StepBatch

BLOCK_SIZE = 16
_log = logging.getLogger("stagewise")
GREEDY = SamplingParams(temperature=0.0)


class DraftModel:
    """The drafter of ``model`` (a folder, a .gguf file or a built-in name)."""

    def __init__(self, model: str, *, device, max_model_len: int, max_num_seqs: int,
                 vocab_size: int | None = None) -> None:
        from stagewise.model.loader import open_checkpoint, resolve_dtype
        from stagewise.model.stage import load_stage

        ckpt = open_checkpoint(model)
        cfg = ckpt.config
        if vocab_size is not None and cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative: the draft model {model!r} has a vocabulary of {cfg.vocab_size} tokens, the "
                             f"target {vocab_size}; a draft model needs the target's tokenizer")
        dev = torch.device(device)
        dtype = resolve_dtype("auto", cfg.dtype)
        precision = "int8" if dev.type == "cpu" and dtype == torch.float32 else "exact"
        stage = load_stage(ckpt, 0, cfg.num_layers, dtype=dtype, device=dev, linear_precision=precision)
        length = min(max_model_len, cfg.max_position_embeddings)
        spec = stage.kv_cache_spec(BLOCK_SIZE, model_dtype(stage))
        blocks = num_cache_blocks(spec, dev, max_num_seqs=max_num_seqs, max_model_len=length)
        self.executor = Executor(stage, num_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=length, device=dev,
                                 max_num_seqs=max_num_seqs)
        self.max_model_len = length
        self._held: dict[Hashable, list[int]] = {}
        """Per request, the tokens whose KV the draft holds."""
        self._known: dict[Hashable, int] = {}
        """Per request, how many of its first held tokens are its own (not drafts): those never change."""

    def propose(self, requests: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """The drafts; none at all when the draft cannot run them (its own KV pool full, say): it
        then forgets every request, and catches up from their tokens when next asked."""
        out: dict[Hashable, list[int]] = {}
        todo = [(rid, list(tokens), k) for rid, tokens, k in requests if len(tokens) + k <= self.max_model_len]
        try:
            if todo:
                first = self._catch_up(todo)
                for (rid, _, _), token in zip(todo, first):
                    out[rid] = [token]
                for j in range(1, max(k for _, _, k in todo)):
                    going = [rid for rid, _, k in todo if k > j]
                    out.update(zip(going, ([*out[r], t] for r, t in zip(going, self._decode(going, out)))))
        except Exception as err:  # noqa: BLE001 - drafts are optional: the step decodes without them
            _log.warning("speculative: the draft model could not draft (%s: %s); the step runs without drafts",
                         type(err).__name__, err)
            self.executor.free(list(self._held))
            self._held.clear()
            self._known.clear()
            return [()] * len(requests)
        return [tuple(out.get(rid, ())) for rid, _, _ in requests]

    def _catch_up(self, todo: list[tuple[Hashable, list[int], int]]) -> list[int]:
        """Each request rolled back to what the draft still holds of its tokens, the rest fed as one
        chunk; the first draft of each."""
        ex = self.executor
        ids, lens, ctx, tokens, positions, sampling = [], [], [], [], [], {}
        for rid, seq, _ in todo:
            held, end = self._held.get(rid, []), len(seq) - 1  # the last token is fed: its logits are the draft's
            same = min(self._known.get(rid, 0), len(held), end)
            while same < min(len(held), end) and held[same] == seq[same]:  # the accepted drafts
                same += 1
            if rid in ex and same == 0:
                ex.free([rid])
            if rid in ex:
                ex.truncate(rid, same)
            else:
                same = 0
                sampling[rid] = SamplingRequest.of(GREEDY, seq)
            ids.append(rid), lens.append(len(seq) - same), ctx.append(same)
            tokens += seq[same:]
            positions += range(same, len(seq))
        batch = StepBatch(request_ids=ids, num_prefills=len(ids), query_lens=lens, context_lens=ctx,
                          positions=int_tensor(positions, device=ex.device),
                          token_ids=int_tensor(tokens, device=ex.device))
        first = ex.run(batch, sampling).tokens.tolist()
        for rid, seq, _ in todo:
            self._held[rid], self._known[rid] = seq, len(seq)
        return first

    def _decode(self, rids: list[Hashable], drafts: dict[Hashable, list[int]]) -> list[int]:
        """One decode step of the draft: each request's last draft fed, the next one back."""
        ex = self.executor
        ctx = [len(self._held[rid]) for rid in rids]
        fed = [drafts[rid][-1] for rid in rids]
        batch = StepBatch(request_ids=rids, num_prefills=0, query_lens=[1] * len(rids), context_lens=ctx,
                          positions=int_tensor(ctx, device=ex.device), token_ids=int_tensor(fed, device=ex.device))
        out = ex.run(batch).tokens.tolist()
        for rid, token in zip(rids, fed):
            self._held[rid].append(token)
        return out

    def forget(self, request_id: Hashable) -> None:
        self._held.pop(request_id, None)
        self._known.pop(request_id, None)
        self.executor.free([request_id])
