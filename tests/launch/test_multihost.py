"""Multi-host runs: plan checks, the commands `stagewise launch` prints or runs over ssh, stages
under torchrun that publish their addresses in torch.distributed's store, and a real pipeline
across network namespaces (one per "host", joined by veth pairs on a bridge: the stages talk
over distinct addresses, never loopback) giving the single-process run's greedy tokens.

The namespace tests need root and `ip netns`; they skip with the reason otherwise. ssh itself is
replaced by a small script that runs the remote command here (inside the host's namespace when
there is one): what is tested is the command stagewise builds and what the stages do with it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stagewise.api import Pipeline
from stagewise.cli import main as cli_main
from stagewise.launch.local import StageProcesses, read_address
from stagewise.launch.local import stage_argv
from stagewise.launch.multihost import PlanError, check_plan, load_plan, ssh_argv
from stagewise.parallel.runplan import RunPlan
from stagewise.launch.torchrun import torchrun_stage
from stagewise.transport.errors import HandshakeError

transformers = pytest.importorskip("transformers")

PY = sys.executable
PROMPT_IDS = [5, 6, 7, 8, 9]
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_plan(path: Path, model: str, stages: list[dict], **options) -> Path:
    path.write_text(json.dumps({"model": model, **options, "stages": stages}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 4-layer Qwen3 folder and its single-process greedy tokens for PROMPT_IDS."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=None)
    path = tmp_path_factory.mktemp("tiny")
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    with Pipeline(str(path)) as pipe:
        [ref] = pipe.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=8, ignore_eos=True)
    return str(path), ref.token_ids


# ---- plan checks (no processes) ----------------------------------------------------------------


def plan_of(stages, model="m", **options) -> RunPlan:
    return RunPlan.from_dict({"model": model, "stages": stages, **options}, 4)


def test_a_remote_stage_listening_on_loopback_is_flagged():
    plan = plan_of([{"host": "127.0.0.1", "listen": "127.0.0.1:7000", "layers": "0-2"},
                    {"host": "192.0.2.77", "listen": "127.0.0.1:7000", "layers": "2-4"}])
    with pytest.raises(PlanError, match=r"stages\[1\]: runs on '192.0.2.77' but listens on loopback"):
        check_plan(plan, fixed_ports=True)
    # A local stage on loopback that a remote stage must dial is flagged too.
    plan = plan_of([{"host": "127.0.0.1", "listen": "127.0.0.1:7000"}, {"host": "192.0.2.77", "listen": "0.0.0.0:7000"}])
    with pytest.raises(PlanError, match=r"stages\[0\]: listens on loopback .* stage 1 on '192.0.2.77' must dial"):
        check_plan(plan, fixed_ports=True)
    check_plan(plan_of([{"host": "192.0.2.7", "listen": "0.0.0.0:7000"}, {"host": "192.0.2.8", "listen": "192.0.2.8:7000"}]),
               fixed_ports=True)


def test_ports_hosts_and_duplicates_are_checked():
    zero = plan_of([{"host": "192.0.2.7", "listen": "192.0.2.7:0"}, {"host": "192.0.2.8", "listen": "192.0.2.8:7000"}])
    with pytest.raises(PlanError, match=r"stages\[0\]: listens on port 0"):
        check_plan(zero, fixed_ports=True)
    check_plan(zero, fixed_ports=False)  # --ssh reads the port each stage prints
    check_plan(zero, fixed_ports=True, started_here={0})  # and so does launch of a stage it starts itself
    with pytest.raises(PlanError, match=r"stages\[0\]: listens on '0.0.0.0:7000' and has no 'host'"):
        check_plan(plan_of([{"listen": "0.0.0.0:7000"}, {"host": "192.0.2.8", "listen": "192.0.2.8:7000"}]),
                   fixed_ports=True)
    with pytest.raises(PlanError, match=r"stages\[1\]: listens on 192.0.2.7:7000 like stage 0"):
        check_plan(plan_of([{"host": "192.0.2.7", "listen": "0.0.0.0:7000"}, {"host": "192.0.2.7", "listen": "192.0.2.7:7000"}]),
                   fixed_ports=True)


@pytest.mark.parametrize("stages, message", [
    ([{"listen": "10.0.0.1"}], r"stages\[0\].listen must be 'host:port', got '10.0.0.1'"),
    ([{"listen": "10.0.0.1:70000"}], r"stages\[0\].listen must be 'host:port' with a port in \[0, 65535\]"),
    ([{"listen": "10.0.0.1:http"}], r"port in \[0, 65535\], got '10.0.0.1:http'"),
    ([{"listen": "a b:7000"}], r"stages\[0\].listen must be"),
    ([{"host": "-oProxyCommand=evil", "listen": "0.0.0.0:1"}], r"stages\[0\].host must be a host name"),
    ([{"host": "h; rm -rf /", "listen": "0.0.0.0:1"}], r"stages\[0\].host must be a host name"),
    ([{"listen": "10.0.0.1:1", "port": 5}], r"stages\[0\] has unknown keys \['port'\]"),
])
def test_bad_stage_entries_name_the_field(stages, message):
    with pytest.raises(ValueError, match=message):
        plan_of(stages)


def test_a_plan_names_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        plan_of([{"listen": "10.0.0.1", "threads": 0}, {"listen": "10.0.0.2:1", "cores": 2}], transport="udp",
                max_num_seqs=0, max_prefill_tokens=0, dtype="int4", sampling={"temperature": -1, "top_p": 5})
    message = str(info.value)
    for fragment in ("stages[0].listen must be 'host:port'", "stages[0].threads must be an int >= 1",
                     "stages[1] has unknown keys ['cores']", "transport must be one of", "max_num_seqs must be an int",
                     "max_prefill_tokens must be an int >= 1, got 0",
                     "dtype must be auto, float32, bfloat16 or float16", "sampling.temperature must be",
                     "sampling.top_p must be"):
        assert fragment in message, (fragment, message)


def test_a_plans_sampling_defaults_are_kept_and_travel_inline():
    plan = plan_of([{"listen": "10.0.0.1:1"}], sampling={"temperature": 0.7, "repetition_penalty": 1.2})
    assert plan.sampling == {"temperature": 0.7, "repetition_penalty": 1.2}
    assert RunPlan.from_dict(json.loads(plan.to_json()), 4) == plan


def test_a_plans_ray_keys_are_checked_and_travel_inline():
    plan = plan_of([{"listen": "10.0.0.1:1", "resources": {"gpu-a": 1, "node:10.0.0.1": 0.5}}], launcher="ray",
                   placement="strict_spread")
    assert (plan.launcher, plan.placement) == ("ray", "strict_spread")
    assert plan.stages[0].resources == {"gpu-a": 1.0, "node:10.0.0.1": 0.5}
    assert RunPlan.from_dict(json.loads(plan.to_json()), 4) == plan
    with pytest.raises(ValueError) as info:
        plan_of([{"listen": "10.0.0.1:1", "resources": {"gpu-a": 0}}, {"listen": "10.0.0.2:1", "resources": ["x"]}],
                launcher="slurm", placement="anywhere")
    for fragment in ("launcher must be one of ('local', 'ray')", "placement must be one of",
                     "stages[0].resources must be a mapping", "stages[1].resources must be a mapping"):
        assert fragment in str(info.value), (fragment, str(info.value))


def test_plan_linear_precision():
    assert plan_of([{"listen": "10.0.0.1:1"}]).linear_precision == "exact"
    assert plan_of([{"listen": "10.0.0.1:1"}], linear_precision="int8").linear_precision == "int8"
    with pytest.raises(ValueError, match="linear_precision"):
        plan_of([{"listen": "10.0.0.1:1"}], linear_precision="int4")


def test_unknown_plan_keys_are_refused(tiny, tmp_path, capsys):
    path = write_plan(tmp_path / "p.json", tiny[0], [{"listen": "127.0.0.1:7000"}], hosts=["a"])
    assert cli_main(["launch", str(path), "--print-only"]) == 2
    assert "unknown keys ['hosts']" in capsys.readouterr().err


# ---- printed commands and ssh -------------------------------------------------------------------


def test_launch_prints_one_runnable_command_per_stage(tiny, tmp_path, capsys):
    path = write_plan(tmp_path / "p.json", tiny[0], [
        {"host": "192.0.2.7", "listen": "0.0.0.0:7100", "threads": 2},
        {"host": "192.0.2.8", "listen": "192.0.2.8:7100", "device": "cuda:1"}], max_model_len=256)
    assert cli_main(["launch", str(path), "--print-only", "--auth-token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert TOKEN not in out  # the secret stays off screens and command lines
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    plan = load_plan(str(path))
    assert [s.end_layer for s in plan.stages] == [2, 4]  # even split of the model's 4 layers
    for i, line in enumerate(commands):
        argv = shlex.split(line)
        assert argv[:3] == ["stagewise", "stage", "--plan-json"]
        assert argv[4:] == ["--stage", str(i), "--auth-token", "$STAGEWISE_AUTH_TOKEN"]
        assert RunPlan.from_dict(json.loads(argv[3])) == plan  # the inline plan is the plan
        assert line.endswith('--auth-token "$STAGEWISE_AUTH_TOKEN"')  # expanded by the host's shell
    assert "# stage 1 on 192.0.2.8: layers 2-4, listens on 192.0.2.8:7100, device cuda:1" in out

    assert cli_main(["launch", str(path), "--print-only", "--remote-plan", "/srv/plan.json",
                     "--remote-command", "/opt/venv/bin/python -m stagewise.cli"]) == 0
    out = capsys.readouterr().out
    assert "/opt/venv/bin/python -m stagewise.cli stage --plan /srv/plan.json --stage 1" in out
    assert "copy " in out and "/srv/plan.json on every host" in out

    # With --max-restarts the printed stages wait for a new driver when the pipeline breaks.
    assert cli_main(["launch", str(path), "--print-only", "--max-restarts", "2"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 2 and all(shlex.split(c)[-2:] == ["--rejoin", "120.0"] for c in commands)
    assert cli_main(["launch", str(path), "--print-only", "--max-restarts", "-1", "--rejoin-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-restarts must be >= 0, got -1" in err and "--rejoin-timeout must be > 0 seconds, got 0.0" in err


# A host that is not this machine and that nothing answers for, without a network: an IPv6
# documentation address (dialling it fails at once, or times out, by the routes there are).
AWAY = "2001:db8::5"


def _launch_watched(cmd: list[str], timeout: float = 180.0) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run a `stagewise launch` command; its result and every child process seen while it ran."""
    import time

    from helpers.processes import children

    env = dict(os.environ)
    env.pop("STAGEWISE_AUTH_TOKEN", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(children(proc.pid))
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), sorted(seen)


