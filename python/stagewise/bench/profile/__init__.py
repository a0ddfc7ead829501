"""``stagewise bench profile``: this machine as a device profile the planner reads (JSON,
``<device>-profile.json``; :mod:`stagewise.planner.profiles` describes the fields), measured by
:mod:`~stagewise.bench.profile.device` from the primitives a node profile measures too
(:mod:`stagewise.measure`) and those only this suite measures: the pipeline's links and the TP link
(:mod:`~stagewise.bench.profile.runtime`, :mod:`~stagewise.bench.profile.tp`), the Python layer
loop's and the DCP combine's cost (:mod:`~stagewise.bench.profile.framework`), how busy processes
slow each other."""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "profile", device=True, quick=True)


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench.profile import device

    return device.run(args, log)
