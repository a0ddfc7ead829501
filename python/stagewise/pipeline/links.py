"""The connections of a pipeline: one listener per stage and links named by role — ``driver``
(control), ``activations`` (stage i -> i + 1) and ``feedback`` (sampled tokens, last stage ->
stage 0).

Every link opens with the transport's hello (protocol version, stage indices, role, model/plan
fingerprint, optional auth token) over TCP; a data link then continues on its transport (a link
transport of :mod:`stagewise.transport.registry`: tcp, a shared-memory ring, a CUDA IPC ring). A
world transport (``torch``) instead opens point-to-point channels in a torch.distributed world
over the run's ranks, whose store stage 0's leader hosts (:mod:`stagewise.parallel.groups`).
:func:`open_data_links` is the one place that wires a stage to its neighbours, whatever the
transport; nothing here names one but the driver's control link, which is always TCP.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagewise.parallel.runplan import RunPlan
from stagewise.pipeline.lines import log_line
from stagewise.transport import registry, tcp
from stagewise.transport.channel import Channel
from stagewise.transport.hello import Hello
from stagewise.transport.tls import TlsConfig
from stagewise.transport.rings import upgrade_accepted, upgrade_dialled

if TYPE_CHECKING:
    from stagewise.pipeline.fanout import Fanout

ROLES = ("driver", "activations", "feedback", "fanout")
LINK_TIMEOUT_S = 120.0
WORLD_TAGS = {"activations": 1, "feedback": 2}
"""The tag of each role's messages on a world transport (both directions share the ranks)."""


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """What every link of a run shares."""

    fingerprint: str
    auth_token: str | None = None
    checksum: bool = True
    tls: TlsConfig | None = None
    """Mutual TLS for the TCP connections with other hosts (None: plain)."""


def hop_transports(plan: RunPlan) -> list[str]:
    """The transport of each stage's outgoing hop (stage i -> i + 1, the last -> 0): the plan's
    ``transport`` resolved per hop by the one rule, :func:`stagewise.transport.registry.resolve`
    (ValueError naming the hop for one it cannot use, or for a hop between hosts on a world
    transport in a plan with ``tls``: torch.distributed would carry the activations in plain text)."""
    n = plan.num_stages
    hops = []
    for i in range(n):
        a, b = plan.stages[i], plan.stages[(i + 1) % n]
        try:
            hop = registry.resolve(plan.transport, same_host=a.host == b.host,
                                   cuda=a.device.startswith("cuda") and b.device.startswith("cuda"))
        except ValueError as err:
            raise ValueError(f"run plan: hop stage {a.index} -> {b.index}: {err}") from None
        if plan.tls and registry.is_world(hop) and a.host != b.host:
            across = [t.name for t in registry.REGISTRY.values() if not t.world and not t.same_host]
            raise ValueError(f"run plan: hop stage {a.index} -> {b.index} crosses hosts ({a.host} -> {b.host}) on "
                             f"the {hop} transport, which has no TLS, while the plan asks for tls: use transport "
                             f"{' or '.join([registry.AUTO, *across])} (TLS between hosts), or leave tls out")
        hops.append(hop)
    return hops


def fanout_transport(plan: RunPlan) -> str:
    """The transport from a stage's leader to its other ranks, which run on its host (CPU tensors:
    steps come from the host): the plan's own when it asks for a link that goes anywhere (tcp
    everywhere), else what ``auto`` takes on one host (shared memory)."""
    asked = registry.REGISTRY.get(plan.transport)
    if asked is not None and not asked.world and not asked.same_host:
        return asked.name
    return registry.resolve(registry.AUTO, same_host=True)


def listen(address: tuple[str, int], options: LinkOptions) -> tcp.Listener:
    """A stage's listener: accepts any role whose hello carries the same fingerprint and token."""
    host, port = address
    return tcp.listen(host, port, hello=Hello(fingerprint=options.fingerprint, stage_from=None, stage_to=None, role=None),
                      auth_token=options.auth_token, checksum=options.checksum, verify_checksum=options.checksum,
                      tls=options.tls)


def dial(address: tuple[str, int], options: LinkOptions, *, transport: str, stage: int, peer: int, role: str,
         timeout: float = 60.0, slot_bytes: int = 1 << 20, num_slots: int = 4, device: int | None = None) -> Channel:
    """Connect to stage ``peer`` as stage ``stage`` (-1: the driver) for ``role``. A data link on a
    ring gets ``num_slots`` slots of ``slot_bytes`` (bigger frames go over its TCP channel)."""
    if role not in ROLES:
        raise ValueError(f"links.dial: role must be one of {ROLES}, got {role!r}")
    if role == "driver" and transport != "tcp":
        raise ValueError(f"links.dial: the driver's control link is TCP, got transport {transport!r}")
    if role != "driver" and transport not in registry.LINK_TRANSPORTS:
        raise ValueError(f"links.dial: transport must be one of {registry.LINK_TRANSPORTS} for a {role} link, "
                         f"got {transport!r}")
    host, port = address
    hello = Hello(fingerprint=options.fingerprint, stage_from=None if stage < 0 else stage, stage_to=peer, role=role)
    channel = tcp.connect(host, int(port), hello=hello, auth_token=options.auth_token, timeout=timeout,
                          checksum=options.checksum, verify_checksum=options.checksum, tls=options.tls)
    if role == "driver":
        return channel
    try:
        return upgrade_dialled(channel, transport, slot_bytes=slot_bytes, num_slots=num_slots, device=device,
                               checksum=options.checksum, verify_checksum=options.checksum)
    except BaseException:
        channel.close()
        raise


