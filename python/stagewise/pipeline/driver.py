"""The driver: the process that talks to a running pipeline.

It connects a control link to every process of every stage (a stage of several ranks is that
many processes, each watched on its own), agrees on the KV block count (the smallest any rank
can hold, so that every stage's allocations mirror stage 0's), wires the stages' leaders into a
chain (each to the next, the last back to stage 0) and each leader to its stage's other ranks,
then feeds requests to stage 0 and collects their text and results. It watches every stage: a closed connection, an exited process or
``HEARTBEAT_TIMEOUT_S`` without a message marks the pipeline broken; requests still running then
end with ``finish_reason="error"`` naming the stage, and every stage process is stopped.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from stagewise.engine.requests import RequestOutput
from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.parallel.groups import store_host, world_ranks
from stagewise.parallel.runplan import RunPlan
from stagewise.pipeline import links, messages
from stagewise.pipeline.messages import (
    Add, Cancel, Connected, Events, Fatal, GetStats, Ready, ResetPrefixCache, Result, Setup, Shutdown, Stats, Status,
)  # fmt: skip
from stagewise.pipeline.faults import Fault, PipelineBroken, StageProcesses
from stagewise.pipeline.protocol import ProtocolError
from stagewise.transport.errors import ChannelClosed, HandshakeError, HelloTimeout

HEARTBEAT_TIMEOUT_S = 3.0


@dataclass(slots=True)
class _Request:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    """What it generated so far (a failed request still reports them)."""
    logprobs: list[TokenLogprobs | None] | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    error: str | None = None
    """Why this side cancelled it (the request then ends with finish_reason 'error')."""


class PipelineDriver:
    """A running pipeline, driven from this process: a front end's
    :class:`~stagewise.frontend.run.Backend`."""

    def __init__(self, plan: RunPlan, addresses: list[tuple[str, int]], *, fingerprint: str,
                 auth_token: str | None = None, processes: StageProcesses | None = None,
                 ready_timeout_s: float = 600.0, connect_timeout_s: float = 60.0,
                 keep_processes: bool = False) -> None:
        self.plan, self.addresses, self.processes = plan, addresses, processes
        self.keep_processes = keep_processes
        """When the pipeline breaks, leave the processes running (whoever starts it again decides
        which to replace: :meth:`lost`); :meth:`close` without ``keep`` still stops them."""
        self.controls = []
        self.broken: str | None = None
        self._ended: list[RequestOutput] = []
        self.status: dict = {}
        """Stage 0's latest status: waiting (queue depth), running (active rows), max_num_seqs,
        free_blocks, total_blocks."""
        self._requests: dict[int, _Request] = {}
        self._tokens: list[tuple[int, int, TokenLogprobs | None]] = []
        self._problems: list[tuple[Fault, int, str]] = []
        self.members = plan.members
        """(stage, rank) of each process, in the order of ``addresses`` and of the launcher's."""
        if len(addresses) != len(self.members):
            raise ValueError(f"PipelineDriver: {len(addresses)} addresses for the {len(self.members)} processes of "
                             "the plan (one per rank of every stage)")
        self.leaders = [self.members.index((i, 0)) for i in range(plan.num_stages)]
        n, m = plan.num_stages, len(self.members)
        self.last_seen = [time.monotonic()] * m
        options = links.LinkOptions(fingerprint=fingerprint, auth_token=auth_token, tls=links.TlsConfig.from_dict(plan.tls))
        try:
            for i, address in enumerate(addresses):
                self.controls.append(self._dial(i, address, options, connect_timeout_s))
                self.last_seen[i] = time.monotonic()
            ready = self._expect_all(Ready, ready_timeout_s)
            for i, msg in enumerate(ready):
                if msg.fingerprint != fingerprint:
                    raise ValueError(f"{self._label(i)} runs model/plan fingerprint {msg.fingerprint!r}, the driver "
                                     f"expects {fingerprint!r}: the hosts do not hold the same model or plan")
            self.num_blocks = min(r.capacity_blocks for r in ready)
            self.pids = [r.pid for r in ready]
            hops = links.hop_transports(plan)
            for i, (stage, rank) in enumerate(self.members):
                leader = rank == 0
                following = [tuple(addresses[j]) for j, (s, r) in enumerate(self.members) if s == stage and r > 0]
                store = self._world_store(stage, hops, ready)
                self._send(i, Setup(num_blocks=self.num_blocks, transport=hops[stage], microbatches=n, store=store,
                                    next=None if n == 1 or not leader else tuple(addresses[self.leaders[(stage + 1) % n]]),
                                    followers=following if leader and following else None))
            self._expect_all(Connected, 120.0)
        except BaseException:
            self.close(force=True)
            raise
        self.last_seen = [time.monotonic()] * m

    def _world_store(self, stage: int, hops: list[str], ready: list[Ready]) -> tuple[str, int] | None:
        """The store of stage ``stage``'s torch.distributed world: hosted by the world's first rank
        (:func:`~stagewise.parallel.groups.world_ranks`; ``members`` are in global rank order, so
        that rank is its process's index here), where its ranks reach it (``store_host``)."""
        world = world_ranks(self.plan, stage, hops)
        if not world:
            return None
        i = world[0]
        if ready[i].store_port is None:
            raise ValueError(f"{self._label(i)} hosts no torch.distributed store for its world: the stages run "
                             "another stagewise version, or a plan with another transport")
        return store_host(hops, self.addresses[i][0]), ready[i].store_port

    # ---- low level --------------------------------------------------------------

    def _dial(self, stage: int, address: tuple[str, int], options: links.LinkOptions, timeout: float):
        """Stage ``stage``'s control link, giving up as soon as its process is gone."""
        return dial_control(address, options, peer=stage, timeout=timeout, name=self._name(stage),
                            check=lambda: self._check_process(stage))

    def _label(self, member: int) -> str:
        return self.plan.member_label(*self.members[member])

    def _name(self, member: int) -> str:
        return f"{self._label(member)} on {self.plan.stages[self.members[member][0]].host}"

    def _expect_all(self, kind: type, timeout: float) -> list:
        """The next message of type ``kind`` from every stage, watching them all at once: the
        first stage that fails or exits meanwhile ends the wait with its own words."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.controls):
            for i in range(len(self.controls)):
                if i not in got:
                    msg = self._expect(i, kind, max(0.0, deadline - time.monotonic()), wait=0.05)
                    if msg is not None:
                        got[i] = msg
            if len(got) < len(self.controls) and time.monotonic() > deadline:
                missing = [self._label(i) for i in range(len(self.controls)) if i not in got]
                raise TimeoutError(f"{', '.join(missing)} did not report {kind.__name__} within {timeout:.0f} s")
        return [got[i] for i in range(len(self.controls))]

    def _expect(self, stage: int, kind: type, timeout: float, wait: float | None = None, hang_s: float | None = None):
        """The next message of type ``kind`` from ``stage`` (status and heartbeats are taken on
        the way). With ``wait``, None when none came within that many seconds; with ``hang_s``, a
        stage that sends nothing, not even a heartbeat, for that long is hung (PipelineBroken)."""
        deadline = time.monotonic() + (timeout if wait is None else min(wait, timeout))
        while True:
            self._check_process(stage)
            try:
                frame = self.controls[stage].recv(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except TimeoutError:  # nothing waiting: messages read late (between calls) count from when read
                if hang_s is not None and self._silent(stage, time.monotonic(), hang_s):
                    raise PipelineBroken(self._problems[-1][2]) from None
                if time.monotonic() > deadline:
                    if wait is not None:
                        return None
                    raise TimeoutError(f"{self._name(stage)} did not report {kind.__name__} within {timeout:.0f} s") \
                        from None
                continue
            except ChannelClosed as err:
                time.sleep(0.2)  # an exiting stage's process and words come a moment after its connection ends
                self._check_process(stage)
                raise PipelineBroken(f"{self._name(stage)} closed its connection before {kind.__name__}: {err}") \
                    from None
            msg = messages.from_frame(frame)
            self.last_seen[stage] = time.monotonic()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, Fatal):
                raise PipelineBroken(f"{self._name(stage)} failed: {msg.message}")
            if isinstance(msg, Status):
                self.status = _status_dict(msg)
            elif isinstance(msg, Events) and stage == 0:  # requests running (a server asking for stats)
                self._ended += self._events(msg)
            elif not isinstance(msg, messages.Heartbeat):
                raise ProtocolError(f"stage {stage}: expected {kind.__name__}, got {type(msg).__name__}")

    def _check_process(self, stage: int) -> None:
        if self.processes is not None:
            code = self.processes.exit_code(stage)
            if code is not None:
                said = self.processes.failure(stage)
                if said:
                    raise PipelineBroken(said)
                raise PipelineBroken(f"{self._name(stage)}: its process exited with "
                                     + (f"signal {-code}" if code < 0 else f"code {code}"))

    def _send(self, stage: int, msg: messages.Message) -> None:
        if self.broken:
            raise PipelineBroken(self.broken)
        try:
            self.controls[stage].send(messages.to_frame(msg))
        except (ChannelClosed, OSError) as err:
            self._break(f"{self._label(stage)} is unreachable: {err}")
            raise PipelineBroken(self.broken) from None

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self.close(force=True, keep=self.keep_processes)

    def lost(self) -> list[int]:
        """The processes (indices of :attr:`members`) a broken pipeline lost: exited, killed,
        hung or failed on their own; the others only lost a neighbour."""
        self._settle()
        faults = {i for fault, i, _ in self._problems if fault in (Fault.KILLED, Fault.FAILED)}
        exited = {i for i in range(len(self.members)) if self.processes is not None
                  and self.processes.exit_code(i) is not None}
        return sorted(faults | exited)

    # ---- requests -----------------------------------------------------------------

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams, images=None, resumed: int = 0) -> None:
        """Send a request (with its images, if any; ``resumed``: see :meth:`Engine.add_request`) to stage 0."""
        self._requests[request_id] = _Request(list(prompt_ids), logprobs=[] if params.logprobs is not None else None)
        self._send(0, Add(request_id=request_id, prompt_ids=list(prompt_ids), params=params, images=images, resumed=resumed))

    def cancel(self, request_id: int) -> None:
        if not self.broken and request_id in self._requests:
            self._send(0, Cancel(request_id=request_id))

    def reset_prefix_cache(self) -> None:
        """Stage 0 forgets every cached prefix (see :meth:`Engine.reset_prefix_cache`)."""
        if not self.broken:
            self._send(0, ResetPrefixCache())

    def abort(self, request_id: int, error: str) -> None:
        """Cancel a request that is to end with finish_reason 'error' and ``error``."""
        req = self._requests.get(request_id)
        if req is not None and req.error is None:
            req.error = error
            self.cancel(request_id)

    def take_tokens(self) -> list[tuple[int, int, TokenLogprobs | None]]:
        """(request_id, token, its logprobs or None) received since the last call, in order: what
        a front end streams."""
        out, self._tokens = self._tokens, []
        return out

    def poll(self, timeout: float) -> list[RequestOutput]:
        """Wait up to ``timeout`` for stage 0's events; returns the requests that ended (their
        new tokens wait in :meth:`take_tokens`). Checks every stage's health on the way: when the
        pipeline breaks, every request still running ends with an error naming the stage."""
        done, self._ended = self._ended, []  # requests that ended while stats were fetched
        if self.broken:
            return done + self._fail_all()
        self.controls[0].poll(0.0 if done else timeout)  # wait for stage 0's events (or the timeout)
        now = time.monotonic()
        for i, control in enumerate(self.controls):
            try:
                while control.poll(0):
                    try:
                        frame = control.recv(timeout=0.5)
                    except TimeoutError:
                        break  # a frame still arriving: read it next time
                    # Every message, heartbeats included, shows the stage alive; messages read
                    # late (between generate calls) count from when they are read.
                    self.last_seen[i] = now
                    done += self._on_message(i, messages.from_frame(frame))
            except (ChannelClosed, OSError) as err:
                self._problems.append((Fault.GONE, i, f"{self._label(i)} closed its connection ({err})"))
        self._check_health(now)
        if self._problems:
            self._break(self._diagnose())
            return done + self._fail_all()
        return done

    def _on_message(self, stage: int, msg: messages.Message) -> list[RequestOutput]:
        if isinstance(msg, Fatal):
            self._problems.append((Fault.LOST_NEIGHBOUR if msg.neighbour else Fault.FAILED, stage,
                                   f"{self._label(stage)} failed: {msg.message}"))
        elif isinstance(msg, Status) and stage == 0:
            self.status = _status_dict(msg)
        elif isinstance(msg, Events) and stage == 0:
            return self._events(msg)
        return []

    def _events(self, events: Events) -> list[RequestOutput]:
        stamp = time.perf_counter()
        for new in events.tokens:
            req = self._requests.get(new.request_id)
            if req is None:
                continue
            if req.first_token_s is None:
                req.first_token_s = stamp
            req.tokens.append(new.token)
            if req.logprobs is not None:
                req.logprobs.append(new.logprobs)
            self._tokens.append((new.request_id, new.token, new.logprobs))
        return [self._output(r) for r in events.done if r.request_id in self._requests]

    def _output(self, result: Result) -> RequestOutput:
        req = self._requests.pop(result.request_id)
        reason, error = result.finish_reason, result.error
        if req.error is not None and reason == "cancelled":
            reason, error = "error", req.error
        return RequestOutput(request_id=result.request_id, prompt_ids=req.prompt_ids, token_ids=result.token_ids,
                             finish_reason=reason, error=error, logprobs=req.logprobs, arrival_s=req.arrival_s,
                             first_token_s=req.first_token_s, finish_s=time.perf_counter(),
                             cached_tokens=result.cached_tokens, draft_tokens=result.draft_tokens,
                             accepted_tokens=result.accepted_tokens)

    def _check_health(self, now: float) -> None:
        for i in range(len(self.members)):
            code = None if self.processes is None else self.processes.exit_code(i)
            if code is not None:
                self._problems.append((Fault.KILLED if code < 0 else Fault.GONE, i, f"{self._label(i)} process exited "
                                       "with " + (f"signal {-code}" if code < 0 else f"code {code}")))
            else:
                self._silent(i, now, HEARTBEAT_TIMEOUT_S)

    def _silent(self, i: int, now: float, limit_s: float) -> bool:
        """Whether process ``i`` sent nothing, not even a heartbeat, for ``limit_s`` (then a
        problem: hung or unreachable)."""
        if now - self.last_seen[i] <= limit_s:
            return False
        self._problems.append((Fault.KILLED, i, f"{self._label(i)} sent nothing for {now - self.last_seen[i]:.1f} s "
                                                "(hung or unreachable)"))
        return True

    def _settle(self) -> None:
        """Processes known only by asking (Ray actors): ask each now, and wait up to 2 s."""
        settle = getattr(self.processes, "settle", None)
        if settle is not None:
            settle(2.0)

    def _diagnose(self) -> str:
        """The most likely cause among the problems seen (see :class:`Fault`)."""
        time.sleep(0.3)  # let the other stages notice and report
        if self.processes is not None:
            self._settle()
            for i in range(len(self.members)):
                code = self.processes.exit_code(i)
                if code is not None and code < 0:
                    self._problems.append((Fault.KILLED, i, f"{self._label(i)} process exited with signal {-code}"))
        return min(self._problems)[2]

    def _fail_all(self) -> list[RequestOutput]:
        """Every request still running, ended with the pipeline's failure (what it generated
        so far kept)."""
        return [self._output(Result(request_id=rid, token_ids=list(self._requests[rid].tokens), finish_reason="error",
                                    error=f"pipeline failed: {self.broken}")) for rid in list(self._requests)]

    # ---- stats and shutdown ----------------------------------------------------------

    def stage_stats(self, *, trace: bool = False, reset: bool = False) -> list[Stats]:
        """Every stage's measurements (PipelineBroken, and the pipeline stopped, when a stage is
        gone)."""
        try:
            for i in self.leaders:
                self._send(i, GetStats(trace=trace, reset=reset))
            # A stage silent for the heartbeat timeout is hung (a trace's large reply may take longer).
            return [self._expect(i, Stats, 30.0, hang_s=None if trace else HEARTBEAT_TIMEOUT_S) for i in self.leaders]
        except (PipelineBroken, TimeoutError) as err:
            self._break(str(err))
            raise PipelineBroken(self.broken) from None

    def close(self, force: bool = False, keep: bool = False) -> None:
        """Stop every stage: ask politely (``Shutdown``) and wait for the processes, then close
        the connections; ``force`` skips the asking. Stragglers get SIGTERM, then SIGKILL.
        ``keep``: only close the connections (stages started with ``--rejoin`` wait for a new
        driver)."""
        if not force and not keep:
            for control in self.controls:
                try:
                    control.send(messages.to_frame(Shutdown()))
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self.processes is not None and not keep:
            self.processes.stop(0.2 if force else 5.0)
        for control in self.controls:
            try:
                control.close()
            except Exception:  # noqa: BLE001
                pass
        self.controls = []


def _status_dict(msg: Status) -> dict:
    return dataclasses.asdict(msg)


def dial_control(address: tuple[str, int], options: links.LinkOptions, *, peer: int, timeout: float, name: str,
                 check=lambda: None):
    """The driver's control link to stage member ``peer`` (``name`` in errors), dialled again every
    2 s until ``timeout``: while nothing listens yet, and while the stage, busy loading its layers,
    leaves a connection without its hello; ``check()`` between tries raises once its process is
    gone. A refused hello (another model or plan, a wrong token) raises at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return links.dial(address, options, transport="tcp", stage=-1, peer=peer, role="driver",
                              timeout=min(2.0, max(0.1, deadline - time.monotonic())))
        except (TimeoutError, ConnectionError) as err:
            if isinstance(err, HandshakeError) and not isinstance(err, HelloTimeout):
                raise
            check()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{name}: no answer at {address[0]}:{address[1]} within {timeout:.0f} s "
                                   f"({err})") from None
