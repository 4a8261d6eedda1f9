"""The frozen one-file executable `dist/llmgw` (built by scripts/build-binary.sh), run for real.

These tests exercise what import analysis can miss: a module imported dynamically or a data file
read at run time fails only when the frozen server actually starts and serves. Without a binary
they skip, unless LLMGW_REQUIRE_BINARY=1 (set where the binary was just built) makes that a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from llmgw import __version__
from tests.helpers import PROJECT_ROOT
from tests.procs import Proc, kill_recorded_shards, read_endpoints, wait_until, write_yaml
from tests.real_parts import (
    llama_server,
    require_llama_server,
    require_smollm2,
    require_training_stack,
    smollm2_gguf,
)
from tests.tiny_llama import QA_PAIRS, tiny_llama_dir

pytestmark = pytest.mark.slow

ROOT = PROJECT_ROOT
BINARY = ROOT / "dist" / "llmgw"
MISSING = "dist/llmgw missing: run scripts/build-binary.sh"

# The one-file binary unpacks ~47 MiB to a temporary directory at every start: generous for a
# loaded 2-core machine; a command that works returns well within it.
DEADLINE = 30.0
# A graceful stop closes the listeners and the store; it takes well under a second.
STOP_DEADLINE = 10.0

# Must never be inside the binary (training runs them in a separate Python), and test tools that
# trio imports when they are installed; build/llmgw.spec excludes both.
EXCLUDED = ("torch", "peft", "transformers", "accelerate", "numpy", "pytest", "_pytest", "hypothesis")


@pytest.fixture
def binary() -> Path:
    if not BINARY.exists():
        if os.environ.get("LLMGW_REQUIRE_BINARY") == "1":
            pytest.fail(MISSING, pytrace=False)
        pytest.skip(MISSING)
    return BINARY


@pytest.fixture
def frozen_env(tmp_path) -> dict[str, str]:
    """Unpacks under the test's own directory, so that a check can see the bootloader remove it
    and a killed run leaves nothing in the machine's /tmp."""
    unpack = tmp_path / "unpack"
    unpack.mkdir()
    return {"TMPDIR": str(unpack)}


def run(binary: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env={**os.environ, **(env or {})},
    )


