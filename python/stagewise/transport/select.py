# Interim bridge on this branch only; replaced when the transport restructuring is merged.
from __future__ import annotations

TRANSPORTS = ("auto", "tcp", "shm", "cuda-ipc", "torch")


def resolve(kind: str, *, same_host: bool, cuda: bool = False) -> str:
    if kind not in TRANSPORTS:
        raise ValueError(f"stagewise.transport: transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind != "auto":
        return kind
    return "shm" if same_host else "tcp"
