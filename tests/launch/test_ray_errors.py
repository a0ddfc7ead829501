"""What a Ray launch says when it cannot start, without a cluster: a cluster that cannot be joined
(its token authentication among the causes, read from what Ray writes to stderr), a layout the
cluster's resources cannot hold, each with what to change; and a command prints them as the
launcher's words, not as a model that failed to load."""

from __future__ import annotations

import os

import pytest

from stagewise.launch import LaunchError
from stagewise.launch.ray_join import connect, connect_failure, fit_problem
from stagewise.parallel.runplan import RunPlan

# What Ray 2.60's GCS client writes, once a second, to a driver the cluster refused.
REFUSED = ("[2026-11-28 12:38:14,122 W 14357 14357] gcs_client.cc:210: Failed to get cluster ID from GCS server: "
           "Unauthenticated: RPC error: InvalidAuthToken: Authentication token is missing or incorrect\n")


def _plan(threads: list[int], **stage) -> RunPlan:
    return RunPlan.from_dict({"model": "m", "stages": [{"threads": t, **stage} for t in threads]}, 6)


def test_a_cpu_shortfall_names_the_fix():
    nodes = [{"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0}]
    why = fit_problem(_plan([1, 1, 1]), nodes, "SPREAD")
    assert why.startswith("--launcher ray: the stages need CPU 3 in all; the cluster has 2 (CPU 2)")
    assert "every one of the 3 stage ranks takes 1 CPU, the least it can: run at most 2 ranks" in why
    assert "ray start --num-cpus N" in why and "memory" not in why
    why = fit_problem(_plan([2, 1]), nodes, "PACK")
    assert "need CPU 3 in all" in why and "as many CPUs as its threads (2, 1 a stage): fewer --threads" in why
    assert fit_problem(_plan([1, 1]), nodes, "PACK") is None


def test_a_stage_no_node_can_hold_names_the_fix():
    nodes = [{"CPU": 4.0}, {"CPU": 2.0}]
    why = fit_problem(_plan([8]), nodes, "SPREAD")
    assert "no node of the cluster can hold stage 0 (CPU 8); its nodes have: CPU 4; CPU 2" in why
    assert "--threads 4 (or the plan's threads)" in why
    why = fit_problem(_plan([1, 1], resources={"gpu-a": 1}), nodes, "SPREAD")
    assert "start a node with 'gpu-a'" in why and "--resources=" in why
    why = fit_problem(_plan([1, 1, 1]), [{"CPU": 4.0}, {"CPU": 4.0}], "STRICT_SPREAD")
    assert why.startswith("--placement strict_spread: 3 stages need as many nodes; the cluster has 2")
    assert "--placement spread" in why


def test_a_refused_token_gets_the_way_to_connect_in_token_mode():
    why = connect_failure("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"),
                          said=REFUSED * 3, env={})
    assert why.startswith("--launcher ray: cannot connect to the Ray cluster at 10.0.0.1:6379: Failed to connect")
    assert "InvalidAuthToken" in why and "RAY_AUTH_MODE is unset" in why
    for advice in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "ray get-auth-token", "~/.ray/auth_token",
                   "RAY_AUTH_TOKEN_PATH"):
        assert advice in why, advice
    assert "missing or not the cluster's" in connect_failure("h:1", ConnectionError("x"), REFUSED,
                                                             env={"RAY_AUTH_MODE": "token"})
    plain = connect_failure("h:1", ConnectionError("Failed to connect to Ray cluster at h:1"), "", env={})
    assert "RAY_AUTH" not in plain and "`ray status` on its head node" in plain and "--ray-address" in plain


def test_ray_authentication_error_is_told_in_one_line():
    exceptions = pytest.importorskip("ray.exceptions")
    err = exceptions.AuthenticationError("Token authentication is enabled but no authentication token was found")
    why = connect_failure("h:1", err, "", env={"RAY_AUTH_MODE": "token"})
    assert "no authentication token was found; the cluster uses Ray's token authentication" in why
    assert why.count("RAY_AUTH_TOKEN_PATH") == 1  # Ray's own paragraph of advice is left out


class _FakeRay:
    """What connect() asks of Ray: its init writes to stderr (fd 2, as Ray's C++ logs do)."""

    def __init__(self, said: str, error: Exception | None):
        self.said, self.error, self.calls = said, error, []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.calls.append(kwargs)
        os.write(2, self.said.encode())
        if self.error is not None:
            raise self.error


def test_connect_reads_rays_stderr_for_the_cause(capfd):
    with pytest.raises(LaunchError, match="RAY_AUTH_MODE=token") as caught:
        connect(_FakeRay(REFUSED * 2, ConnectionError("Failed to connect")), "10.0.0.1:6379")
    assert "cannot connect to the Ray cluster at 10.0.0.1:6379" in str(caught.value)
    os.write(2, b"after\n")  # stderr is this process's again
    assert capfd.readouterr().err == "after\n"  # the refusal's spam is summed up in the error
    assert connect(_FakeRay("a warning of Ray's\n", None), "10.0.0.1:6379") is True
    assert capfd.readouterr().err == "a warning of Ray's\n"  # what Ray said on success still shows


def test_generate_says_a_ray_failure_in_its_own_words(monkeypatch, capsys):
    pytest.importorskip("ray")
    from stagewise.cli import main
    from stagewise.launch import ray_cluster

    def refused(ray, address, cpus=0):
        raise LaunchError(connect_failure("10.0.0.1:6379", ConnectionError("Failed to connect"), REFUSED, env={}))

    monkeypatch.setattr(ray_cluster, "connect", refused)
    code = main(["generate", "smollm2-135m", "--stages", "2", "--launcher", "ray", "--ray-address", "10.0.0.1:6379",
                 "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("stagewise generate: --launcher ray: cannot connect to the Ray cluster"), err
    assert "cannot load" not in err
