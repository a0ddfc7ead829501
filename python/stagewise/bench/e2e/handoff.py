"""The floor under a pipeline's batch-1 overhead: a pipeline's own stages' layers taking turns in S
bare processes (a pipe from each to the next, and from the last back to the first; no pipeline
code), against the same layers taking turns in one process.

What the two differ by is what handing a token from process to process costs on this machine
whatever a runtime does around it: the wait (a process asleep on a pipe, its CPU idle or given to
another), the waking, and the code and data of each step coming back to a core whose caches the
other stages' weights went through meanwhile. ``stagewise bench e2e --stages`` reports it beside
the pipeline's own overhead, measured in the same run, so that the part of the overhead the
pipeline could still remove is the difference.

A part runs the stage's layers through the runtime's :class:`~stagewise.engine.executor.Executor`
(the C++ layer loop, the same KV metadata), fed raw bytes: a length and a position, then a
``[T, hidden]`` float32 hidden state or, from the last part, one int64 token. ``python -m
stagewise.bench.e2e.handoff`` is a later part's process.
"""

from __future__ import annotations

import os
import statistics
import struct
import subprocess
import sys
import time

import torch

from stagewise.engine.executor import Executor
from stagewise.engine.params import SamplingParams, SamplingRequest
from stagewise.model.batch import StepBatch
from stagewise.model.stage import load_stage

_HEAD = struct.Struct("<IQ?")  # bytes that follow, the step's first position, whether waits spin


class Part:
    """Layers ``[start, end)`` of ``model`` as a stage runs them; ``last``: also the LM head and
    greedy sampling."""

    def __init__(self, model: str, start: int, end: int, last: bool, *, dtype: str, quantized, precision: str,
                 max_len: int) -> None:
        stage = load_stage(model, start, end, dtype=dtype, quantized=quantized, linear_precision=precision)
        self.first, self.last, self.rid = start == 0, last, 0
        self.hidden = stage.config.hidden_size
        self.executor = Executor(stage, num_blocks=max_len // 16 + 2, block_size=16, max_model_len=max_len)

    def step(self, position: int, x: torch.Tensor) -> torch.Tensor:
        """One step at ``position`` (0: the prompt ``x``; else one token): hidden states, or the
        last part's token as a 1-element int64 tensor. A prompt starts a new request."""
        n = x.shape[0]
        if position == 0:
            self.executor.free([self.rid])
            self.rid += 1
        sampling = {self.rid: SamplingRequest(SamplingParams(temperature=0.0, ignore_eos=True))} \
            if self.last and position == 0 else None
        inputs = {"token_ids": x} if self.first else {"hidden_states": x}
        batch = StepBatch(request_ids=[self.rid], num_prefills=int(position == 0), query_lens=[n],
                          context_lens=[position], positions=torch.arange(position, position + n), **inputs)
        out = self.executor.run(batch, sampling if self.last else None)
        return out.tokens if self.last else out


def _write(fd: int, position: int, spin: bool, t: torch.Tensor) -> None:
    body = t.contiguous().numpy().tobytes()
    data = memoryview(_HEAD.pack(len(body), position, spin) + body)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int, spin: bool) -> bytes:
    """``n`` bytes from ``fd``. A reader that waits polls, yielding its CPU, when ``spin``; else it
    sleeps in the kernel (the descriptor's mode is set to match)."""
    if os.get_blocking(fd) == spin:
        os.set_blocking(fd, not spin)
    parts, got = [], 0
    while got < n:
        try:
            chunk = os.read(fd, n - got)
        except BlockingIOError:
            os.sched_yield()
            continue
        if not chunk:
            raise EOFError("the previous part closed its pipe")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read(fd: int, spin: bool, dtype: torch.dtype, width: int) -> tuple[int, bool, torch.Tensor]:
    """(position, the sender's wait mode, tensor) of the next message."""
    size, position, spin_next = _HEAD.unpack(_read_exact(fd, _HEAD.size, spin))
    t = torch.frombuffer(bytearray(_read_exact(fd, size, spin)), dtype=dtype)
    return position, spin_next, t.view(-1, width) if width else t


class Handoff:
    """The parts of one layer split, in one process and in as many processes (the first in this
    one). :meth:`run` times a greedy batch-1 generation through either."""

    def __init__(self, model: str, ranges: list[tuple[int, int]], *, dtype: str, quantized,
                 precision: str, max_len: int) -> None:
        if len(ranges) < 2:
            raise ValueError(f"Handoff: a split of at least two parts is handed off, got {ranges}")
        self.procs: list[subprocess.Popen] = []
        spec = dict(dtype=dtype, quantized=quantized, precision=precision, max_len=max_len)
        last = len(ranges) - 1
        self.local = [Part(model, a, b, i == last, **spec) for i, (a, b) in enumerate(ranges)]
        try:
            upstream = subprocess.PIPE
            for i, (a, b) in enumerate(ranges[1:], 1):
                argv = [sys.executable, "-m", "stagewise.bench.e2e.handoff", model, str(a), str(b), str(int(i == last)),
                        dtype, str(quantized), precision, str(max_len)]
                proc = subprocess.Popen(argv, stdin=upstream, stdout=subprocess.PIPE)
                self.procs.append(proc)
                upstream = proc.stdout
            self.first = self.local[0]  # the split's first part, in this process
        except BaseException:
            self.close()
            raise

    def run(self, prompt: list[int], new_tokens: int, *, processes: bool, spin: bool = False) -> dict:
        """Generate ``new_tokens`` greedily: the tokens, and the decode cycles' median and mean
        seconds (a cycle: from one step of the first part to the next). ``spin``: every process
        waits for its input polling (yielding its CPU) instead of asleep on the pipe."""
        token = torch.tensor(prompt, dtype=torch.int64)
        starts, position, tokens = [], 0, []
        for i in range(new_tokens):
            starts.append(time.perf_counter())
            x = self.first.step(position, token)
            if processes:  # the flag says how to wait for the next message: none polls between runs
                _write(self.procs[0].stdin.fileno(), position, spin and i < new_tokens - 1, x)
                x = _read(self.procs[-1].stdout.fileno(), spin, torch.int64, 0)[2]
            else:
                for part in self.local[1:]:
                    x = part.step(position, x)
            position += token.numel()
            token = x.reshape(1)
            tokens.append(int(token))
        stamps = [*starts[1:], time.perf_counter()]  # the decode steps' (the first step was the prefill)
        cycles = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"tokens": tokens, "median_s": statistics.median(cycles), "mean_s": statistics.mean(cycles)}

    def close(self) -> None:
        for proc in self.procs:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve(argv: list[str]) -> None:
    """A later part's process: a step for every message on stdin, its output on stdout, until EOF."""
    model, start, end, last, dtype, quantized, precision, max_len = argv
    torch.set_num_threads(1)
    part = Part(model, int(start), int(end), last == "1", dtype=dtype,
                quantized=None if quantized == "None" else quantized == "True", precision=precision,
                max_len=int(max_len))
    spin = False  # how this process waits for a message: as the last one said
    while True:
        try:
            position, spin, x = _read(sys.stdin.fileno(), spin, torch.float32, part.hidden)
        except EOFError:
            return
        _write(sys.stdout.fileno(), position, spin, part.step(position, x))


if __name__ == "__main__":
    _serve(sys.argv[1:])
