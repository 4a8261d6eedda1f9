"""A vLLM profile pinning a release, served by two real agents that install it themselves: each
node makes a virtual environment and fills it offline from a local wheelhouse (a stand-in package
under vLLM's name, tests/stand_in_engine.py), the install's progress shows on the replica, the
replicas run the environment's vLLM server (behind llmgw's key guard) as the unprivileged engine
user and become Ready; a profile pinning a release the wheelhouse lacks fails with pip's reason."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from llmgw.agent import shard_state
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until
from tests.stand_in_engine import build_wheel, venv_python

pytestmark = pytest.mark.slow

NODES = ("gpu-a", "gpu-b")
SIMULATED = Path(__file__).resolve().parent.parent / "fixtures" / "simulated" / "h100-x2.yaml"


def profile(name: str, version: str, replicas: int) -> dict:
    return {
        "name": name,
        "model": "big",
        "engine": "vllm",
        "engine_version": version,
        "gpu_class": "h100-80g",
        "gpus_per_node": 1,
        "memory_mib": 40000,
        "min_replicas": replicas,
        "max_replicas": replicas,
        "startup_timeout": 300,
    }


def replicas(server: Server, name: str) -> list[dict]:
    return [r for r in server.admin("GET", "/admin/v1/replicas")["replicas"] if r["profile"] == name]


def test_agents_install_a_pinned_vllm_offline_and_serve_it(tmp_path, engine_user):
    # Where the engines' user can reach the environments (pytest's tmp_path is root's alone).
    public = Path(tempfile.mkdtemp(prefix="llmgw-venvs-"))
    public.chmod(0o755)
    wheelhouse = tmp_path / "wheelhouse"
    build_wheel(tmp_path, "vllm", "0.33.0", wheelhouse)
    # A failed replica waits long before its restart: its reason is looked at in between.
    server = Server(tmp_path, heartbeat_interval=0.5, reconcile={"restart": {"initial_delay": "10m"}}).start()
    agents = {}
    try:
        for name in NODES:
            engines = {
                "run_as": engine_user,
                "stop_grace": "3s",
                "engines_dir": str(public / name),
                "venv_python": venv_python(),
                "python_find_links": str(wheelhouse),
            }
            agents[name] = start_agent(
                tmp_path, server, name, engines=engines, discovery={"simulate": str(SIMULATED)}
            )
        wait_until(lambda: all(server.nodes().get(n, {}).get("connected") for n in NODES), "both agents")
        server.admin(
            "POST",
            "/admin/v1/catalog",
            {
                "models": [{"name": "big", "path": "/models/big", "format": "safetensors"}],
                "profiles": [profile("v33", "0.33.0", 2)],
            },
        )

        def installing() -> str | None:
            for replica in replicas(server, "v33"):
                for shard in replica["shards"]:
                    if shard["reason"].startswith("installing vLLM 0.33.0: "):
                        return shard["reason"]
            return None

        wait_until(installing, "the install's progress on a replica", deadline=120)

        def settled(name: str, count: int):
            found = replicas(server, name)
            done = [r for r in found if r["state"] in ("Ready", "Failed")]
            return done if len(done) == count else None

        done = wait_until(lambda: settled("v33", 2), "both v33 replicas to be Ready", deadline=300)
        assert [r["state"] for r in done] == ["Ready", "Ready"], done

        # Every shard runs its node's environment's vLLM, as the engines' user.
        nodes_used = set()
        for name in NODES:
            for _directory, record in shard_state.read_all(tmp_path / f"agent-{name}" / "shards"):
                assert not isinstance(record, ValueError), record
                venv = public / name / "vllm-0.33.0" / "venv"
                # vLLM's server by module, behind llmgw's key guard, in that environment's Python.
                argv = record.processes[-1].argv
                assert argv[:2] == (str(venv / "bin" / "python"), "-c") and "--middleware" in argv, record
                assert (venv.parent / "installed.json").is_file()
                status = Path(f"/proc/{record.processes[-1].pid}/status").read_text()
                uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
                assert uid != "0"
                nodes_used.add(name)
        assert nodes_used, "no shard found"

        # A release the wheelhouse does not have: the replica fails with pip's reason.
        server.admin("POST", "/admin/v1/catalog", {"profiles": [profile("v34", "0.34.0", 1)]})
        (failed,) = wait_until(lambda: settled("v34", 1), "the v34 replica to fail", deadline=300)
        assert failed["state"] == "Failed", failed
        assert "engine install: vLLM 0.34.0: " in failed["reason"], failed
        assert "Could not find a version that satisfies the requirement vllm==0.34.0" in failed["reason"]
        shown = server.ctl("replicas")
        assert shown.returncode == 0 and "Could not find a version" in shown.stdout, shown.stdout
        assert not any((public / name / "vllm-0.34.0").exists() for name in NODES)
    finally:
        for name, agent in agents.items():
            agent.stop()
            kill_recorded_shards(tmp_path / f"agent-{name}")
        if server.proc is not None:
            server.proc.stop()
        shutil.rmtree(public, ignore_errors=True)
