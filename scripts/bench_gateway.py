"""Benchmark of the gateway users run: CPU per request and per streamed chunk, requests/s, p50, p99.

It starts the real `llmgw server` and `llmgw agent` processes, as a user runs them, in a temporary
directory; the agent's `engines.llama_server` is a wrapper that runs scripts/bench_engine.py (a fast
fake llama-server, run as an unprivileged engine user) on the port the agent gives it. Through
`llmgw ctl` it makes a tenant with quotas (high enough never to refuse, so that every request
reserves and settles them) and an API key, applies a catalog with one profile, and waits for its
replica to be Ready. So every request takes the whole path: key, quota, admission, routing, relay,
usage record.

Then wrk (Debian's package, installed when missing) drives keep-alive load from a process of its
own, a thread of C, for --seconds at each of --connections: non-streaming chat requests, and
streamed ones (BENCH_ENGINE_CHUNKS SSE events each). For every phase it prints requests/s, p50 and
p99 latency, errors, and the CPU time of the server's whole process tree (the server and every
process under it, such as gateway workers; not the agent, the engine or wrk) per request or per
streamed chunk. The same load runs against vllm-router (`--policy round_robin`, installed into
--router-venv when missing) in front of a second instance of the same fake engine, as the yardstick,
and the two are printed side by side.

Every process it starts is stopped by its process group, also on Ctrl-C; all traffic stays on
127.0.0.1. Every load is bounded by --seconds and every wait by --deadline.

    .venv/bin/python scripts/bench_gateway.py                      # 1 and 64 connections, 10 s each
    .venv/bin/python scripts/bench_gateway.py --workers 2          # gateway.workers: 2 in server.yaml
    .venv/bin/python scripts/bench_gateway.py --seconds 3 --no-router   # a smoke run
    .venv/bin/python scripts/bench_gateway.py --tracing both --no-router  # the cost of tracing

--tracing on runs llmgw with OpenTelemetry tracing at sample_ratio 1.0 (or --tracing-ratio),
exporting over OTLP/HTTP to a receiver this script runs on 127.0.0.1 (it decodes every export and
counts the spans, printed per request: fewer than a request makes means the SDK's export queue
overflowed and dropped some); --tracing both runs llmgw twice, off then on, side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from benchproc import BenchError, Child, loopback_server_config, wait_for, write_private

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SCRIPT = Path(__file__).resolve().parent / "bench_engine.py"
MODEL = "bench-model"
PROFILE = "bench-gateway"
NODE = "bench-node"
TENANT = "bench-gateway"
# The test suite's engine user (tests/conftest.py): engines never run as root.
ENGINE_USER = "llmgw-test-eng"
ENGINE_PYTHON = "/usr/bin/python3"  # the engine user cannot enter a venv under /root
VLLM_ROUTER = "vllm-router==0.1.17"
PY_SPY = "py-spy==0.4.3"
PY_SPY_RATE = 250  # samples per second: enough for a 10 s phase's top entries
TOP_ENTRIES = 15
# A thread waiting for work is sampled as if it ran: left out of the shares.
IDLE_FRAMES = frozenset({"WorkerThread._work (trio/_core/_thread_cache.py)", "Condition.wait (threading.py)"})
CHUNKS = 64  # SSE events per streamed answer (bench_engine.py's BENCH_ENGINE_CHUNKS)
# Room per replica: more than the most connections, so that the admission queue never holds a
# request back and llmgw meets the same load as vllm-router, which has no such limit.
PARALLEL = 512
# Quotas high enough never to refuse in a run, so each request reserves and settles them.
QUOTA = {"--rpm": 10**9, "--tpm": 10**12, "--tpd": 10**13}
WARMUP_S = 2.0
CTL_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0
WRK_TIMEOUT_S = 10  # a request slower than this counts as wrk's timeout error
PY_SPY_BINARY = Path("py-spy")  # set by --profile

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": CHUNKS}


# ------------------------------------------------------------------------------------ processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and every process under it, every thread of each: the scheduler's own
    count (schedstat, in ns). /proc/PID/stat's ticks are sampled, and under-count a process that
    wakes briefly thousands of times a second, as a gateway does. A process that exits between
    the two readings takes its time with it: gateway workers are expected to live through a run."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[0])
                    pending += [int(child) for child in (task / "children").read_text().split()]
    return total / 1e9


# ------------------------------------------------------------------------------------ tools


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise BenchError("wrk is missing: install Debian's package (apt-get install wrk) and run again")
    print("==> installing wrk (Debian's package), the load generator", flush=True)
    for attempt in range(10):  # another install may hold the dpkg lock for a while
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "wrk"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            break
        if "lock" not in done.stderr:
            subprocess.run(["apt-get", "update", "-qq"], check=False)
        time.sleep(min(30, 3 * (attempt + 1)))
    found = shutil.which("wrk")
    if not found:
        raise BenchError("could not install wrk with apt-get: install it by hand and run again")
    return found


def ensure_router(venv: Path) -> Path:
    binary = venv / "bin" / "vllm-router"
    if binary.exists():
        return binary
    print(f"==> installing {VLLM_ROUTER} into {venv} (once; the yardstick)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", VLLM_ROUTER], check=True)
    if not binary.exists():
        raise BenchError(f"{VLLM_ROUTER} installed no {binary}")
    return binary


def ensure_py_spy(venv: Path) -> Path:
    binary = venv / "bin" / "py-spy"
    if not binary.exists():
        if not (venv / "bin" / "pip").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"==> installing {PY_SPY} into {venv} (once; the profiler)", flush=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", PY_SPY], check=True)
    return binary


def ensure_engine_user() -> None:
    try:
        pwd.getpwnam(ENGINE_USER)
    except KeyError:
        if os.geteuid() != 0:
            raise BenchError(
                f"no user {ENGINE_USER} to run the fake engine as, and no root to make one"
            ) from None
        subprocess.run(["useradd", "--system", "--no-create-home", ENGINE_USER], check=True)


def public_engine() -> tuple[Path, Path]:
    """A directory the engine user can read, with the fake engine, a `llama-server` wrapper that
    runs it, and a stand-in model file; the wrapper's path and the model's."""
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-engine-"))
    root.chmod(0o755)
    shutil.copyfile(ENGINE_SCRIPT, root / "bench_engine.py")
    (root / "bench_engine.py").chmod(0o644)
    wrapper = root / "llama-server"
    wrapper.write_text(
        f'#!/bin/sh\nexport BENCH_ENGINE_CHUNKS={CHUNKS}\nexec {ENGINE_PYTHON} {root / "bench_engine.py"} "$@"\n'
    )
    wrapper.chmod(0o755)
    model = root / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))  # the fake engine never reads it
    model.chmod(0o644)
    return wrapper, model


# ------------------------------------------------------------------------------------ llmgw


class Llmgw:
    """The real thing in a temporary directory: a server, one agent, ctl and the admin API."""

    def __init__(
        self,
        work: Path,
        wrapper: Path,
        model: Path,
        workers: int | None,
        deadline: float,
        tracing: str | None = None,
        ratio: float = 1.0,
    ) -> None:
        self.ratio = ratio
        self.work = work
        self.tracing = tracing  # the OTLP endpoint, or None: tracing off (no block at all)
        self.wrapper = wrapper
        self.model = model
        self.workers = workers
        self.deadline = deadline
        self.children: list[Child] = []
        self.data_dir = work / "server"
        self.endpoints: dict = {}
        self.token = ""
        self.server: Child | None = None

    def start(self) -> None:
        # The bench's workers stop with its server: by default they would serve on after it.
        gateway: dict = {"stop_workers_on_exit": True}
        if self.workers is not None:
            gateway["workers"] = self.workers
        config = loopback_server_config(self.data_dir, gateway)
        if self.tracing is not None:
            config["tracing"] = {"endpoint": self.tracing, "sample_ratio": self.ratio}
        server_yaml = write_private(self.work / "server.yaml", yaml.safe_dump(config))
        self.server = self._spawn(["server", "--config", str(server_yaml)], "server.log")
        self.endpoints = wait_for(self._read_endpoints, "the server to listen", self.deadline, [self.server])
        self.token = (self.data_dir / "admin-token").read_text().strip()
        agent_config = {
            "node_name": NODE,
            "work_dir": str(self.work / "agent"),
            "log_level": "warning",
            "server": {
                "address": self.endpoints["link"],
                "join_token_file": str(self.data_dir / "join-token"),
            },
            "engines": {
                "llama_server": str(self.wrapper),
                "run_as": ENGINE_USER,
                "stop_shards_on_exit": True,
                "stop_grace": "5s",
            },
        }
        agent_yaml = write_private(self.work / "agent.yaml", yaml.safe_dump(agent_config))
        agent = self._spawn(["agent", "--config", str(agent_yaml)], "agent.log")
        wait_for(self._node_connected, "the agent to register", self.deadline, [self.server, agent])

    def _spawn(self, args: list[str], log: str) -> Child:
        child = Child([sys.executable, "-m", "llmgw", *args], self.work / log)
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):  # the agent first: it stops its engine
            child.stop()

    def _read_endpoints(self) -> dict | None:
        try:
            return json.loads((self.data_dir / "endpoints.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _node_connected(self) -> bool:
        nodes = self.admin("/admin/v1/nodes")["nodes"]
        return any(node["name"] == NODE and node["connected"] for node in nodes)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.endpoints['gateway']}"

    def ctl(self, *args: str) -> str:
        env = {
            **os.environ,
            "LLMGW_SERVER": f"http://{self.endpoints['admin']}",
            "LLMGW_TOKEN": self.token,
            "LLMGW_CONTEXT": str(self.work / "ctl-context.json"),
        }
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "ctl", *args],
            capture_output=True,
            text=True,
            timeout=CTL_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise BenchError(f"llmgw ctl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def admin(self, path: str) -> dict:
        request = urllib.request.Request(
            f"http://{self.endpoints['admin']}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return json.loads(response.read())

    def deploy(self) -> str:
        """Tenant, key, catalog; the API key's secret once the replica is Ready and answers."""
        limits = [str(item) for pair in QUOTA.items() for item in pair]
        self.ctl("tenant", "create", TENANT, *limits)
        key = json.loads(self.ctl("keys", "create", "--tenant", TENANT, "--model", MODEL, "--json"))["secret"]
        profile = {
            "model": MODEL,
            "engine": "llamacpp",
            "gpu_class": None,  # the CPU
            "memory_mib": 256,
            "cpu_cores": 1,
            "parallel": PARALLEL,
            "min_replicas": 1,
            "max_replicas": 1,
        }
        catalog = {
            "models": {MODEL: {"path": str(self.model), "format": "gguf"}},
            "profiles": {PROFILE: profile},
        }
        path = write_private(self.work / "catalog.yaml", yaml.safe_dump(catalog))
        self.ctl("apply", "-f", str(path))

        def ready() -> bool:
            replicas = self.admin("/admin/v1/replicas")["replicas"]
            return any(r["profile"] == PROFILE and r["state"] == "Ready" for r in replicas)

        wait_for(ready, f"a Ready replica of {PROFILE}", self.deadline, self.children)
        wait_for(
            lambda: answers(self.gateway_url, key), "the gateway to answer", self.deadline, self.children
        )
        return key


