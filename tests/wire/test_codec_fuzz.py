"""Fuzzing the agent link's message decoding (issue 27, item 9): any line of bytes, and JSON objects
shaped like messages (a known or unknown type, members of any JSON type). Decoding gives a
message, skips an unknown type, or is a FramingError — the connection's end, never an exception
that escapes it. What reaches the decoder at all is what an accepted link sent: before the join
token is checked nothing is decoded (tests/wire/test_link.py)."""

from __future__ import annotations

import json

import attrs
from hypothesis import given
from hypothesis import strategies as st

from llmgw.wire.codec import FramingError, LineDecoder, UnknownMessage, decode
from llmgw.wire.messages import MESSAGE_TYPES
from tests.fuzzing import FUZZ, json_values

TYPES = sorted(cls.__name__ for cls in MESSAGE_TYPES)
FIELDS = sorted({field.name for cls in MESSAGE_TYPES for field in attrs.fields(cls)})
shaped = st.builds(
    lambda type_name, members: {**members, "type": type_name},
    st.sampled_from(TYPES) | st.text(max_size=10),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6),
)


@FUZZ
@given(st.binary(max_size=1024))
def test_any_line_is_a_message_or_a_framing_error(data):
    line = data.replace(b"\n", b" ")
    try:
        message = decode(line)
    except (FramingError, UnknownMessage):
        return
    assert isinstance(message, MESSAGE_TYPES)


@FUZZ
@given(shaped)
def test_any_message_shaped_object_decodes_is_skipped_or_ends_the_link(obj):
    line = json.dumps(obj).encode()
    decoder = LineDecoder()
    try:
        out = decoder.feed(line + b"\n")
    except FramingError:
        return
    assert all(isinstance(m, MESSAGE_TYPES) for m in out)
