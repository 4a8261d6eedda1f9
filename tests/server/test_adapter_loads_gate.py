"""Adapters loaded on demand, the gateway's side: routes that offer only what each replica's
engine holds (in this process and, through the worker link, in a worker), a gate that asks for a
load only when no holder has room, and a waiter whose adapter is unloaded elsewhere asking again
instead of waiting for nothing."""

from __future__ import annotations

import attrs
import pytest
import trio

from llmgw.core.shard import Adapter
from llmgw.gateway import GatewayError, Usage
from llmgw.server.adapter_loads import AdapterLoads
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import ReplicaRouter
from llmgw.server.worker import PushedState
from llmgw.server.worker_link import AdapterAnswer, NeedAdapter, Report, decode, encode
from llmgw.server.workers import routes_message
from tests.server.test_gate import ALICE, Keys, chat, served
from tests.server.test_routing import Catalog, Registry, Replicas, replica
from tests.server.test_routing import profile as plain_profile


def on_demand_router(held: dict[str, list[str]], slots: int = 4) -> ReplicaRouter:
    lora = attrs.evolve(
        plain_profile("p-lora", slots),
        engine="vllm",
        max_loaded_adapters=2,
        adapters=(Adapter(name="a", path="/a/a"), Adapter(name="b", path="/a/b")),
    )
    router = ReplicaRouter(
        Catalog(lora), Replicas(replica("r1", "p-lora"), replica("r2", "p-lora", node="n2")), Registry()
    )
    router.held = lambda rid: held.get(rid, [])
    return router


async def test_on_demand_routes_offer_only_what_each_engine_holds_here_and_in_a_worker():
    held = {"r1": ["a"]}
    router = on_demand_router(held)
    routes = router.routes("m")
    assert routes.loads_adapters
    assert {r.replica: sorted(r.adapters) for r in routes.replicas} == {"r1": ["a"], "r2": []}
    assert router.models() == ["a", "b", "m"]  # both listed, loaded or not

    pushed = decode(encode(attrs.evolve(routes_message(router, lambda model: None), version=7)))
    state = PushedState()
    state.take_routes(pushed)
    assert state.routes_version == 7
    theirs = state.routes("m")
    assert theirs.loads_adapters
    assert {r.replica: sorted(r.adapters) for r in theirs.replicas} == {"r1": ["a"], "r2": []}

    held["r2"] = ["b"]
    router.refresh()
    assert {r.replica: sorted(r.adapters) for r in router.routes("m").replicas} == {"r1": ["a"], "r2": ["b"]}


def test_the_worker_link_carries_adapter_questions_answers_and_counts():
    for message in (
        NeedAdapter(ask=3, model="m", adapter="a"),
        AdapterAnswer(
            ask=3, status=502, message="the engine said no", code="adapter_load_failed", routes_version=9
        ),
        Report(
            worker="w0",
            pid=1,
            fresh=True,
            requests=0,
            routes_version=9,
            adapters_in_flight=(("r1", "a", 2),),
            adapters_waiting=(("b", 1),),
        ),
    ):
        assert decode(encode(message)) == message


class Loader:
    """A stand-in for the server's AdapterLoads.need: records the asks, and 'loads' what the
    test says each ask makes a replica hold."""

    def __init__(self, router: ReplicaRouter, held: dict[str, list[str]], gate_of) -> None:
        self.router = router
        self.held = held
        self.gate_of = gate_of
        self.asks: list[str] = []
        self.then: list[tuple[str, str] | None] = []  # per ask: (replica, adapter) it loads, or None

    async def __call__(self, model: str, adapter: str) -> None:
        self.asks.append(adapter)
        change = self.then.pop(0) if self.then else None
        await trio.sleep(1.0)  # a load takes time
        if change is not None:
            self.held.setdefault(change[0], []).append(change[1])
            self.router.refresh()
            self.gate_of().redispatch()


