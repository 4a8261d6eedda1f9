"""Adapters reach the gateway workers: the control plane's routes, through the worker link's
encoding, give a worker the same adapter names, parents and selecting upstreams."""

from __future__ import annotations

import attrs

from llmgw.core.shard import Adapter
from llmgw.gateway import Usage
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import ReplicaRouter
from llmgw.server.worker import PushedState
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


def test_a_worker_serves_the_adapters_the_control_plane_pushed():
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
