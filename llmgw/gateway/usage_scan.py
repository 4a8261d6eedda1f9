"""Token usage, found in response bytes without decoding the whole response.

Non-streaming bodies carry ``"usage": {...}`` in the JSON; only that object is decoded. Streams
carry it in one chunk near the end (``data: {..."choices":[],"usage":{...}}`` before
``data: [DONE]``) when the request set ``stream_options.include_usage``; every other chunk then has
``"usage":null`` or none. The stream is passed through as bytes: a cheap substring test per read,
and a JSON decode of the one event that holds a usage object.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

_USAGE_KEY = b'"usage"'
# A key inside a JSON string would have escaped quotes, so a bare `"usage"` is always a key.
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_decoder = json.JSONDecoder()


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_json(cls, value: Any) -> Usage | None:
        if not isinstance(value, dict):
            return None
        prompt = value.get("prompt_tokens")
        completion = value.get("completion_tokens", 0)  # embeddings have none
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        total = value.get("total_tokens")
        return cls(prompt, completion, total if isinstance(total, int) else prompt + completion)


def usage_in_body(body: bytes) -> Usage | None:
    """The usage object of a non-streaming JSON response (the last one, as it is top-level)."""
    if _USAGE_KEY not in body:
        return None
    found = list(_USAGE_OBJECT.finditer(body))
    if not found:
        return None
    last = found[-1]
    try:
        value, _ = _decoder.raw_decode(body[last.end() - 1 :].decode())
    except ValueError:  # UnicodeDecodeError is one
        return None
    return Usage.from_json(value)


class StreamUsage:
    """Passes an SSE byte stream through, picking out the usage and dropping its chunk if told to.

    Bytes are passed on a whole event at a time (an event ends with a blank line), so that the usage
    chunk can be cut out; engines write whole events, so in practice nothing waits.
    """

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send on after `chunk` arrived: every event it completed."""
        data = self._partial + chunk if self._partial else chunk
        end = _events_end(data)
        if end < len(data):
            data, self._partial = data[:end], data[end:]
        else:
            self._partial = b""
        if self.usage is None and _USAGE_KEY in data:
            data = self._take_usage(data)
        return data

    def flush(self) -> bytes:
        """What is left once the stream ended: an event without its closing blank line, if any."""
        data, self._partial = self._partial, b""
        if self.usage is None and _USAGE_KEY in data:
            data = self._take_usage(data)
        return data

    def _take_usage(self, data: bytes) -> bytes:
        found = _USAGE_OBJECT.search(data)
        if found is None:
            return data
        start = _events_end(data[: found.start()])
        stop = _next_event_end(data, found.end())
        event = _event_json(data[start:stop])
        if not isinstance(event, dict):
            return data
        self.usage = Usage.from_json(event.get("usage"))
        # Only a usage-only chunk can go whole; one that also carries choices (some engines put the
        # usage on the last token's chunk) stays, as cutting it would mean re-encoding it.
        if self.strip and event.get("choices") == []:
            return data[:start] + data[stop:]
        return data


def _events_end(data: bytes) -> int:
    """The offset just past the last blank line in `data` (0 if none): where complete events end."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _next_event_end(data: bytes, at: int) -> int:
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := data.find(sep, at)) >= 0]
    return min(ends, default=len(data))


def _event_json(event: bytes) -> Any:
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None
