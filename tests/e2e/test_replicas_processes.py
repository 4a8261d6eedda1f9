"""Replicas on a small fleet of real agents (one machine, separate work directories and node
names) running fake engines: placement with nobody naming a node, every candidate's reason when a
profile fits nowhere, and a node that goes silent having its replica reaped and placed elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmgw.agent.processes import read_stat
from tests.helpers import TESTS
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until

pytestmark = pytest.mark.slow

FAKE_ENGINE = TESTS / "fake_engine.py"


def fake_llama_server(tmp: Path, name: str = "llama-server", **knobs: str) -> str:
    """A llama-server stand-in; ``knobs`` are the fake engine's FAKE_ENGINE_* settings."""
    wrapper = tmp / name
    exports = "".join(f"export FAKE_ENGINE_{key.upper()}={value}\n" for key, value in knobs.items())
    wrapper.write_text(f'#!/bin/sh\n{exports}exec {sys.executable} {FAKE_ENGINE} "$@"\n')
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
    return [r for r in server.admin("GET", "/admin/v1/replicas")["replicas"] if r["profile"] == profile_name]


def test_replicas_are_placed_explained_and_reaped_on_a_silent_node(tmp_path):
    server = Server(tmp_path, heartbeat_interval=0.3, missed_heartbeats=3).start()
    engines = {"llama_server": fake_llama_server(tmp_path), "run_as": None, "stop_grace": "2s"}
    agents = {name: start_agent(tmp_path, server, name, engines=engines) for name in ("n1", "n2")}
    try:
        wait_until(lambda: all(server.nodes().get(n, {}).get("connected") for n in agents), "both agents")
        server.admin(
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
        shown = server.admin("GET", f"/admin/v1/replicas/{pending['id']}")
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


def test_an_engine_that_keeps_crashing_is_restarted_with_backoff_then_moved(tmp_path):
    restart = {"initial_delay": "200ms", "max_delay": "1s", "move_after": 2, "give_up_after": 10}
    # A liveness window (6 s) a starved agent on a loaded machine stays inside: a node that looked
    # lost for a moment would have the replica placed on n2 at once, and nothing would crash.
    server = Server(
        tmp_path, heartbeat_interval=0.3, missed_heartbeats=20, reconcile={"restart": restart}
    ).start()
    crashing = fake_llama_server(tmp_path, "crashing-llama-server", exit_after="0.3")
    healthy = fake_llama_server(tmp_path)
    agents = {
        # Packing breaks ties by name: the replica goes to n1 first, whose engine always crashes.
        "n1": start_agent(tmp_path, server, "n1", engines={"llama_server": crashing, "run_as": None}),
        "n2": start_agent(tmp_path, server, "n2", engines={"llama_server": healthy, "run_as": None}),
    }
    try:
        wait_until(lambda: all(server.nodes().get(n, {}).get("connected") for n in agents), "both agents")
        server.admin(
            "POST",
            "/admin/v1/catalog",
            {
                "models": [{"name": "tiny", "path": "/models/tiny.gguf", "format": "gguf"}],
                "profiles": [profile("flaky")],
            },
        )
        ready = wait_until(
            lambda: [r for r in replicas(server, "flaky") if r["state"] == "Ready"],
            "the replica to be Ready after moving",
        )[0]
        assert ready["shards"][0]["node"] == "n2"
        assert "n1" in ready["failed_nodes"] and ready["failures"] >= 2
        # It was started on n1 once, then restarted there after a backoff, before it moved.
        starts_on_n1 = agents["n1"].output().count("start shard")
        assert starts_on_n1 >= 2, agents["n1"].output()
        log = server.proc.output()
        # The backoff doubles: 0.2 s after the first failure, 0.4 s after the second.
        assert "starts again in 0.2 s (failure 1)" in log
        assert "starts again on other nodes in 0.4 s (failure 2)" in log
    finally:
        for proc in agents.values():
            proc.stop()
        server.proc.stop()
        for name in agents:
            kill_recorded_shards(tmp_path / f"agent-{name}")
