"""`stagewise serve` started as a user starts it, for the tests that talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx


class Served:
    """`stagewise serve smollm2-135m --stages 2 ...` in its own process group, and a client."""

    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "serve", "smollm2-135m", "--stages", "2",
                                      "--port", "0", "--max-num-seqs", "16", "--log-level", "warning", *extra],
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log, url = [], None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if " on http://" in line:
                url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
        if url is None:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()
        self.client = httpx.Client(base_url=url, timeout=60)
        while self.client.get("/health").status_code != 200:
            time.sleep(0.1)

    def _drain(self) -> None:  # the pipe never fills; its lines are kept
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
