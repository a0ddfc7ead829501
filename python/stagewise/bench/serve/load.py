"""The load of `stagewise bench serve`: a workload's requests (:mod:`~stagewise.bench.serve.workloads`)
sent to an OpenAI-compatible server at their arrival times (a conversation's later turns as soon
as the answer before them ends), each streamed, timed as a client sees it.

Per request: time to first token (sent to the first streamed text), time per output token
((end - first token) / (tokens - 1)) and, when the server's usage says so, the prompt tokens its
prefix cache held. Per run: completed requests and output tokens per second over the run (first
arrival to last end), the 50th / 99th percentiles of both times, and the prefix-cache hit rate.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

from stagewise.bench.serve.workloads import Request

@dataclass(slots=True)
class Timed:
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    end_s: float = 0.0
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Of its prompt tokens, those the server's prefix cache held (None: the server does not say)."""


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
                "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99), "cache_hit_rate": _hit_rate(ok),
                "errors": sorted({r.error for r in self.requests if r.error})[:3]}


def _hit_rate(done: list[Timed]) -> float | None:
    """Cached prompt tokens over prompt tokens, when the server reported both for every request."""
    if not done or any(r.cached_tokens is None or not r.prompt_tokens for r in done):
        return None
    return sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done)


def _pct(values: list[float], p: int) -> float | None:
    """The ``p``-th percentile (1..99) of sorted ``values``; None for none."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


async def _one(client, url: str, body: dict, sent: float, out: Timed) -> str | None:
    """One request, streamed; its text (None when it failed). Its tokens: the server's usage when it
    gives one (``stream_options.include_usage``), else its text chunks (one token each, as llama.cpp
    streams)."""
    first = last = None
    chunks, usage, pieces = 0, None, []
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    pieces.append(choices[0]["text"])
    except Exception as err:  # noqa: BLE001 - a failed request is counted as failed, the run goes on
        out.error = f"{type(err).__name__}: {err}"
        return None
    if first is None:
        out.error = "no text streamed"
        return None
    out.tokens = usage["completion_tokens"] if usage else chunks
    if usage:
        out.prompt_tokens = usage.get("prompt_tokens")
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out.ttft_s, out.end_s = first - sent, last
    if out.tokens > 1:
        out.tpot_s = (last - first) / (out.tokens - 1)
    return "".join(pieces)


async def _conversation(client, body: dict, start: float, req: Request, timed: list[Timed]) -> None:
    """A request at its arrival time and, for a conversation, each later turn after the answer
    before it, with the conversation so far."""
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    prompt, sent = req.prompt, start + req.arrival_s  # a late start counts in the first turn's TTFT
    for i, out in enumerate(timed):
        answer = await _one(client, "/v1/completions", {**body, "prompt": prompt}, sent, out)
        sent = time.perf_counter()
        if answer is None or i == len(req.turns):
            return
        prompt = f"{prompt}{answer}\n\n{req.turns[i]}"


async def run_load(base_url: str, model: str, requests: list[Request], rate: float, extra: dict,
                   timeout_s: float = 600.0) -> RunResult:
    """Send ``requests`` (streamed completions, ``extra`` fields added to each body) and time them."""
    import httpx

    timed = [[Timed() for _ in range(1 + len(r.turns))] for r in requests]
    result = RunResult(rate=rate, requests=[t for ts in timed for t in ts])
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = [_conversation(client, {"model": model, "max_tokens": r.max_tokens, "temperature": 0.0,
                                        "stream": True, "stream_options": {"include_usage": True}, **extra},
                               start, r, ts)
                 for r, ts in zip(requests, timed)]
        await asyncio.gather(*tasks)
    ends = [t.end_s for t in result.requests if t.error is None and t.end_s]
    result.wall_s = (max(ends) - (start + requests[0].arrival_s)) if ends else 0.0
    return result
