"""Every transport, registered once: its name, what a hop needs to use it, and what sets up a
channel on it. Everything that names transports or picks one reads this table: the ``--transport``
choices, run-plan validation, the pipeline's per-hop choice and its links, the process groups.

Two kinds of transport:

- a **link** continues a TCP channel that did the hello (``tcp``, and the rings ``shm`` and
  ``cuda-ipc``): the dialling end names it in a ``link`` message
  (:mod:`~stagewise.transport.rings.link`), and its ``setup`` is a class with ``offer`` (the
  dialling end) and ``attach`` (the accepting end) — :class:`LinkSetup`;
- a **world** transport opens point-to-point channels between ranks of a torch.distributed world
  over every rank of the run (``torch``): its ``setup`` is a function like
  :func:`stagewise.transport.torch_dist.open_channel`. The run then has one world, which cannot
  take a new member, and its connections are torch.distributed's, not ours: no TLS between hosts.

The rule for ``auto``, for one hop between two stages: of the transports ``auto`` may take, the
most specific one the hop can use — one that needs both stages on one host before one that goes
anywhere, one that needs GPUs as well before that (a transport has a requirement because it is the
faster one where it holds). Today: ``shm`` on one host, ``tcp`` across hosts. ``cuda-ipc`` is left
out of ``auto`` (its ring has been written and compile-checked but has not yet run on a GPU), and
``torch`` too (it needs a world over the run): both are used only when asked for by name.

This module imports neither torch nor the extension (the CLI and the run-plan parser name
transports without loading either): a transport's ``setup`` is imported when a channel is set up
on it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stagewise.transport.channel import Channel

AUTO = "auto"
"""The name that asks for :func:`resolve`'s rule, hop by hop."""


class LinkSetup(Protocol):
    """How a link transport continues a TCP channel after its hello: ``tcp`` is the channel
    itself; a ring sends through its ring and keeps the TCP channel beside it."""

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int, num_slots: int, device: int | None, checksum: bool,
              verify_checksum: bool) -> Channel:  # fmt: skip
        """The dialling end: send the ``link`` message naming the transport (a ring: of
        ``num_slots`` slots of ``slot_bytes``, on GPU ``device``) and wait until the peer took it."""

    @classmethod
    def attach(cls, tcp: Channel, message: dict, *, device: int | None, checksum: bool,
               verify_checksum: bool) -> Channel:  # fmt: skip
        """The accepting end, given the dialler's ``link`` message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Transport:
    name: str
    """What a user writes (``--transport``, a run plan's ``transport:``, a ``link`` message)."""
    what: str
    """What carries the frames, in a few words."""
    setup: str
    """``module:attribute`` of what sets a channel up: a :class:`LinkSetup` for a link, the channel
    opener for a world transport."""
    world: bool = False
    """Opens channels between the ranks of a torch.distributed world over the run (no link message)."""
    same_host: bool = False
    """Both stages of a hop must run on one host."""
    gpus: bool = False
    """Both stages of a hop must run on GPUs."""
    auto: bool = False
    """``auto`` may take it (where the hop meets its requirements)."""

    def problem(self, *, same_host: bool, cuda: bool) -> str | None:
        """Why a hop (``same_host``: both stages on one host; ``cuda``: both on GPUs) cannot use
        this transport; None when it can."""
        if self.same_host and not same_host:
            instead = " or ".join(t.name for t in REGISTRY.values() if not t.same_host)
            return f"transport {self.name!r} needs both stages on one host; these run on two (use {instead} across hosts)"
        if self.gpus and not cuda:
            instead = " or ".join(t.name for t in REGISTRY.values() if t.same_host and not t.gpus)
            return f"transport {self.name!r} needs both stages on GPUs; at least one runs on the CPU (use {instead})"
        return None

    def load(self):
        """The ``setup`` object, imported now."""
        module, _, attribute = self.setup.partition(":")
        return getattr(importlib.import_module(module), attribute)


REGISTRY: dict[str, Transport] = {t.name: t for t in (
    Transport(name="tcp", what="the TCP channel itself", setup="stagewise.transport.rings.link:TcpLink", auto=True),
    Transport(name="shm", what="a shared-memory ring per direction", same_host=True, auto=True,
              setup="stagewise.transport.rings.shm:ShmChannel"),
    Transport(name="cuda-ipc", what="a ring in GPU memory shared by CUDA IPC", same_host=True, gpus=True,
              setup="stagewise.transport.rings.cuda_ipc:CudaIpcChannel"),
    Transport(name="torch", what="torch.distributed point-to-point in one world over the run", world=True,
              setup="stagewise.transport.torch_dist:open_channel"),
)}  # fmt: skip
"""Every transport by name, in the order they are listed to users."""

TRANSPORTS = (AUTO, *REGISTRY)
"""Every name a user may give: ``auto`` and the registered transports."""
LINK_TRANSPORTS = tuple(name for name, t in REGISTRY.items() if not t.world)
"""What a data link may continue on (a world transport is a process group, not a link)."""


def get(name: str) -> Transport:
    """The registered transport ``name`` (ValueError listing the known ones otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"stagewise.transport: transport must be one of {', '.join(TRANSPORTS)}, got {name!r}") \
            from None


def resolve(kind: str, *, same_host: bool, cuda: bool = False) -> str:
    """The concrete transport of one hop for the asked ``kind`` (``auto`` or a registered name).
    ``same_host``: both stages run on one host; ``cuda``: both stages run on GPUs. Raises
    ValueError for an unknown name or a transport the hop cannot use."""
    if kind == AUTO:
        usable = [t for t in REGISTRY.values()
                  if t.auto and t.problem(same_host=same_host, cuda=cuda) is None]
        return max(usable, key=lambda t: (t.same_host, t.gpus)).name  # the most specific; tcp goes anywhere
    problem = get(kind).problem(same_host=same_host, cuda=cuda)
    if problem is not None:
        raise ValueError(f"stagewise.transport: {problem}")
    return kind


def is_world(name: str) -> bool:
    """Whether hops on ``name`` run in a torch.distributed world over the run."""
    return get(name).world
