"""What a Run drives is the Backend protocol: the engine in this process, a pipeline's driver and a
driver that repairs its pipeline each have every method of it, taking the protocol's arguments
(names, order, defaults)."""

from __future__ import annotations

import inspect

import pytest

from stagewise.frontend.local import LocalBackend
from stagewise.frontend.run import Backend
from stagewise.pipeline.driver import PipelineDriver
from stagewise.pipeline.recovery import Recovering

METHODS = [name for name, member in vars(Backend).items() if inspect.isfunction(member) and not name.startswith("_")]


def test_the_protocol_names_what_a_run_calls():
    assert sorted(METHODS) == ["abort", "add", "cancel", "close", "poll", "reset_prefix_cache", "take_tokens"]


@pytest.mark.parametrize("backend", [LocalBackend, PipelineDriver, Recovering])
def test_each_backend_conforms(backend):
    assert issubclass(backend, Backend)  # runtime_checkable: every method is there
    for name in METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters.values())
        have = list(inspect.signature(getattr(backend, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in have[:len(want)]] == \
            [(p.name, p.kind, p.default) for p in want], f"{backend.__name__}.{name}"
        extra = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty]
        assert not extra, f"{backend.__name__}.{name} needs arguments a Run does not give: {extra}"
