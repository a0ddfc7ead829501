"""The load of `stagewise bench serve`: requests whose prompt and output lengths follow a
ShareGPT-like (log-normal) distribution, generated here from a seed, sent to an OpenAI-compatible
server at Poisson arrival times, each streamed, timed as a client sees it.

Per request: time to first token (arrival to the first streamed text) and time per output token
((end - first token) / (tokens - 1)). Per run: completed requests and output tokens per second
over the run (first arrival to last end), and the 50th / 99th percentiles of both times.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

WORDS = ("time river stone light city north quiet green seven over under bright market song letter garden "
         "winter summer mountain window paper silver engine orange forest morning story number").split()


@dataclass(frozen=True, slots=True)
class Shape:
    """Log-normal lengths, clipped: ``median * exp(sigma * N(0, 1))`` within ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))


PROMPT = Shape(96, 0.7, 16, 512)
OUTPUT = Shape(48, 0.7, 8, 192)
"""ShareGPT's lengths (a few hundred prompt tokens, a few hundred answer tokens) scaled down to what
a 2-core CPU answers in seconds."""


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    """Seconds after the run's start."""
    prompt: str
    prompt_tokens: int
    max_tokens: int


def workload(n: int, rate: float, tokenize, seed: int = 0, prompt: Shape = PROMPT, output: Shape = OUTPUT
             ) -> list[Request]:
    """``n`` requests arriving at ``rate`` per second (exponential gaps); each prompt is words
    until ``tokenize(text)`` reaches its drawn length."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        want = prompt.draw(rng)
        words: list[str] = []
        while True:
            words += [rng.choice(WORDS) for _ in range(max(1, (want - tokenize(" ".join(words))) // 2))]
            n_tok = tokenize(" ".join(words))
            if n_tok >= want:
                break
        out.append(Request(t, " ".join(words), n_tok, output.draw(rng)))
    return out


@dataclass(slots=True)
class Timed:
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    end_s: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    rate: float
    requests: list[Timed] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None and r.ttft_s is not None]
        ttft = sorted(r.ttft_s for r in ok)
        tpot = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
        return {"rate": self.rate, "completed": len(ok), "failed": len(self.requests) - len(ok),
                "wall_s": self.wall_s, "req_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
                "tok_per_s": sum(r.tokens for r in ok) / self.wall_s if self.wall_s else 0.0,
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
                "errors": sorted({r.error for r in self.requests if r.error})[:3]}


def _pct(values: list[float], p: int) -> float | None:
    """The ``p``-th percentile (1..99) of sorted ``values``; None for none."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


async def _one(client, url: str, body: dict, start: float, req: Request, out: Timed) -> None:
    """One request at its arrival time, streamed. Its tokens: the server's usage when it gives one
    (``stream_options.include_usage``), else its text chunks (one token each, as llama.cpp streams)."""
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    arrived = start + req.arrival_s
    first = last = None
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
    except Exception as err:  # noqa: BLE001 - a failed request is counted as failed, the run goes on
        out.error = f"{type(err).__name__}: {err}"
        return
    if first is None:
        out.error = "no text streamed"
        return
    out.tokens = usage if usage is not None else chunks
    out.ttft_s, out.end_s = first - arrived, last
    if out.tokens > 1:
        out.tpot_s = (last - first) / (out.tokens - 1)


async def run_load(base_url: str, model: str, requests: list[Request], rate: float, extra: dict,
                   timeout_s: float = 600.0) -> RunResult:
    """Send ``requests`` (streamed completions, ``extra`` fields added to each body) and time them."""
    import httpx

    result = RunResult(rate=rate, requests=[Timed() for _ in requests])
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = [_one(client, "/v1/completions",
                      {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, **extra}, start, r, t)
                 for r, t in zip(requests, result.requests)]
        await asyncio.gather(*tasks)
    ends = [t.end_s for t in result.requests if t.error is None and t.end_s]
    result.wall_s = (max(ends) - (start + requests[0].arrival_s)) if ends else 0.0
    return result
