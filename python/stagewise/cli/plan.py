"""``stagewise plan ...``: the planner (:mod:`stagewise.planner.cli`: ``plan MODEL``, ``plan memory``,
``plan ranks``), and ``plan validate``, which runs pipelines to check the planner's predictions and
so belongs to the benchmarks (:mod:`stagewise.bench.plan_validate`). Each parses its own
arguments; they are imported only when asked for."""

from __future__ import annotations


def run(argv: list[str]) -> int:
    if argv[:1] == ["validate"]:
        from stagewise.bench.plan_validate import main as validate

        return validate(argv[1:])
    from stagewise.planner.cli import main as plan

    return plan(argv)
