"""The relay's part in adapters: the members an upstream selects its adapter with are set in
the body it is sent (replacing the client's own), and GET /v1/models names each adapter's base."""

from __future__ import annotations

import json

import attrs

from llmgw.gateway import StaticRouter, serve_gateway
from tests.gateway.test_gateway_relay import ANSWER, FakeEngine, Gateway, chat

LORA = b'{"lora":[{"id":0,"scale":0.0},{"id":1,"scale":1.0}]}'


async def test_the_body_members_of_an_upstream_are_set_in_what_it_is_sent(nursery):
    engine = FakeEngine()
    upstream = attrs.evolve(await engine.start(nursery), body_members=LORA)
    gateway = await Gateway().start(nursery, {"m": [upstream]})
    # The client's own lora list is replaced: only the gateway chooses the engine's adapters.
    status, body = await gateway.call("POST", "/v1/chat/completions", chat(lora=[{"id": 0, "scale": 1}]))
    assert (status, body) == (200, ANSWER)
    [seen] = engine.seen
    assert seen.body == {**chat(), **json.loads(LORA)}


async def test_a_plain_upstream_gets_the_clients_bytes_as_they_were(nursery):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}]}'
    await gateway.call("POST", "/v1/chat/completions", raw, [(b"content-type", b"application/json")])
    [seen] = engine.seen
    assert seen.raw == raw


class AdapterRouter(StaticRouter):
    def parent(self, name: str) -> str | None:
        return "m" if name == "sql" else None


async def test_models_lists_each_adapter_with_its_parent(nursery):
    gateway = Gateway()
    router = AdapterRouter({"m": [], "sql": []})
    gateway.port = await nursery.start(
        lambda task_status: serve_gateway(router, "127.0.0.1", 0, task_status=task_status)
    )
    status, body = await gateway.call("GET", "/v1/models")
    assert status == 200
    assert body["data"] == [
        {"id": "m", "object": "model", "owned_by": "llmgw"},
        {"id": "sql", "object": "model", "owned_by": "llmgw", "parent": "m"},
    ]
