"""Adapters reach the gateway workers: the control plane's routes, through the worker link's
encoding, give a worker the same adapter names, parents and selecting upstreams."""

from __future__ import annotations

import attrs
import trio

from llmgw.core.shard import Adapter
from llmgw.gateway import Usage
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import ReplicaRouter
from llmgw.server.worker import LOADS_STALE_AFTER, PushedState
from llmgw.server.worker_link import decode, encode
from llmgw.server.workers import routes_message
from tests.server.test_gate import ALICE, Keys, chat, served
from tests.server.test_routing import Catalog, Registry, Replicas, profile, replica


def control_plane_router() -> ReplicaRouter:
    lora = attrs.evolve(
        profile("p-lora", 2),
        adapters=(Adapter(name="sql", path="/a/sql.gguf"), Adapter(name="chat", path="/a/chat.gguf")),
    )
    records = (replica("r1", "p-lora"), replica("r2", "p-plain", node="n2"))
    return ReplicaRouter(Catalog(lora, profile("p-plain", 2)), Replicas(*records), Registry())


async def test_a_worker_serves_the_adapters_the_control_plane_pushed():
    router = control_plane_router()
    state = PushedState()
    state.take_routes(decode(encode(routes_message(router, lambda model: None))))
    assert state.models() == router.models() == ["chat", "m", "sql"]
    assert state.base_models() == ["m"]  # what its lanes, reports and the scaler count
    assert [state.parent(n) for n in ("chat", "m", "sql")] == ["m", None, "m"]
    ours = {r.replica: r for r in router.routes("m").replicas}
    theirs = {r.replica: r for r in state.routes("m").replicas}
    assert theirs["r1"].adapters == ours["r1"].adapters and not theirs["r2"].adapters
    assert theirs["r1"].upstream == ours["r1"].upstream  # with the members that select the base


async def test_a_workers_gate_sends_an_adapter_request_where_it_is_served(autojump_clock):
    state = PushedState()
    state.take_routes(decode(encode(routes_message(control_plane_router(), lambda model: None))))
    gate = ControlPlaneGate(Keys(("s", ALICE)), state)
    for _ in range(3):
        ticket = await gate.admit(ALICE, "chat", *chat())
        assert (ticket.model, ticket.adapter, ticket.replica) == ("m", "chat", "r1")
        assert ticket.upstreams[0].body_members == b'{"lora":[{"id":0,"scale":0.0},{"id":1,"scale":1.0}]}'
        gate.finish(ticket, served(Usage(1, 1, 2)))


async def test_a_workers_engine_loads_expire_when_no_control_plane_refreshes_them(autojump_clock):
    """A replica last seen full (its engine queueing) must not stay full to a worker whose server
    is gone: past LOADS_STALE_AFTER without routes the worker routes by its slots alone, and a
    request that waited for room gets it."""
    pushed = decode(encode(routes_message(control_plane_router(), lambda model: None)))
    full = attrs.evolve(
        pushed,
        models=tuple(
            attrs.evolve(
                m, replicas=tuple(attrs.evolve(r, running=0, waiting=3, saturation=1.0) for r in m.replicas)
            )
            for m in pushed.models
        ),
    )
    state = PushedState()
    state.take_routes(full)
    assert all(r.load is not None for r in state.routes("m").replicas)
    gate = ControlPlaneGate(Keys(("s", ALICE)), state, queue_timeout=LOADS_STALE_AFTER * 4)
    started = trio.current_time()
    admitted = []

    async def client():
        admitted.append(await gate.admit(ALICE, "m", *chat()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        await trio.sleep(LOADS_STALE_AFTER / 2)
        assert not admitted and not state.loads_stale(trio.current_time())  # full, and still believed
        await trio.sleep(LOADS_STALE_AFTER)
        assert state.loads_stale(trio.current_time())
        state.rebuild()  # as the worker's _watch_staleness does
        gate.redispatch()
    assert len(admitted) == 1 and trio.current_time() - started < LOADS_STALE_AFTER * 2
    assert all(r.load is None for r in state.routes("m").replicas)
    gate.finish(admitted[0], served(Usage(1, 1, 2)))
