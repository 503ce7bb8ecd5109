"""Real Python child processes for tests that need a second owner, a SIGKILL, or a crash."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading

from tests.helpers.cli import REPO


class Child:
    """A `python -c` child whose stdout lines the test waits for."""

    def __init__(self, code: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump_stdout, daemon=True).start()

    def _pump_stdout(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of output

    @property
    def pid(self) -> int:
        return self.process.pid

    def read_line(self, timeout_s: float = 60.0) -> str:
        """The child's next stdout line; fails the test with its stderr if it exits or stalls."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            line = ""
        if not line:
            self.kill()
            raise AssertionError(f"child printed nothing within {timeout_s} s; stderr:\n{self.process.stderr.read()}")
        return line.strip()

    def kill(self) -> None:
        """SIGKILL and reap, so the pid is really gone (not a zombie) when this returns."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def finish(self, timeout_s: float = 60.0) -> str:
        """Wait for a clean exit and return the rest of stdout."""
        returncode = self.process.wait(timeout=timeout_s)
        assert returncode == 0, f"child failed ({returncode}):\n{self.process.stderr.read()}"
        lines = []
        while (line := self._lines.get(timeout=timeout_s)) != "":
            lines.append(line)
        return "".join(lines)
