"""`stagewise launch PLAN --serve`: the stages of a run plan on this machine, started by `launch`
itself, answer HTTP requests through the driver with the tokens `Pipeline.generate` gives in one
process, and stop with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from helpers.processes import children, gone  # noqa: E402
from stagewise.api import Pipeline  # noqa: E402

PY = sys.executable


def test_launch_serve_answers_with_the_single_process_tokens(tmp_path):
    prompt = "The capital of France is"
    with Pipeline("smollm2-135m") as pipe:
        [want] = pipe.generate([prompt], max_new_tokens=6)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "smollm2-135m", "stages": [
        {"host": "127.0.0.1", "listen": "127.0.0.1:0"}, {"host": "127.0.0.1", "listen": "127.0.0.1:0"}]}))
    env = dict(os.environ)
    env.pop("STAGEWISE_AUTH_TOKEN", None)
    launch = subprocess.Popen([PY, "-m", "stagewise.cli", "launch", str(plan), "--serve", "--port", "0",
                               "--log-level", "warning", "--connect-timeout", "120"],
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    stages: list[int] = []
    try:
        url = None
        deadline = time.monotonic() + 180
        lines = []
        while url is None and time.monotonic() < deadline:
            line = launch.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " on http://" in line:
                url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
        stages = children(launch.pid)
        assert url and len(stages) == 2, "".join(lines)  # both stages started by launch, none by hand
        assert not any(line.startswith("stagewise stage ") for line in lines), "".join(lines)
        threading.Thread(target=launch.stderr.read, daemon=True).start()
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        os.killpg(launch.pid, signal.SIGINT)
        launch.wait(timeout=30)
        assert gone(stages, timeout=20), "the stages did not stop with the driver"
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
