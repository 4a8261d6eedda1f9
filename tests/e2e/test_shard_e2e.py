"""A real llama.cpp replica through the whole chain: catalog → reconciler → link → agent →
supervisor → engine.

A profile in the catalog becomes a replica without anyone naming a node; the engine serves SmolLM2
with its replica's key and refuses requests without it. The agent is killed with -9 and started
again: the same engine process is adopted and Ready again. The server is killed with -9 and
started again: it rebuilds the replica from the agent's report, and the engine — never restarted —
still serves. Scaled to zero, the replica drains and nothing of it is left.
"""

from __future__ import annotations

import json
import pwd
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmgw.agent.processes import read_stat
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until
from tests.real_parts import llama_server, require_llama_server, require_smollm2, smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def public_parts():
    """llama-server (with its libraries) and the model, copied where the unprivileged engine
    user can reach them: the checkout may sit under a directory only root may enter."""
    require_llama_server()
    require_smollm2()
    root = Path(tempfile.mkdtemp(prefix="llmgw-e2e-"))
    root.chmod(0o755)
    try:
        shutil.copytree(llama_server().parent, root / "bin", symlinks=True)
        shutil.copyfile(smollm2_gguf(), root / "smollm2.gguf")
        (root / "smollm2.gguf").chmod(0o644)
        yield root / "bin" / "llama-server", root / "smollm2.gguf"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# One SmolLM2 replica on the CPU, placed by the reconciler (the store-move test starts the same).