async def test_the_gate_asks_for_a_load_only_when_no_holder_has_room(autojump_clock):
    held = {"r1": ["a"]}
    router = on_demand_router(held, slots=1)
    gate: ControlPlaneGate
    loader = Loader(router, held, lambda: gate)
    gate = ControlPlaneGate(Keys(("s", ALICE)), router, adapter_loader=loader)

    first = await gate.admit(ALICE, "a", *chat())  # r1 holds it and has room: no ask
    assert (first.replica, loader.asks) == ("r1", [])
    assert gate.adapters_in_flight() == {("r1", "a"): 1}

    loader.then = [("r2", "b")]
    second = await gate.admit(ALICE, "b", *chat())  # nobody holds b: asked, then sent where loaded
    assert (second.replica, second.adapter, loader.asks) == ("r2", "b", ["b"])

    gate.finish(first, served(Usage(1, 1, 2)))
    gate.finish(second, served(Usage(1, 1, 2)))
    assert gate.adapters_in_flight() == {}


async def test_a_waiter_whose_adapter_leaves_every_replica_asks_again(autojump_clock):
    held = {"r1": ["a"]}
    router = on_demand_router(held, slots=1)
    gate: ControlPlaneGate
    loader = Loader(router, held, lambda: gate)
    gate = ControlPlaneGate(Keys(("s", ALICE)), router, adapter_loader=loader, queue_timeout=600)

    first = await gate.admit(ALICE, "a", *chat())
    tickets = []
    async with trio.open_nursery() as nursery:

        async def second() -> None:
            tickets.append(await gate.admit(ALICE, "a", *chat()))

        loader.then = [None]  # r1, its holder, is busy: the server says wait for it
        nursery.start_soon(second)
        await trio.sleep(5)
        assert loader.asks == ["a"] and gate.adapters_waiting() == {"a": 1}
        # The server unloads a from r1 (it had made room for another; the waiter was not yet
        # counted): the waiter asks again, and goes where that second ask loads it.
        held["r1"] = []
        loader.then = [("r2", "a")]
        router.refresh()
        gate.redispatch()
    assert loader.asks == ["a", "a"]
    assert tickets[0].replica == "r2" and gate.adapters_waiting() == {}
    gate.finish(first, served(Usage(1, 1, 2)))
    gate.finish(tickets[0], served(Usage(1, 1, 2)))


class GoneReplicas(Replicas):
    """Listed Ready, gone by the time a load is carried out: nothing is posted to an engine."""

    def get(self, replica_id: str) -> None:
        return None


async def test_an_eviction_takes_the_victim_out_of_the_routes_before_another_request_is_routed():
    """A request for b where r1's only slot holds a, idle: a is evicted. Had the routes gone on
    offering a there until the load's own task ran, a fresh request for a could be sent to r1
    and have a unloaded from under it (the CI failure: `violations: ['a1']`). So the task that
    decides refreshes the routes before it first yields."""
    one_slot = attrs.evolve(
        plain_profile("p-lora", 4),
        engine="vllm",
        max_loaded_adapters=1,
        adapters=(Adapter(name="a", path="/a/a"), Adapter(name="b", path="/a/b")),
    )
    refreshes: list[tuple[object, list[str]]] = []
    loads: AdapterLoads
    loads = AdapterLoads(
        Catalog(one_slot),
        GoneReplicas(replica("r1", "p-lora")),
        Registry(),
        in_flight=dict,
        waiting=dict,
        replica_in_flight=lambda model: {},
        on_change=lambda: refreshes.append((trio.lowlevel.current_task(), loads.held("r1"))),
    )
    async with trio.open_nursery() as nursery:
        loads.attach(nursery)
        loads.residency.relearn("r1", ["a"], 0.0)
        with pytest.raises(GatewayError):  # the replica is gone when its load is carried out
            await loads.need("m", "b")
    asker = trio.lowlevel.current_task()
    assert refreshes[0] == (asker, [])  # a left the routes in the asker's own step
    assert loads.held("r1") == [] and loads.unloads == 0
