"""Replicas on a small fleet of real agents (one machine, separate work directories and node
names) running fake engines: placement with nobody naming a node, every candidate's reason when a
profile fits nowhere, and a node that goes silent having its replica reaped and placed elsewhere."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from llmgw.agent.processes import read_stat
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until

pytestmark = pytest.mark.slow

FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def admin(server: Server, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"http://{server.endpoints['admin']}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {server.ctl_env['LLMGW_TOKEN']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def fake_llama_server(tmp: Path) -> str:
    wrapper = tmp / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_ENGINE} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def profile(name: str, **fields: object) -> dict:
    return {
        "name": name,
        "model": "tiny",
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 256,
        "cpu_cores": 1,
        "min_replicas": 1,
        "max_replicas": 1,
        **fields,
    }


def replicas(server: Server, profile_name: str) -> list[dict]:
    return [r for r in admin(server, "GET", "/admin/v1/replicas")["replicas"] if r["profile"] == profile_name]


def test_replicas_are_placed_explained_and_reaped_on_a_silent_node(tmp_path):
    server = Server(tmp_path, heartbeat_interval=0.3, missed_heartbeats=3).start()
    engines = {"llama_server": fake_llama_server(tmp_path), "run_as": None, "stop_grace": "2s"}
    agents = {name: start_agent(tmp_path, server, name, engines=engines) for name in ("n1", "n2")}
    try:
        wait_until(lambda: all(server.nodes().get(n, {}).get("connected") for n in agents), "both agents")
        admin(
            server,
            "POST",
            "/admin/v1/catalog",
            {
                "models": [{"name": "tiny", "path": "/models/tiny.gguf", "format": "gguf"}],
                "profiles": [
                    profile("cpu-chat"),
                    # No node has this GPU: it stays Pending with every node's reason.
                    profile("big", engine="vllm", gpu_class="h100-80g", gpus_per_node=1, memory_mib=70000),
                ],
            },
        )
        ready = wait_until(
            lambda: [r for r in replicas(server, "cpu-chat") if r["state"] == "Ready"], "the cpu-chat replica"
        )[0]
        first_node = ready["shards"][0]["node"]

        pending = wait_until(lambda: replicas(server, "big"), "the big replica's record")[0]
        shown = admin(server, "GET", f"/admin/v1/replicas/{pending['id']}")
        assert shown["state"] == "Pending"
        assert {c["node"]: c["reason"] for c in shown["candidates"]} == {
            "n1": "no h100-80g GPUs",
            "n2": "no h100-80g GPUs",
        }
        listing = server.ctl("replicas")
        assert listing.returncode == 0, listing.stderr
        assert (
            "Pending" in listing.stdout
            and "Ready" in listing.stdout
            and f"{first_node}: cpu" in listing.stdout
        )
        detail = server.ctl("replica", "show", pending["id"])
        assert "no h100-80g GPUs" in detail.stdout and "n1" in detail.stdout and "n2" in detail.stdout

        # The node running it goes silent — the agent and its engines gone, like a machine that
        # died: the replica is reaped and placed on the other node.
        agents[first_node].kill9()
        kill_recorded_shards(tmp_path / f"agent-{first_node}")
        other = "n2" if first_node == "n1" else "n1"
        moved = wait_until(
            lambda: [
                r
                for r in replicas(server, "cpu-chat")
                if r["state"] == "Ready" and r["shards"][0]["node"] == other
            ],
            "the replica to be Ready on the other node",
        )[0]
        assert moved["id"] != ready["id"]
        assert server.nodes()[first_node]["state"] == "lost"
        assert len(replicas(server, "cpu-chat")) == 1  # the reaped one is gone, not doubled
        pid = next(s["pid"] for s in server.nodes()[other]["shards"] if s["replica_id"] == moved["id"])
        assert read_stat(pid) is not None
    finally:
        for proc in agents.values():
            proc.stop()
        server.proc.stop()
        for name in agents:
            kill_recorded_shards(tmp_path / f"agent-{name}")
