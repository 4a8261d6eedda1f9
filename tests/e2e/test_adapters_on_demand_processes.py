"""Adapters loaded on demand, through the real server and agent processes: a vLLM profile with
max_loaded_adapters on two replicas of the fake engine (its run-time LoRA API, with a load delay
and a failing adapter) — 50 concurrent first requests load a cold adapter once, a failed load
fails its requests with the engine's reason and is retried by the next request only, no adapter
is unloaded under a request, and a restarted server relearns what the engines hold instead of
loading it again, nor after the agent restarts."""

from __future__ import annotations

import json
import random
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmgw.agent import shard_state
from tests.e2e.test_adapter_delivery_processes import MODEL, keep_adapter
from tests.helpers import TESTS
from tests.procs import Proc, Server, agent_config, kill_recorded_shards, llmgw_command, wait_until

pytestmark = pytest.mark.slow

FAKE_ENGINE = TESTS / "fake_engine.py"
SIMULATED = TESTS / "fixtures" / "simulated"
ADAPTERS = [f"a{i}" for i in range(10)]


def engine_port_range(size: int = 10) -> dict[str, int]:
    """Engine ports of this test's own, below the kernel's ephemeral range (where a client
    socket could take one between the check and the engine's bind) and away from the default
    range other runs' engines use: ``size`` ports free now, from a random start."""
    rng = random.Random()
    for _ in range(100):
        first = rng.randrange(21000, 32000)
        try:
            for port in range(first, first + size):
                with socket.socket() as sock:
                    sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        return {"engine_port_min": first, "engine_port_max": first + size - 1}
    raise AssertionError("no free engine port range")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_engine(tmp: Path, **knobs: str) -> str:
    """vLLM's `vllm serve ...` or SGLang's `python -m sglang.launch_server ...`, faked."""
    wrapper = tmp / "fake-engine"
    exports = "".join(f"export FAKE_ENGINE_{key.upper()}={value}\n" for key, value in knobs.items())
    wrapper.write_text(f'#!/bin/sh\n{exports}exec {sys.executable} {FAKE_ENGINE} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def catalog(engine: str) -> dict:
    return {
        "models": [{"name": MODEL, "path": "/models/tiny", "format": "safetensors"}],
        "profiles": [
            {
                "name": "lora",
                "model": MODEL,
                "engine": engine,
                "gpu_class": "h100-80g",
                "gpus_per_node": 1,
                "memory_mib": 20000,
                "parallel": 64,
                "min_replicas": 2,
                "max_replicas": 2,
                "max_loaded_adapters": 3,
                "adapters": [
                    *({"name": name, "path": f"/srv/adapters/{name}"} for name in ADAPTERS),
                    # A stored adapter (as ctl train leaves one): delivered to the node first.
                    {"name": "qa-lora", "source": "qa"},
                ],
            }
        ],
    }


def ready_replicas(server: Server) -> list[dict]:
    listed = server.admin("GET", "/admin/v1/replicas")["replicas"]
    ready = [r for r in listed if r["profile"] == "lora" and r["state"] == "Ready"]
    return ready if len(ready) == 2 else []


def engine_state(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/fake/adapters", timeout=10) as answer:
        return json.loads(answer.read())


def complete(gateway: str, secret: str, model: str) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{gateway}/v1/completions",
        data=json.dumps({"model": model, "prompt": "hi", "max_tokens": 4}).encode(),
        headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def engine_listing(port: int, server: Server) -> list[dict]:
    """The engine's /v1/models, with its key (the admin API's engine key of the replica)."""
    for replica in server.admin("GET", "/admin/v1/replicas")["replicas"]:
        if replica["shards"] and replica["shards"][0]["port"] == port:
            key = server.admin("GET", f"/admin/v1/replicas/{replica['id']}/engine-key")["key"]
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                return json.loads(answer.read())["data"]
    raise AssertionError(f"no replica on port {port}")


def loads_of(ports: list[int], adapter: str, kind: str = "load") -> int:
    return sum(1 for port in ports for event in engine_state(port)["events"] if event == [kind, adapter])


# In the server's process, and in two gateway workers: each asks the server, which loads once.
# SGLang's endpoints are its own (no /v1), its flags too.
@pytest.mark.parametrize(("engine", "workers"), [("vllm", 0), ("vllm", 2), ("sglang", 0)])
def test_adapters_load_once_on_demand_fail_with_the_engines_reason_and_are_relearned(
    tmp_path: Path, engine: str, workers: int
):
    ports = {"link_port": free_port(), "admin_port": free_port(), "gateway_port": free_port()}
    # The default heartbeat: 50 concurrent clients on a loaded 2-core machine must not make the
    # node look lost. Engine ports of its own: other runs' engines listen in the default range.
    server = Server(tmp_path, gateway={"workers": workers}, reconcile=engine_port_range(), **ports)
    keep_adapter(server.data_dir, "qa")
    server.start()
    engines = {
        # The binary the engine's descriptor runs: `vllm`, or the `python` that has sglang.
        "vllm" if engine == "vllm" else "python": fake_engine(
            tmp_path, lora_load_delay="1.0", response_delay="0.3", lora_fail="a9"
        ),
        "run_as": None,
        "stop_grace": "2s",
    }
    config = agent_config(
        tmp_path, server, "n1", discovery={"simulate": str(SIMULATED / "h100-x2.yaml")}, engines=engines
    )
    agent = Proc([*llmgw_command(), "agent", "--config", str(config)], tmp_path / "agent-n1.log")
    try:
        server.admin("POST", "/admin/v1/catalog", catalog(engine))
        replicas = wait_until(lambda: ready_replicas(server), "two Ready replicas", proc=server.proc)
        engine_ports = [r["shards"][0]["port"] for r in replicas]
        server.admin("POST", "/admin/v1/tenants", {"name": "t"})
        secret = server.admin("POST", "/admin/v1/keys", {"tenant": "t"})["secret"]
        gateway = server.endpoints["gateway"]
        # The engines were started for run-time loading, holding nothing, with room for the
        # highest rank the stored adapter's config says (r 8).
        assert all(engine_state(port)["held"] == [] for port in engine_ports)
        records = [r for _, r in shard_state.read_all(tmp_path / "agent-n1" / "shards")]
        assert len(records) == 2
        for record in records:
            argv = record.processes[-1].argv
            assert argv[argv.index("--max-lora-rank") + 1] == "8"
            assert "--max-loras" in argv if engine == "vllm" else "--max-loaded-loras" in argv

        # 50 concurrent first requests for one cold adapter: one load, every request answered.
        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda _: complete(gateway, secret, "a0"), range(50)))
        assert [status for status, _ in answers] == [200] * 50, [a for a in answers if a[0] != 200][:3]
        assert loads_of(engine_ports, "a0") == 1

        # Every adapter, several at a time, over 2 × 3 slots: loads and LRU unloads, never one
        # under a request in flight.
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda name: complete(gateway, secret, name), ADAPTERS[:9] * 2))
        assert [status for status, _ in answers] == [200] * 18, [a for a in answers if a[0] != 200][:3]
        states = [engine_state(port) for port in engine_ports]
        assert all(len(state["held"]) <= 3 for state in states)
        assert [v for state in states for v in state["violations"]] == []
        assert sum(1 for state in states for e in state["events"] if e[0] == "unload") >= 3

        # A stored adapter: its files reach the node, and the engine loads the node's copy.
        status, body = complete(gateway, secret, "qa-lora")
        assert status == 200, body
        (root,) = [
            entry["root"]
            for port in engine_ports
            for entry in engine_listing(port, server)
            if entry["id"] == "qa-lora"
        ]
        assert Path(root).parent == tmp_path / "agent-n1" / "adapters" and Path(root).name.startswith("qa-")
        assert (Path(root) / "adapter_config.json").exists()

        # A load the engine refuses: the request gets its reason; only the next request retries.
        status, body = complete(gateway, secret, "a9")
        assert status == 502 and "No adapter found" in body, body
        assert loads_of(engine_ports, "a9", "load-failed") == 1
        status, body = complete(gateway, secret, "a9")
        assert status == 502 and loads_of(engine_ports, "a9", "load-failed") == 2

        # The server restarts; the engines keep what they hold, and it learns that from them.
        held = {port: engine_state(port)["held"] for port in engine_ports}
        loads_before = sum(1 for port in engine_ports for e in engine_state(port)["events"] if e[0] == "load")
        server.proc.stop()
        server.start()
        wait_until(lambda: ready_replicas(server), "the replicas adopted again", proc=server.proc)
        some = next(name for names in held.values() for name in names)
        wait_until(
            lambda: complete(gateway, secret, some)[0] == 200, f"{some} served again", proc=server.proc
        )
        loads_after = sum(1 for port in engine_ports for e in engine_state(port)["events"] if e[0] == "load")
        assert loads_after == loads_before, "an adapter the engines held was loaded again"
        assert {port: engine_state(port)["held"] for port in engine_ports} == held

        # The agent dies and comes back, adopting its engines: every adapter they hold is
        # served again without a load.
        agent.kill9()
        agent = Proc([*llmgw_command(), "agent", "--config", str(config)], tmp_path / "agent-n1-again.log")
        wait_until(lambda: server.nodes().get("n1", {}).get("connected"), "the agent back", proc=agent)
        wait_until(lambda: ready_replicas(server), "the replicas Ready again", proc=server.proc)
        for name in sorted({name for names in held.values() for name in names}):
            status, body = complete(gateway, secret, name)
            assert status == 200, body
        loads_now = sum(1 for port in engine_ports for e in engine_state(port)["events"] if e[0] == "load")
        assert loads_now == loads_before, "an adapter the engines held was loaded again"
    finally:
        agent.stop()
        if server.proc is not None:
            server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-n1")
