"""The driver: the process that talks to a running pipeline.

It connects a control channel to every stage, agrees on the KV block count (the smallest any
stage can hold, so that every stage's allocations mirror stage 0's), wires the stages into a
chain (each to the next, the last back to stage 0), then feeds requests to stage 0 and collects
their tokens and text. It watches every stage: a closed connection, an exited process or
``HEARTBEAT_TIMEOUT_S`` without a message marks the pipeline broken; in-flight requests then
end with ``finish_reason="error"`` naming the stage, and every stage process is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stagewise.launch.planfile import RunPlan
from stagewise.runtime import links
from stagewise.transport.errors import ChannelClosed
from stagewise.transport.frame import Frame, StepKind

HEARTBEAT_TIMEOUT_S = 3.0


class PipelineBroken(RuntimeError):
    """A stage died, hung or disconnected; the pipeline cannot serve any more."""


@dataclass(slots=True)
class RequestState:
    rid: int
    text: list[str] = field(default_factory=list)
    first_token_s: float | None = None
    result: dict | None = None


class PipelineDriver:
    def __init__(self, plan: RunPlan, addresses: list[tuple[str, int]], *, fingerprint: str,
                 auth_token: str | None = None, processes: list | None = None, ready_timeout_s: float = 600.0,
                 hop_transports: list[str] | None = None, connect_timeout_s: float = 60.0) -> None:
        self.plan, self.addresses, self.processes = plan, addresses, processes
        self.fingerprint = fingerprint
        self.controls = []
        self.last_seen: list[float] = []
        self.broken: str | None = None
        try:
            for i, address in enumerate(addresses):
                self.controls.append(links.dial(address, transport="tcp", stage=-1, peer=i, role="driver",
                                                fingerprint=fingerprint, auth_token=auth_token,
                                                timeout=connect_timeout_s))
            ready = [self._expect(i, "ready", ready_timeout_s) for i in range(plan.num_stages)]
            for i, msg in enumerate(ready):
                if msg.get("fingerprint") != fingerprint:
                    raise ValueError(f"stage {i} runs model/plan fingerprint {msg.get('fingerprint')!r}, the driver "
                                     f"expects {fingerprint!r}: the hosts do not hold the same model or plan")
            self.num_blocks = min(int(m["capacity_blocks"]) for m in ready)
            self.pids = [m.get("pid") for m in ready]
            hops = hop_transports or ["tcp"] * plan.num_stages
            store = self._torch_store() if "torch" in hops else None
            for i, control in enumerate(self.controls):
                nxt = None if plan.num_stages == 1 else addresses[(i + 1) % plan.num_stages]
                control.send(Frame(step_kind=StepKind.CONTROL, control={
                    "op": "setup", "num_blocks": self.num_blocks, "next": None if nxt is None else list(nxt),
                    "transport": hops[i], "microbatches": plan.num_stages, "store": store}))
            for i in range(plan.num_stages):
                self._expect(i, "connected", 120.0)
        except BaseException:
            self.close(force=True)
            raise
        now = time.monotonic()
        self.last_seen = [now] * plan.num_stages
        self.requests: dict[int, RequestState] = {}
        self._problems: list[tuple[int, int, str]] = []
        self.status: dict = {}
        """Stage 0's latest status: waiting (queue depth), running (active rows), max_num_seqs,
        free_blocks, total_blocks."""

    def _torch_store(self) -> list:
        """A TCPStore for the stages' torch.distributed process group (the ``torch`` transport),
        hosted here on the address the stages reach this process at."""
        from datetime import timedelta

        import torch.distributed as dist

        host = self.controls[0]._sock.getsockname()[0]
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        return [host, self._store.port]

    # ---- low level --------------------------------------------------------------

    def _expect(self, stage: int, op: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            self._check_process(stage)
            try:
                frame = self.controls[stage].recv(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stage {stage} did not report {op!r} within {timeout:.0f} s") from None
                continue
            except ChannelClosed as err:
                raise PipelineBroken(f"stage {stage} closed its connection before {op!r}: {err}") from None
            msg = frame.control or {}
            if self.last_seen:
                self.last_seen[stage] = time.monotonic()
            if msg.get("op") == op:
                return msg
            if msg.get("op") == "status":
                self.status = {k: v for k, v in msg.items() if k != "op"}
                continue
            if msg.get("op") in ("heartbeat", "events"):
                continue  # (events only arrive here after every request has ended)
            raise ValueError(f"stage {stage}: expected {op!r}, got {msg.get('op')!r}")

    def _check_process(self, stage: int) -> None:
        if self.processes is not None:
            code = self.processes[stage].poll()
            if code is not None:
                raise PipelineBroken(f"stage {stage} process exited with code {code}")

    def send(self, control: dict, stage: int = 0) -> None:
        if self.broken:
            raise PipelineBroken(self.broken)
        try:
            self.controls[stage].send(Frame(step_kind=StepKind.CONTROL, control=control))
        except (ChannelClosed, OSError) as err:
            self._break(f"stage {stage} is unreachable: {err}")
            raise PipelineBroken(self.broken) from None

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            for state in self.requests.values():
                if state.result is None:
                    state.result = {"id": state.rid, "token_ids": [], "text": "".join(state.text),
                                    "finish_reason": "error", "error": f"pipeline failed: {reason}"}
            self.close(force=True)

    # ---- requests -----------------------------------------------------------------

    def add(self, rid: int, prompt_ids: list[int], params: dict) -> None:
        self.requests[rid] = RequestState(rid)
        self.send({"op": "add", "id": rid, "prompt_ids": prompt_ids, "params": params})

    def cancel(self, rid: int) -> None:
        if not self.broken and rid in self.requests and self.requests[rid].result is None:
            self.send({"op": "cancel", "id": rid})

    def pump(self, timeout: float, on_text: Callable[[int, str], None] | None = None) -> list[dict]:
        """Wait up to ``timeout`` for stage 0's events; returns the results that completed.
        Checks every stage's health on the way."""
        done: list[dict] = []
        if self.broken:
            return self._drain_broken()
        self.controls[0].poll(timeout)  # wait for stage 0's events (or the timeout)
        now = time.monotonic()
        for i in range(self.plan.num_stages):
            try:
                while self.controls[i].poll(0):
                    try:
                        msg = self.controls[i].recv(timeout=0.5).control or {}
                    except TimeoutError:
                        break  # a frame still arriving: read it next time
                    # Every message, heartbeats included, shows the stage alive; messages read
                    # late (between generate calls) count from when they are read.
                    self.last_seen[i] = now
                    if msg.get("op") == "fatal":
                        self._problems.append((2 if msg.get("neighbour") else 1, i,
                                               f"stage {i} failed: {msg.get('message')}"))
                    elif i == 0 and msg.get("op") == "status":
                        self.status = {k: v for k, v in msg.items() if k != "op"}
                    elif i == 0:
                        done += self._events(msg, now, on_text)
            except (ChannelClosed, OSError) as err:
                self._problems.append((3, i, f"stage {i} closed its connection ({err})"))
        for i in range(self.plan.num_stages):
            code = None if self.processes is None else self.processes[i].poll()
            if code is not None:
                self._problems.append((0 if code < 0 else 3, i, f"stage {i} process exited with "
                                       + (f"signal {-code}" if code < 0 else f"code {code}")))
            elif now - self.last_seen[i] > HEARTBEAT_TIMEOUT_S:
                self._problems.append((0, i, f"stage {i} sent nothing for {now - self.last_seen[i]:.1f} s "
                                             "(hung or unreachable)"))
        if self._problems:
            self._break(self._diagnose())
            return done + self._drain_broken()
        return done

    def _diagnose(self) -> str:
        """The most likely cause among the problems seen: a stage killed or silent first, then one
        that failed on its own, then one that only lost a neighbour or exited."""
        time.sleep(0.3)  # let the other stages notice and report
        if self.processes is not None:
            for i, proc in enumerate(self.processes):
                code = proc.poll()
                if code is not None and code < 0:
                    self._problems.append((0, i, f"stage {i} process exited with signal {-code}"))
        return min(self._problems)[2]

    def _drain_broken(self) -> list[dict]:
        out = []
        for state in self.requests.values():
            if state.result is not None and not getattr(state, "_reported", False):
                out.append(state.result)
        for rid in [r["id"] for r in out]:
            self.requests.pop(rid, None)
        return out

    def _events(self, msg: dict, now: float, on_text) -> list[dict]:
        if msg.get("op") != "events":
            return []
        for rid, _count in msg.get("tokens", []):
            state = self.requests.get(rid)
            if state is not None and state.first_token_s is None:
                state.first_token_s = time.perf_counter()
        for rid, delta in msg.get("text", []):
            state = self.requests.get(rid)
            if state is not None:
                state.text.append(delta)
                if on_text is not None:
                    on_text(rid, delta)
        done = []
        for result in msg.get("done", []):
            state = self.requests.pop(result["id"], None)
            if state is not None:
                result["first_token_s"] = state.first_token_s
                done.append(result)
        return done

    def has_pending(self) -> bool:
        return bool(self.requests)

    # ---- stats and shutdown ----------------------------------------------------------

    def stage_stats(self, *, trace: bool = False, reset: bool = False) -> list[dict]:
        for i in range(self.plan.num_stages):
            self.send({"op": "stats", "trace": trace, "reset": reset}, stage=i)
        return [self._expect(i, "stats", 30.0) for i in range(self.plan.num_stages)]

    def close(self, force: bool = False) -> None:
        """Stop every stage: ask politely (``shutdown``) and wait for the processes, then close
        the connections; ``force`` skips the asking. Stragglers get SIGTERM, then SIGKILL."""
        if not force:
            for control in self.controls:
                try:
                    control.send(Frame(step_kind=StepKind.CONTROL, control={"op": "shutdown"}))
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self.processes is not None:
            from stagewise.launch.local import stop_processes

            stop_processes(self.processes, grace_s=0.2 if force else 5.0)
        for control in self.controls:
            try:
                control.close()
            except Exception:  # noqa: BLE001
                pass
        self.controls = []
