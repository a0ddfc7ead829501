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


def test_the_model_in_the_servers_process_leaves_a_core_to_the_http_loop_in_one_token_steps(monkeypatch):
    from stagewise.cli.serve import serving_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert serving_threads(_args()) == (3, (3, 4))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert serving_threads(_args()) == (1, None)
    # what the user says, stage processes (the cores shared out among them) and GPUs are left alone
    assert serving_threads(_args("--threads", "2")) == (2, None)
    assert serving_threads(_args("--stages", "2")) == (None, None)
    assert serving_threads(_args("--device", "cuda")) == (None, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert serving_threads(_args()) == (None, None)


def test_a_step_of_one_token_runs_on_its_own_thread_count():
    """The engine in this process with step threads (2, 3): a prompt's step and a decode of two rows
    run on 3 torch threads, a lone request's decode on 2; the tokens are those of the process's own
    setting."""
    import torch

    import stagewise
    from stagewise.engine.params import SamplingParams

    def run(pipe, step_threads=None):
        seen = []  # the threads of the step each request ended in
        r = pipe.open_run(on_done=lambda i, c: seen.append(torch.get_num_threads()))
        if step_threads is not None:
            r.backend.set_step_threads(*step_threads)
        for i, ids in enumerate([[1, 2, 3, 4], [5, 6]]):
            r.add(pipe.new_request_id(), i, ids, SamplingParams(max_new_tokens=3 + 2 * i))
        r.wait()
        return [r.results[i].token_ids for i in range(2)], seen

    before = torch.get_num_threads()
    try:
        with stagewise.Pipeline("smollm2-135m") as pipe:
            want, _ = run(pipe)
            got, seen = run(pipe, (2, 3))
        assert got == want
        assert seen == [3, 2]  # the first ended in a decode of both rows, the second decoding alone
    finally:
        torch.set_num_threads(before)
