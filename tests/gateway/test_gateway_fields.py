"""The fields the gateway acts on are taken only with the JSON types OpenAI documents: a `"true"`
that an engine's lax parser would read as a stream must not slip past the gateway's billing. A
stream always asks the engine for usage; fields that select an engine's adapter are the gateway's."""

from __future__ import annotations

import json

import h11
import pytest

from llmgw.gateway import Usage
from llmgw.gateway.h11_stream import H11Stream
from tests.gateway.test_gateway_relay import (
    USAGE_CHUNK,
    FakeEngine,
    Gateway,
    chat,
    sse,
    streaming_reply,
    token_chunk,
)


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("stream", "true"),
        ("stream", 1),
        ("stream", "yes"),
        ("stream_options", "include_usage"),
        ("stream_options", {"include_usage": "false"}),
        ("stream_options", {"include_usage": 0}),
        ("max_tokens", "100"),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_completion_tokens", "9"),
        ("n", "2"),
        ("n", 0),
        ("n", 2.0),
        ("model", 5),
    ],
)
async def test_a_field_of_the_wrong_type_is_400_naming_it(nursery, member, value):
    engine = FakeEngine(streaming_reply())
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    body = chat()
    if member == "stream_options":
        body["stream"] = True
    body[member] = value
    status, answer = await gateway.call("POST", "/v1/chat/completions", body)
    param = "stream_options.include_usage" if isinstance(value, dict) else member
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"
    assert engine.seen == []


async def test_documented_types_and_nulls_are_taken(nursery):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    body = chat(stream=None, max_tokens=None, n=None, stream_options=None, max_completion_tokens=3)
    assert (await gateway.call("POST", "/v1/chat/completions", body))[0] == 200
    assert (await gateway.call("POST", "/v1/chat/completions", chat(n=2, max_tokens=1)))[0] == 200


async def test_a_stream_asks_for_usage_even_when_the_client_turned_it_off(nursery):
    engine = FakeEngine(streaming_reply())
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    body = chat(stream=True, stream_options={"include_usage": False})
    status, answer = await gateway.call("POST", "/v1/chat/completions", body)
    assert status == 200
    assert engine.seen[0].body["stream_options"] == {"include_usage": True}
    # The client said no to the usage chunk: it does not get it, and the gateway still counts.
    assert answer == sse(token_chunk("Hel")) + sse(token_chunk("lo")) + sse(b"[DONE]")
    assert USAGE_CHUNK not in answer
    record = await gateway.record()
    assert record.usage == Usage(3, 5, 8)


async def test_a_stream_that_ends_without_usage_is_flagged_for_the_estimate(nursery):
    async def no_usage(engine: H11Stream, body: dict) -> None:  # an engine that ignores the ask
        await engine.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
        await engine.send(
            h11.Data(data=sse(token_chunk("x"))), h11.Data(data=sse(b"[DONE]")), h11.EndOfMessage()
        )

    engine = FakeEngine(no_usage)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    assert (await gateway.call("POST", "/v1/chat/completions", chat(stream=True)))[0] == 200
    record = await gateway.record()
    assert record.usage is None and record.usage_missing


@pytest.mark.parametrize("member", ["lora_path", "lora_request", "lora_name", "lora"])
async def test_members_that_select_an_adapter_never_come_from_the_client(nursery, member):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    body = {**chat(), member: "/adapters/other-tenant"}
    assert (await gateway.call("POST", "/v1/chat/completions", body))[0] == 200
    assert member not in engine.seen[0].body
    assert engine.seen[0].body == chat()
    assert json.loads(engine.seen[0].raw) == chat()
