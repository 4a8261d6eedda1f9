"""Benchmark of adapters loaded on demand: what affinity buys over random placement.

Three fake engines (tests/fake_engine.py, speaking vLLM's run-time LoRA API: a load takes
--load-delay seconds, a completion --response-delay) each hold at most --max-loaded adapters
(N). --requests requests over --adapters adapters, their popularity Zipf-distributed (exponent
--zipf), come from --clients concurrent clients. Each request is placed by
``llmgw.core.adapter_residency`` — the decision the server makes — in two ways:

- affinity: the residency's own choice among all replicas (a replica that holds the adapter and
  has room; else a load, once, on the best placed one, unloading its least recently used idle
  adapter if it must);
- random: the same residency, offered one replica drawn at random per request (a request goes
  where it is sent, and its adapter is loaded there if that replica lacks it).

Both carry out loads and unloads over HTTP on the engines, one load per adapter at a time
(single flight), and send the completion to the engine once its adapter is there. Printed per
mode: adapter loads per 1,000 requests, and the wait each request had before it could be sent
(p50, p90) — the time loads add, and the waits for a slot an affine replica makes.

    .venv/bin/python scripts/bench_adapters.py                   # 1,000 requests per mode
    .venv/bin/python scripts/bench_adapters.py --requests 200    # a smoke run

Everything listens on 127.0.0.1; the engines are stopped by their process groups at the end,
also on Ctrl-C; --max-seconds bounds the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from llmgw.core.adapter_residency import Await, Load, ReplicaView, Residency, Use
from llmgw.core.bench_stats import percentile
from llmgw.http_probe import ProbeFailed, http_get, http_post

ROOT = Path(__file__).resolve().parent.parent
FAKE_ENGINE = ROOT / "tests" / "fake_engine.py"
MODEL = "base"
HTTP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def zipf_requests(count: int, adapters: int, exponent: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = [f"adapter-{i:02d}" for i in range(adapters)]
    weights = [1 / (rank + 1) ** exponent for rank in range(adapters)]
    return rng.choices(names, weights=weights, k=count)


class Placer:
    """The residency, and the loads it asks for carried out on the engines."""

    def __init__(self, ports: dict[str, int], capacity: int, slots: int, mode: str, seed: int) -> None:
        self.ports = ports
        self.slots = slots
        self.mode = mode
        self.rng = random.Random(seed)
        self.residency = Residency()
        self.residency.sync(dict.fromkeys(ports, capacity))
        for replica in ports:
            self.residency.relearn(replica, [], 0.0)
        self.in_flight: dict[tuple[str, str], int] = {}
        self.per_replica = dict.fromkeys(ports, 0)
        self.pending: dict[tuple[str, str], trio.Event] = {}
        self.changed = trio.Event()
        self.loads = 0
        self.failures = 0

    def views(self) -> list[ReplicaView]:
        ids = sorted(self.ports) if self.mode == "affinity" else [self.rng.choice(sorted(self.ports))]
        return [
            ReplicaView(
                id=r, load=self.per_replica[r] / self.slots, has_room=self.per_replica[r] < self.slots
            )
            for r in ids
        ]

    async def acquire(self, adapter: str) -> str:
        views = self.views()  # random: the one replica this request was sent to, kept
        while True:
            if self.mode == "affinity":
                views = self.views()
            else:
                views = [
                    ReplicaView(
                        id=v.id,
                        load=self.per_replica[v.id] / self.slots,
                        has_room=self.per_replica[v.id] < self.slots,
                    )
                    for v in views
                ]
            answer = self.residency.want(adapter, views, self.in_flight, trio.current_time())
            if isinstance(answer, Use):
                key = (answer.replica, adapter)
                self.in_flight[key] = self.in_flight.get(key, 0) + 1
                self.per_replica[answer.replica] += 1
                return answer.replica
            if isinstance(answer, Await):
                await self.pending[(answer.replica, adapter)].wait()
            elif isinstance(answer, Load):
                await self._load(answer, adapter)
            else:
                await self.changed.wait()

    async def _load(self, load: Load, adapter: str) -> None:
        done = self.pending[(load.replica, adapter)] = trio.Event()
        port = self.ports[load.replica]
        try:
            if load.evict is not None:
                body = json.dumps({"lora_name": load.evict}).encode()
                await http_post("127.0.0.1", port, "/v1/unload_lora_adapter", body, timeout=HTTP_TIMEOUT)
                self.residency.unloaded(load.replica, load.evict)
            body = json.dumps({"lora_name": adapter, "lora_path": f"/adapters/{adapter}"}).encode()
            status, text = await http_post(
                "127.0.0.1", port, "/v1/load_lora_adapter", body, timeout=HTTP_TIMEOUT
            )
            if status == 200:
                self.residency.loaded(load.replica, adapter, trio.current_time())
                self.loads += 1
            else:
                self.residency.load_failed(load.replica, adapter)
                self.failures += 1
                print(f"load of {adapter} on {load.replica} failed: {status} {text[:200]!r}", file=sys.stderr)
        finally:
            del self.pending[(load.replica, adapter)]
            done.set()
            self._wake()

    def release(self, replica: str, adapter: str) -> None:
        self.in_flight[(replica, adapter)] -= 1
        self.per_replica[replica] -= 1
        self.residency.used(replica, adapter, trio.current_time())
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


async def run_mode(mode: str, ports: dict[str, int], args: argparse.Namespace) -> dict:
    # A fresh start for each mode: the engines hold nothing.
    for port in ports.values():
        status, body = await http_get("127.0.0.1", port, "/fake/adapters", timeout=HTTP_TIMEOUT)
        for name in json.loads(body)["held"]:
            unload = json.dumps({"lora_name": name}).encode()
            await http_post("127.0.0.1", port, "/v1/unload_lora_adapter", unload, timeout=HTTP_TIMEOUT)
    placer = Placer(ports, args.max_loaded, args.slots, mode, args.seed)
    requests = zipf_requests(args.requests, args.adapters, args.zipf, args.seed)
    waits: list[float] = []
    queue = iter(requests)

    async def client() -> None:
        for adapter in queue:
            arrived = trio.current_time()
            replica = await placer.acquire(adapter)
            waits.append(trio.current_time() - arrived)
            try:
                body = json.dumps({"model": adapter, "prompt": "hello", "max_tokens": 4}).encode()
                status, text = await http_post(
                    "127.0.0.1", ports[replica], "/v1/completions", body, timeout=HTTP_TIMEOUT
                )
                if status != 200:
                    raise RuntimeError(f"{adapter} on {replica}: {status} {text[:200]!r}")
            finally:
                placer.release(replica, adapter)

    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for _ in range(args.clients):
            nursery.start_soon(client)
    seconds = time.monotonic() - started
    violations = []
    for port in ports.values():
        _, body = await http_get("127.0.0.1", port, "/fake/adapters", timeout=HTTP_TIMEOUT)
        violations += json.loads(body)["violations"]
    return {
        "mode": mode,
        "requests": len(waits),
        "loads": placer.loads,
        "loads_per_1000": 1000 * placer.loads / max(1, len(waits)),
        "failed_loads": placer.failures,
        "wait_p50_ms": 1000 * percentile(waits, 50),
        "wait_p90_ms": 1000 * percentile(waits, 90),
        "seconds": seconds,
        "unloads_in_flight": len(violations),
    }


async def wait_healthy(port: int, deadline: float) -> None:
    while True:
        try:
            status, _ = await http_get("127.0.0.1", port, "/health", timeout=1.0)
            if status == 200:
                return
        except ProbeFailed:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake engine on {port} did not come up")
        await trio.sleep(0.05)


async def main_async(args: argparse.Namespace, ports: dict[str, int]) -> list[dict]:
    deadline = time.monotonic() + 30
    for port in ports.values():
        await wait_healthy(port, deadline)
    results = []
    with trio.fail_after(args.max_seconds):
        for mode in args.modes:
            results.append(await run_mode(mode, ports, args))
    return results


def run_with_engines(args: argparse.Namespace) -> list[dict]:
    ports = {f"r{i}": free_port() for i in range(args.replicas)}
    env = {
        **os.environ,
        "FAKE_ENGINE_LORA_LOAD_DELAY": str(args.load_delay),
        "FAKE_ENGINE_RESPONSE_DELAY": str(args.response_delay),
    }
    engines = []
    try:
        for port in ports.values():
            argv = [sys.executable, str(FAKE_ENGINE), "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--served-model-name", MODEL, "--max-loras", str(args.max_loaded)]
            engines.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        return trio.run(main_async, args, ports)
    finally:
        for engine in engines:
            try:
                os.killpg(engine.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for engine in engines:
            try:
                engine.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(engine.pid, signal.SIGKILL)
                engine.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--max-loaded", type=int, default=4, help="N: adapters per replica")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="requests one replica serves at once")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--load-delay", type=float, default=0.2, help="seconds an adapter load takes")
    parser.add_argument("--response-delay", type=float, default=0.02, help="seconds a completion takes")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--modes", nargs="+", default=["affinity", "random"], choices=["affinity", "random"])
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run_with_engines(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{args.requests} requests, Zipf {args.zipf} over {args.adapters} adapters, N={args.max_loaded}, "
        f"{args.replicas} replicas x {args.slots} slots, {args.clients} clients, "
        f"load {args.load_delay * 1000:.0f} ms, completion {args.response_delay * 1000:.0f} ms"
    )
    print(
        f"{'mode':<10}{'loads':>7}{'loads/1000':>12}{'wait p50':>11}{'wait p90':>11}{'seconds':>9}{'unsafe':>8}"
    )
    for r in results:
        print(
            f"{r['mode']:<10}{r['loads']:>7}{r['loads_per_1000']:>12.1f}{r['wait_p50_ms']:>9.1f}ms"
            f"{r['wait_p90_ms']:>9.1f}ms{r['seconds']:>9.1f}{r['unloads_in_flight']:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
