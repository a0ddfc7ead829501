"""A stage's tensor-parallel ranks as processes, for tests/model/test_tensor_parallel.py.

:func:`run_world` hosts a store (``comm.host_store``) and starts ``tp`` processes of this file, one
per rank (``python tp_ranks.py ARGS.json``). Each joins the world through the store (gloo), and
for each case loads its shard of the checkpoint with ``load_stage(..., groups=...)`` and runs the
same steps (:func:`run_steps`). Nothing is pickled: the arguments go as JSON, rank 0's logits
come back as a safetensors file and every rank's counts as JSON. When a rank fails (or the world
outlives its deadline) the other ranks are killed, every process is reaped and the store closed,
and :class:`WorldFailed` names the rank and shows the end of its stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.collectives import StageGroups
from stagewise.model.stage import StageModel, load_stage

BLOCK_SIZE = 4  # small, so that every prompt spans several blocks
PROMPT_LENS = (5, 1, 7)
JOINS = (0, 0, 1)
"""The step at which each request's prompt is prefilled: step 1 mixes a prefill with decodes."""
NUM_STEPS = 6


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def step_requests(step: int) -> tuple[list[int], list[int]]:
    """The requests prefilled and the requests decoding at ``step``; a step's rows are in that order."""
    return [r for r, j in enumerate(JOINS) if j == step], [r for r, j in enumerate(JOINS) if j < step]


def run_steps(stages: list[StageModel], prompts: list[list[int]], feed: list[list[int]] | None = None,
              on_step=None) -> tuple[list[torch.Tensor | None], list[list[int]]]:
    """:data:`NUM_STEPS` steps of ``prompts`` through ``stages`` (a pipeline's stages in order, run
    in this process): request ``i`` is prefilled at step ``JOINS[i]`` and decodes one token a step
    after that. The decoded tokens are ``feed[i]`` when given (what another rank sampled), else the
    argmax of the logits. Returns the last stage's output of each step (logits ``[rows, vocab]``,
    or None on a TP rank other than 0) and the tokens fed to each request. ``on_step(step)`` is
    called after each step."""
    managers = [KVCacheManager(block_size=BLOCK_SIZE, num_blocks=32, max_blocks_per_seq=8) for _ in stages]
    caches = [KVCache(s.kv_cache_spec(BLOCK_SIZE, torch.float32), num_blocks=32) for s in stages]
    tokens: list[list[int]] = [[] for _ in prompts]
    outputs: list[torch.Tensor | None] = []
    for step in range(NUM_STEPS):
        prefills, decodes = step_requests(step)
        ids, lens, ctx, flat, positions = [], [], [], [], []
        for r in prefills:
            ids.append(r), lens.append(len(prompts[r])), ctx.append(0)
            flat += prompts[r]
            positions += range(len(prompts[r]))
        for r in decodes:
            n = step - JOINS[r] - 1  # the request's decode steps before this one
            token = feed[r][n] if feed is not None else tokens[r][n]
            if feed is not None:
                tokens[r].append(token)
            ids.append(r), lens.append(1), ctx.append(len(prompts[r]) + n)
            flat.append(token), positions.append(len(prompts[r]) + n)
        batch = StepBatch(request_ids=ids, num_prefills=len(prefills), query_lens=lens, context_lens=ctx,
                          positions=torch.tensor(positions), token_ids=torch.tensor(flat))
        for stage, manager, cache in zip(stages, managers, caches):
            for r in prefills:
                manager.add(r, len(prompts[r]))
            for r in decodes:
                manager.append(r)
            out = stage(batch, cache, KVMetadata.build(batch, manager, "cpu"))
            if not stage.is_last:
                batch = batch.for_next_stage(out)
        outputs.append(out)
        if feed is None:
            for row, r in enumerate(ids):
                tokens[r].append(int(out[row].argmax()))
        if on_step is not None:
            on_step(step)
    return outputs, tokens


def load_stages(case: dict, groups: StageGroups = StageGroups()) -> list[StageModel]:
    """The case's pipeline: stages cut at ``case["cuts"]`` (none: one stage), each this rank's shard."""
    from stagewise.model.loader import open_checkpoint

    ckpt = open_checkpoint(case["checkpoint"])
    bounds = [0, *case.get("cuts", ()), ckpt.config.num_layers]
    return [load_stage(ckpt, a, b, dtype="float32", groups=groups) for a, b in zip(bounds, bounds[1:])]


# ---- one rank (this file run as a script) ---------------------------------------------------------

