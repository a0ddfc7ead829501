"""`stagewise serve`'s arguments: every problem named at once, before the model loads; a port in
use said before seconds of loading."""

from __future__ import annotations

import socket

from stagewise.cli import main


def test_bad_arguments_are_named_at_once(capsys):
    code = main(["serve", "smollm2-135m", "--port", "70000", "--max-waiting", "-1", "--default-max-tokens", "0",
                 "--tp", "0", "--threads", "0", "--max-request-bytes", "0"])
    err = capsys.readouterr().err
    assert code == 2
    for what in ("--port must be in [0, 65535], got 70000", "--max-waiting must be >= 0, got -1",
                 "--default-max-tokens must be >= 1, got 0", "--tp must be >= 1, got 0", "--threads must be >= 1, got 0",
                 "--max-request-bytes must be >= 1, got 0"):
        assert what in err, err


def test_a_layout_the_model_cannot_take_is_named(capsys):
    assert main(["serve", "smollm2-135m", "--tp", "2"]) == 2
    assert "--tp 2" in capsys.readouterr().err


def test_a_port_in_use_is_said_before_loading(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "smollm2-135m", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_launch_serve_takes_no_prompts(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text('{"model": "smollm2-135m", "stages": [{"listen": "127.0.0.1:1"}]}')
    assert main(["launch", str(plan), "--serve", "--prompt", "hi"]) == 2
    assert "--serve answers HTTP requests" in capsys.readouterr().err


def _args(*argv):
    import argparse

    from stagewise.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["smollm2-135m", *argv])


def test_the_model_in_the_servers_process_leaves_a_core_to_the_http_loop(monkeypatch):
    from stagewise.cli.serve import serving_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert serving_threads(_args()) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert serving_threads(_args()) == 1
    # what the user says, stage processes (the cores shared out among them) and GPUs are left alone
    assert serving_threads(_args("--threads", "2")) == 2
    assert serving_threads(_args("--stages", "2")) is None
    assert serving_threads(_args("--device", "cuda")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert serving_threads(_args()) is None


def test_threads_is_the_stage_processes_with_a_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text('{"model": "smollm2-135m", "stages": [{"listen": "127.0.0.1:1"}]}')
    assert main(["serve", "--plan", str(plan), "--threads", "2"]) == 2
    assert "--threads is the stage processes'" in capsys.readouterr().err
