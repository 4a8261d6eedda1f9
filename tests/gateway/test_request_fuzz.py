"""Fuzzing the gateway's reading of a request body (issue 27, item 9): any bytes, any JSON shape of
the members it acts on. A body is taken, or refused with a 400 that names the member; nothing else
escapes — no exception that would become a 500 or cut the connection. Bounded here (a few hundred
examples each); `scripts/fuzz.sh` runs the same properties longer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.quota import estimate_parts
from llmgw.core.routing import prefix_key
from llmgw.gateway import GatewayError
from llmgw.gateway.relay import (
    ENGINE_SELECTING_MEMBERS,
    _json_object,
    _without_selecting_members,
    check_fields,
)
from tests.fuzzing import FUZZ, json_values

messages = st.lists(
    st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values | st.text()})
    | json_values,
    max_size=4,
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=12) | json_values,
        "stream": json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
        "n": json_values,
        "messages": messages | json_values,
        "prompt": json_values | st.lists(st.text(max_size=12), max_size=3),
        **{member: json_values for member in ENGINE_SELECTING_MEMBERS},
    },
)
ACTED_ON = {
    "model",
    "stream",
    "stream_options",
    "stream_options.include_usage",
    "max_tokens",
    "max_completion_tokens",
    "n",
}


def read(body: bytes) -> dict | None:
    """The gateway's reading of ``body``, as the relay does it: the object, or None when refused."""
    try:
        payload = _json_object(body)
        check_fields(payload)
    except GatewayError as refused:
        assert refused.status == 400, refused
        assert refused.param is None or refused.param in ACTED_ON, refused.param
        return None
    return payload


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_are_a_json_object_or_a_400(body):
    read(body)


@FUZZ
@given(payloads)
def test_any_shape_of_the_members_acted_on_is_taken_whole_or_refused_naming_one(payload):
    body = json.dumps(payload).encode()
    taken = read(body)
    if taken is None:
        return
    prompt, completion = estimate_parts(taken, len(body))
    assert prompt >= 0 and completion >= 0
    prefix_key(taken)
    stripped = _without_selecting_members(taken, body)
    assert not set(json.loads(stripped)) & set(ENGINE_SELECTING_MEMBERS)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_a_400_not_a_crash(depth):
    body = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(GatewayError) as refused:
        _json_object(body)
    assert refused.value.status == 400 and refused.value.code == "invalid_json"