def _rank_main(args_path: str) -> None:
    from safetensors.torch import save_file

    from stagewise.parallel import comm

    args = json.loads(Path(args_path).read_text())
    rank, world, out = args["rank"], args["world"], Path(args["out"])
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = comm.init_world(rank=rank, world_size=world, store=tuple(args["store"]), timeout_s=args["timeout_s"])
    try:
        if rank == args.get("fail_rank"):
            raise RuntimeError(f"rank {rank} fails on purpose")
        logits, counts = {}, {}
        for case in args["cases"]:
            stages = load_stages(case, StageGroups(tp=tp))
            calls, sent = [tp.calls], [tp.bytes]
            outputs, _ = run_steps(stages, case["prompts"], feed=case["tokens"],
                                   on_step=lambda step: (calls.append(tp.calls), sent.append(tp.bytes)))
            counts[case["name"]] = {"calls": [b - a for a, b in zip(calls, calls[1:])],
                                    "bytes": [b - a for a, b in zip(sent, sent[1:])],
                                    "none": [o is None for o in outputs],
                                    "decode_stack": any(s.decode_stack is not None for s in stages)}
            logits.update({f"{case['name']}/{i}": o for i, o in enumerate(outputs) if o is not None})
        save_file(logits, out / f"rank{rank}.safetensors")
        (out / f"rank{rank}.json").write_text(json.dumps(counts))
    finally:
        comm.destroy_world()


# ---- the world (the test's side) ------------------------------------------------------------------

class WorldFailed(RuntimeError):
    """A rank exited with an error, or the world did not finish in time. ``pids`` are the rank
    processes (all reaped by then), ``address`` the store's (closed by then)."""

    pids: list[int]
    address: tuple[str, int]


def run_world(cases: list[dict], tp: int, out: Path, *, timeout_s: float = 60.0,
              fail_rank: int | None = None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Runs ``cases`` (each: name, checkpoint, prompts, tokens to feed, optional cuts) on ``tp``
    rank processes; returns rank 0's logits (``"{case}/{step}"``) and each rank's counts."""
    from safetensors.torch import load_file

    from stagewise.parallel import comm

    out.mkdir(parents=True, exist_ok=True)
    store, address = comm.host_store("127.0.0.1", timeout_s=timeout_s)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(tp):
            args = dict(rank=rank, world=tp, store=list(address), timeout_s=timeout_s, out=str(out),
                        cases=cases, fail_rank=fail_rank)
            path = out / f"args{rank}.json"
            path.write_text(json.dumps(args))
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, __file__, str(path)], stdout=log,
                                              stderr=subprocess.STDOUT))
        _wait(procs, out, time.monotonic() + timeout_s)
    except WorldFailed as e:
        e.pids, e.address = [p.pid for p in procs], address
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store  # closes its port
    return load_file(out / "rank0.safetensors"), [json.loads((out / f"rank{r}.json").read_text())
                                                   for r in range(tp)]


GRACE_S = 3.0
"""How long the other ranks get to exit on their own once one has failed (a rank whose peer died
fails too, and may exit first: every failed rank's output is shown)."""


def _wait(procs: list[subprocess.Popen], out: Path, deadline: float) -> None:
    """Until every rank exits 0; WorldFailed soon after one fails, or at the deadline."""
    while all(p.poll() in (None, 0) for p in procs) and time.monotonic() < deadline:
        if all(p.poll() == 0 for p in procs):
            return
        time.sleep(0.02)
    grace = min(deadline, time.monotonic() + GRACE_S)
    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
        time.sleep(0.02)
    codes = [p.poll() for p in procs]
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    shown = failed or [r for r, c in enumerate(codes) if c is None]
    what = "; ".join(f"rank {r} exited with {codes[r]}" for r in failed) or "the world timed out"
    tails = "".join(f"\n--- the end of rank {r}'s output:\n{(out / f'rank{r}.log').read_text(errors='replace')[-1500:]}"
                    for r in shown)
    raise WorldFailed(what + tails)


if __name__ == "__main__":
    _rank_main(sys.argv[1])


def hf_step_logits(hf, ps, tokens):
    """Per step, transformers' logits in the step's row order (each request's whole sequence at once)."""
    with torch.no_grad():
        per_request = [hf(torch.tensor([p + t[:-1]])).logits[0, len(p) - 1:] for p, t in zip(ps, tokens)]
    steps = []
    for step in range(NUM_STEPS):
        rows = [r for group in step_requests(step) for r in group]
        steps.append(torch.stack([per_request[r][step - JOINS[r]] for r in rows]))
    return steps


def check_steps(case: dict, logits: dict, name: str, tol: dict) -> None:
    """Rank 0's logits of each step (``logits["{name}/{step}"]``) are the single process's and
    transformers' (``case["logits"]``, ``case["hf"]``) within ``tol``, and greedy picks exactly the
    single process's tokens."""
    for step in range(NUM_STEPS):
        got = logits[f"{name}/{step}"]
        torch.testing.assert_close(got, case["logits"][step], **tol, msg=lambda m: f"step {step} vs one process: {m}")
        torch.testing.assert_close(got, case["hf"][step], **tol, msg=lambda m: f"step {step} vs transformers: {m}")
        rows = [r for group in step_requests(step) for r in group]
        assert got.argmax(-1).tolist() == [case["tokens"][r][step - JOINS[r]] for r in rows], step