def test_launch_starts_the_stages_of_this_machine_itself(tiny, tmp_path):
    """Every stage on 127.0.0.1: `launch` starts them (no command printed, nothing to run by hand),
    answers with the single process's tokens and leaves no process behind."""
    from helpers.processes import gone

    model, ref = tiny
    plan_path = write_plan(tmp_path / "plan.json", model, [{"host": "127.0.0.1", "listen": "127.0.0.1:0"},
                                                           {"host": "localhost", "listen": "127.0.0.1:0"}])
    done, seen = _launch_watched([PY, "-m", "stagewise.cli", "launch", str(plan_path), "--prompt-ids",
                                  ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "8", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completions"][0]["token_ids"][:8] == ref
    assert "starting 2 stages on this machine" in done.stderr
    assert "stagewise stage" not in done.stderr and "waiting" not in done.stderr
    assert len(seen) == 2 and gone(seen), "the stage processes were not stopped"


def test_launch_prints_and_waits_for_the_stages_of_other_hosts(tiny, tmp_path, capsys):
    """Stages on other hosts: their commands, then what is awaited where; when they do not come,
    the error says which and how to start them."""
    model, _ = tiny
    path = write_plan(tmp_path / "p.json", model, [{"host": "2001:db8::4", "listen": "[::]:7100"},
                                                   {"host": AWAY, "listen": f"[{AWAY}]:7101"}])
    assert cli_main(["launch", str(path), "--prompt-ids", "5,6", "--connect-timeout", "1"]) == 1
    err = capsys.readouterr().err
    commands = [line for line in err.splitlines() if line.startswith("stagewise stage ")]
    assert [shlex.split(c)[-1] for c in commands] == ["0", "1"]
    assert f"# stage 1 on {AWAY}: layers 2-4, listens on [{AWAY}]:7101" in err
    awaited = f"stage 0 at [2001:db8::4]:7100 (on 2001:db8::4), stage 1 at [{AWAY}]:7101 (on {AWAY})"
    assert f"waiting up to 1 s for {awaited}, started by the commands above on their hosts" in err
    assert f"start {awaited} on their hosts with the commands printed above" in err
    assert "starting" not in err  # nothing is started here


def test_launch_starts_its_own_stage_and_waits_for_the_other_hosts(tiny, tmp_path):
    """Stage 0 on this machine (by its name, listening on every interface), stage 1 elsewhere:
    stage 0 is started here, only stage 1's command is printed and awaited, and stage 0's
    process is stopped when stage 1 does not come."""
    from helpers.processes import gone

    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        pytest.skip(f"this machine's name {host!r} does not resolve (the driver dials stage 0 by it)")
    model, _ = tiny
    plan_path = write_plan(tmp_path / "plan.json", model, [{"host": host, "listen": "0.0.0.0:0"},
                                                           {"host": AWAY, "listen": f"[{AWAY}]:7101"}])
    done, seen = _launch_watched([PY, "-m", "stagewise.cli", "launch", str(plan_path), "--prompt-ids", "5,6",
                                  "--connect-timeout", "60"])
    assert done.returncode == 1, done.stderr
    commands = [line for line in done.stderr.splitlines() if line.startswith("stagewise stage ")]
    assert len(commands) == 1 and shlex.split(commands[0])[-1] == "1"
    assert "starting stage 0 here" in done.stderr
    assert f"waiting up to 60 s for stage 1 at [{AWAY}]:7101 (on {AWAY}), started by its command above on its " \
           "host" in done.stderr
    assert f"start stage 1 at [{AWAY}]:7101 (on {AWAY}) on its host with the command printed above" in done.stderr
    assert len(seen) == 1 and gone(seen), "stage 0's process was not stopped"


def test_a_ctrl_c_while_connecting_stops_the_stages_started_here(tiny, tmp_path, monkeypatch):
    from stagewise.cli import launch
    from stagewise.api import Pipeline

    stopped = []

    class Started:
        def stop(self, grace_s):
            stopped.append(grace_s)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Pipeline, "attach", interrupted)
    plan = load_plan(write_plan(tmp_path / "plan.json", tiny[0], [{"listen": "127.0.0.1:0"}]))
    args = launch.argparse.Namespace(connect_timeout=1.0, max_restarts=0, rejoin_timeout=None)
    with pytest.raises(KeyboardInterrupt):
        launch._drive(plan, args, None, token=None, addresses=[("127.0.0.1", 1)], procs=Started(),
                          interactive=False, launcher=None)
    assert stopped, "the stages started here were left running"


def test_ssh_command_survives_the_remote_shell_exactly(tmp_path):
    """ssh hands the remote shell one string; run that string with sh as sshd would, with the
    token on stdin, and get back the exact argv and the token in the environment."""
    echo = [PY, "-c", "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['STAGEWISE_AUTH_TOKEN']]))"]
    nasty = ["a b", "'; touch pwned; '", "$HOME", '"q"', "`id`", "*", "--die-with-parent"]
    argv = ssh_argv("host-1.example", [*echo, *nasty], auth=True, ssh=["ssh", "-p", "2222"])
    assert argv[:6] == ["ssh", "-p", "2222", "-o", "BatchMode=yes", "--"]
    assert argv[6] == "host-1.example" and len(argv) == 8
    done = subprocess.run(["sh", "-c", argv[7]], input=TOKEN + "\n", capture_output=True, text=True, cwd=tmp_path,
                          timeout=60, check=True)
    assert json.loads(done.stdout) == [nasty, TOKEN]
    assert not (tmp_path / "pwned").exists()
    assert TOKEN not in " ".join(argv)
    with pytest.raises(ValueError, match="ssh host must be a host name"):
        ssh_argv("-oProxyCommand=x", ["true"], auth=False)


def test_stage_argv_inline_plan_round_trips():
    plan = plan_of([{"host": "h0", "listen": "0.0.0.0:1", "threads": 3}, {"host": "h1", "listen": "h1:2"}],
                   max_model_len=64)
    argv = stage_argv(plan, 1, program=["x", "-m", "y"])
    assert argv[:4] == ["x", "-m", "y", "stage"] and argv[-2:] == ["--stage", "1"]
    assert RunPlan.from_dict(json.loads(argv[argv.index("--plan-json") + 1])) == plan


FAKE_SSH = textwrap.dedent("""\
    #!/bin/sh
    # ssh [options] -- HOST COMMAND: runs COMMAND here, inside HOST's network namespace when
    # $FAKE_SSH_NETNS maps it (HOST=NS,...), with sh as the remote login shell.
    while [ "$1" != "--" ]; do shift; done; shift
    host=$1; shift
    printf '%s %s\\n' "$host" "$*" >> "$FAKE_SSH_LOG"
    ns=$(printf '%s\\n' "$FAKE_SSH_NETNS" | tr ',' '\\n' | sed -n "s/^$host=//p")
    if [ -n "$ns" ]; then exec ip netns exec "$ns" sh -c "$*"; fi
    exec sh -c "$*"
    """)


def fake_ssh(folder: Path) -> Path:
    path = folder / "ssh"
    path.write_text(FAKE_SSH)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_launch(plan_path: Path, folder: Path, *extra: str, netns: str = "", timeout: float = 240.0):
    env = dict(os.environ, FAKE_SSH_LOG=str(folder / "ssh.log"), FAKE_SSH_NETNS=netns)
    env.pop("STAGEWISE_AUTH_TOKEN", None)
    cmd = [PY, "-m", "stagewise.cli", "launch", str(plan_path), "--ssh", "--ssh-command", str(fake_ssh(folder)),
           "--remote-command", f"{PY} -m stagewise.cli", "--json", "--connect-timeout", "120", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


# ---- torchrun -------------------------------------------------------------------------------------


def test_torchrun_environment_is_checked(monkeypatch):
    plan = plan_of([{"device": "cuda"}, {}])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"WORLD_SIZE is 3 but the plan has 2 processes \(2 stages"):
        torchrun_stage(plan, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--stage 1 disagrees with RANK 0"):
        torchrun_stage(plan, 1)
    plan0, index, rank = torchrun_stage(plan, None)
    assert (index, rank) == (0, 0) and plan0.stages[0].device == "cuda:3"
    # A stage of two TP ranks: RANK 1 is its second rank, RANK 2 the next stage's leader.
    tp_plan = plan.with_stage(0, tp=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    assert torchrun_stage(tp_plan, None)[1:] == (0, 1)
    monkeypatch.setenv("RANK", "2")
    assert torchrun_stage(tp_plan, None)[1:] == (1, 0)
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="RANK must be an integer"):
        torchrun_stage(plan, None)


def test_torchrun_refuses_a_stage_split_across_nodes(monkeypatch):
    """Two stages of tp 2 on nodes of 3 processes each: node 0 runs RANKs 0-2, so stage 1 (RANKs
    2-3) would straddle both nodes; nodes of 2 (or 4) hold whole stages."""
    plan = plan_of([{"tp": 2}, {"tp": 2}])
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank, local, per_node, ok in [(2, 2, 3, False), (3, 0, 1, False), (0, 0, 3, True), (1, 1, 3, True),
                                      (2, 0, 2, True), (3, 1, 2, True), (3, 3, 4, True)]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
        if ok:
            assert torchrun_stage(plan, None)[1:] == divmod(rank, 2)
        else:
            with pytest.raises(ValueError, match=r"stage 1 is RANKs 2-3, but this node runs RANKs .*must share a node"):
                torchrun_stage(plan, None)


def test_torchrun_stages_publish_their_addresses_in_the_store(tiny, tmp_path):
    model, ref = tiny
    plan_path = write_plan(tmp_path / "plan.json", model, [{"listen": "127.0.0.1:0"}, {"listen": "127.0.0.1:0"}])
    port = free_port()
    run = subprocess.Popen([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                            "--master-port", str(port), "-m", "stagewise.cli", "stage", "--plan", str(plan_path),
                            "--torchrun"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with Pipeline.attach(str(plan_path), store=f"127.0.0.1:{port}", connect_timeout=120) as pipe:
            [out] = pipe.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=8, ignore_eos=True)
        assert out.token_ids == ref
        log, _ = run.communicate(timeout=60)
        assert run.returncode == 0, log  # every stage exits cleanly on the driver's shutdown
        assert f"store at 127.0.0.1:{port}" in log
    finally:
        StageProcesses([run]).stop(grace_s=0.1)


def test_launch_over_ssh_on_this_machine(tiny, tmp_path):
    """Without namespaces (any user): two stages on loopback started through the fake ssh."""
    model, ref = tiny
    plan_path = write_plan(tmp_path / "plan.json", model, [{"listen": "127.0.0.1:0"}, {"listen": "127.0.0.1:0"}])
    done = run_launch(plan_path, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "8",
                      "--auth-token", TOKEN)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completions"][0]["token_ids"][:8] == ref
    log = (tmp_path / "ssh.log").read_text()
    # the preflight's two probes over ssh, then the two stages
    assert log.count("127.0.0.1 sh -c") == 4 and log.count("--probe") == 2 and TOKEN not in log
    assert "preflight: " in done.stderr


def test_stages_started_over_ssh_are_started_again_over_ssh_when_lost(tmp_path, monkeypatch):
    """What `stagewise launch --ssh --max-restarts 1` drives: stages started through "ssh" with
    --rejoin; when one dies mid-generation only it is started again, through ssh on its host, the
    other rejoins with its layers loaded, and the request ends with the undisturbed tokens."""
    import signal

    from helpers.processes import gone
    from stagewise.launch.start import REJOIN_ARGS, start_stages

    prompt = "The capital of France is"
    with Pipeline("smollm2-135m") as pipe:
        [ref] = pipe.generate([prompt], max_new_tokens=40, ignore_eos=True)
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    monkeypatch.setenv("FAKE_SSH_NETNS", "")
    plan = load_plan(write_plan(tmp_path / "plan.json", "smollm2-135m", [{"listen": "127.0.0.1:0"}] * 2))
    launcher = {"launcher": "ssh", "timeout_s": 120.0,
                "ssh": {"program": [PY, "-m", "stagewise.cli"], "ssh": [str(fake_ssh(tmp_path))]}}
    procs, plan, addresses = start_stages(plan, auth_token=TOKEN, extra=REJOIN_ARGS, **launcher)
    first = list(procs.pids)
    with Pipeline.attach(plan, addresses=addresses, auth_token=TOKEN, processes=procs, max_restarts=1,
                         launcher=launcher) as pipe:
        streamed = []

        def kill_stage_1(i, text):
            streamed.append(text)
            if len(streamed) == 10:
                os.kill(pipe.driver.processes.pids[1], signal.SIGKILL)

        [out] = pipe.generate([prompt], max_new_tokens=40, ignore_eos=True, on_text=kill_stage_1)
        assert len(streamed) >= 10 and pipe.restarts == 1
        assert out.finish_reason == "length" and out.token_ids == ref.token_ids, out.error
        now = list(pipe.driver.processes.pids)
        assert now[0] == first[0] and now[1] != first[1]
    log = (tmp_path / "ssh.log").read_text().splitlines()
    assert len(log) == 3 and all(line.startswith("127.0.0.1 sh -c") and "--rejoin" in line for line in log)
    assert "--stage 1" in log[2] and TOKEN not in "".join(log)
    assert gone(first + now)


def test_launch_reads_prompts_from_stdin_and_labels_each_answer(tiny, tmp_path):
    """Each stdin line is a prompt; its answer is printed under its line number (blank lines are
    skipped, their numbers kept); the plan's sampling section sets the defaults."""
    import shutil

    import tokenizers

    model = tmp_path / "model"
    shutil.copytree(tiny[0], model)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 101)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.save(str(model / "tokenizer.json"))
    plan_path = write_plan(tmp_path / "plan.json", str(model), [{"listen": "127.0.0.1:0"}, {"listen": "127.0.0.1:0"}],
                           sampling={"max_new_tokens": 3, "ignore_eos": True})
    env = dict(os.environ, FAKE_SSH_LOG=str(tmp_path / "ssh.log"), FAKE_SSH_NETNS="")
    env.pop("STAGEWISE_AUTH_TOKEN", None)
    done = subprocess.run([PY, "-m", "stagewise.cli", "launch", str(plan_path), "--ssh", "--ssh-command",
                           str(fake_ssh(tmp_path)), "--remote-command", f"{PY} -m stagewise.cli", "--connect-timeout",
                           "120"], input="w5 w6 w7\n\nw9\n", capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.split("--- ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["line 1", "line 3"]
    for b in blocks:
        assert len(b.splitlines()[1].split()) == 3  # three generated words, from the plan's max_new_tokens


# ---- network namespaces -----------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Namespaces:
    """``n`` network namespaces on a bridge in the root namespace (which holds the .1 address,
    for the driver); namespace i holds 10.77.X.(10 + i). Unique names per run; ``close`` removes
    everything."""

    def __init__(self, n: int) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"swbr{self.tag}"
        self.names = [f"sw{self.tag}n{i}" for i in range(n)]
        self.veths = [f"sw{self.tag}v{i}" for i in range(n)]
        used = _ip("-4", "addr").stdout
        subnet = next(x for x in range(77, 255) if f"10.77.{x}." not in used)
        self.prefix = f"10.77.{subnet}"
        self.addresses = [f"{self.prefix}.{10 + i}" for i in range(n)]
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, veth, address in zip(self.names, self.veths, self.addresses):
                _ip("netns", "add", name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{veth}p")
                _ip("-n", name, "link", "set", f"{veth}p", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def rx_bytes(self, i: int) -> int:
        """Bytes namespace i sent (received by the root-side end of its veth)."""
        return int(Path(f"/sys/class/net/{self.veths[i]}/statistics/rx_bytes").read_text())

    def close(self) -> None:
        for name, veth in zip(self.names, self.veths):
            _ip("link", "del", veth, check=False)
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' tool (iproute2) is not installed"
    probe = f"swprobe{secrets.token_hex(2)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"'ip netns add' fails here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def netns():
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    spaces = Namespaces(3)
    try:
        yield spaces
    finally:
        spaces.close()


SMOL_PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol_reference():
    with Pipeline("smollm2-135m", max_model_len=256) as pipe:
        [c] = pipe.generate([SMOL_PROMPT], chat=True, max_new_tokens=12)
    return c.token_ids


@pytest.fixture(scope="module")
def smol_stages(netns, tmp_path_factory):
    """SmolLM2 as 3 stages, stage i in namespace i listening on its own address, with a token."""
    folder = tmp_path_factory.mktemp("netns")
    stages = [{"host": a, "listen": f"{a}:7400", "threads": 1} for a in netns.addresses]
    plan_path = write_plan(folder / "plan.json", "smollm2-135m", stages, max_model_len=256)
    env = dict(os.environ, STAGEWISE_AUTH_TOKEN=TOKEN)
    procs = StageProcesses([subprocess.Popen(["ip", "netns", "exec", name, PY, "-m", "stagewise.cli", "stage",
                                              "--plan", str(plan_path), "--stage", str(i), "--die-with-parent"],
                                             env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
                            for i, name in enumerate(netns.names)])
    try:
        for i, proc in enumerate(procs.procs):
            assert read_address(proc, i, 120) == (netns.addresses[i], 7400)
        yield plan_path, procs
    finally:
        procs.stop(grace_s=0.5)


def test_namespaced_stages_refuse_a_driver_without_the_token(smol_stages):
    plan_path, procs = smol_stages
    with pytest.raises(HandshakeError, match="auth token"):
        Pipeline.attach(str(plan_path), connect_timeout=30)
    with pytest.raises(HandshakeError, match="auth token differs"):
        Pipeline.attach(str(plan_path), auth_token="not-" + TOKEN, connect_timeout=30)
    assert all(procs.exit_code(i) is None for i in range(3))  # refused drivers do not stop the stages


def test_three_namespaced_stages_equal_the_single_process_run(netns, smol_stages, smol_reference):
    plan_path, procs = smol_stages
    before = [netns.rx_bytes(i) for i in range(3)]
    with Pipeline.attach(str(plan_path), auth_token=TOKEN, connect_timeout=60,
                         processes=procs) as pipe:
        assert [s.listen for s in pipe.plan.stages] == [f"{a}:7400" for a in netns.addresses]
        [c] = pipe.generate([SMOL_PROMPT], chat=True, max_new_tokens=12)
        stages = pipe.last_stats["stages"]
    assert c.token_ids == smol_reference
    # Activations and tokens left each namespace through its veth (there is no other way out).
    for i in range(3):
        assert stages[i]["bytes_sent"] > 0
        assert netns.rx_bytes(i) - before[i] >= stages[i]["bytes_sent"], i
    for proc in procs.procs:
        assert proc.wait(timeout=30) == 0


def test_launch_over_ssh_into_namespaces(netns, tiny, tmp_path):
    """`stagewise launch --ssh`: each stage started through "ssh" into its host's namespace,
    listening on all interfaces at a free port, dialled at its host address."""
    model, ref = tiny
    hosts = netns.addresses[:2]
    plan_path = write_plan(tmp_path / "plan.json", model, [{"host": h, "listen": "0.0.0.0:0"} for h in hosts])
    mapping = ",".join(f"{h}={n}" for h, n in zip(hosts, netns.names))
    done = run_launch(plan_path, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "8",
                      "--auth-token", TOKEN, netns=mapping)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completions"][0]["token_ids"][:8] == ref
    log = (tmp_path / "ssh.log").read_text().splitlines()
    # each host twice: the preflight's probe, then its stage (the two of each run at once)
    assert sorted(line.split()[0] for line in log) == sorted(hosts * 2)
    assert sum("--probe" in line for line in log) == 2 and "preflight: " in done.stderr
