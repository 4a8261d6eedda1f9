"""What the benchmarks that start real llmgw processes share: children in sessions of their own,
waiting for a condition while watching them, and private files.

Imported by the scripts beside it (``python scripts/bench_x.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

POLL_S = 0.25
# SIGTERM, then SIGKILL to the group: an agent stops its engines within its own stop grace.
STOP_GRACE_S = 30.0


class BenchError(Exception):
    """The bench cannot go on; the message says why (and where the logs are)."""


class Child:
    """A process in a session (and process group) of its own, its output in a log file."""

    def __init__(
        self, args: list[str], log: Path, *, user: str | None = None, env: dict | None = None
    ) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                user=user,
                env={**os.environ, **(env or {})},
                cwd="/" if user else None,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        """SIGTERM to its group (an agent then stops its engines), SIGKILL if it lingers."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=STOP_GRACE_S)
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=STOP_GRACE_S)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def wait_for(condition, what: str, deadline: float, watch: list[Child]):
    """Polls ``condition()`` until it returns something truthy (returned), until ``deadline``
    (a time.monotonic() value); fails early when a process in ``watch`` exits."""
    while time.monotonic() < deadline:
        try:
            value = condition()
        except OSError:  # not answering yet (urllib's errors are OSErrors)
            value = None
        if value:
            return value
        for child in watch:
            if not child.running():
                raise BenchError(f"{what}: {child.log.name} exited {child.popen.returncode}:\n{child.tail()}")
        time.sleep(POLL_S)
    raise BenchError(f"timed out waiting for {what}")


def write_private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def loopback_server_config(data_dir: Path, gateway: dict) -> dict:
    """server.yaml for a bench's own `llmgw server`: every listener on 127.0.0.1, any free port."""
    return {
        "data_dir": str(data_dir),
        "log_level": "warning",
        "link": {"listen": "127.0.0.1:0"},
        "admin": {"listen": "127.0.0.1:0"},
        "gateway": {"listen": "127.0.0.1:0", **gateway},
    }
