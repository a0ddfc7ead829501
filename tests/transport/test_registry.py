"""The transport registry (stagewise.transport.registry): every registered transport is reached by
its name through the one path that sets a link up (or, for a world transport, opens its channel),
``auto`` follows its rule over the registry's fields, and the places that name transports take
their names from it."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from stagewise.transport import Frame, Hello, StepKind, registry, tcp
from stagewise.transport.registry import AUTO, LINK_TRANSPORTS, REGISTRY, TRANSPORTS, resolve
from stagewise.transport.rings import upgrade_accepted, upgrade_dialled

HOPS = list(itertools.product((True, False), repeat=2))
"""(same_host, cuda) of every kind of hop."""


@pytest.mark.parametrize("same_host,cuda", HOPS)
def test_auto_takes_the_most_specific_transport_auto_may_take_that_the_hop_can_use(same_host, cuda):
    chosen = REGISTRY[resolve(AUTO, same_host=same_host, cuda=cuda)]
    assert chosen.auto and chosen.problem(same_host=same_host, cuda=cuda) is None
    for other in REGISTRY.values():
        if other.auto and other.problem(same_host=same_host, cuda=cuda) is None:
            assert (other.same_host, other.gpus) <= (chosen.same_host, chosen.gpus), other.name


@pytest.mark.parametrize("same_host,cuda,want", [(True, False, "shm"), (True, True, "shm"), (False, False, "tcp"),
                                                 (False, True, "tcp")])  # fmt: skip
def test_auto_is_shm_on_one_host_and_tcp_across_hosts_never_cuda_ipc(same_host, cuda, want):
    assert resolve(AUTO, same_host=same_host, cuda=cuda) == want


def test_auto_always_has_a_transport_that_goes_anywhere():
    assert any(t.auto and not t.same_host and not t.gpus for t in REGISTRY.values())


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("same_host,cuda", HOPS)
def test_a_named_transport_is_taken_as_asked_where_the_hop_meets_its_needs(name, same_host, cuda):
    t = REGISTRY[name]
    if (t.same_host and not same_host) or (t.gpus and not cuda):
        with pytest.raises(ValueError, match=f"transport '{name}' needs both stages on"):
            resolve(name, same_host=same_host, cuda=cuda)
    else:
        assert resolve(name, same_host=same_host, cuda=cuda) == name


def test_what_a_hop_cannot_use_is_said_with_what_to_use_instead():
    with pytest.raises(ValueError, match=r"'shm' needs both stages on one host; these run on two \(use tcp or torch"):
        resolve("shm", same_host=False)
    with pytest.raises(ValueError, match=r"'cuda-ipc' needs both stages on GPUs; at least one runs on the CPU \(use "
                                         r"shm\)"):
        resolve("cuda-ipc", same_host=True, cuda=False)


def test_unknown_names_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="transport must be one of auto, tcp, shm, cuda-ipc, torch, got 'udp'"):
        resolve("udp", same_host=True)
    assert TRANSPORTS == (AUTO, *REGISTRY) and AUTO not in REGISTRY
    assert LINK_TRANSPORTS == tuple(n for n, t in REGISTRY.items() if not t.world)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_setup_is_importable_and_of_its_kind(name):
    setup = REGISTRY[name].load()
    if REGISTRY[name].world:
        from stagewise.transport import torch_dist

        assert setup is torch_dist.open_channel
    else:
        assert callable(setup.offer) and callable(setup.attach)


class _Recorder:
    """A stand-in setup: says which transport's offer or attach the one path reached."""

    calls: list = []

    def __init__(self, name: str) -> None:
        self.name = name

    def offer(self, channel, **options):
        _Recorder.calls.append(("offer", self.name, sorted(options)))
        return channel

    def attach(self, channel, message, **options):
        _Recorder.calls.append(("attach", self.name, message["transport"], sorted(options)))
        return channel


class _Control:
    """A channel whose next frame is the dialler's link message."""

    peer_name = "the peer"

    def __init__(self, transport: str) -> None:
        self.transport = transport

    def recv(self, timeout=None):
        return Frame(step_kind=StepKind.CONTROL, control={"op": "link", "transport": self.transport})


