"""`stagewise serve`'s arguments: every problem named at once, before the model loads; a port in
use said before seconds of loading."""

from __future__ import annotations

import socket

from stagewise.cli import main


def test_bad_arguments_are_named_at_once(capsys):
    code = main(["serve", "smollm2-135m", "--port", "70000", "--max-waiting", "-1", "--default-max-tokens", "0",
                 "--tp", "0"])
    err = capsys.readouterr().err
    assert code == 2
    for what in ("--port must be in [0, 65535], got 70000", "--max-waiting must be >= 0, got -1",
                 "--default-max-tokens must be >= 1, got 0", "--tp must be >= 1, got 0"):
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
