"""``stagewise bench transport``: one-way latency and GB/s of each transport between two processes
of this machine, 8 KB - 64 MB frames, checksum on and off, beside the copy bandwidth and the
codec's and checksum's own costs (:mod:`~stagewise.bench.transport.channels`, timed by
:mod:`~stagewise.bench.transport.pingpong`); ``cuda-ipc``, frames of CUDA tensors between two
processes on one GPU beside the device-to-device copy (:mod:`~stagewise.bench.transport.cuda_ipc`;
recorded as skipped, with the reason, where it cannot run). Also here:
``stagewise bench shm`` (:mod:`~stagewise.bench.transport.shm`), the shared-memory ring against
loopback sockets, and the throwaway TLS certificates of the ``tcp-tls`` row
(:mod:`~stagewise.bench.transport.certs`)."""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stagewise.bench.transport.channels import TRANSPORTS

    add_common(parser, "transport", quick=True)
    parser.add_argument("--transports", default=None,
                        help=f"comma-separated subset of {','.join(TRANSPORTS)} (default: all; cuda-ipc is "
                             "recorded as skipped, with the reason, without a CUDA GPU)")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench.transport import channels

    return channels.run(args, log)
