"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own (one per server, so
that servers in one process do not share counters).

Counted as requests end: requests finished by reason, prompt and generated tokens, and the
time-to-first-token, time-per-output-token and end-to-end histograms. Read at each scrape: requests
running and waiting, KV blocks used and free (the scheduler's pool, which every stage mirrors), and
with pipeline stages each stage's busy fraction and the bytes it sent and received.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stagewise.frontend.run import Completion

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self.labels = labels
        names = ["model_name"]
        self.running = Gauge("stagewise_requests_running", "Requests in the running batches", names, registry=r)
        self.waiting = Gauge("stagewise_requests_waiting", "Requests waiting for a place in a batch", names,
                             registry=r)
        self.finished = Counter("stagewise_requests_finished", "Requests that ended, by finish reason",
                                names + ["finish_reason"], registry=r)
        self.rejected = Counter("stagewise_requests_rejected", "Requests refused before they ran, by reason "
                                "(busy, bad_request, too_large, unauthorized, unavailable)", names + ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("stagewise_prompt_tokens", "Prompt tokens of the requests that ended", names,
                                     registry=r)
        self.cached_tokens = Counter("stagewise_prefix_cache_hit_tokens", "Of the prompt tokens, those whose KV the "
                                     "prefix cache held (stagewise_prompt_tokens are the queries)", names, registry=r)
        self.generation_tokens = Counter("stagewise_generation_tokens", "Tokens generated", names, registry=r)
        self.draft_tokens = Counter("stagewise_spec_decode_draft_tokens", "Draft tokens proposed and verified "
                                    "(speculative decoding)", names, registry=r)
        self.accepted_tokens = Counter("stagewise_spec_decode_accepted_tokens", "Of the draft tokens, those "
                                       "accepted", names, registry=r)
        self.ttft = Histogram("stagewise_time_to_first_token_seconds", "Request received to its first token",
                              names, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("stagewise_time_per_output_token_seconds",
                              "Mean time between a request's tokens after its first", names,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("stagewise_e2e_request_latency_seconds", "Request received to its end", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_used = Gauge("stagewise_kv_blocks_used", "KV cache blocks in use on each stage", names + ["stage"],
                             registry=r)
        self.kv_cached = Gauge("stagewise_prefix_cache_blocks", "Of the free KV blocks, those whose KV the prefix "
                               "cache keeps for later requests", names, registry=r)
        self.evicted = Counter("stagewise_prefix_cache_evictions", "Cached KV blocks taken back for new KV",
                               names, registry=r)
        self._evicted_seen = 0
        self.kv_free = Gauge("stagewise_kv_blocks_free", "Free KV cache blocks on each stage", names + ["stage"],
                             registry=r)
        self.busy = Gauge("stagewise_stage_busy_fraction", "Share of a stage's time spent computing since it "
                          "started", names + ["stage"], registry=r)
        self.sent = Gauge("stagewise_stage_bytes_sent", "Bytes a stage sent to the next (hidden states, tokens)",
                          names + ["stage"], registry=r)
        self.received = Gauge("stagewise_stage_bytes_received", "Bytes a stage received", names + ["stage"],
                              registry=r)
        self.restarts = Counter("stagewise_stage_restarts", "Times the stage processes were started again after "
                                "one died or hung", names, registry=r)
        self._restarts_seen = 0

    def observe(self, result: Completion, timings: dict) -> None:
        """One request that ended."""
        m = self.labels
        self.finished.labels(**m, finish_reason=result.finish_reason).inc()
        self.prompt_tokens.labels(**m).inc(len(result.prompt_token_ids))
        self.cached_tokens.labels(**m).inc(result.cached_tokens)
        n = len(result.token_ids)
        self.generation_tokens.labels(**m).inc(n)
        if result.draft_tokens:
            self.draft_tokens.labels(**m).inc(result.draft_tokens)
            self.accepted_tokens.labels(**m).inc(result.accepted_tokens)
        self.e2e.labels(**m).observe(timings["e2e_s"])
        if timings.get("ttft_s") is not None:
            self.ttft.labels(**m).observe(timings["ttft_s"])
            if n > 1:
                self.tpot.labels(**m).observe((timings["end_at"] - timings["first_token_at"]) / (n - 1))

    def reject(self, reason: str) -> None:
        self.rejected.labels(**self.labels, reason=reason).inc()

    def scrape(self, status: dict, num_stages: int, stages: list[dict] | None, restarts: int = 0) -> bytes:
        """The text exposition, with the gauges read now (``restarts``: the pipeline's so far)."""
        m = self.labels
        if restarts > self._restarts_seen:
            self.restarts.labels(**m).inc(restarts - self._restarts_seen)
            self._restarts_seen = restarts
        self.running.labels(**m).set(status.get("running", 0))
        self.waiting.labels(**m).set(status.get("waiting", 0))
        total, free = status.get("total_blocks", 0), status.get("free_blocks", 0)
        self.kv_cached.labels(**m).set(status.get("cached_blocks", 0))
        evicted = status.get("evicted_blocks", 0)  # stage 0's count: a new pipeline counts from 0 again
        if evicted > self._evicted_seen:
            self.evicted.labels(**m).inc(evicted - self._evicted_seen)
        self._evicted_seen = evicted
        for i in range(num_stages):
            self.kv_used.labels(**m, stage=str(i)).set(total - free)
            self.kv_free.labels(**m, stage=str(i)).set(free)
        for s in stages or []:
            stage = str(s["stage"])
            self.busy.labels(**m, stage=stage).set(s["busy_s"] / s["wall_s"] if s["wall_s"] > 0 else 0.0)
            self.sent.labels(**m, stage=stage).set(s["bytes_sent"])
            self.received.labels(**m, stage=stage).set(s["bytes_received"])
        return generate_latest(self.registry)