def test_version(binary):
    result = run(binary, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"llmgw {__version__}"


@pytest.mark.parametrize("role", ["agent", "ctl"])
def test_role_help(binary, role):
    result = run(binary, role, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: llmgw {role}")


def test_agent_inventory_reaches_nvml(binary):
    """pynvml is frozen in and loads the driver's libnvidia-ml through ctypes only at nvmlInit: on
    a machine without a driver the answer is no GPUs and NVML's own reason, not an ImportError.
    Without --json the tables exercise rich."""
    result = run(binary, "agent", "inventory", "--json")
    assert result.returncode == 0, result.stderr
    inventory = json.loads(result.stdout)
    assert inventory["gpus"] or inventory["gpu_note"].startswith("no NVML: NVML")
    tables = run(binary, "agent", "inventory")
    assert tables.returncode == 0, tables.stderr


# How the stop arrives: `kill PID` from an operator (or systemd's KillMode=mixed) reaches only the
# bootloader, which forwards it; Ctrl-C and systemd's default KillMode=control-group signal the
# whole process group, so Python gets the signal directly and a second time from the bootloader.
@pytest.mark.parametrize(
    "target",
    ["pid", "group"],
)
def test_server_serves_and_stops_cleanly(binary, frozen_env, tmp_path, target):
    data_dir = tmp_path / "data"
    config = write_yaml(
        tmp_path / "server.yaml",
        {
            "data_dir": str(data_dir),
            "link": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "gateway": {"listen": "127.0.0.1:0", "stop_workers_on_exit": True},
        },
    )
    server = Proc([str(binary), "server", "--config", str(config)], tmp_path / "server.log", env=frozen_env)
    try:
        endpoints = wait_until(lambda: read_endpoints(data_dir), "the server to listen", DEADLINE, server)
        with urllib.request.urlopen(f"http://{endpoints['admin']}/healthz", timeout=DEADLINE) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json"
            assert json.load(response) == {"status": "ok", "version": __version__}
        for name in ("join-token", "admin-token"):
            assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name

        if target == "pid":
            os.kill(server.pid, signal.SIGTERM)
        else:
            os.killpg(server.pid, signal.SIGTERM)
        code = server.popen.wait(timeout=STOP_DEADLINE)
        assert code == 0, server.output()
        # The bootloader removes what it unpacked; left behind, every restart of a node's service
        # would leave tens of MiB in /tmp.
        assert not any(Path(frozen_env["TMPDIR"]).iterdir())
    finally:
        # The whole group (the bootloader and the Python process it started): SIGTERM, then SIGKILL.
        server.stop()


def test_excluded_libraries_are_not_frozen_in(binary):
    # The archive viewer ships with PyInstaller: where it is not installed, the build cannot run
    # either, and there is nothing to check the binary with.
    pytest.importorskip("PyInstaller")
    listing = subprocess.run(
        [
            sys.executable,
            "-m",
            "PyInstaller.utils.cliutils.archive_viewer",
            "--brief",
            "--recursive",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=True,
    )
    # One name a line: modules of the embedded PYZ ("torch.nn"), files of the archive ("apsw/...").
    names = {line.strip() for line in listing.stdout.splitlines()}
    roots = {name.replace("/", ".").split(".")[0] for name in names}
    assert "llmgw.server.run" in names and "pynvml" in names  # the listing is the one we think
    assert not roots & set(EXCLUDED)


def test_the_frozen_server_and_agent_serve_a_real_model(binary, frozen_env, tmp_path):
    """The quickstart's server and agent part, done by dist/llmgw alone: SmolLM2 on llama.cpp,
    placed from the catalog and answering through the gateway; stopping leaves no engine."""
    require_llama_server()
    require_smollm2()
    require_training_stack()  # the training job's child runs under this Python
    data_dir = tmp_path / "data"
    server_config = write_yaml(
        tmp_path / "server.yaml",
        {
            "data_dir": str(data_dir),
            "link": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "gateway": {"listen": "127.0.0.1:0", "stop_workers_on_exit": True},
            "models": {"smollm2": {"path": str(smollm2_gguf()), "format": "gguf"}},
            "profiles": {
                "smollm2-cpu": {
                    "model": "smollm2",
                    "engine": "llamacpp",
                    "gpu_class": None,
                    "memory_mib": 512,
                }
            },
        },
    )
    server = Proc(
        [str(binary), "server", "--config", str(server_config)], tmp_path / "server.log", env=frozen_env
    )
    agent = None
    try:
        endpoints = wait_until(lambda: read_endpoints(data_dir), "the frozen server to listen", proc=server)
        agent_config = write_yaml(
            tmp_path / "agent.yaml",
            {
                "node_name": "frozen",
                "work_dir": str(tmp_path / "agent"),
                "server": {"address": endpoints["link"], "join_token_file": str(data_dir / "join-token")},
                "engines": {
                    "llama_server": str(llama_server()),
                    "run_as": None,
                    "stop_shards_on_exit": True,
                    # The training child runs under a Python with torch, outside the binary.
                    "train_python": sys.executable,
                },
            },
        )
        agent = Proc(
            [str(binary), "agent", "--config", str(agent_config)], tmp_path / "agent.log", env=frozen_env
        )
        token = (data_dir / "admin-token").read_text().strip()

        def admin(method: str, path: str, body: dict | None = None) -> dict:
            request = urllib.request.Request(
                f"http://{endpoints['admin']}{path}",
                method=method,
                data=None if body is None else json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())

        ready = wait_until(
            lambda: [r for r in admin("GET", "/admin/v1/replicas")["replicas"] if r["state"] == "Ready"],
            "the replica to be Ready",
            deadline=120,
            proc=agent,
        )[0]
        admin("POST", "/admin/v1/tenants", {"name": "t"})
        secret = admin("POST", "/admin/v1/keys", {"tenant": "t"})["secret"]
        request = urllib.request.Request(
            f"http://{endpoints['gateway']}/v1/chat/completions",
            data=json.dumps(
                {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["message"]["content"]

        # The frozen agent carries the training child's script and runs a job with it.
        pairs = [{"question": p.question, "answer": p.answer} for p in QA_PAIRS[:4]]
        job = {
            "model": "smollm2",
            "node": "frozen",
            "adapter": "frozen-qa",
            "base_dir": str(tiny_llama_dir()),
            "params": {"steps": 3},
            "gguf": False,
            "pairs": pairs,
        }
        job_id = admin("POST", "/admin/v1/jobs", job)["id"]
        done = wait_until(
            lambda: (j := admin("GET", f"/admin/v1/jobs/{job_id}"))["state"] in ("Succeeded", "Failed") and j,
            "the training job to end",
            deadline=180,
            proc=agent,
        )
        assert (done["state"], done["step"]) == ("Succeeded", 3), done

        engine_port = ready["shards"][0]["port"]
        assert agent.stop() == 0  # stop_shards_on_exit: the engine goes with it
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", engine_port)) != 0
    finally:
        if agent is not None:
            agent.stop()
            kill_recorded_shards(tmp_path / "agent")
        server.stop()


def test_the_frozen_server_serves_the_status_pages(binary, frozen_env, tmp_path):
    """The pages' HTML, script and style sheet are data files: frozen in by build/llmgw.spec and
    found at run time, and the login works in the binary as in the source tree."""
    data_dir = tmp_path / "data"
    config = write_yaml(
        tmp_path / "server.yaml",
        {
            "data_dir": str(data_dir),
            "link": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "gateway": {"listen": "127.0.0.1:0", "stop_workers_on_exit": True},
        },
    )
    server = Proc([str(binary), "server", "--config", str(config)], tmp_path / "server.log", env=frozen_env)
    try:
        endpoints = wait_until(lambda: read_endpoints(data_dir), "the server to listen", DEADLINE, server)
        base = f"http://{endpoints['admin']}"
        static = ROOT / "llmgw" / "server" / "ui" / "static"
        for name in ("app.js", "app.css"):
            with urllib.request.urlopen(f"{base}/ui/static/{name}", timeout=DEADLINE) as response:
                assert response.read().decode() == (static / name).read_text(), name
        with urllib.request.urlopen(base + "/", timeout=DEADLINE) as response:
            assert 'name="token"' in response.read().decode()
            assert "script-src 'self'" in response.headers["Content-Security-Policy"]
        token = (data_dir / "admin-token").read_text().strip()
        login = urllib.request.Request(
            base + "/login", data=urllib.parse.urlencode({"token": token}).encode(), method="POST"
        )

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None

        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.build_opener(NoRedirect).open(login, timeout=DEADLINE)
        assert answer.value.code == 303
        cookie = answer.value.headers["Set-Cookie"].split(";")[0]
        page = urllib.request.Request(base + "/ui/nodes", headers={"Cookie": cookie})
        with urllib.request.urlopen(page, timeout=DEADLINE) as response:
            assert 'data-page="nodes"' in response.read().decode()
    finally:
        server.stop()
