"""The transport names and the one rule that picks a hop's transport.

Every place that spells out transport names (the CLI's ``--transport`` choices, run-plan
validation, the pipeline's per-hop choice) imports :data:`TRANSPORTS` and :func:`resolve` from
here, so they cannot disagree.

The rule, for one hop between two stages:

- ``auto``: ``shm`` (a shared-memory ring) when both stages run on one host, ``tcp`` across
  hosts. Never ``cuda-ipc``, even between two GPU stages of one host: that ring has been written
  and compile-checked but has not yet run on a GPU, so it is used only when asked for by name.
- ``tcp``, ``torch`` (torch.distributed point-to-point): as asked, on one host or across hosts.
- ``shm``: as asked; both stages must be on one host.
- ``cuda-ipc``: as asked; both stages must be on one host and on GPUs.
"""

from __future__ import annotations

TRANSPORTS = ("auto", "tcp", "shm", "cuda-ipc", "torch")
"""Every name a user may give: ``auto`` and the concrete transports."""


def resolve(kind: str, *, same_host: bool, cuda: bool = False) -> str:
    """The concrete transport of one hop for the asked ``kind``. ``same_host``: both stages run
    on one host; ``cuda``: both stages run on GPUs. Raises ValueError for an unknown name or a
    transport the hop cannot use (shm or cuda-ipc across hosts, cuda-ipc without GPUs)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"stagewise.transport: transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind == "auto":
        return "shm" if same_host else "tcp"
    if kind in ("shm", "cuda-ipc") and not same_host:
        raise ValueError(f"stagewise.transport: transport {kind!r} needs both stages on one host; these run on two "
                         "(use tcp or torch across hosts)")  # fmt: skip
    if kind == "cuda-ipc" and not cuda:
        raise ValueError("stagewise.transport: transport 'cuda-ipc' needs both stages on GPUs; at least one runs on "
                         "the CPU (use shm)")  # fmt: skip
    return kind