PROFILE = {
    "name": "smollm2-cpu",
    "model": "smollm2",
    "engine": "llamacpp",
    "gpu_class": None,
    "memory_mib": 512,
    "cpu_cores": 1,
    "ctx_size": 2048,
    "parallel": 2,
    "min_replicas": 1,
    "max_replicas": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(port: int, key: str | None) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(
            {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        ).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["message"]["content"]
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def shard_view(server: Server, node: str, shard_id: str) -> dict | None:
    shards = {s["shard_id"]: s for s in server.admin("GET", f"/admin/v1/nodes/{node}")["shards"]}
    return shards.get(shard_id)


def alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.alive


def what_happened(tmp_path: Path, server: Server, agent) -> str:
    """The agent's log, the engine's output and the server's events: why a shard is not what the
    test expected, on a machine whose files are gone by the time anyone reads the failure."""
    parts = [f"--- agent log ---\n{agent.output()[-6000:]}"]
    for out in sorted(tmp_path.glob("agent-*/shards/*/*.out")):
        parts.append(f"--- {out.name} ---\n{out.read_text(errors='replace')[-4000:]}")
    try:
        events = server.admin("GET", "/admin/v1/events")["events"]
    except OSError as exc:
        events = [f"(events unreadable: {exc})"]
    parts.append("--- server events ---\n" + "\n".join(map(str, events[-30:])))
    return "\n".join(parts)


def replicas(server: Server) -> list[dict]:
    return server.admin("GET", "/admin/v1/replicas")["replicas"]


def ready_replica(server: Server) -> dict | None:
    ready = [r for r in replicas(server) if r["state"] == "Ready"]
    return ready[0] if ready else None


def test_llamacpp_replica_placed_survives_agent_and_server_kills_and_stops(
    tmp_path, public_parts, engine_user
):
    binary, model = public_parts
    # A liveness window (10 s) longer than a new agent process takes to start and register on
    # a loaded machine: the kill -9 below must be a disconnect, never a lost node.
    server = Server(tmp_path, heartbeat_interval=0.5, missed_heartbeats=20).start()
    engines = {"llama_server": str(binary), "run_as": engine_user, "stop_grace": "5s"}
    agent = start_agent(tmp_path, server, "cpu-1", engines=engines)
    engine_pid = 0
    try:
        wait_until(lambda: server.nodes().get("cpu-1", {}).get("connected"), "the agent", proc=agent)
        catalog = {
            "models": [{"name": "smollm2", "path": str(model), "format": "gguf"}],
            "profiles": [PROFILE],
        }
        asked = time.monotonic()
        server.admin("POST", "/admin/v1/catalog", catalog)
        # The reconciler places it (nobody names a node), the agent starts it, it loads.
        replica = wait_until(
            lambda: ready_replica(server), "the replica to be Ready", deadline=120, proc=agent
        )
        print(f"\ncatalog apply -> replica Ready: {time.monotonic() - asked:.2f}s")
        (shard,) = replica["shards"]
        assert shard["node"] == "cpu-1"
        # What it computes on is learned just after Ready: the CPU, since it holds no GPU memory.
        wait_until(
            lambda: ready_replica(server)["shards"][0]["compute"] == {"gpus": []}, "the replica's compute"
        )
        engine_pid = shard_view(server, "cpu-1", shard["shard_id"])["pid"]
        port = shard["port"]

        # The engine runs as the unprivileged user, with its key in the environment only.
        status = Path(f"/proc/{engine_pid}/status").read_text()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        assert int(uid) == pwd.getpwnam(engine_user).pw_uid
        key = server.admin("GET", f"/admin/v1/replicas/{replica['id']}/engine-key")["key"]
        assert key.encode() not in Path(f"/proc/{engine_pid}/cmdline").read_bytes()
        assert chat(port, key) == 200
        assert chat(port, None) == 401
        assert chat(port, "not-the-key") == 401
        started_at = read_stat(engine_pid).start_time

        # The same replica through the gateway, with the official OpenAI SDK and an llmgw API key.
        server.admin("POST", "/admin/v1/tenants", {"name": "acme", "limits": {"rpm": 100}})
        secret = server.admin("POST", "/admin/v1/keys", {"tenant": "acme", "models": ["smollm2"]})["secret"]
        gateway = f"http://{server.endpoints['gateway']}/v1"
        client = openai.OpenAI(base_url=gateway, api_key=secret, max_retries=0, timeout=60)
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert all(c.usage is None for c in chunks)  # the usage chunk llmgw asked for is stripped
        assert [m.id for m in client.models.list()] == ["smollm2"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway, api_key="llmgw-k-00000000-nope", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        # Every request left a usage record for the tenant.
        summary = wait_until(
            lambda: [
                row
                for row in server.admin("GET", "/admin/v1/usage?by=tenant,model")["usage"]
                if row["tenant"] == "acme" and row["requests"] >= 2
            ],
            "the usage records",
        )
        assert summary[0]["model"] == "smollm2" and summary[0]["completion_tokens"] > 0

        # kill -9 the agent: the engine keeps serving; a new agent adopts the same process.
        now = shard_view(server, "cpu-1", shard["shard_id"])
        assert now and now["pid"] == engine_pid and now["state"] == "Ready", what_happened(
            tmp_path, server, agent
        )
        agent.kill9()
        assert alive(engine_pid), what_happened(tmp_path, server, agent)
        restarted = time.monotonic()
        agent = start_agent(tmp_path, server, "cpu-1", engines=engines)
        wait_until(lambda: server.nodes()["cpu-1"]["connected"], "the agent to come back", proc=agent)
        registered = time.monotonic()
        adopted = wait_until(
            lambda: (
                (s := shard_view(server, "cpu-1", shard["shard_id"]))
                and s["state"] == "Ready"
                and s["adopted"]
                and s
            ),
            "the adopted shard to be Ready",
            proc=agent,
        )
        print(
            f"agent restart -> adopted Ready: {time.monotonic() - restarted:.2f}s "
            f"({time.monotonic() - registered:.2f}s after it registered)"
        )
        assert time.monotonic() - registered < 2.0 + 1.0  # + this test's polling of the API
        assert adopted["pid"] == engine_pid
        # The node was disconnected for a moment, never lost: its replica was not reaped.
        assert "Reap" not in server.proc.output()

        # kill -9 the server: restarted, it rebuilds the replica from the agent's report.
        link_port = int(server.endpoints["link"].rsplit(":", 1)[1])
        admin_port = int(server.endpoints["admin"].rsplit(":", 1)[1])
        server.proc.kill9()
        server = Server(tmp_path, link_port=link_port, admin_port=admin_port, heartbeat_interval=0.5).start()
        rebuilt = wait_until(lambda: ready_replica(server), "the replica to be rebuilt", proc=agent)
        assert rebuilt["id"] == replica["id"]
        assert shard_view(server, "cpu-1", shard["shard_id"])["pid"] == engine_pid
        assert read_stat(engine_pid).start_time == started_at  # never restarted
        assert chat(port, key) == 200

        # Scaled to zero: the replica drains and stops, and no process of the shard is left.
        server.admin("POST", "/admin/v1/profiles/smollm2-cpu/scale", {"replicas": 0})
        wait_until(lambda: not alive(engine_pid), "the engine to stop", deadline=90)
        members = [
            p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == engine_pid
        ]
        assert members == []
        wait_until(lambda: replicas(server) == [], "the replica record to go")
        assert f"DrainReplica {replica['id']}" in server.proc.output()  # drained, not killed
        assert "drain shard" in agent.output()
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-cpu-1")  # a failed test must not leave engines behind


def _pgid(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.pgrp if stat is not None and stat.alive else None