@pytest.mark.parametrize("name", LINK_TRANSPORTS)
def test_each_link_transport_is_reached_by_name_at_both_ends(name, monkeypatch):
    monkeypatch.setattr(registry.Transport, "load", lambda self: _Recorder(self.name))
    _Recorder.calls = []
    channel = _Control(name)
    assert upgrade_dialled(channel, name) is channel
    assert upgrade_accepted(channel) is channel
    checks = ["checksum", "device", "verify_checksum"]
    assert _Recorder.calls == [("offer", name, ["checksum", "device", "num_slots", "slot_bytes", "verify_checksum"]),
                               ("attach", name, name, checks)]


def test_a_world_transport_is_no_link():
    world = [n for n, t in REGISTRY.items() if t.world]
    assert world == ["torch"]
    with pytest.raises(ValueError, match="a link continues on one of"):
        upgrade_dialled(_Control("torch"), "torch")


HELLO = Hello(fingerprint="registry", stage_from=0, stage_to=1)


ON_GPUS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=ON_GPUS if REGISTRY[n].gpus else [])
                                  for n in LINK_TRANSPORTS])
def test_every_link_transport_carries_a_frame_set_up_by_its_name(name):
    device = 0 if REGISTRY[name].gpus else None
    tensor_device = "cuda" if device is not None else "cpu"
    lis = tcp.listen(hello=HELLO)
    got: dict = {}

    def accept() -> None:
        got["in"] = upgrade_accepted(lis.accept(30), device=device)

    thread = threading.Thread(target=accept)
    thread.start()
    out = upgrade_dialled(tcp.connect("127.0.0.1", lis.address[1], hello=HELLO, timeout=30), name,
                          slot_bytes=1 << 16, num_slots=2, device=device)
    thread.join(30)
    inn = got["in"]
    try:
        assert type(out) is type(inn)
        hidden = torch.arange(64, dtype=torch.float32, device=tensor_device).view(4, 16)
        out.send(Frame(step_kind=StepKind.DECODE, tensors={"hidden": hidden}))
        frame = inn.recv(timeout=30)
        assert torch.equal(frame.tensors["hidden"].cpu(), hidden.cpu())
    finally:
        out.close()
        inn.close()
        lis.close()


@pytest.mark.parametrize("asked,fanout", [("auto", "shm"), ("tcp", "tcp"), ("shm", "shm"), ("cuda-ipc", "shm"),
                                          ("torch", "shm")])  # fmt: skip
def test_a_leader_reaches_its_ranks_on_tcp_when_asked_everywhere_else_on_autos_choice_on_one_host(asked, fanout):
    from stagewise.parallel.runplan import RunPlan
    from stagewise.pipeline.links import fanout_transport

    plan = RunPlan.from_dict({"model": "m", "stages": [{"tp": 2}, {}], "transport": asked}, 4)
    assert fanout_transport(plan) == fanout


def test_a_world_transport_spans_the_run_and_agrees_with_the_driver_only_on_its_kind():
    from stagewise.parallel.groups import spans_run
    from stagewise.pipeline import stage_setup
    from stagewise.pipeline.messages import Setup

    assert spans_run(["torch", "torch"]) and not spans_run(["shm", "tcp"])
    setup = Setup(num_blocks=1, next=None, transport="tcp", microbatches=1)
    assert stage_setup.checked(setup, "shm") is setup  # which link a hop runs is the driver's to say
    with pytest.raises(ValueError, match="over 'tcp', but this stage's plan makes it 'torch'"):
        stage_setup.checked(setup, "torch")


def test_the_cli_and_the_run_plan_take_the_names_from_the_registry(capsys):
    import argparse

    from stagewise.cli import generate as cli_generate
    from stagewise.parallel import plan_options

    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    for name in TRANSPORTS:
        assert parser.parse_args(["--transport", name]).transport == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--transport", "udp"])
    assert ", ".join(repr(t) for t in TRANSPORTS) in capsys.readouterr().err
    assert plan_options.TRANSPORTS is TRANSPORTS  # the run plan's option checks


def test_the_registry_loads_without_torch():
    import subprocess
    import sys

    code = ("import sys; import stagewise.transport.registry as r; r.resolve('auto', same_host=True); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
