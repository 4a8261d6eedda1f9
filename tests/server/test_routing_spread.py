"""Requests spread over 2, 3 and 4 Ready replicas, through the real router, gate and relay.

The router (server.routing.ReplicaRouter), the gate (server.gate.ControlPlaneGate) and the relay
(gateway.serve_gateway) are the production objects; only the replica records, the catalog and the
engines are fakes. The engines count what reaches them, so the assertions are about where
requests went, over real sockets on 127.0.0.1 — which is where two rotations once cancelled out
and sent every request to the first replica.
"""

from __future__ import annotations

import itertools
import math
import socket

import attrs
import pytest
import trio
import trio.testing

from llmgw.core.catalog import Profile
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState
from llmgw.gateway import serve_gateway
from llmgw.gateway.h11_stream import H11Stream
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import ReplicaRouter
from llmgw.wire.messages import Inventory
from tests.gateway.test_gateway_relay import ANSWER, Client, FakeEngine, json_reply
from tests.helpers import wait_for

KEY = "Bearer tenant-key"
REQUESTS = 40


@attrs.frozen
class CallerKey:
    id: str = "k1"
    tenant: str = "acme"
    models: tuple[str, ...] = ()
    band: int = 0
    limits: None = None


class Keys:
    def authenticate(self, secret: str):
        return CallerKey() if secret == KEY.removeprefix("Bearer ") else None

    def tenant(self, name: str):
        return None


class Catalog:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def profiles(self) -> dict[str, Profile]:
        return {self.profile.name: self.profile}


class Replicas:
    def __init__(self, ports: list[int]) -> None:
        self.records = [
            Replica(
                id=f"r{i}",
                profile="chat",
                model="m",
                state=ReplicaState.READY,
                shards=(ReplicaShard(node="n", shard_id=f"r{i}-s0", rank=0, port=port, state="Ready"),),
                since=0,
                created=i,
            )
            for i, port in enumerate(ports)
        ]

    def list(self) -> list[Replica]:
        return self.records

    def key_of(self, replica_id: str) -> str:
        return f"engine-key-{replica_id}"


@attrs.define
class Node:
    inventory: Inventory


class Registry:
    def get(self, name: str) -> Node:
        inventory = Inventory(
            hostname=name, cpu_count=1, memory_total_mib=1, memory_available_mib=1, mgmt_address="127.0.0.1"
        )
        return Node(inventory)


class HeldEngine(FakeEngine):
    """Answers once released, and remembers the most requests it held at once."""

    def __init__(self, release: trio.Event) -> None:
        super().__init__(self._reply)
        self.release = release
        self.holding = 0
        self.most = 0

    async def _reply(self, engine: H11Stream, body: dict) -> None:
        self.holding += 1
        self.most = max(self.most, self.holding)
        try:
            await self.release.wait()
        finally:
            self.holding -= 1
        await json_reply(engine, body)


async def fleet(nursery, engines: list[FakeEngine], policy: str, parallel: int = 4, dead_ports=()):
    """The real router, gate and relay in front of ``engines`` (and Ready replicas at
    ``dead_ports``, where nothing listens); returns (port, gate, metrics)."""
    ports = [(await engine.start(nursery)).port for engine in engines] + list(dead_ports)
    profile = Profile(
        name="chat",
        model="m",
        engine="llamacpp",
        gpu_class=None,
        memory_mib=512,
        parallel=parallel,
        routing=policy,
    )
    router = ReplicaRouter(Catalog(profile), Replicas(ports), Registry())
    salts = itertools.count()  # the least-loaded tie-break, deterministic here
    gate = ControlPlaneGate(Keys(), router, salt=lambda: next(salts))
    metrics = GatewayMetrics(gate=gate)
    gate.observer = metrics
    port = await nursery.start(
        lambda task_status: serve_gateway(
            router, "127.0.0.1", 0, gate=gate, metrics=metrics, task_status=task_status
        )
    )
    return port, gate, metrics


