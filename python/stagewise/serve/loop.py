"""The one thread that talks to the pipeline while a server runs (:class:`ServeLoop`).

Requests from every client are added to the same running :class:`~stagewise.frontend.run.Run`, so they
join the batches the scheduler is running (continuous batching across HTTP requests). The server's
handlers never touch the pipeline: they hand requests and cancellations to this thread through a
queue and get their text and results back through a :class:`Sink`, called on this thread.

Back-pressure: at most ``max_num_seqs + max_waiting`` requests are held at once; one more is refused
at once (:class:`Busy`) rather than queued without bound.

The thread polls the pipeline whether requests run or not: the same poll that reads their tokens
reads the stages' heartbeats and exit codes, so a stage that dies or hangs while the server is idle
is noticed within the heartbeat timeout (its process reaped) and repaired at once, not when the
next request comes (:meth:`ServeLoop.health` says so meanwhile).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.frontend.run import Completion


class Busy(Exception):
    """The server holds as many requests as it may: the client should retry later."""


class Unavailable(Exception):
    """The pipeline stopped serving (a stage died or hung) or the server is shutting down."""


@dataclass(eq=False)
class Sink:
    """Where one request's output goes; both callables are called on the loop's thread."""

    on_text: Callable[[str, list[TokenLogprobs | None]], None]
    """New text, and the log-probabilities of the tokens that came since the last call."""
    on_done: Callable[[Completion, dict], None]
    """The result and its timings (``ttft_s``, ``e2e_s``)."""
    submitted: float = field(default_factory=time.perf_counter)
    sent_logprobs: int = 0


class ServeLoop:
    """Owns the pipeline's request traffic from its own thread; every other method may be called
    from any thread. ``observe(completion, timings)`` (metrics) is called for each ended request.
    ``step_threads``: a model in this process runs a step of one token on the first number of torch
    threads and a larger step on the second (:func:`stagewise.cli.serve.serving_threads`)."""

    def __init__(self, pipe, *, max_waiting: int, observe: Callable[[Completion, dict], None] | None = None,
                 status_every_s: float = 0.25, step_threads: tuple[int, int] | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"ServeLoop: max_waiting must be >= 0, got {max_waiting}")
        self.pipe, self.observe = pipe, observe
        self.capacity = pipe.max_num_seqs + max_waiting
        self.status: dict[str, int] = dict(pipe.status())
        self.failed: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._ended: list[int] = []
        self._held = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._status_every = status_every_s
        self._status_due = False
        self._stages = pipe.driver is not None
        """Whether there are stage processes to watch (in one process, an idle engine has nothing to do)."""
        self._run = pipe.open_run(on_text=self._text, on_done=self._done)
        if step_threads is not None and pipe.driver is None:
            self._run.backend.set_step_threads(*step_threads)
        self._thread = threading.Thread(target=self._main, name="stagewise-serve-loop", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why requests cannot be served now (None: they can)."""
        if self._stop.is_set():
            return "the server is shutting down"
        return self.failed or (f"the pipeline failed: {self.pipe.broken}" if self.pipe.broken else None)

    def health(self) -> tuple[str, str | None]:
        """``("ok", None)`` while requests can be served, else the state and why: ``repairing`` (a
        stage died or hung and is being started again: requests wait for it), ``failed`` (the
        pipeline cannot serve any more) or ``stopping``."""
        if self._stop.is_set():
            return "stopping", "the server is shutting down"
        why = self.unavailable
        if why:
            return "failed", why
        repairing = self.pipe.repairing
        if repairing:
            return "repairing", f"{repairing}; the pipeline is being started again"
        return "ok", None

    @property
    def held(self) -> int:
        return self._held

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, images=None) -> int:
        """Queue a request (with its :class:`~stagewise.engine.images.ImageInputs`, or None); its id
        (Busy when full, Unavailable when the pipeline cannot serve)."""
        why = self.unavailable
        if why:
            raise Unavailable(why)
        with self._lock:
            if self._held >= self.capacity:
                raise Busy(f"{self._held} requests are running or waiting (at most {self.capacity})")
            self._held += 1
        rid = self.pipe.new_request_id()
        self._commands.put(("add", rid, prompt_ids, params, sink, images))
        return rid

    def cancel(self, rid: int) -> None:
        """End a request whose client went away; its KV is freed on every stage."""
        self._commands.put(("cancel", rid))

    def reset_prefix_cache(self) -> None:
        """Stage 0 forgets every cached prefix (after the requests already handed to the loop)."""
        self._commands.put(("reset_prefix_cache",))

    def stage_stats(self, timeout: float = 5.0) -> list[dict] | None:
        """Each stage's counters since it started (None for one process, or when they did not
        come within ``timeout``)."""
        if self.pipe.driver is None or self.unavailable:
            return None
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._commands.put(("stats", box))
        try:
            got = box.get(timeout=timeout)
        except queue.Empty:
            return None
        return got if isinstance(got, list) else None

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is left, and stop the thread (the pipeline stays open: its owner closes it)."""
        if not self._stop.is_set():
            self._stop.set()
            self._commands.put(("wake",))
            self._thread.join(timeout)

    # ---- the loop's thread --------------------------------------------------------------------

    def _main(self) -> None:
        last_status = 0.0
        try:
            while not self._stop.is_set():
                self._take_commands(block=not self._run.pending)
                if self._run.pending or (self._stages and not self.pipe.broken):  # idle too: one watch
                    self._run.poll_once(0.01 if self._run.pending else 0.0)
                self._ended = [rid for rid in self._ended if not self._run.forget(rid)]
                now = time.perf_counter()
                if now - last_status >= self._status_every or self._status_due:
                    self._status_due = False
                    last_status = now
                    self.status = dict(self.pipe.status())
        except Exception as err:  # noqa: BLE001 - the loop is the server's only way to the pipeline
            self.failed = f"the serving loop stopped: {type(err).__name__}: {err}"
        finally:
            self._shutdown()

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, sink, images = cmd
            self._sinks[rid] = sink
            try:
                self._run.add(rid, rid, ids, params, images)
            except RuntimeError as err:  # the pipeline broke between the check and now
                self._done(rid, _failed(str(err), ids))
        elif kind == "cancel":
            self._run.cancel(cmd[1])
        elif kind == "reset_prefix_cache":
            self.pipe.reset_prefix_cache()
        elif kind == "stats":
            try:
                cmd[1].put(self.pipe.stage_stats())
            except Exception as err:  # noqa: BLE001 - answered as missing stats; the pipeline's state says why
                cmd[1].put(err)

    def _text(self, rid: int, delta: str) -> None:
        sink = self._sinks.get(rid)
        if sink is None:
            return
        lps = self._run.logprobs(rid)
        new, sink.sent_logprobs = lps[sink.sent_logprobs:], len(lps)
        sink.on_text(delta, new)

    def _done(self, rid: int, result: Completion) -> None:
        sink = self._sinks.pop(rid, None)
        if sink is None:
            return
        with self._lock:
            self._held -= 1
        now = time.perf_counter()
        first = self._run.first_token_s(rid)
        timings = {"ttft_s": None if first is None else first - sink.submitted, "e2e_s": now - sink.submitted,
                   "first_token_at": first, "end_at": now}
        lps = self._run.logprobs(rid)
        rest = lps[sink.sent_logprobs:len(result.token_ids)]
        if rest:
            sink.sent_logprobs += len(rest)
            sink.on_text("", rest)
        self._ended.append(rid)
        self._status_due = True
        if self.observe is not None:
            self.observe(result, timings)
        sink.on_done(result, timings)

    def _shutdown(self) -> None:
        self._run.cancel_unfinished()
        deadline = time.monotonic() + 5.0
        while self._run.pending and time.monotonic() < deadline and not self.pipe.broken:
            try:
                self._run.poll_once(0.05)
            except Exception:  # noqa: BLE001 - shutting down: what is left ends below
                break
        reason = self.failed or "the server is shutting down"
        for rid in list(self._sinks):
            self._done(rid, _failed(reason))
        while True:  # requests queued after the loop stopped
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                with self._lock:
                    self._held -= 1
                cmd[4].on_done(_failed(reason, cmd[2]), {"ttft_s": None, "e2e_s": 0.0})


def _failed(error: str, prompt_ids=()) -> Completion:
    """The result of a request that ends before the pipeline gave it any token."""
    return Completion(text="", token_ids=[], finish_reason="error", error=error, prompt_token_ids=list(prompt_ids))
