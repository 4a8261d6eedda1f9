"""A fleet on one machine: a real server and two real agents, each reading its GPUs from a
discovery.simulate file — registration with those GPUs and classes, the simulated marker in ctl,
a GPU profile placed on the simulated cards, NVML never imported, and a bad file refused."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_replicas_processes import fake_llama_server, replicas
from tests.helpers import TESTS
from tests.procs import (
    DEADLINE,
    Proc,
    Server,
    agent_config,
    kill_recorded_shards,
    llmgw_command,
    wait_until,
)

pytestmark = pytest.mark.slow

SIMULATED = TESTS / "fixtures" / "simulated"
L40S_MIB = 46068


def poisoned_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """PYTHONPATH with a pynvml that leaves a mark when imported (and then fails)."""
    modules = tmp / "poison"
    modules.mkdir()
    marker = tmp / "pynvml-imported"
    (modules / "pynvml.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\nraise ImportError('poisoned for the test')\n"
    )
    path = os.pathsep.join(filter(None, [str(modules), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path}, marker


def simulated_agent_config(tmp: Path, server: Server, name: str, simulate: Path, **extra: object) -> Path:
    return agent_config(tmp, server, name, discovery={"simulate": str(simulate)}, **extra)


def engine_ports() -> dict[str, int]:
    """A small range of engine ports starting at one the OS says is free: the default range
    (20000-) is where engines of other test runs and benchmarks on this machine listen."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    return {"engine_port_min": first, "engine_port_max": min(first + 20, 65535)}


def engine_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_two_simulated_nodes_register_and_take_a_gpu_profile(tmp_path: Path) -> None:
    server = Server(tmp_path, heartbeat_interval=0.3, reconcile=engine_ports()).start()
    env, pynvml_marker = poisoned_env(tmp_path)
    engines = {"llama_server": fake_llama_server(tmp_path), "run_as": None, "stop_grace": "2s"}
    simulations = {"a": SIMULATED / "h100-x2.yaml", "b": SIMULATED / "l40s-x4-roce.yaml"}
    agents = {
        name: Proc(
            [
                *llmgw_command(),
                "agent",
                "--config",
                str(simulated_agent_config(tmp_path, server, name, path, engines=engines)),
            ],
            tmp_path / f"agent-{name}.log",
            env=env,
        )
        for name, path in simulations.items()
    }
    try:

        def registered() -> dict[str, dict] | None:
            nodes = server.nodes()
            return nodes if all(nodes.get(name, {}).get("connected") for name in agents) else None

        nodes = wait_until(registered, "both agents to register")
        a, b = nodes["a"]["inventory"], nodes["b"]["inventory"]
        assert a["simulated"] is True and b["simulated"] is True
        assert [g["gpu_class"] for g in a["gpus"]] == ["h100-80g", "h100-80g"]
        assert [g["uuid"] for g in a["gpus"]] == ["GPU-sim-a-0", "GPU-a81c7e52-3f09-4d6a-b0e4-7c9d2f1e4001"]
        assert [g["memory_used_mib"] for g in a["gpus"]] == [0, 1024]
        assert [g["gpu_class"] for g in b["gpus"]] == ["l40s-45g"] * 4
        assert [g["uuid"] for g in b["gpus"]] == [f"GPU-sim-b-{i}" for i in range(4)]
        assert [g["problems"] for g in b["gpus"]] == [[], [], [], ["ecc-uncorrected"]]
        assert (a["fabric"], b["fabric"]) == ("", "roce-10.0.0")
        assert [p["device"] for p in b["ib_ports"]] == ["mlx5_0"]

        table = server.ctl("nodes")
        assert table.returncode == 0, table.stderr
        rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:] if line.strip()}
        assert "2× h100-80g (simulated)" in rows["a"]
        assert "4× l40s-45g (1 unhealthy) (simulated)" in rows["b"]
        shown = server.ctl("node", "show", "b")
        assert shown.returncode == 0, shown.stderr
        assert "simulated GPUs" in shown.stdout and "GPUs (simulated)" in shown.stdout

        # A profile for two L40S: only node b has them, and only three of its four are healthy.
        server.admin(
            "POST",
            "/admin/v1/catalog",
            {
                "models": [{"name": "tiny", "path": "/models/tiny.gguf", "format": "gguf"}],
                "profiles": [
                    {
                        "name": "l40s-pair",
                        "model": "tiny",
                        "engine": "llamacpp",
                        "gpu_class": "l40s-45g",
                        "gpus_per_node": 2,
                        "tensor_parallel": 2,
                        "memory_mib": 20000,
                        "min_replicas": 1,
                        "max_replicas": 1,
                    }
                ],
            },
        )
        ready = wait_until(
            lambda: [r for r in replicas(server, "l40s-pair") if r["state"] == "Ready"],
            "the l40s-pair replica to be Ready",
            deadline=2 * DEADLINE,
        )[0]
        (shard,) = ready["shards"]
        assert shard["node"] == "b"
        assert len(shard["gpu_indices"]) == 2 and 3 not in shard["gpu_indices"]
        pid = next(s["pid"] for s in server.nodes()["b"]["shards"] if s["replica_id"] == ready["id"])
        assert engine_environment(pid)["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, shard["gpu_indices"]))

        # Neither agent went near NVML, not for discovery, nor for the shard's accounting.
        assert not pynvml_marker.exists()
    finally:
        for proc in agents.values():
            proc.stop()
        server.proc.stop()
        # stop_shards_on_exit is off: whatever the agents leave running is killed by pid group.
        for name in agents:
            kill_recorded_shards(tmp_path / f"agent-{name}")


def test_an_agent_with_a_bad_simulation_file_exits_with_status_2(tmp_path: Path) -> None:
    server = Server(tmp_path).start()
    try:
        bad = tmp_path / "gpus.yaml"
        bad.write_text(
            'gpus:\n  - {name: "NVIDIA L40S", memory_mib: 46068, compute_capability: "8.9"}\n'
            '  - {name: "NVIDIA L40S", memory_mib: lots, compute_capability: "8.9"}\n'
        )
        config = simulated_agent_config(tmp_path, server, "bad", bad)
        result = subprocess.run(
            [*llmgw_command(), "agent", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert result.returncode == 2, result.stderr
        assert 'llmgw agent: gpus.yaml: gpus[1].memory_mib: expected an integer, got "lots"' in result.stderr
        assert "bad" not in server.nodes()
    finally:
        server.proc.stop()
