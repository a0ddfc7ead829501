"""The one rule that picks a hop's transport (stagewise.transport.select), and the places that
spell out transport names taking theirs from it."""

from __future__ import annotations

import pytest

from stagewise.transport.select import TRANSPORTS, resolve


@pytest.mark.parametrize("same_host,cuda,want", [(True, False, "shm"), (True, True, "shm"), (False, False, "tcp"),
                                                 (False, True, "tcp")])  # fmt: skip
def test_auto_is_shm_on_one_host_and_tcp_across_hosts_never_cuda_ipc(same_host, cuda, want):
    assert resolve("auto", same_host=same_host, cuda=cuda) == want


@pytest.mark.parametrize("kind", ["tcp", "torch"])
def test_tcp_and_torch_go_anywhere(kind):
    for same_host in (True, False):
        assert resolve(kind, same_host=same_host) == kind


def test_rings_need_one_host_and_cuda_ipc_needs_gpus():
    assert resolve("shm", same_host=True) == "shm"
    assert resolve("cuda-ipc", same_host=True, cuda=True) == "cuda-ipc"
    with pytest.raises(ValueError, match="'shm' needs both stages on one host"):
        resolve("shm", same_host=False)
    with pytest.raises(ValueError, match="'cuda-ipc' needs both stages on one host"):
        resolve("cuda-ipc", same_host=False, cuda=True)
    with pytest.raises(ValueError, match="'cuda-ipc' needs both stages on GPUs"):
        resolve("cuda-ipc", same_host=True, cuda=False)


def test_unknown_names_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="transport must be one of auto, tcp, shm, cuda-ipc, torch, got 'udp'"):
        resolve("udp", same_host=True)


def test_the_cli_and_the_run_plan_take_the_names_from_here(capsys):
    import argparse

    from stagewise import cli_generate
    from stagewise.parallel import plan_options

    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    for name in TRANSPORTS:
        assert parser.parse_args(["--transport", name]).transport == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--transport", "udp"])
    assert ", ".join(repr(t) for t in TRANSPORTS) in capsys.readouterr().err
    assert plan_options.TRANSPORTS is TRANSPORTS  # the run plan's option checks