class Acceptor:
    """Takes the links that arrive on a stage's listener, by role. A connection that fails its
    hello is refused and logged; the stage waits on."""

    def __init__(self, listener: tcp.Listener, *, stage: int, checksum: bool = True,
                 device: int | None = None) -> None:
        self.listener, self.stage, self.checksum, self.device = listener, stage, checksum, device
        self._pending: dict[str, Channel] = {}
        self._cancelled = threading.Event()

    def take(self, role: str, timeout: float) -> Channel:
        """The link of ``role`` (TimeoutError when none arrives in ``timeout`` seconds, or once
        :meth:`cancel` is called)."""
        deadline = time.monotonic() + timeout
        while role not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or self._cancelled.is_set():
                why = "before the stage was stopped" if self._cancelled.is_set() else f"within {timeout:.0f} s"
                raise TimeoutError(f"stage {self.stage}: no {role} connection {why}")
            try:
                self._accept_one(min(0.5, left))
            except TimeoutError:
                continue
            except Exception as err:  # noqa: BLE001 - a bad connector must not stop the stage
                log_line(f"stagewise stage {self.stage}: refused a connection: {err}")
        return self._pending.pop(role)

    def _accept_one(self, timeout: float) -> None:
        channel = self.listener.accept(timeout=timeout)
        role = channel.peer.role if channel.peer is not None else None
        if role not in ROLES:
            channel.close()
            raise ValueError(f"a peer connected with role {role!r}; expected one of {ROLES}")
        if role != "driver":
            try:
                channel = upgrade_accepted(channel, device=self.device, checksum=self.checksum,
                                           verify_checksum=self.checksum)
            except BaseException:
                channel.close()
                raise
        self._pending[role] = channel

    def cancel(self) -> None:
        """End every wait in :meth:`take` (from another thread) within half a second."""
        self._cancelled.set()

    def drop(self) -> None:
        """Close the links taken from the listener but not handed out (a broken pipeline's)."""
        for channel in self._pending.values():
            channel.close()
        self._pending.clear()

    def close(self) -> None:
        self.drop()
        self.listener.close()


@dataclass(slots=True)
class DataLinks:
    """A stage's links to its neighbours (None where it has none)."""

    upstream: Channel | None = None
    """Activations from the previous stage (stages 1 .. S-1)."""
    downstream: Channel | None = None
    """Activations to the next stage (stages 0 .. S-2)."""
    feedback: Channel | None = None
    """Sampled tokens: sent by the last stage, received by stage 0."""
    fanout: Fanout | None = None
    """A leader's channels to its stage's other ranks."""

    def close(self) -> None:
        for channel in (self.upstream, self.downstream, self.feedback, self.fanout):
            if channel is not None:
                channel.close()


def open_data_links(*, index: int, num_stages: int, transport: str, next_address: tuple[str, int] | None,
                    acceptor: Acceptor, options: LinkOptions, slot_bytes: int, num_slots: int,
                    device: int | None = None, world_ranks: list[int] | None = None) -> DataLinks:
    """Connect stage ``index``'s leader to its neighbours: dial the next stage (the last dials
    stage 0) while accepting the previous one, since every stage dials first and a hello needs the
    other end to be accepting. A world transport (``torch``) runs over the run's torch.distributed
    world (already joined: :mod:`stagewise.parallel.groups`), between the leaders' ranks
    ``world_ranks``."""
    links = DataLinks()
    if num_stages == 1:
        return links
    first, last = index == 0, index == num_stages - 1
    incoming = "feedback" if first else "activations"
    outgoing = "feedback" if last else "activations"
    peer, prev = (index + 1) % num_stages, (index - 1) % num_stages
    if registry.is_world(transport):
        world, open_channel = world_ranks or list(range(num_stages)), registry.get(transport).load()

        def open_in() -> Channel:
            return _world_link(open_channel, world, options, sender=prev, receiver=index, role=incoming, stage=index)

        def open_out() -> Channel:
            return _world_link(open_channel, world, options, sender=index, receiver=peer, role=outgoing, stage=index)
    else:
        if next_address is None:
            raise ValueError(f"stage {index}: setup names no address for stage {peer}")

        def open_in() -> Channel:
            return acceptor.take(incoming, LINK_TIMEOUT_S)

        def open_out() -> Channel:
            return dial(next_address, options, transport=transport, stage=index, peer=peer, role=outgoing,
                        slot_bytes=slot_bytes, num_slots=num_slots, device=device)
    got: dict[str, Channel | BaseException] = {}

    def accept() -> None:
        try:
            got["in"] = open_in()
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the stage's own thread
            got["in"] = err

    thread = threading.Thread(target=accept, name="accept-link", daemon=True)
    thread.start()
    out = open_out()  # on an error the stage exits; the accepting thread is a daemon
    thread.join(LINK_TIMEOUT_S + 10)
    incoming_link = got.get("in")
    if not isinstance(incoming_link, Channel):
        out.close()
        if isinstance(incoming_link, BaseException):
            raise incoming_link
        raise TimeoutError(f"stage {index}: no {incoming} link from stage {prev} within {LINK_TIMEOUT_S:.0f} s")
    if first:
        links.downstream, links.feedback = out, incoming_link
    elif last:
        links.upstream, links.feedback = incoming_link, out
    else:
        links.upstream, links.downstream = incoming_link, out
    return links


def _world_link(open_channel, world: list[int], options: LinkOptions, *, sender: int, receiver: int, role: str,
                stage: int) -> Channel:
    hello = Hello(fingerprint=options.fingerprint, stage_from=sender, stage_to=receiver, role=role)
    peer = world[receiver if stage == sender else sender]
    return open_channel(peer, hello=hello, initiator=stage == sender, tag=WORLD_TAGS[role], auth_token=options.auth_token,
                        checksum=options.checksum, verify_checksum=options.checksum, timeout=LINK_TIMEOUT_S)
