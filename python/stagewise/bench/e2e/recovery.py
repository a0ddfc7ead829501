"""`stagewise bench e2e --recovery [--stages S]`: how long running requests are delayed when a
stage dies or hangs, with only the lost stage started again (the others rejoin) and, side by side,
with every stage started again (`rejoin=False`: what recovery did before).

Each run: a new pipeline of S stages (``max_restarts=1``), warmed by one short request; then 4
prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens each, during which the last
stage is killed (SIGKILL) or stopped (SIGSTOP: hung) a quarter of the way through (a quarter of
the undisturbed case's wall time in the same repeat).
The cases take turns in every repeat, so a noisy machine slows them alike. Reported: the median
wall time, its delay over the undisturbed case, and whether every request's tokens equal the
undisturbed run's.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time

import torch

CASES = (("undisturbed", None, True), ("killed, stage rejoins", signal.SIGKILL, True),
         ("killed, every stage anew", signal.SIGKILL, False), ("hung, stage rejoins", signal.SIGSTOP, True))
"""(name, the signal the last stage gets, whether the others rejoin)."""
REQUESTS = 4


def run(args, log=print) -> int:
    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.bench.e2e.prompts import make_prompts

    stages = int(str(args.stages or "2").split(",")[-1])
    repeats = args.repeats or 3
    if stages < 2 or args.prompt_len < 1 or args.new_tokens < 4 or repeats < 1:
        print("stagewise bench e2e --recovery: --stages S >= 2 (one count), --prompt-len >= 1, --new-tokens >= 4, "
              "--repeats >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    info = report.machine_info("cpu")
    options = dict(stages=stages, threads=1, dtype="float32", max_restarts=1,
                   max_model_len=args.prompt_len + args.new_tokens + 1)
    wall: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    equal: dict[str, bool] = {name: True for name, _, _ in CASES}
    reference = prompts = None
    for rep in range(repeats):
        for name, sig, rejoin in CASES:
            with Pipeline(args.model, **options, rejoin=rejoin) as pipe:  # off: every stage started anew
                if prompts is None:
                    prompts = make_prompts(pipe.checkpoint, REQUESTS, args.prompt_len)
                pipe.generate(prompt_token_ids=prompts[:1], max_new_tokens=2, ignore_eos=True)
                victim = pipe.driver.processes.pids[-1]
                timer = None
                if sig is not None:
                    timer = threading.Timer(wall["undisturbed"][-1] / 4, os.kill, (victim, sig))
                    timer.start()
                start = time.perf_counter()
                out = pipe.generate(prompt_token_ids=prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
                wall[name].append(time.perf_counter() - start)
                if timer is not None:
                    timer.join()
                tokens = [c.token_ids for c in out]
                reference = tokens if reference is None else reference
                equal[name] &= tokens == reference and pipe.restarts == (sig is not None)
            log(f"  run {rep + 1}/{repeats} {name}: {wall[name][-1]:.2f} s")
    base = statistics.median(wall["undisturbed"])
    rows = [{"case": name, "wall_s": statistics.median(wall[name]), "delay_s": statistics.median(wall[name]) - base,
             "runs_s": wall[name], "tokens_equal": equal[name]} for name, _, _ in CASES]
    info.update(model=str(args.model), stages=stages, repeats=repeats, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, requests=REQUESTS, load_average=os.getloadavg())
    table = format_table(rows)
    print(table)
    report.write_results(args.out, f"{info['device']}-e2e-recovery", {"machine": info, "rows": rows}, [
        f"# stagewise end to end: a stage lost mid-generation, {stages} stages", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs; 1 torch thread per stage; "
        f"torch {info['torch']}; load average at the end {info['load_average'][0]:.2f}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, float32, {REQUESTS} prompts of {args.prompt_len} tokens, {args.new_tokens} greedy "
        f"tokens each; the last stage killed or stopped after a quarter of the tokens; median of {repeats} runs, "
        "the cases taking turns", "",
        "delay = the case's wall time over the undisturbed one's. 'every stage anew' is the same failure with the "
        "rejoin path switched off (rejoin=False). tokens = undisturbed: every request's greedy tokens identical.", "",
        table, ""], log)
    return 0


def format_table(rows: list[dict]) -> str:
    lines = ["| case | wall s | delay s | tokens = undisturbed |", "|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['wall_s']:.2f} | {r['delay_s']:.2f} | {'yes' if r['tokens_equal'] else 'NO'} |")
    return "\n".join(lines)
