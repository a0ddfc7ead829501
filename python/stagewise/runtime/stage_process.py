"""A pipeline stage as an OS process: ``stagewise stage --plan PLAN --stage I``.

Life of a stage (seed 000 §4.2):

1. listen on the plan's address (loopback unless one is given) and print
   ``STAGEWISE-LISTENING host port`` on stdout, so a local launcher learns an ephemeral port;
2. load only this stage's layers;
3. accept the driver's control connection and report ``ready`` (how many KV blocks it can hold);
4. on ``setup`` (the block count every stage uses, the next stage's address, the transport):
   allocate the KV cache, connect to the next stage (the last stage connects back to stage 0,
   the token feedback edge), accept the previous one, report ``connected``;
5. serve steps until ``shutdown``, the driver's disconnection or a dead neighbour.

Stage 0 runs the :class:`~stagewise.runtime.pipeline_head.PipelineHead` (requests, scheduling,
detokenisation, stop rules, up to S microbatches in flight); later stages run a
:class:`~stagewise.runtime.stage_runtime.StageRuntime`. A heartbeat goes to the driver every
``HEARTBEAT_S`` so that it notices a hung stage.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from stagewise.launch.planfile import RunPlan, parse_address
from stagewise.runtime import links
from stagewise.runtime.engine import DEFAULT_BLOCK_SIZE, RequestOutput, default_num_tokens
from stagewise.runtime.sampling import SamplingParams
from stagewise.runtime.stage_runtime import StepRow, rows_of
from stagewise.transport.errors import ChannelClosed, FrameError
from stagewise.transport.frame import Frame, Row, RowFlags, StepKind

HEARTBEAT_S = 0.5
READY_LINE = "STAGEWISE-LISTENING"
MAX_TRACE_EVENTS = 200_000


@dataclass(slots=True)
class StageStats:
    """What a stage reports: time computing, sending and waiting, bytes moved, and trace events."""

    busy_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected_frames: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    trace: list[tuple[str, float, float, int]] = field(default_factory=list)
    """(name, start, duration, microbatch): name is compute, send or recv-wait; start is
    ``time.perf_counter()`` (CLOCK_MONOTONIC: one time base for all processes of a host)."""

    def event(self, name: str, start: float, end: float, microbatch: int = -1) -> None:
        if len(self.trace) < MAX_TRACE_EVENTS:
            self.trace.append((name, start, end - start, microbatch))

    def as_dict(self) -> dict:
        return {"busy_s": self.busy_s, "send_s": self.send_s, "recv_wait_s": self.recv_wait_s, "steps": self.steps,
                "tokens": self.tokens, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "rejected_frames": self.rejected_frames,
                "wall_s": time.perf_counter() - self.started_s}


def _step_kind(rows: list[StepRow]) -> StepKind:
    prefills = sum(r.prefill for r in rows)
    return StepKind.PREFILL if prefills == len(rows) else StepKind.DECODE if prefills == 0 else StepKind.MIXED


def step_frame(rows: list[StepRow], hidden: torch.Tensor, *, group: int, step_id: int, stage: int,
               sampling: dict | None) -> Frame:
    wire_rows = [Row(int(r.request_id), r.first_position, r.num_tokens,
                     RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK if r.prefill else RowFlags.NONE) for r in rows]
    control = {"sampling": {str(k): v for k, v in sampling.items()}} if sampling else None
    return Frame(step_kind=_step_kind(rows), step_id=step_id, microbatch=group, stage_from=stage,
                 stage_to=stage + 1, token_index=max(r.first_position + r.num_tokens - 1 for r in rows),
                 rows=wire_rows, tensors={"hidden": hidden.contiguous()}, control=control)


def rows_from_frame(frame: Frame) -> list[StepRow]:
    return [StepRow(r.request_id, r.first_position, r.num_tokens, bool(r.flags & RowFlags.PREFILL))
            for r in frame.rows]


class StageProcess:
    def __init__(self, plan: RunPlan, index: int, *, listen: str | None = None, auth_token: str | None = None,
                 driver_timeout_s: float = 600.0) -> None:
        if not 0 <= index < plan.num_stages:
            raise ValueError(f"stagewise stage: --stage must be in [0, {plan.num_stages}), got {index}")
        self.plan, self.index = plan, index
        self.spec = plan.stages[index]
        self.listen_address = parse_address(listen or self.spec.listen)
        self.auth_token = auth_token
        self.driver_timeout_s = driver_timeout_s
        self.is_first, self.is_last = index == 0, index == plan.num_stages - 1
        self.stats = StageStats()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.control = self.upstream = self.downstream = self.feedback = None
        self.head = self.runtime = None
        self.fingerprint = ""
        self.on_listening = None
        """Called with this object once the listener is bound (torchrun publishes the address)."""

    # ---- start-up --------------------------------------------------------------

    def _open(self) -> None:
        """The checkpoint's config (cheap): enough for the fingerprint before the weights load."""
        from stagewise.model.loader import open_checkpoint

        self.checkpoint = open_checkpoint(self.plan.model)
        cfg = self.checkpoint.config
        if cfg.num_layers != self.plan.num_layers:
            raise ValueError(f"stage {self.index}: the plan has {self.plan.num_layers} layers but "
                             f"{self.plan.model!r} has {cfg.num_layers}")
        self.fingerprint = self.plan.fingerprint(self.checkpoint.hf_config)

    def _load(self):
        from stagewise.model.loader import resolve_dtype
        from stagewise.model.stage import load_stage

        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        ckpt, cfg = self.checkpoint, self.checkpoint.config
        dtype = resolve_dtype(self.plan.dtype, cfg.dtype)
        self.model = load_stage(ckpt, self.spec.start_layer, self.spec.end_layer, dtype=dtype, device=self.spec.device,
                                quantized=self.plan.quantized, linear_precision=self.plan.linear_precision)
        self.config, self.dtype = cfg, dtype
        self.device = torch.device(self.spec.device)
        self.max_model_len = self.plan.max_model_len or cfg.max_position_embeddings

    def _capacity_blocks(self) -> int:
        block = self.plan.block_size or DEFAULT_BLOCK_SIZE
        spec = self.model.kv_cache_spec(block, self.dtype)
        if self.plan.kv_cache_bytes is not None:
            return spec.num_blocks_for_bytes(self.plan.kv_cache_bytes)
        tokens = self.plan.max_num_tokens or default_num_tokens(spec, self.device, self.plan.max_num_seqs,
                                                                self.max_model_len)
        return spec.num_blocks_for_tokens(tokens)

    def _setup(self, msg: dict) -> None:
        from stagewise.runtime.pipeline_head import PipelineHead
        from stagewise.runtime.stage_runtime import StageRuntime

        num_blocks, block = int(msg["num_blocks"]), self.plan.block_size
        if self.is_first:
            try:
                tokenizer = self.checkpoint.tokenizer()
            except FileNotFoundError:
                tokenizer = None
            self.head = PipelineHead(self.model, num_groups=int(msg.get("microbatches", self.plan.num_stages)),
                                     num_blocks=num_blocks, tokenizer=tokenizer, device=self.device,
                                     max_num_seqs=self.plan.max_num_seqs, max_model_len=self.max_model_len,
                                     block_size=block)
        else:
            self.runtime = StageRuntime(self.model, num_blocks=num_blocks, block_size=block,
                                        max_model_len=self.max_model_len, device=self.device)
        transport = msg.get("transport", "tcp")
        expect = "activations" if not self.is_first else ("feedback" if self.plan.num_stages > 1 else None)
        if transport == "torch":
            self._setup_torch_links(msg)
            return
        # Accept the previous stage while dialling the next: every stage dials first, and a
        # hello needs the other end to be accepting.
        accepter = None
        if expect is not None:
            accepter = threading.Thread(target=self._accept_until, args=(expect, 120.0), daemon=True)
            accepter.start()
        peer = self.index + 1 if not self.is_last else 0
        address = msg.get("next")
        if address is not None:
            slot_bytes, num_slots = self._ring_size()
            out = links.dial(tuple(address), transport=transport, stage=self.index, peer=peer,
                             role="feedback" if self.is_last else "activations", fingerprint=self.fingerprint,
                             auth_token=self.auth_token, checksum=self.plan.checksum, slot_bytes=slot_bytes,
                             num_slots=num_slots, device=self._cuda_index())
            if self.is_last:
                self.feedback = out
            else:
                self.downstream = out
        if accepter is not None:
            accepter.join()
            channel = self.pending.pop(expect, None)
            if channel is None:
                raise TimeoutError(f"stage {self.index}: no {expect} connection within 120 s")
            if expect == "activations":
                self.upstream = channel
            else:
                self.feedback = channel

    def _setup_torch_links(self, msg: dict) -> None:
        """The ``torch`` transport: the stages form a gloo process group (rank = stage index) over
        the driver's TCPStore, and each hop is a torch.distributed point-to-point channel (tag 1:
        activations, tag 2: the token feedback), opened with the same hello as over TCP."""
        from datetime import timedelta

        import torch.distributed as dist

        from stagewise.transport import torch_dist
        from stagewise.transport.hello import Hello

        n = self.plan.num_stages
        if not dist.is_initialized():
            host, port = msg["store"]
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
            dist.init_process_group("gloo", store=store, rank=self.index, world_size=n,
                                    timeout=timedelta(seconds=120))
        opts = dict(auth_token=self.auth_token, checksum=self.plan.checksum, verify_checksum=self.plan.checksum,
                    timeout=120.0)

        def link(peer: int, sender: int, receiver: int, role: str, tag: int):
            hello = Hello(fingerprint=self.fingerprint, stage_from=sender, stage_to=receiver, role=role)
            return torch_dist.open_channel(peer, hello=hello, initiator=self.index == sender, tag=tag, **opts)

        incoming = {}
        prev = self.index - 1 if not self.is_first else (n - 1)
        expect = None if n == 1 else ("feedback" if self.is_first else "activations")
        accepter = None
        if expect is not None:
            args = (prev, n - 1, 0, "feedback", 2) if self.is_first else (prev, prev, self.index, "activations", 1)
            accepter = threading.Thread(target=lambda: incoming.update(ch=link(*args)), daemon=True)
            accepter.start()
        if n > 1:
            if self.is_last:
                self.feedback = link(0, self.index, 0, "feedback", 2)
            else:
                self.downstream = link(self.index + 1, self.index, self.index + 1, "activations", 1)
        if accepter is not None:
            accepter.join(130)
            if "ch" not in incoming:
                raise TimeoutError(f"stage {self.index}: no torch.distributed {expect} link from stage {prev}")
            if self.is_first:
                self.feedback = incoming["ch"]
            else:
                self.upstream = incoming["ch"]

    def _cuda_index(self) -> int | None:
        device = getattr(self, "device", None)
        return device.index if device is not None and device.type == "cuda" else None

    def _ring_size(self) -> tuple[int, int]:
        """Slots of this stage's outgoing shm ring: a step's hidden states (a long prefill that
        does not fit goes over TCP) or, from the last stage, token ids; enough slots that the
        S steps in flight and the free messages rarely wait."""
        s = self.plan.num_stages
        if self.is_last:
            return 1 << 20, s + 2
        tokens = min(8192, self.plan.max_num_seqs * self.max_model_len) + self.plan.max_num_seqs
        need = tokens * self.config.hidden_size * self.dtype.itemsize + (256 << 10)
        return min(max(need, 1 << 20), 32 << 20), 2 * s + 2

    def _accept_until(self, role: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while role not in self.pending and time.monotonic() < deadline:
            try:
                self._accept_one(timeout=0.5)
            except Exception as err:  # noqa: BLE001 - a bad connector must not stop the stage
                print(f"stagewise stage {self.index}: refused a connection: {err}", file=sys.stderr, flush=True)

    def _accept_one(self, timeout: float) -> None:
        try:
            channel, role = links.accept(self.listener, timeout=timeout, checksum=self.plan.checksum,
                                         device=self._cuda_index())
        except TimeoutError:
            return
        self.pending[role] = channel

    # ---- messages to the driver ---------------------------------------------------

    def tell_driver(self, control: dict) -> None:
        with self._send_lock:
            self.control.send(Frame(step_kind=StepKind.CONTROL, stage_from=self.index, control=control))

    def _heartbeats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.tell_driver({"op": "heartbeat"})
            except Exception:  # noqa: BLE001 - the main loop notices a dead driver
                return

    def _send(self, channel, frame: Frame) -> None:
        start, before = time.perf_counter(), channel.stats.bytes_sent
        channel.send(frame)
        end = time.perf_counter()
        self.stats.send_s += end - start
        self.stats.bytes_sent += channel.stats.bytes_sent - before
        self.stats.event("send", start, end, frame.microbatch)

    def _recv(self, channel, timeout: float) -> Frame | None:
        start = time.perf_counter()
        try:
            frame = channel.recv(timeout=timeout)
        except TimeoutError:
            frame = None
        except FrameError as err:
            self.reject(f"from {channel.peer_name}: {err}")
            if channel.closed:
                raise
            frame = None
        except ChannelClosed:
            # A neighbour that exits on shutdown closes its links before this stage reads its
            # own shutdown: not an error then.
            if self._shutdown_follows(2.0):
                raise _Shutdown() from None
            raise
        end = time.perf_counter()
        self.stats.recv_wait_s += end - start
        if frame is not None:
            self.stats.bytes_received += frame.payload_bytes
            self.stats.event("recv-wait", start, end, frame.microbatch)
        return frame

    def reject(self, why: str) -> None:
        """Log a frame that was not accepted; the stage serves on."""
        self.stats.rejected_frames += 1
        if self.stats.rejected_frames <= 20 or self.stats.rejected_frames % 1000 == 0:
            print(f"stagewise stage {self.index}: rejected frame #{self.stats.rejected_frames} {why}",
                  file=sys.stderr, flush=True)

    def check_step(self, frame: Frame) -> str | None:
        """Why a step frame does not fit this stage (None when it does)."""
        if frame.stage_to != self.index:
            return f"stage_to is {frame.stage_to}, this is stage {self.index}"
        if frame.step_kind not in (StepKind.PREFILL, StepKind.DECODE, StepKind.MIXED):
            return f"step_kind {frame.step_kind!r} does not carry a step"
        if not frame.rows:
            return "rows: a step needs at least one row"
        hidden = frame.tensors.get("hidden")
        tokens = sum(r.num_tokens for r in frame.rows)
        want = (tokens, self.config.hidden_size)
        if hidden is None or tuple(hidden.shape) != want:
            return f"tensors['hidden']: expected shape {want}, got {None if hidden is None else tuple(hidden.shape)}"
        if hidden.dtype != self.dtype:
            return f"tensors['hidden']: expected dtype {self.dtype}, got {hidden.dtype}"
        for i, r in enumerate(frame.rows):
            prefill = bool(r.flags & RowFlags.PREFILL)
            if r.num_tokens < 1 or (not prefill and r.num_tokens != 1) or (prefill and r.first_position != 0):
                return f"rows[{i}]: {r.num_tokens} tokens from position {r.first_position} (prefill={prefill})"
            if r.first_position + r.num_tokens > self.max_model_len:
                return f"rows[{i}]: position {r.first_position + r.num_tokens} beyond max_model_len"
        return None

    # ---- serving -----------------------------------------------------------------

    def run(self) -> int:
        self._open()
        self.listener = links.listen(self.listen_address, fingerprint=self.fingerprint, auth_token=self.auth_token,
                                     checksum=self.plan.checksum)
        host, port = self.listener.address
        print(f"{READY_LINE} {host} {port}", flush=True)
        if self.on_listening is not None:
            self.on_listening(self)
        self._load()
        self.pending: dict[str, object] = {}
        self._accept_until("driver", self.driver_timeout_s)
        if "driver" not in self.pending:
            raise TimeoutError(f"stage {self.index}: no driver connected within {self.driver_timeout_s:.0f} s")
        self.control = self.pending.pop("driver")
        self.tell_driver({"op": "ready", "stage": self.index, "capacity_blocks": self._capacity_blocks(),
                          "layers": [self.spec.start_layer, self.spec.end_layer], "pid": os.getpid(),
                          "fingerprint": self.fingerprint})
        msg = self.control.recv(timeout=self.driver_timeout_s).control or {}
        if msg.get("op") != "setup":
            raise ValueError(f"stage {self.index}: expected the driver's setup, got {msg.get('op')!r}")
        self._setup(msg)
        self.tell_driver({"op": "connected", "stage": self.index})
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        self.stats = StageStats()
        try:
            if self.is_first:
                self._serve_head()
            else:
                self._serve_later()
        except _Shutdown:
            pass
        except Exception as err:
            try:
                self.tell_driver({"op": "fatal", "message": f"{type(err).__name__}: {err}",
                                  "neighbour": isinstance(err, ChannelClosed)})
            except Exception:  # noqa: BLE001 - the driver notices the exit anyway
                pass
            raise
        finally:
            self._stop.set()
        return 0

    def _control_messages(self) -> list[dict]:
        messages = []
        while self.control.poll(0):
            frame = self.control.recv(timeout=0)
            if frame.control is not None:
                messages.append(frame.control)
                if frame.control.get("op") == "shutdown":
                    break  # the driver may close right after it: its EOF is no error
        return messages

    def _shutdown_follows(self, wait_s: float) -> bool:
        """Whether the driver's shutdown arrives within ``wait_s`` (other messages are dropped)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if any(m.get("op") == "shutdown" for m in self._control_messages()):
                    return True
            except ChannelClosed:
                return False
            self.control.poll(0.05)
        return False

    def _common_control(self, msg: dict) -> bool:
        """Handles shutdown and stats; True when the stage must stop."""
        op = msg.get("op")
        if op == "shutdown":
            return True
        if op == "stats":
            body = {"op": "stats", "stage": self.index, "layers": [self.spec.start_layer, self.spec.end_layer],
                    **self.stats.as_dict()}
            if msg.get("trace"):
                body["trace"] = self.stats.trace
            if msg.get("reset"):
                self.stats = StageStats()
            self.tell_driver(body)
        return False

    # -- stage 0

    def _serve_head(self) -> None:
        """Stage 0's loop, seed 002's steps: pick_prompts, prepare_inputs + decode (one group's
        step through stage 0's layers, sent on), switch_tokens (the sampled tokens that come
        back), push_outputs, update_users (KV of ended requests freed on every stage),
        send_status."""
        if self.plan.num_stages == 1:
            raise ValueError("a one-stage plan runs in the driver's process")
        self._events: dict = {"text": [], "tokens": {}, "done": []}
        self._last_status: tuple | None = None
        while True:
            if self._pick_prompts():
                return
            self._prepare_and_decode()
            self._update_users()
            self._push_outputs()
            self._send_status()
            if not self.head.inflight:
                if not self.head.has_unfinished():
                    self.control.poll(0.05)
                continue
            self._switch_tokens(self._recv(self.feedback, timeout=0.002))

    def _on_text(self, rid: Hashable, delta: str) -> None:
        self._events["text"].append([rid, delta])

    def _finished(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self._events["done"].append({"id": out.request_id, "token_ids": out.token_ids, "text": out.text,
                                         "finish_reason": out.finish_reason, "error": out.error})

    def _pick_prompts(self) -> bool:
        """New requests and cancellations from the driver; True on shutdown."""
        for msg in self._control_messages():
            op = msg.get("op")
            if op == "add":
                try:
                    params = SamplingParams(**msg["params"])
                    self.head.add_request(int(msg["id"]), list(msg["prompt_ids"]), params, self._on_text)
                except (ValueError, TypeError, KeyError) as err:
                    self._events["done"].append({"id": msg.get("id"), "token_ids": [], "text": "",
                                                 "finish_reason": "error", "error": str(err)})
            elif op == "cancel":  # seed 002 sends EOS; here the request ends at once, its KV freed
                out = self.head.cancel(int(msg["id"]))
                if out is not None:
                    self._finished([out])
            elif self._common_control(msg):
                return True
        return False

    def _prepare_and_decode(self) -> None:
        """Every idle group with work: schedule (prefills + one decode row per running request),
        run stage 0's layers, send the hidden states to stage 1."""
        for g in self.head.idle_groups_with_work():
            start = time.perf_counter()
            step, done = self.head.launch(g)
            end = time.perf_counter()
            self._finished(done)
            if step is None:
                continue
            self.stats.busy_s += end - start
            self.stats.steps += 1
            self.stats.tokens += step.batch.num_tokens
            self.stats.event("compute", start, end, g)
            self._send(self.downstream, step_frame(rows_of(step.batch), step.hidden_states, group=g,
                                                   step_id=step.step_id, stage=0, sampling=step.sampling))

    def _switch_tokens(self, frame: Frame | None) -> None:
        """The last stage's sampled tokens (or its failure) for one group's step."""
        if frame is None:
            return
        head = self.head
        try:
            if frame.step_kind == StepKind.TOKENS:
                rids = [r.request_id for r in frame.rows]
                ids = frame.tensors.get("token_ids")
                if ids is None or tuple(ids.shape) != (len(rids),):
                    raise ValueError(f"tensors['token_ids']: expected shape ({len(rids)},), "
                                     f"got {None if ids is None else tuple(ids.shape)}")
                self._finished(head.on_tokens(frame.microbatch, frame.step_id, rids, ids.tolist()))
                for rid in rids:
                    req = head._requests.get(rid)
                    self._events["tokens"][rid] = len(req.seq.output_ids) if req is not None else -1
            elif frame.control and frame.control.get("op") == "step_failed":
                self._finished(head.on_step_failed(frame.microbatch, frame.step_id, str(frame.control["message"])))
            else:
                raise ValueError(f"step_kind {frame.step_kind!r} is not expected on the feedback link")
        except (ValueError, TypeError, KeyError) as err:
            self.reject(f"(feedback step {frame.step_id}): {err}")

    def _push_outputs(self) -> None:
        """Text deltas, first-token marks and finished requests to the driver."""
        ev = self._events
        if ev["text"] or ev["done"] or ev["tokens"]:
            self.tell_driver({"op": "events", "text": ev["text"], "done": ev["done"],
                              "tokens": [[k, v] for k, v in ev["tokens"].items()]})
            self._events = {"text": [], "tokens": {}, "done": []}

    def _update_users(self) -> None:
        """Requests that ended left their rows on stage 0; every later stage frees their KV."""
        if self.head.has_freed:
            freed = self.head.take_freed()
            self._send(self.downstream, Frame(step_kind=StepKind.CONTROL, stage_from=0, stage_to=1,
                                              rows=[Row(int(r), 0, 0, RowFlags.FINISHED) for r in freed],
                                              control={"op": "free"}))

    def _send_status(self) -> None:
        """Queue depth, active rows and free KV blocks to the driver, when they change."""
        st = self.head.status()
        key = (st.waiting, st.running, st.free_blocks)
        if key != self._last_status:
            self._last_status = key
            self.tell_driver({"op": "status", "waiting": st.waiting, "running": st.running,
                              "max_num_seqs": st.max_num_seqs, "free_blocks": st.free_blocks,
                              "total_blocks": st.total_blocks})

    # -- stages 1 .. S-1

    def _serve_later(self) -> None:
        runtime = self.runtime
        while True:
            for msg in self._control_messages():
                if self._common_control(msg):
                    return
            frame = self._recv(self.upstream, timeout=0.05)
            if frame is None:
                continue
            if frame.step_kind == StepKind.CONTROL:
                op = (frame.control or {}).get("op")
                if op == "free":
                    runtime.free([r.request_id for r in frame.rows])
                    if not self.is_last:
                        self._send(self.downstream, frame)
                elif op == "step_failed":
                    self._send(self.feedback if self.is_last else self.downstream, frame)
                continue
            why = self.check_step(frame)
            if why is not None:
                self.reject(f"(step {frame.step_id}): {why}")
                continue
            rows = rows_from_frame(frame)
            try:
                sampling = {int(k): v for k, v in ((frame.control or {}).get("sampling") or {}).items()}
                bad = [r.request_id for r in rows if not r.prefill and r.request_id not in runtime.manager]
                if bad:
                    raise LookupError(f"unknown request ids {bad[:4]} in decode rows")
            except (ValueError, TypeError, AttributeError, LookupError) as err:
                self.reject(f"(step {frame.step_id}): {err}")
                continue
            start = time.perf_counter()
            try:
                out = runtime.run(rows, frame.tensors["hidden"], sampling)
            except Exception as err:  # noqa: BLE001 - the step's requests fail, the stage serves on
                message = f"stage {self.index} step failed: {type(err).__name__}: {err}"
                failed = Frame(step_kind=StepKind.CONTROL, step_id=frame.step_id, microbatch=frame.microbatch,
                               stage_from=self.index, control={"op": "step_failed", "message": message})
                self._send(self.feedback if self.is_last else self.downstream, failed)
                continue
            end = time.perf_counter()
            self.stats.busy_s += end - start
            self.stats.steps += 1
            self.stats.tokens += sum(r.num_tokens for r in rows)
            self.stats.event("compute", start, end, frame.microbatch)
            if self.is_last:
                self._send(self.feedback, Frame(step_kind=StepKind.TOKENS, step_id=frame.step_id,
                                                microbatch=frame.microbatch, stage_from=self.index, stage_to=0,
                                                rows=[Row(int(r.request_id), 0, 1) for r in rows],
                                                tensors={"token_ids": out.to("cpu", torch.int64)}))
            else:
                self._send(self.downstream, step_frame(rows, out, group=frame.microbatch, step_id=frame.step_id,
                                                       stage=self.index, sampling=sampling))


class _Shutdown(Exception):
    """The driver asked this stage to stop."""


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it exits (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="run plan (YAML/JSON) naming every stage")
    source.add_argument("--plan-json", metavar="JSON", help="the run plan itself, as JSON (what 'stagewise launch' "
                        "prints, so that no file needs copying)")
    parser.add_argument("--stage", type=int, default=None, help="this process's stage index")
    parser.add_argument("--torchrun", action="store_true",
                        help="under torchrun: the stage index is RANK, and the listen address is published in "
                             "torch.distributed's store at MASTER_ADDR:MASTER_PORT")
    parser.add_argument("--listen", default=None, help="HOST:PORT to listen on (default: the plan's)")
    parser.add_argument("--auth-token", default=None,
                        help="shared secret for the hello (default: $STAGEWISE_AUTH_TOKEN)")
    parser.add_argument("--die-with-parent", action="store_true", help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def main(args) -> int:
    if args.die_with_parent:
        _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    code = 1
    try:
        from stagewise.launch.multihost import stage_from_args

        plan, index, on_listening = stage_from_args(args)
        stage = StageProcess(plan, index, listen=args.listen, auth_token=token)
        stage.on_listening = on_listening
        code = stage.run()
    except KeyboardInterrupt:
        code = 130
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except Exception as err:  # noqa: BLE001 - one line for the operator, not a traceback
        which = args.stage if args.stage is not None else os.environ.get("RANK", "?")
        print(f"stagewise stage {which}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the heartbeat and accept threads may still be blocked in I/O.
    os._exit(code)
