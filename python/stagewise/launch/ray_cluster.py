"""Stages on a Ray cluster: each rank of each stage is a Ray actor, all of a run's actors in one
placement group, one bundle per stage (so a stage's ranks share a node: their collectives never
cross the network).

An actor reserves its rank's resources (``num_cpus`` = its threads; on a GPU stage the stage's
GPUs) and is the rank's process: it runs ``stagewise stage`` (the same program every launcher
starts, from the same arguments) in a thread of its own, so Ray's accounting of CPUs, GPUs and
memory is the stage's, and a stage dies with its actor.

Placement (``--placement``): ``spread`` (Ray's SPREAD: one stage a node where it can), ``pack``
(PACK: as few nodes as fit) or ``strict_spread`` (every stage on a node of its own, or no run).
Stages are told nothing in advance: once placed, each actor reports its node's address, the
plan's stages get those hosts with port 0, and each stage reports the port it bound. Hops then
follow the one ``auto`` rule (shared memory between stages of one host, TCP across hosts).
Activations and control keep the project's frames: only Ray's own actor calls carry anything else
(argv, addresses, exit codes).

:class:`RayStages` is what the driver watches (exit codes, failures, stop); stopping it stops
every stage, kills every actor, removes the placement group, and shuts down the Ray instance
it started (none when it joined a running cluster). Joining the cluster, and refusing at once a
layout it cannot hold, are :mod:`stagewise.launch.ray_join`'s.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

from stagewise.launch import LaunchError
from stagewise.launch.local import stage_argv
from stagewise.launch.ray_join import bundles, check_fits, connect
from stagewise.parallel.runplan import RunPlan

STRATEGIES = {"spread": "SPREAD", "pack": "PACK", "strict_spread": "STRICT_SPREAD"}
"""Ray's placement strategy for each of :data:`~stagewise.parallel.plan_options.PLACEMENTS`."""
POLL_S = 1.0
"""How often the driver asks each actor whether its stage still runs (a stage that stops
answering is caught sooner by the driver's heartbeat; each ask costs the actor's CPU)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError("--launcher ray needs Ray, which is not installed: pip install 'stagewise[ray]'") from None
    return ray


class StageActor:
    """One stage rank on a Ray node (made a Ray actor by :func:`start_stages`): the actor's process
    is the rank's process, and the stage serves in a thread of it."""

    def __init__(self) -> None:
        self.label = "stage"
        self._thread: threading.Thread | None = None
        self._stop = None
        self._code: int | None = None
        self._error: str | None = None

    def node(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "node_id": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start(self, argv: list[str], env: dict[str, str], label: str, timeout_s: float) -> tuple[str, int]:
        """Run ``stagewise stage`` with ``argv`` (after ``stage``) here; its listen address once it
        listens. ``env``: its threads and its stage's GPUs, set before torch starts CUDA."""
        from stagewise import startup_gc
        from stagewise.launch import stage_args

        args = stage_args.parse(argv)
        os.environ.update(env)
        startup_gc.pause()  # as in a stage process of its own: the stage settles it once its model is built
        self.label, listening, address = label, threading.Event(), []

        def announce(host: str, port: int) -> None:
            address.append((host, int(port)))
            listening.set()

        def serve() -> None:
            code = 1
            try:
                run, self._stop = stage_args.prepare(args, announce)
                code = run()
            except BaseException as err:  # noqa: BLE001 - the driver reads it (failure)
                self._error = f"{type(err).__name__}: {err}"
                print(f"stagewise {label}: {self._error}", file=sys.stderr, flush=True)
            finally:
                self._code = code
                listening.set()

        self._thread = threading.Thread(target=serve, name=label, daemon=True)
        self._thread.start()
        if not listening.wait(timeout_s):
            raise TimeoutError(f"{label} did not start listening within {timeout_s:.0f} s")
        if not address:
            raise RuntimeError(self.failure() or f"{label} exited with code {self._code} before listening")
        return address[0]

    def poll(self) -> int | None:
        """None while the stage serves (or before it started); its exit code once it ended."""
        return None if self._thread is None or self._thread.is_alive() else self._code

    def failure(self) -> str | None:
        return None if self._error is None else f"{self.label} on {socket.gethostname()} failed: {self._error}"

    def stop(self, grace_s: float) -> None:
        """Give the stage ``grace_s`` to end (the driver's shutdown), then end it: its links close and
        it unwinds, closing its rings, before the driver kills this actor; if it is still busy (a
        ring's set-up waiting for its peer, say), the names of the rings it offered are removed."""
        if self._thread is None:
            return
        self._thread.join(grace_s)
        if self._thread.is_alive() and self._stop is not None:
            self._stop()
            self._thread.join(max(1.0, min(2.0, grace_s)))
        if self._thread.is_alive():  # killed next, without unwinding: no ring it offered keeps its name
            from stagewise.transport.rings.segment import remove_names

            remove_names()


class RayStages:
    """The actors of a run, in :attr:`RunPlan.members` order (the driver's ``StageProcesses``)."""

    def __init__(self, ray, pg, labels: list[str], started_ray: bool) -> None:
        self.ray, self.pg, self.labels, self.started_ray = ray, pg, labels, started_ray
        self.actors: list = []
        self.nodes: list[dict[str, Any]] = []
        """Each member's node: ``ip``, ``host``, ``node_id``."""
        self._codes: dict[int, int] = {}
        self._lost: set[int] = set()
        self._asked: dict[int, tuple[Any, float]] = {}
        self.strategy = "SPREAD"

    def place(self, plan: RunPlan, which, *, auth_token: str | None, extra=(), timeout_s: float = 120.0,
              keep_going: bool = False) -> tuple[RunPlan, list]:
        """Members ``which`` (indices of :attr:`RunPlan.members`) as new actors in their stage's
        bundle, each serving its rank. Returns the plan with each placed stage's host
        (its node's address) and their listen addresses; with ``keep_going`` a rank's error takes
        its place (a string)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, members, which = self.ray, plan.members, list(which)
        remote = ray.remote(StageActor)
        while len(self.actors) < len(members):
            self.actors.append(None)
            self.nodes.append({})
        for i in which:
            index, rank = members[i]
            spec = plan.stages[index]
            cuda = spec.device.startswith("cuda")
            leader_gpus = spec.tp * plan.pcp if cuda and rank == 0 else 0  # the stage's GPUs, seen by all its ranks
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
            self.actors[i] = remote.options(num_cpus=spec.threads or 1, num_gpus=leader_gpus,
                                            scheduling_strategy=strategy).remote()
            for known in (self._codes, self._asked):
                known.pop(i, None)
            self._lost.discard(i)
        try:
            for i, node in zip(which, ray.get([self.actors[i].node.remote() for i in which], timeout=timeout_s)):
                self.nodes[i] = node
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"--launcher ray: {', '.join(self.labels[i] for i in which)} not placed within "
                              f"{timeout_s:.0f} s; free: {ray.available_resources()} (`ray status` shows what holds "
                              "the rest)") from None
        placed = plan
        for i in which:
            index, rank = members[i]
            if rank == 0:
                ip = self.nodes[i]["ip"]
                device = "cuda:0" if plan.stages[index].device.startswith("cuda") else plan.stages[index].device
                placed = placed.with_stage(index, host=ip, listen=f"{ip}:0", device=device)
        starts = []
        for i in which:
            index, rank = members[i]
            env = {"OMP_NUM_THREADS": str(placed.stages[index].threads or 1)}
            if auth_token:
                env["STAGEWISE_AUTH_TOKEN"] = auth_token
            gpus = self.nodes[members.index((index, 0))]["gpus"]
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            argv = stage_argv(placed, index, rank=rank, program=(), extra=extra)[1:]  # after "stage"
            starts.append(self.actors[i].start.remote(argv, env, self.labels[i], timeout_s))
        addresses = []
        for ref in starts:
            try:
                addresses.append(tuple(ray.get(ref, timeout=timeout_s + 10)))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                cause = getattr(err, "cause", None)
                why = str(cause) if cause is not None else f"{type(err).__name__}: {err}"
                if not keep_going:
                    raise RuntimeError(why) from None
                addresses.append(why)
        return placed, addresses

    def respawn(self, plan: RunPlan, which, *, auth_token: str | None, extra=()) -> tuple[RunPlan, list]:
        """Members ``which`` placed again (their actors killed first): Ray has moved a lost node's
        bundles to nodes it still has, where the layout allows (refused at once where it does not)."""
        stops = [self.actors[i].stop.remote(0.0) for i in which]  # a hung stage too: killed with its actor
        self.ray.wait(stops, num_returns=len(stops), timeout=5.0)
        for i in which:
            try:
                self.ray.kill(self.actors[i], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        check_fits(self.ray, plan, self.strategy)
        return self.place(plan, which, auth_token=auth_token, extra=extra, timeout_s=60.0)

    def __len__(self) -> int:
        return len(self.actors)

    def exit_code(self, i: int) -> int | None:
        """None while member ``i``'s stage runs; its exit code once it ended; -9 when its actor
        (or its node) is gone. Asks the actor at most every :data:`POLL_S`, never waiting."""
        if i in self._codes:
            return self._codes[i]
        entry = self._asked.get(i)
        if entry is None or entry[0] is None:
            if entry is not None and time.monotonic() - entry[1] < POLL_S:
                return None
            entry = self._asked[i] = (self.actors[i].poll.remote(), time.monotonic())
        ref = entry[0]
        ready, _ = self.ray.wait([ref], timeout=0)
        if not ready:
            return None
        self._asked[i] = (None, time.monotonic())
        try:
            code = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            self._lost.add(i)
            code = -9
        if code is not None:
            self._codes[i] = code
        return code

    def settle(self, timeout_s: float) -> None:
        """Ask every actor not known to have ended whether its stage runs, and wait up to
        ``timeout_s`` for the answers (a failure's diagnosis: which stage is gone)."""
        refs = {i: a.poll.remote() for i, a in enumerate(self.actors) if i not in self._codes and a is not None}
        if refs:
            self.ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for i, ref in refs.items():
            self._asked[i] = (ref, time.monotonic())
            self.exit_code(i)

    def failure(self, i: int) -> str | None:
        node = self.nodes[i] if i < len(self.nodes) else {}
        if i in self._lost:
            return (f"{self.labels[i]} on {node.get('host', '?')} ({node.get('ip', '?')}, Ray node "
                    f"{str(node.get('node_id', '?'))[:12]}): its Ray actor is gone (the node or the actor died)")
        try:
            return self.ray.get(self.actors[i].failure.remote(), timeout=5.0)
        except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError):
            return None

    def stop(self, grace_s: float = 5.0) -> None:
        """Every stage stopped (politely for ``grace_s``), every actor killed, the placement group
        removed, and the Ray instance this run started shut down."""
        ray = self.ray
        try:
            actors = [a for a in self.actors if a is not None]  # None: not created when a start failed
            refs = [a.stop.remote(grace_s) for a in actors]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=grace_s + 5.0)
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
        finally:
            self.actors, self.pg = [], None
            if self.started_ray and ray.is_initialized():
                ray.shutdown()


