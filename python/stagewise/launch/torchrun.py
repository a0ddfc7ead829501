"""Stages under ``torchrun``: ``RANK`` names the process (stage and stage rank, in the plan's
rank order: the stage index when every stage is one process), ``WORLD_SIZE`` is the number of
processes of the plan (a stage's ranks on one node: checked), and they publish their listen
addresses in torch.distributed's TCPStore at ``MASTER_ADDR:MASTER_PORT`` (no rendezvous of our
own).

    torchrun --nproc-per-node 2 --master-port 29511 -m stagewise.cli stage --plan plan.yaml --torchrun
    stagewise generate --plan plan.yaml --store 127.0.0.1:29511 --prompt "..."

Which process hosts the store follows torch's own ``env://`` rule
(``torch.distributed.rendezvous._create_c10d_store``): with ``TORCHELASTIC_USE_AGENT_STORE=True``
(torchrun's default) the torchrun agent of node 0 hosts it and every stage is a client; otherwise
stage 0 hosts it. Each process sets ``stagewise/<fingerprint>/stage/<RANK>`` to
``{"host", "port", "pid", "restart"}``; the driver connects to the same store as a client and
waits for all of them. The fingerprint in the key keeps two different models or plans that share a
store apart.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta
from typing import Any

from stagewise.parallel.runplan import RunPlan, parse_address

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
ADVERTISE_ENV = "STAGEWISE_ADVERTISE_HOST"


def store_key(fingerprint: str, index: int) -> str:
    return f"stagewise/{fingerprint}/stage/{index}"


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.lstrip("-").isdigit():
        raise ValueError(f"stagewise stage --torchrun: environment variable {name} must be an integer "
                         f"(set by torchrun), got {value!r}")
    return int(value)


def torchrun_stage(plan: RunPlan, stage: int | None) -> tuple[RunPlan, int, int]:
    """The stage index and stage rank of ``RANK``, checked against ``WORLD_SIZE`` and ``--stage``.
    A plan device of plain ``cuda`` becomes ``cuda:LOCAL_RANK`` (for the stage's leader; its other
    ranks take the next devices)."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world != plan.world_size:
        raise ValueError(f"stagewise stage --torchrun: WORLD_SIZE is {world} but the plan has {plan.world_size} "
                         f"processes ({plan.num_stages} stages of pcp x tp ranks); start torchrun with "
                         f"{plan.world_size} processes in all")
    if not 0 <= rank < world:
        raise ValueError(f"stagewise stage --torchrun: RANK {rank} is not in [0, {world})")
    index, stage_rank = plan.members[rank]
    if stage is not None and stage != index:
        raise ValueError(f"stagewise stage --torchrun: --stage {stage} disagrees with RANK {rank} (stage {index}); "
                         "leave --stage out")
    _check_one_node(plan, index, rank)
    if plan.stages[index].device == "cuda":
        plan = plan.with_stage(index, device=f"cuda:{_env_int('LOCAL_RANK') - stage_rank}")
    return plan, index, stage_rank


def _check_one_node(plan: RunPlan, index: int, rank: int) -> None:
    """Refuse a stage whose ranks torchrun puts on more than one node: a node runs the consecutive
    RANKs ``RANK - LOCAL_RANK`` .. ``+ LOCAL_WORLD_SIZE - 1``, and a stage's collectives (and its
    world's store, on loopback) must stay on its leader's host."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return
    node_first, per_node = rank - _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    ranks = plan.stage_ranks()[index]
    if ranks.first < node_first or ranks.first + ranks.size > node_first + per_node:
        raise ValueError(f"stagewise stage --torchrun: stage {index} is RANKs {ranks.first}-"
                         f"{ranks.first + ranks.size - 1}, but this node runs RANKs {node_first}-"
                         f"{node_first + per_node - 1} (--nproc-per-node {per_node}): a stage's ranks must share "
                         "a node. Give each node whole stages (--nproc-per-node a sum of consecutive stages' "
                         "tp x pcp), or use --launcher ssh or ray, which place a stage's ranks together")


def _master() -> tuple[str, int]:
    host = os.environ.get("MASTER_ADDR")
    if not host:
        raise ValueError("stagewise stage --torchrun: MASTER_ADDR is not set (run under torchrun)")
    return host, _env_int("MASTER_PORT")


def advertised_host(bound_host: str, toward: str) -> str:
    """The address other hosts should dial: the bound one, or for a wildcard bind
    ``$STAGEWISE_ADVERTISE_HOST`` or this host's address on the route to ``toward`` (the store's
    host: what reaches the store is reachable from there)."""
    if bound_host not in WILDCARD_HOSTS:
        return bound_host
    if os.environ.get(ADVERTISE_ENV):
        return os.environ[ADVERTISE_ENV]
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    try:
        info = socket.getaddrinfo(toward, 9, family, socket.SOCK_DGRAM)[0][4]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(info)  # UDP: picks a route and a source address, sends nothing
            return probe.getsockname()[0]
    except OSError as err:
        raise ValueError(f"stagewise stage: listening on {bound_host or 'all interfaces'} and no address to "
                         f"advertise (no route to {toward!r}: {err}); set {ADVERTISE_ENV}") from None


def _open_store(host: str, port: int, *, world_size: int | None, master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    options: dict[str, Any] = dict(timeout=timedelta(seconds=timeout_s))
    if master:
        options.update(multi_tenant=True)
    else:
        options.update(wait_for_workers=False)
    try:
        return TCPStore(host, port, world_size, master, **options)
    except (RuntimeError, OSError) as err:
        raise ConnectionError(f"cannot reach torch.distributed's store at {host}:{port}: {err}") from None


def publish(stage, *, timeout_s: float = 300.0):
    """``on_listening`` hook of a StageProcess under torchrun: put its address in the store.
    Returns the store, which the stage must keep (stage 0 may host it)."""
    host, port = _master()
    index = stage.plan.stage_ranks()[stage.index].first + stage.rank
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = _open_store(host, port, world_size=stage.plan.world_size, master=not agent and index == 0,
                        timeout_s=timeout_s)
    bound_host, bound_port = stage.listener.address[:2]
    value = {"host": advertised_host(bound_host, host), "port": int(bound_port), "pid": os.getpid(),
             "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}
    store.set(store_key(stage.fingerprint, index), json.dumps(value))
    if index == 0:  # the driver needs this address: say it where the operator looks
        print(f"stagewise stage 0: stage addresses are in torch.distributed's store at {host}:{port} "
              f"(driver: stagewise generate --plan PLAN --store {host}:{port})", file=sys.stderr, flush=True)
    return store


def store_addresses(plan: RunPlan, fingerprint: str, store: tuple[str, int] | str, *,
                    timeout_s: float = 300.0) -> list[tuple[str, int]]:
    """The driver's side: every process's published address (in the plan's rank order), waiting
    up to ``timeout_s`` for all."""
    host, port = parse_address(store, "store") if isinstance(store, str) else (store[0], int(store[1]))
    client = _open_store(host, port, world_size=None, master=False, timeout_s=timeout_s)
    keys = [store_key(fingerprint, i) for i in range(plan.world_size)]
    try:
        client.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as err:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing = [i for i, k in enumerate(keys) if not client.check([k])]
        raise TimeoutError(f"processes (RANK) {missing} did not publish their address under {store_key(fingerprint, 0)[:-1]}"
                           f"<i> in the store at {host}:{port} within {timeout_s:.0f} s (a different model or "
                           f"plan gives a different fingerprint): {err}") from None
    out = []
    for key in keys:
        value = json.loads(client.get(key).decode())
        out.append((str(value["host"]), int(value["port"])))
    return out
