"""The README's first command, as a new user runs it (in --check mode, so it ends by itself)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import pytest

from tests.helpers import PROJECT_ROOT
from tests.real_parts import require_llama_server, require_smollm2

ROOT = PROJECT_ROOT
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def real_parts():
    require_llama_server()
    require_smollm2()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_quickstart_serves_a_real_model_and_leaves_nothing_running(tmp_path):
    link_port, admin_port, gateway_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "LLMGW_HOME": str(tmp_path / "home"),
        "LLMGW_LINK_PORT": str(link_port),
        "LLMGW_ADMIN_PORT": str(admin_port),
        "LLMGW_GATEWAY_PORT": str(gateway_port),
        "LLMGW_CONTEXT": str(tmp_path / "context.json"),
    }
    for run in (1, 2):  # the second run reuses the store, the secrets and the node
        result = subprocess.run(
            ["scripts/quickstart.sh", "--check"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"run {run}:\n{result.stdout}\n{result.stderr}"
        assert "NAME" in result.stdout and "online" in result.stdout, result.stdout
        assert "Ready" in result.stdout and "smollm2-cpu" in result.stdout, result.stdout
        answer = re.search(r"^A: (.+)$", result.stdout, re.MULTILINE)
        assert answer and answer.group(1).strip(), result.stdout
        # Nothing left listening: the engine, the agent and the server were all stopped.
        assert refused(link_port) and refused(admin_port) and refused(gateway_port) and refused(20000)

    # One API key, made by the first run and reused by the second, kept 0600.
    key_file = tmp_path / "home" / "api-key"
    assert key_file.read_text().startswith("llmgw-") and (key_file.stat().st_mode & 0o777) == 0o600
    context = json.loads((tmp_path / "context.json").read_text())
    assert context["server"] == f"http://127.0.0.1:{admin_port}"
    server_log = (tmp_path / "home" / "logs" / "server.log").read_text()
    assert server_log.count("llmgw server up") == 2
    assert server_log.count("SIGTERM: stopping") == 2
