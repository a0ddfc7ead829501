"""A pipeline stage rank: the IO around a :class:`~stagewise.pipeline.roles.Head` (stage 0) or a
:class:`~stagewise.pipeline.roles.Worker` (later stages), in a process of its own
(``stagewise stage``) or a thread of a Ray actor (:mod:`stagewise.launch.ray_cluster`).

Life of a stage:

1. read the model's config (for the fingerprint), listen on the plan's address and ``announce``
   it (default: ``STAGEWISE-LISTENING host port`` on stdout), so a launcher learns the port;
2. load only this stage's layers while accepting the driver's control link (heartbeats start
   then), and report :class:`~stagewise.pipeline.messages.Ready` (its KV block capacity; a
   torch.distributed world's first rank also its store's port) or, on failure, ``Fatal``;
3. on :class:`~stagewise.pipeline.messages.Setup`: allocate the KV cache, connect to the
   neighbours (:func:`~stagewise.pipeline.links.open_data_links`), report ``Connected``;
4. serve until ``Shutdown``, the driver's disconnection or a dead neighbour. A heartbeat goes to
   the driver every ``HEARTBEAT_S`` so that it notices a hung stage.

Whatever stops it with an error goes to the driver (``Fatal``) and, even before a driver connected,
to its launcher: a process prints ``STAGEWISE-FAILED {json}`` (:mod:`stagewise.cli.stage`), a Ray
actor keeps the words for the driver to ask.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from stagewise import startup_gc
from stagewise.engine.executor import Executor, model_dtype
from stagewise.parallel.groups import host_world_store, join_stage_groups, spans_run
from stagewise.parallel.runplan import RunPlan, parse_address
from stagewise.pipeline import fanout, links, messages, protocol, stage_setup
from stagewise.pipeline.lines import log_line, print_listening
from stagewise.pipeline.messages import Add, Cancel, Connected, Fatal, GetStats, Heartbeat, Ready, Setup, Shutdown
from stagewise.pipeline.protocol import ProtocolError
from stagewise.pipeline.roles import Head, Route, StageStats, Worker
from stagewise.transport.channel import Channel
from stagewise.transport.errors import ChannelClosed, FrameError
from stagewise.transport.frame import Frame

HEARTBEAT_S = 0.5


class _Shutdown(Exception):
    """The driver asked this stage to stop."""


class StageProcess:
    def __init__(self, plan: RunPlan, index: int, *, rank: int = 0, listen: str | None = None,
                 auth_token: str | None = None, driver_timeout_s: float = 600.0, rejoin_s: float = 0.0) -> None:
        if not 0 <= index < plan.num_stages:
            raise ValueError(f"stagewise stage: --stage must be in [0, {plan.num_stages}), got {index}")
        self.plan, self.index, self.spec = plan, index, plan.stages[index]
        self.ranks = plan.stage_ranks()[index]
        if not 0 <= rank < self.ranks.size:
            raise ValueError(f"stagewise stage: --rank must be in [0, {self.ranks.size}) for stage {index} "
                             f"(pcp {plan.pcp} x tp {self.spec.tp}), got {rank}")
        self.rank = rank
        self.listen_address = parse_address(listen or self.spec.rank_listen(rank))
        self.auth_token, self.driver_timeout_s, self.rejoin_s = auth_token, driver_timeout_s, rejoin_s
        self._beat, self.stats = threading.Event(), StageStats()
        self.control: Channel | None = None
        self.links = links.DataLinks()
        self._send_lock, self._stop = threading.Lock(), threading.Event()
        self.fingerprint, self.listener, self.acceptor = "", None, None
        self._store = None  # the store of this process's torch.distributed world, when it hosts it
        self.executor: Executor | None = None
        self._counters_base = stage_setup.step_counters(None)
        self.on_listening = None
        """Called with this object once the listener is bound (torchrun publishes the address)."""
        self.announce = print_listening

    # ---- start-up ------------------------------------------------------------------

    def run(self) -> int:
        from stagewise.model.loader import open_checkpoint

        checkpoint = open_checkpoint(self.plan.model)  # the config only: the fingerprint before the weights
        if checkpoint.config.num_layers != self.plan.num_layers:
            raise ValueError(f"the plan has {self.plan.num_layers} layers but {self.plan.model!r} has "
                             f"{checkpoint.config.num_layers}")
        self.fingerprint = self.plan.fingerprint(checkpoint.hf_config)
        self.options = links.LinkOptions(fingerprint=self.fingerprint, auth_token=self.auth_token,
                                         checksum=self.plan.checksum, tls=links.TlsConfig.from_dict(self.plan.tls))
        self.listener = links.listen(self.listen_address, self.options)
        device = torch.device(self.spec.rank_device(self.rank))
        acceptor = self.acceptor = links.Acceptor(self.listener, stage=self.index, checksum=self.plan.checksum,
                                  device=device.index if device.type == "cuda" else None)
        self.announce(*self.listener.address)
        if self.on_listening is not None:
            self.on_listening(self)
        # The driver connects while the layers load, so that a failure to load reaches it at once.
        driver = threading.Thread(target=self._accept_driver, args=(acceptor, self.driver_timeout_s),
                                  name="accept-driver", daemon=True)
        driver.start()
        try:
            try:
                weights, dtype = stage_setup.load_weights(self.plan, self.index, self.rank, checkpoint, device)
                cfg = checkpoint.config
                max_model_len = self.plan.max_model_len or cfg.max_position_embeddings
                capacity = stage_setup.kv_capacity(self.plan, self.index, cfg, dtype, device, max_model_len)
            finally:
                driver.join(self.driver_timeout_s)
            if self.control is None:
                raise TimeoutError(f"no driver connected within {self.driver_timeout_s:.0f} s")
            model, hops = None, links.hop_transports(self.plan)
            # The first rank of a world hosts its store, once: a stage that rejoins keeps its world.
            self._store = host_world_store(self.plan, self.index, self.rank, hops, self.listener.address[0])
            while True:  # a driver each time round: the first, then (--rejoin) each after a broken pipeline
                try:
                    layers, port = (self.spec.start_layer, self.spec.end_layer), self._store and int(self._store.port)
                    self.tell_driver(Ready(stage=self.index, rank=self.rank, capacity_blocks=capacity, layers=layers,
                                           pid=os.getpid(), fingerprint=self.fingerprint, store_port=port))
                    setup = stage_setup.checked(messages.from_frame(self.control.recv(timeout=self.driver_timeout_s)),
                                                hops[self.index])
                    if model is None:
                        from stagewise.model.stage import StageModel  # after listening: the driver connects meanwhile
                        if spans_run(hops):  # the run's one world cannot take a new member: no rejoin
                            self.rejoin_s = 0.0
                        groups = join_stage_groups(self.plan, self.index, self.rank, setup.store, hops)
                        model = StageModel.from_weights(cfg, self.spec.start_layer, self.spec.end_layer, weights,
                                                        dtype=dtype, device=device, groups=groups,
                                                        tokenizer_source=checkpoint.path)
                        del weights
                        startup_gc.settle()  # start-up is over (a no-op unless the command paused it)
                    self._serve(model, setup, acceptor, max_model_len, device)  # ends by raising
                except OSError as err:  # ChannelClosed, a timeout, a refused hello: the driver or a neighbour is gone
                    if not self.rejoin_s:
                        raise
                    self._report_fatal(err, neighbour=True)
                # Out of the except: its traceback, which holds the executor and its KV, is gone.
                if not self._await_driver(acceptor):
                    return 0
        except _Shutdown:
            pass
        except Exception as err:
            self._report_fatal(err)
            raise
        finally:
            self._stop.set()
            self.links.close()
            acceptor.close()
        return 0

    def stop(self) -> None:
        """End :meth:`run` from another thread: no rejoin, every link closed (the loop unwinds and
        closes its rings), a wait for a driver ended; a stage loading its layers stops once loaded."""
        self.rejoin_s = 0.0
        self._stop.set()
        if self.acceptor is not None:
            self.acceptor.cancel()
        self._close_links()

    def _close_links(self) -> None:
        for channel in (self.control, self.links):
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - already gone (or None: no driver yet)
                pass

    def _serve(self, model, setup: Setup, acceptor: links.Acceptor, max_model_len: int,
               device: torch.device) -> None:
        """Serve one driver: a fresh executor (an empty KV cache), links to the neighbours the
        setup names, then steps until the driver, a neighbour or an error ends it."""
        executor = self.executor = Executor(model, num_blocks=setup.num_blocks, block_size=self.plan.block_size,
                                            max_model_len=max_model_len, device=device,
                                            interleave_size=self.plan.interleave_size,
                                            max_num_seqs=self.plan.max_num_seqs, kv_cache_dtype=self.plan.kv_cache_dtype)
        self.stats.reset()  # and the collectives' counters (its world's outlive a rejoin): from here
        self._counters_base = stage_setup.step_counters(executor)
        if self.rank > 0:
            self._serve_follower(executor, acceptor, max_model_len, device)
            raise _Shutdown()
        hidden, dtype = model.config.hidden_size, model_dtype(model)
        cuda = device.index if device.type == "cuda" else None
        slot_bytes, num_slots = stage_setup.ring_size(self.plan, self.index, hidden, dtype, max_model_len)
        self.links = links.open_data_links(
            index=self.index, num_stages=self.plan.num_stages, transport=setup.transport,
            next_address=setup.next, acceptor=acceptor, options=self.options,
            slot_bytes=slot_bytes, num_slots=num_slots, device=cuda,
            world_ranks=[r.first for r in self.plan.stage_ranks()])
        if setup.followers:  # steps carry the stage's input (hidden states): rings sized as for activations
            slot_bytes, num_slots = stage_setup.ring_size(self.plan, self.index, hidden, dtype, max_model_len,
                                                          activations=True)
            executor.mirror = fanout.Fanout(
                [links.dial(tuple(address), self.options, transport=links.fanout_transport(self.plan),
                            stage=self.index, peer=self.index, role="fanout", slot_bytes=slot_bytes,
                            num_slots=num_slots, device=cuda)
                 for address in setup.followers], stage=self.index)
            self.links.fanout = executor.mirror
        self.tell_driver(Connected(stage=self.index))
        if self.index == 0:
            self._serve_head(Head(stage_setup.head_engine(executor, self.plan, setup), stats=self.stats))
        else:
            self._serve_worker(Worker(executor, index=self.index, num_stages=self.plan.num_stages, stats=self.stats))

    def _await_driver(self, acceptor: links.Acceptor) -> bool:
        """After the pipeline broke: drop this stage's links, requests and KV (the model stays
        loaded) and wait up to ``rejoin_s`` for a new driver; False when none came."""
        self._beat.set()
        self._close_links()
        self.control, self.links, self.executor = None, links.DataLinks(), None
        acceptor.drop()
        log_line(f"stagewise stage {self.index}: the pipeline broke; waiting up to {self.rejoin_s:.0f} s for a "
                 "driver to rejoin")
        self._accept_driver(acceptor, self.rejoin_s)
        return self.control is not None

    def _accept_driver(self, acceptor: links.Acceptor, timeout_s: float) -> None:
        """Take the driver's control link, then tell it every HEARTBEAT_S that this stage lives
        (also while its layers load)."""
        try:
            self.control = acceptor.take("driver", timeout_s)
        except TimeoutError:
            return
        self._beat = threading.Event()
        threading.Thread(target=self._heartbeats, args=(self._beat,), name="heartbeat", daemon=True).start()

    # ---- the driver ----------------------------------------------------------------

    def _serve_follower(self, executor: Executor, acceptor: links.Acceptor, max_model_len: int,
                        device: torch.device) -> None:
        """A rank other than the leader: the leader's steps, until the leader or the driver stops."""
        channel = acceptor.take("fanout", links.LINK_TIMEOUT_S)
        self.links.upstream = channel
        self.tell_driver(Connected(stage=self.index))
        shape = protocol.StageShape(index=self.index, hidden_size=executor.model.config.hidden_size,
                                    dtype=model_dtype(executor.model), max_model_len=max_model_len, device=device)
        try:
            fanout.serve_follower(executor, channel, shape, between=self._driver_messages)
        except ChannelClosed:
            # The leader closes its channels when it shuts down: not an error then.
            if self._shutdown_follows(2.0):
                raise _Shutdown() from None
            raise

    def _stats_report(self, trace: bool) -> messages.Stats:
        report = self.stats.report(self.index, (self.spec.start_layer, self.spec.end_layer), trace=trace)
        now = stage_setup.step_counters(self.executor)
        (report.collective_s, report.collective_bytes, report.collective_calls, report.fanout_s, report.fanout_bytes,
         report.constraint_s) = (a - b for a, b in zip(now, self._counters_base))
        report.ranks = self.ranks.size
        if self.executor is not None:
            report.kv_blocks = self.executor.num_blocks
            report.kv_block_bytes = self.executor.kv_cache.nbytes // self.executor.num_blocks
        return report

    def tell_driver(self, msg: messages.Message) -> None:
        with self._send_lock:
            self.control.send(messages.to_frame(msg, stage_from=self.index))

    def _heartbeats(self, beat: threading.Event) -> None:
        while not self._stop.wait(HEARTBEAT_S) and not beat.is_set():
            try:
                self.tell_driver(Heartbeat())
            except Exception:  # noqa: BLE001 - the driver is gone: the main loop notices, unless
                # it waits in a send to a hung neighbour; closing the data links ends that wait.
                if not beat.is_set() and not self._stop.is_set():
                    try:
                        self.links.close()
                    except Exception:  # noqa: BLE001 - already closed
                        pass
                return

    def _report_fatal(self, err: Exception, neighbour: bool | None = None) -> None:
        """Tell the driver why this stage stops, in its own words (the launcher also reads them
        from the process's output: see :mod:`stagewise.cli.stage`); ``neighbour``: it only lost
        its pipeline (default: when a link closed)."""
        if self.control is None:
            return
        neighbour = isinstance(err, ChannelClosed) if neighbour is None else neighbour
        try:
            self.tell_driver(Fatal(message=f"{type(err).__name__}: {err}", neighbour=neighbour))
        except Exception:  # noqa: BLE001 - the driver notices the exit anyway
            pass

    def _driver_messages(self) -> list[Add | Cancel | messages.ResetPrefixCache | messages.Result]:
        """The driver's messages waiting now; answers stats requests, raises _Shutdown."""
        out = []
        while self.control.poll(0):
            try:
                frame = self.control.recv(timeout=0)
            except TimeoutError:  # a frame still arriving (an Add with images): the rest next time
                break
            try:
                msg = messages.from_frame(frame)
            except ProtocolError as err:
                self._reject(f"from the driver: {err}")
                if (ended := messages.refused_request(frame, err)) is not None:
                    out.append(ended)  # its request ends with the error: the driver does not wait for it
                continue
            if isinstance(msg, Shutdown):
                raise _Shutdown()
            if isinstance(msg, GetStats):
                self.tell_driver(self._stats_report(msg.trace))
                if msg.reset:
                    self.stats.reset()
                    self._counters_base = stage_setup.step_counters(self.executor)
            elif isinstance(msg, (Add, Cancel, messages.ResetPrefixCache)):
                out.append(msg)
        return out

    def _shutdown_follows(self, wait_s: float) -> bool:
        """Whether the driver's shutdown arrives within ``wait_s`` (other messages are dropped)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                self._driver_messages()
            except _Shutdown:
                return True
            except ChannelClosed:
                return False
            self.control.poll(0.05)
        return False

    # ---- serving -------------------------------------------------------------------

    def _serve_head(self, head: Head) -> None:
        """Requests and cancellations from the driver; every idle group's step through stage 0's
        layers, sent on; the sampled tokens that come back; events and status to the driver."""
        if self.links.feedback is not None:
            self.links.feedback.warm = head.read
        while True:
            for msg in self._driver_messages():
                head.on_message(msg)
            for frame in head.launch():  # each group's step goes on as soon as it is computed
                self._send(self.links.downstream, frame)
            events, status = head.take_events(), head.take_status()
            if events is not None:
                self.tell_driver(events)
            if status is not None:
                self.tell_driver(status)
            if not head.engine.inflight:
                if not head.busy:
                    self.control.poll(0.05)
                continue
            frame = self._recv(self.links.feedback, timeout=0.002)
            if frame is None:
                continue
            try:
                for out in head.on_feedback(head.read(frame)):
                    self._send(self.links.downstream, out)
            except ValueError as err:  # a ProtocolError, or tokens of a step not in flight
                self._reject(f"(feedback step {frame.step_id}): {err}")

    def _serve_worker(self, worker: Worker) -> None:
        routes = {Route.DOWNSTREAM: self.links.downstream, Route.FEEDBACK: self.links.feedback}
        self.links.upstream.warm = worker.read
        while True:
            self._driver_messages()
            frame = self._recv(self.links.upstream, timeout=0.05)
            if frame is None:
                continue
            try:
                out = worker.handle(frame)
            except ProtocolError as err:
                self._reject(f"(step {frame.step_id}): {err}")
                continue
            for route, outgoing in out:
                self._send(routes[route], outgoing)

    def _send(self, channel: Channel, frame: Frame) -> None:
        start, before = time.perf_counter(), channel.stats.bytes_sent
        channel.send(frame)
        self.stats.send_s += (end := time.perf_counter()) - start
        self.stats.bytes_sent += channel.stats.bytes_sent - before
        self.stats.event("send", start, end, frame.microbatch)

    def _recv(self, channel: Channel, timeout: float) -> Frame | None:
        start = time.perf_counter()
        try:
            frame = channel.recv(timeout=timeout)
        except TimeoutError:
            frame = None
        except FrameError as err:
            self._reject(f"from {channel.peer_name}: {err}")
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

    def _reject(self, why: str) -> None:
        """Log a frame that was not accepted; the stage serves on."""
        self.stats.rejected_frames += 1
        if self.stats.rejected_frames <= 20 or self.stats.rejected_frames % 1000 == 0:
            log_line(f"stagewise stage {self.index}: rejected frame #{self.stats.rejected_frames} {why}")