def answers(base: str, key: str | None) -> bool:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", data=json.dumps(CHAT).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status == 200 and b"usage" in response.read()
    except urllib.error.HTTPError:
        return False


# ------------------------------------------------------------------------------------ vllm-router


class Router:
    """vllm-router in front of its own instance of the fake engine."""

    def __init__(self, work: Path, binary: Path, wrapper: Path, deadline: float) -> None:
        self.work = work
        self.binary = binary
        self.wrapper = wrapper
        self.deadline = deadline
        self.children: list[Child] = []
        self.port = free_port()
        self.process: Child | None = None

    def start(self) -> None:
        engine_port = free_port()
        engine = Child(
            [str(self.wrapper), "--port", str(engine_port), "--alias", MODEL],
            self.work / "router-engine.log",
            user=ENGINE_USER,
        )
        self.children.append(engine)
        wait_for(
            lambda: _get(f"http://127.0.0.1:{engine_port}/health"),
            "the router's engine",
            self.deadline,
            [engine],
        )
        args = [
            str(self.binary),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--worker-urls", f"http://127.0.0.1:{engine_port}",
            "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--log-level", "warning",
        ]  # fmt: skip
        self.process = Child(args, self.work / "vllm-router.log")
        self.children.append(self.process)
        wait_for(lambda: answers(self.url, None), "vllm-router to answer", self.deadline, self.children)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def _get(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return response.status == 200


# ------------------------------------------------------------------------------------ load


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
{auth}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,' ..
    '"timeout":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def wrk_script(work: Path, name: str, stream: bool, key: str | None) -> Path:
    body = json.dumps({**CHAT, "stream": stream}, separators=(",", ":"))
    auth = f'wrk.headers["Authorization"] = "Bearer {key}"' if key else ""
    # The key is in a private file, never on a command line.
    return write_private(work / f"{name}.lua", WRK_SCRIPT.format(body=body, auth=auth))


def run_wrk(
    wrk: str,
    script: Path,
    url: str,
    connections: int,
    seconds: float,
    tree_pid: int,
    profile: Path | None = None,
) -> dict:
    spy = None
    if profile is not None:
        # Sampling pauses the process for each sample: without (--nonblocking) py-spy reads
        # stacks as they change and keeps more of those in a system call than it should.
        # Subprocesses too, for gateway workers.
        spy = subprocess.Popen(
            [
                str(PY_SPY_BINARY),
                "record",
                "--pid",
                str(tree_pid),
                "--subprocesses",
                "--rate",
                str(PY_SPY_RATE),
                "--duration",
                str(max(1, round(seconds))),
                "--format",
                "raw",
                "--output",
                str(profile),
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    before = tree_cpu_seconds(tree_pid)
    done = subprocess.run(
        [
            wrk,
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            f"--timeout={WRK_TIMEOUT_S}s",
            "-s",
            str(script),
            f"{url}/v1/chat/completions",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=seconds + WRK_TIMEOUT_S + 30,
    )
    cpu = tree_cpu_seconds(tree_pid) - before
    if spy is not None:
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    match = re.search(r"^WRK_JSON (.*)$", done.stdout, re.M)
    if done.returncode != 0 or match is None:
        raise BenchError(f"wrk failed ({done.returncode}): {done.stdout}\n{done.stderr}")
    result = json.loads(match.group(1))
    result["cpu_s"] = cpu
    result["errors"] = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
    return result


def measure(name: str, wrk: str, work: Path, url: str, key: str | None, pid: int, args) -> dict:
    """Every phase against one gateway: {(kind, connections): wrk's figures + CPU}."""
    results = {}
    for stream in (False, True):
        kind = "stream" if stream else "plain"
        script = wrk_script(work, f"{name}-{kind}", stream, key)
        run_wrk(wrk, script, url, max(args.connections), WARMUP_S, pid)  # not counted
        for connections in args.connections:
            profile = work / f"{name}-{kind}-c{connections}.stacks" if args.profile and key else None
            result = run_wrk(wrk, script, url, connections, args.seconds, pid, profile)
            results[kind, connections] = result
            print(f"  {name:<12} {describe(kind, connections, result)}", flush=True)
            if profile is not None and profile.exists():
                print(top_entries(profile), flush=True)
    return results


def top_entries(stacks: Path) -> str:
    """py-spy's raw stacks as the functions with the most samples: on top of the stack (self)
    and anywhere on it (inclusive, each function once per stack)."""
    own: dict[str, int] = {}
    anywhere: dict[str, int] = {}
    total = 0
    for line in stacks.read_text(errors="replace").splitlines():
        frames, _, count = line.rpartition(" ")
        if not frames or not count.isdigit():
            continue
        samples = int(count)
        names = [
            _function(frame) for frame in frames.split(";") if not frame.startswith(("process ", "thread "))
        ]
        if not names or names[-1] in IDLE_FRAMES:
            continue
        total += samples
        own[names[-1]] = own.get(names[-1], 0) + samples
        for name in set(names):
            anywhere[name] = anywhere.get(name, 0) + samples
    if not total:
        return "    (py-spy took no samples)"
    lines = [f"    py-spy, {total} samples ({stacks.name}): self | inclusive (llmgw's own functions)"]
    best_own = sorted(own.items(), key=lambda item: -item[1])[:TOP_ENTRIES]
    best_anywhere = sorted(((n, c) for n, c in anywhere.items() if "llmgw/" in n), key=lambda item: -item[1])[
        :TOP_ENTRIES
    ]
    for index in range(max(len(best_own), len(best_anywhere))):
        left = f"{best_own[index][1] / total:6.1%} {best_own[index][0]}" if index < len(best_own) else ""
        right = (
            f"{best_anywhere[index][1] / total:6.1%} {best_anywhere[index][0]}"
            if index < len(best_anywhere)
            else ""
        )
        lines.append(f"    {left:<75.75} | {right}")
    return "\n".join(lines)


def _function(frame: str) -> str:
    """ "name (path:line)" as "name (path)": samples of one function on different lines add up."""
    name, _, where = frame.partition(" (")
    path = where.rpartition(":")[0] or where.rstrip(")")
    return f"{name} ({_short(path)})"


def _short(path: str) -> str:
    if "llmgw/" in path:
        return "llmgw/" + path.rpartition("llmgw/")[2]
    for marker in ("site-packages/", "python3.11/"):
        if marker in path:
            return path.rpartition(marker)[2]
    return path


def describe(kind: str, connections: int, r: dict) -> str:
    return (
        f"{kind:<6} c={connections:<3} {rate(r):8.0f} req/s  p50 {r['p50_us'] / 1e3:7.2f} ms  "
        f"p99 {r['p99_us'] / 1e3:7.2f} ms  max {r['max_us'] / 1e3:7.1f} ms  "
        f"CPU {per_unit(kind, r):7.1f} µs/{'chunk' if kind == 'stream' else 'req'}  errors {r['errors']}"
    )


def per_unit(kind: str, r: dict) -> float:
    units = r["requests"] * (CHUNKS if kind == "stream" else 1)
    return r["cpu_s"] / units * 1e6 if units else float("nan")


def table(columns: dict[str, dict], connections: list[int]) -> str:
    names = list(columns)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for kind, unit in (("plain", "request"), ("stream", f"streamed chunk ({CHUNKS} per answer)")):
        answers = "streams" if kind == "stream" else "requests"
        for c in connections:
            results = [columns[name][kind, c] for name in names]
            row(f"{kind}: CPU per {unit}, {c} conn", [f"{per_unit(kind, r):.1f} µs" for r in results])
            row(f"{kind}: {answers}/s, {c} conn", [f"{rate(r):.0f}" for r in results])
            row(
                f"{kind}: p50 / p99, {c} conn",
                [f"{r['p50_us'] / 1e3:.2f} / {r['p99_us'] / 1e3:.2f} ms" for r in results],
            )
            row(f"{kind}: errors, {c} conn", [str(r["errors"]) for r in results])
    return "\n".join(lines)


def rate(r: dict) -> float:
    return r["requests"] / (r["duration_us"] / 1e6)


# ------------------------------------------------------------------------------------ tracing


class SpanReceiver:
    """An OTLP/HTTP collector on 127.0.0.1 that counts the spans it is sent (in this process, whose
    CPU is not the gateway's)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans = 0
        self.lock = threading.Lock()
        receiver = self
        answer = ExportTraceServiceResponse().SerializeToString()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                count = sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
                with receiver.lock:
                    receiver.spans += count
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


# ------------------------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="length of each measured phase (default 10)"
    )
    parser.add_argument(
        "--connections",
        type=lambda text: sorted({int(n) for n in text.split(",")}),
        default=[1, 64],
        help="keep-alive connections, comma-separated: a phase each (default 1,64)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="gateway.workers in server.yaml: worker processes, 0 for the gateway in the server process;"
        " unset: the server's default, and the key is left out, for servers that do not know it",
    )
    parser.add_argument("--no-router", action="store_true", help="skip vllm-router, the yardstick")
    parser.add_argument(
        "--tracing",
        choices=("off", "on", "both"),
        default="off",
        help="llmgw with OpenTelemetry tracing off (default), on (to a local OTLP/HTTP receiver),"
        " or both, one after the other",
    )
    parser.add_argument(
        "--tracing-ratio",
        type=float,
        default=1.0,
        help="tracing.sample_ratio with --tracing on or both (default 1.0); below 1 the traces left"
        " out are still recorded, for the failed and slow ones to be kept",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"sample the llmgw server's process tree with py-spy in every phase and print its top"
        f" entries ({PY_SPY}, installed into --router-venv when missing). Sampling pauses the"
        " server: take the figures from a run without it",
    )
    parser.add_argument(
        "--router-venv",
        type=Path,
        default=ROOT / ".venv-bench",
        help=f"the virtual environment with {VLLM_ROUTER} (made when missing; default .venv-bench)",
    )
    parser.add_argument(
        "--deadline", type=float, default=300.0, help="the longest any start-up wait may take (s)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print it")
    args = parser.parse_args()
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers: expected 0 (the gateway in the server process) or more, got {args.workers}")
    if any(c < 1 for c in args.connections):
        parser.error(f"--connections: expected numbers of 1 or more, got {args.connections}")

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-gateway-"))
    wrapper_dir: Path | None = None
    running: list = []
    # SIGTERM as Ctrl-C: the finally below stops every process group this started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        wrk = ensure_wrk()
        router_binary = None if args.no_router else ensure_router(args.router_venv)
        if args.profile:
            global PY_SPY_BINARY
            PY_SPY_BINARY = ensure_py_spy(args.router_venv)
        ensure_engine_user()
        wrapper, model = public_engine()
        wrapper_dir = wrapper.parent
        deadline = time.monotonic() + args.deadline
        columns = {}

        for traced in {"off": [False], "on": [True], "both": [False, True]}[args.tracing]:
            receiver = SpanReceiver() if traced else None
            if receiver is not None:
                running.append(receiver)
            run_dir = work / ("traced" if traced else "untraced")
            run_dir.mkdir()
            llmgw = Llmgw(
                run_dir,
                wrapper,
                model,
                args.workers,
                deadline,
                receiver.url if receiver else None,
                args.tracing_ratio,
            )
            running.append(llmgw)
            llmgw.start()
            key = llmgw.deploy()
            label = "llmgw" if args.workers is None else f"llmgw ×{args.workers}"
            label += f", tracing {args.tracing_ratio:g}" if traced else ""
            print(f"==> {label}: server pid {llmgw.server.pid}, gateway {llmgw.gateway_url}", flush=True)
            columns[label] = measure("llmgw", wrk, run_dir, llmgw.gateway_url, key, llmgw.server.pid, args)
            llmgw.stop()
            running.remove(llmgw)
            if receiver is not None:
                requests = sum(r["requests"] for r in columns[label].values())
                # Warm-up requests are traced too: a bound from above, for a dropped-spans check.
                print(
                    f"  spans received: {receiver.spans} ({receiver.spans / requests:.1f} per measured request)"
                )
                receiver.stop()
                running.remove(receiver)

        if router_binary is not None:
            router = Router(work, router_binary, wrapper, time.monotonic() + args.deadline)
            running.append(router)
            router.start()
            print(f"==> vllm-router: pid {router.process.pid}, {router.url}", flush=True)
            columns["vllm-router"] = measure(
                "vllm-router", wrk, work, router.url, None, router.process.pid, args
            )
            router.stop()
            running.remove(router)

        print()
        print(f"wrk -t1, {args.seconds:g} s per phase; CPU: the gateway's whole process tree")
        print(table(columns, args.connections))
        return 0
    except BenchError as error:
        print(f"bench_gateway: {error}\n(logs in {work})", file=sys.stderr)
        args.keep = True
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for part in reversed(running):
            part.stop()
        if wrapper_dir is not None:
            shutil.rmtree(wrapper_dir, ignore_errors=True)
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
