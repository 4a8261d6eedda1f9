"""Real `llmgw` processes for tests: start them, wait for what they write, stop them by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

DEADLINE = 30.0


def llmgw_command() -> list[str]:
    return [sys.executable, "-m", "llmgw"]


class Proc:
    """A child in its own process group, with stdout+stderr going to a log file."""

    def __init__(
        self, args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
                cwd=cwd,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill9(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=DEADLINE)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it does not exit in time."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                return self.popen.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return self.popen.wait(timeout=DEADLINE)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.popen.wait(timeout=DEADLINE)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_until(condition, what: str, deadline: float = DEADLINE, proc: Proc | None = None):
    """Polls until ``condition()`` returns something truthy, and returns it."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.popen.returncode}:\n{proc.output()}")
        time.sleep(0.05)
    detail = f"\n--- log ---\n{proc.output()}" if proc is not None else ""
    raise AssertionError(f"timed out after {deadline}s waiting for {what}{detail}")


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def read_endpoints(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / "endpoints.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


class Server:
    def __init__(
        self,
        tmp: Path,
        *,
        link_port: int = 0,
        admin_port: int = 0,
        gateway_port: int = 0,
        reconcile: dict | None = None,
        gateway: dict | None = None,
        **link: object,
    ) -> None:
        self.tmp = tmp
        self.data_dir = tmp / "server-data"
        self.config = write_yaml(
            tmp / "server.yaml",
            {
                "data_dir": str(self.data_dir),
                "link": {"listen": f"127.0.0.1:{link_port}", **link},
                "admin": {"listen": f"127.0.0.1:{admin_port}"},
                # A test's server stops its gateway workers with it, unless the test says otherwise,
                # and runs one, whatever the machine's cores (tests that are about several ask).
                "gateway": {
                    "listen": f"127.0.0.1:{gateway_port}",
                    "stop_workers_on_exit": True,
                    "workers": 1,
                    **(gateway or {}),
                },
                **({"reconcile": reconcile} if reconcile else {}),
            },
        )
        self.proc: Proc | None = None
        self.endpoints: dict = {}

    def start(
        self, *, command: list[str] | None = None, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> Server:
        (self.data_dir / "endpoints.json").unlink(missing_ok=True)
        self.proc = Proc(
            [*(command or llmgw_command()), "server", "--config", str(self.config)],
            self.tmp / "server.log",
            env=env,
            cwd=cwd,
        )
        self.endpoints = wait_until(
            lambda: read_endpoints(self.data_dir), "the server to listen", proc=self.proc
        )
        return self

    @property
    def ctl_env(self) -> dict[str, str]:
        return {
            "LLMGW_SERVER": f"http://{self.endpoints['admin']}",
            "LLMGW_TOKEN": (self.data_dir / "admin-token").read_text().strip(),
            "LLMGW_CONTEXT": str(self.tmp / "no-context.json"),
        }

    def ctl(self, *args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*llmgw_command(), "ctl", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.ctl_env},
        )

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        """One admin API call with the admin token; the JSON answer."""
        request = urllib.request.Request(
            f"http://{self.endpoints['admin']}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.ctl_env['LLMGW_TOKEN']}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def nodes(self) -> dict[str, dict]:
        result = self.ctl("nodes", "--json")
        assert result.returncode == 0, result.stderr
        return {node["name"]: node for node in json.loads(result.stdout)["nodes"]}


def agent_config(tmp: Path, server: Server, name: str, **extra: object) -> Path:
    """agent-NAME.yaml for an agent of ``server`` (``extra``: more top-level sections). Its engines
    run as the test's own user unless ``engines`` names another: the tests' models and Pythons
    live in places only that user reads."""
    extra["engines"] = {"run_as": None, **(extra.get("engines") or {})}  # type: ignore[dict-item]
    return write_yaml(
        tmp / f"agent-{name}.yaml",
        {
            "node_name": name,
            "work_dir": str(tmp / f"agent-{name}"),
            "server": {
                "address": server.endpoints["link"],
                "join_token_file": str(server.data_dir / "join-token"),
            },
            "reconnect": {"initial_delay": "50ms", "max_delay": "500ms"},
            **extra,
        },
    )


def start_agent(tmp: Path, server: Server, name: str, **extra: object) -> Proc:
    config = agent_config(tmp, server, name, **extra)
    return Proc([*llmgw_command(), "agent", "--config", str(config)], tmp / f"agent-{name}.log")


def kill_recorded_shards(work_dir: Path) -> None:
    """Kills the process groups an agent's state files record under ``work_dir`` (by group, and
    only a group whose recorded process is still the one the agent started). For a test's
    ``finally``: an agent stopped without stop_shards_on_exit leaves its engines running."""
    from llmgw.agent import shard_state
    from llmgw.agent.processes import read_stat

    for _directory, record in shard_state.read_all(work_dir / "shards"):
        if isinstance(record, ValueError):
            continue
        for process in record.processes:
            stat = read_stat(process.pid)
            if stat is not None and stat.start_time == process.start_time:
                try:
                    os.killpg(process.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
