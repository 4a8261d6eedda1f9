"""The move from SQLite to PostgreSQL under a running fleet, with a real llama.cpp replica.

A server on SQLite places SmolLM2 on an agent's node; a tenant's key chats through the gateway.
The server is stopped (its agent and engine keep running), `llmgw server store copy` moves the
store into a real PostgreSQL, and the server starts again on it from the same data_dir. The agent
reconnects and the very engine process started before the move (same pid, same start time) is
adopted: its key was derived from the store's secret, which moved with the data, so the gateway
of the server on the new store still gets 200 from it with the same API key.
"""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
import trio
import yaml

from llmgw.agent.processes import read_stat
from llmgw.server.store import open_store
from tests.e2e.test_shard_e2e import PROFILE, chat, public_parts, ready_replica, shard_view, what_happened
from tests.helpers import PROJECT_ROOT
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml

pytestmark = pytest.mark.slow

__all__ = ["public_parts"]  # a fixture, imported for pytest

CATALOG = {"profiles": [PROFILE]}


async def tenants_in(data_dir, url: str, password: str) -> list[str]:
    store = await open_store(data_dir, url, password)
    try:
        return [t.name for t in await store.list_tenants()]
    finally:
        await store.aclose()


def gateway_chat(server: Server, secret: str) -> str:
    client = openai.OpenAI(
        base_url=f"http://{server.endpoints['gateway']}/v1", api_key=secret, max_retries=0, timeout=60
    )
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert answer.usage.completion_tokens > 0
    return answer.choices[0].message.content


def test_an_engine_started_before_the_move_serves_the_server_on_the_new_store(
    tmp_path, public_parts, engine_user, pg_cluster
):
    binary, model = public_parts
    # A liveness window (10 s) longer than the server's stop, the copy and its start again take on
    # a loaded 2-core machine: the node must come back as the same node, never be lost and reaped.
    link = {"heartbeat_interval": 0.5, "missed_heartbeats": 20}
    server = Server(tmp_path, **link).start()
    engines = {"llama_server": str(binary), "run_as": engine_user, "stop_grace": "5s"}
    agent = start_agent(tmp_path, server, "cpu-1", engines=engines)
    try:
        wait_until(lambda: server.nodes().get("cpu-1", {}).get("connected"), "the agent", proc=agent)
        models = [{"name": "smollm2", "path": str(model), "format": "gguf"}]
        server.admin("POST", "/admin/v1/catalog", {"models": models, **CATALOG})
        replica = wait_until(
            lambda: ready_replica(server), "the replica to be Ready", deadline=120, proc=agent
        )
        (shard,) = replica["shards"]
        engine_pid = shard_view(server, "cpu-1", shard["shard_id"])["pid"]
        started_at = read_stat(engine_pid).start_time
        engine_key = server.admin("GET", f"/admin/v1/replicas/{replica['id']}/engine-key")["key"]
        server.admin("POST", "/admin/v1/tenants", {"name": "acme", "limits": {"rpm": 100}})
        secret = server.admin("POST", "/admin/v1/keys", {"tenant": "acme", "models": ["smollm2"]})["secret"]
        assert gateway_chat(server, secret)

        # Stopped, not killed: what it wrote is in the SQLite file the copy reads.
        ports = {f"{name}_port": int(server.endpoints[name].rsplit(":", 1)[1]) for name in ("link", "admin")}
        assert server.proc.stop() == 0, server.proc.output()[-4000:]
        url = pg_cluster.url(pg_cluster.create_database())
        copied = subprocess.run(
            [sys.executable, "-m", "llmgw", "server", "store", "copy", "--config", str(server.config)]
            + ["--to", url],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=PROJECT_ROOT,
            env={**os.environ, "LLMGW_TARGET_STORE_PASSWORD": pg_cluster.password},
        )
        assert copied.returncode == 0, copied.stderr
        assert "counts and checksums equal" in copied.stdout

        # The same data_dir (its admin and join tokens), the store now PostgreSQL.
        password_file = tmp_path / "store-password"
        password_file.write_text(pg_cluster.password + "\n")
        password_file.chmod(0o600)
        moved = Server(tmp_path, **ports, **link)
        config = yaml.safe_load(moved.config.read_text())
        write_yaml(moved.config, {**config, "store": url, "store_password_file": str(password_file)})
        server = moved.start()
        rebuilt = wait_until(lambda: ready_replica(server), "the replica on the new store", proc=agent)
        assert rebuilt["id"] == replica["id"]
        view = shard_view(server, "cpu-1", shard["shard_id"])
        assert view["pid"] == engine_pid, what_happened(tmp_path, server, agent)
        assert read_stat(engine_pid).start_time == started_at  # the same process, never restarted
        # The server on the new store derives the same key the engine was started with...
        assert server.admin("GET", f"/admin/v1/replicas/{replica['id']}/engine-key")["key"] == engine_key
        assert chat(shard["port"], engine_key) == 200
        # ... and its gateway reaches the engine with it, for the same tenant's API key.
        assert gateway_chat(server, secret)
        assert "Reap" not in server.proc.output()
        # And it writes to PostgreSQL, not to the SQLite file still in its data_dir.
        server.admin("POST", "/admin/v1/tenants", {"name": "after-the-move", "limits": {}})
        assert "after-the-move" in trio.run(tenants_in, server.data_dir, url, pg_cluster.password)
    finally:
        agent.stop()
        if server.proc is not None:
            server.proc.stop()
        kill_recorded_shards(tmp_path / "agent-cpu-1")