def start_stages(plan: RunPlan, *, address: str | None = None, placement: str = "spread",
                 auth_token: str | None = None, timeout_s: float = 120.0, extra=(),
                 keep_going: bool = False) -> tuple[RayStages, RunPlan, list]:
    """Place and start every rank of ``plan`` on the Ray cluster (``extra``: more arguments of
    each). Returns the actors, the plan with each stage's host (its node's address), and the
    listen addresses (in :attr:`RunPlan.members` order); on any error everything started is
    stopped, or with ``keep_going`` a rank's error takes its place in the list (a string)."""
    if placement not in STRATEGIES:
        raise ValueError(f"--placement must be one of {', '.join(STRATEGIES)}, got {placement!r}")
    ray = import_ray()
    from ray.util.placement_group import placement_group

    need = bundles(plan)
    started = connect(ray, address, sum(b["CPU"] for b in need))
    members = plan.members
    stages = RayStages(ray, None, [plan.member_label(s, r) for s, r in members], started)
    try:
        check_fits(ray, plan, STRATEGIES[placement])
        stages.pg = placement_group(need, strategy=STRATEGIES[placement], name=f"stagewise-{os.getpid()}")
        try:
            ray.get(stages.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"--launcher ray: the cluster did not place the {len(need)} stages ({placement}) "
                              f"within {timeout_s:.0f} s; free: {ray.available_resources()} (`ray status` shows what "
                              "holds the rest)") from None
        stages.strategy = STRATEGIES[placement]
        placed, addresses = stages.place(plan, range(len(members)), auth_token=auth_token, extra=extra,
                                         timeout_s=timeout_s, keep_going=keep_going)
        return stages, placed, addresses
    except BaseException:
        stages.stop(grace_s=0.5)
        raise