def chat(i: int, system: str | None = None) -> dict:
    messages = [{"role": "user", "content": f"question {i}: what is {i} times {i}?"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": "m", "messages": messages, "max_tokens": 4}


async def call(port: int, body: dict) -> int:
    client = await Client.open(port)
    try:
        status, answer = await client.call(
            "POST", "/v1/chat/completions", body, [(b"authorization", KEY.encode())]
        )
    finally:
        await client.http.aclose()
    assert answer == ANSWER or status != 200
    return status


def counts(engines: list[FakeEngine]) -> list[int]:
    return [len(engine.seen) for engine in engines]


@pytest.mark.parametrize("replicas", [2, 3, 4])
async def test_round_robin_gives_each_replica_its_share_in_turn(nursery, replicas):
    engines = [FakeEngine() for _ in range(replicas)]
    port, _, _ = await fleet(nursery, engines, "round-robin")
    for i in range(REQUESTS):
        assert await call(port, chat(i)) == 200
    share = REQUESTS // replicas
    assert all(share <= n <= share + 1 for n in counts(engines)), counts(engines)


@pytest.mark.parametrize("replicas", [2, 3, 4])
async def test_least_loaded_spreads_sequential_requests_over_every_replica(nursery, replicas):
    engines = [FakeEngine() for _ in range(replicas)]
    port, _, _ = await fleet(nursery, engines, "least-loaded")
    for i in range(REQUESTS):
        assert await call(port, chat(i)) == 200
    # Sequential requests find every replica idle: the tie-break alone spreads them.
    assert min(counts(engines)) >= REQUESTS // replicas // 3, counts(engines)


@pytest.mark.parametrize("replicas", [2, 3, 4])
async def test_distinct_prompts_spread_and_one_prompt_stays_on_its_replica(nursery, replicas):
    engines = [FakeEngine() for _ in range(replicas)]
    port, _, metrics = await fleet(nursery, engines, "prefix")
    for i in range(REQUESTS):
        assert await call(port, chat(i, system=f"You are assistant number {i}."))
    assert min(counts(engines)) >= 1, counts(engines)
    before = counts(engines)
    system = "You answer questions about one long shared document. " * 10
    for i in range(10):
        assert await call(port, chat(i, system=system)) == 200
    grew = [after - b for after, b in zip(counts(engines), before, strict=True)]
    assert sorted(grew) == [0] * (replicas - 1) + [10]  # every one where the cache holds it
    text = metrics.exposition().decode()
    assert 'llmgw_routing_decisions_total{model="m",outcome="affinity",policy="prefix"}' in text
    for i in range(replicas):
        assert f'llmgw_replica_requests_total{{model="m",replica="r{i}"}}' in text


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
@pytest.mark.parametrize("replicas", [2, 3, 4])
async def test_concurrent_requests_fill_every_replica_and_none_past_its_slots(nursery, replicas, policy):
    release = trio.Event()
    engines = [HeldEngine(release) for _ in range(replicas)]
    port, gate, _ = await fleet(nursery, engines, policy, parallel=2)
    statuses: list[int] = []
    clients = 2 * replicas + 3  # more than the replicas' slots: three wait at the gateway

    async def client(i: int) -> None:
        statuses.append(await call(port, chat(i, system="one shared system prompt for all of them")))

    async with trio.open_nursery() as clients_nursery:
        for i in range(clients):
            clients_nursery.start_soon(client, i)
        await wait_for(
            lambda: (
                sum(e.holding for e in engines) == 2 * replicas
                and sum(gate.queue_depths().get("m", {}).values()) == 3
            ),
            "every slot taken and three requests queued",
        )
        # Every replica holds its two slots, whatever the policy: room is per replica, and a
        # request is admitted only to a replica that has some.
        assert [e.holding for e in engines] == [2] * replicas
        release.set()
    assert statuses == [200] * clients
    assert max(e.most for e in engines) == 2
    assert gate.in_flight("m") == {}


@pytest.mark.parametrize("replicas", [2, 3, 4])
async def test_a_hot_prefix_waits_for_its_replicas_within_the_load_bound(nursery, replicas):
    """Many concurrent requests with one prompt start: they wait for the replicas whose cache
    holds it rather than go to a cold one, but no replica's load (in flight and waiting for it)
    passes CHWBL's bound, so the hot prefix spreads; and no engine runs past its slots."""
    release = trio.Event()
    engines = [HeldEngine(release) for _ in range(replicas)]
    port, gate, _ = await fleet(nursery, engines, "prefix", parallel=2)
    statuses: list[int] = []
    clients = 2 * replicas + 3

    async def client(i: int) -> None:
        statuses.append(await call(port, chat(i, system="one shared system prompt for all of them")))

    async with trio.open_nursery() as clients_nursery:
        for i in range(clients):
            clients_nursery.start_soon(client, i)
        await wait_for(
            lambda: (
                sum(e.holding for e in engines) + sum(gate.queue_depths().get("m", {}).values()) == clients
            ),
            "every request held by an engine or waiting at the gateway",
        )
        await trio.testing.wait_all_tasks_blocked()
        held = {f"r{i}": e.holding for i, e in enumerate(engines)}
        waiting = gate.waiting_for("m")
        loads = [held[r] + waiting.get(r, 0) for r in held]
        assert max(held.values()) <= 2
        assert max(loads) <= math.ceil(1.25 * clients / replicas), (held, waiting)
        assert sum(1 for n in held.values() if n) >= 2  # the bound spread the hot prefix
        release.set()
    assert statuses == [200] * clients
    assert max(e.most for e in engines) == 2
    assert gate.in_flight("m") == {} and gate.waiting_for("m") == {}


async def test_a_replica_that_refuses_connections_is_passed_over(nursery):
    """A replica's engine died and the reconciler has not heard yet: it is still Ready in the
    routes, and the relay falls back to the next replica in the order the gate chose."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]
    live = FakeEngine()
    port, _, metrics = await fleet(nursery, [live], "round-robin", dead_ports=[dead_port])
    for i in range(6):
        assert await call(port, chat(i)) == 200
    assert counts([live]) == [6]
    # Half of them were routed to the dead one first, and answered by the live one.
    assert 'llmgw_replica_requests_total{model="m",replica="r0"} 6.0' in metrics.exposition().decode()
