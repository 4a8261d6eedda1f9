"""Encoding and framing of link messages.

Framing is newline-delimited JSON: one message per line, UTF-8. JSON text never contains a raw
newline, so a line is a message, and a capture of the stream reads as plain text. A line longer
than ``MAX_MESSAGE_BYTES`` is a protocol error: it bounds what a broken or hostile peer can make us
buffer before we give up on the connection.
"""

from __future__ import annotations

import json

import cattrs
from cattrs.strategies import configure_tagged_union

from llmgw.wire.messages import MESSAGE_TYPES, Message

# Inventory of a 8-GPU node with processes is a few KiB; later messages (adapter pieces) are sent
# in chunks far below this.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class FramingError(Exception):
    """The peer sent something that is not a stream of messages."""


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False)
    configure_tagged_union(Message, conv, tag_name="type", tag_generator=lambda cl: cl.__name__)
    return conv


converter = _make_converter()


def encode(message: Message) -> bytes:
    data = converter.unstructure(message, Message)
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode(line: bytes) -> Message:
    try:
        data = json.loads(line)
        return converter.structure(data, Message)
    except (ValueError, cattrs.BaseValidationError, KeyError, TypeError) as exc:
        raise FramingError(f"undecodable message: {exc}") from None


class LineDecoder:
    """Splits received bytes into messages; keeps the unfinished tail."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_message_bytes

    @property
    def buffered(self) -> int:
        """Bytes of a message that has not finished arriving."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        return [message for message, _ in self.feed_sized(data) if message is not None]

    def feed_sized(self, data: bytes) -> list[tuple[Message | None, int]]:
        """Complete messages in ``data`` and the buffered bytes before it, each with the number
        of bytes it took on the wire (newline included), so that a receiver can return exactly
        that much flow-control credit when the message is consumed. Blank lines come back as
        ``(None, size)``."""
        self._buffer += data
        out: list[tuple[Message | None, int]] = []
        start = 0
        while (end := self._buffer.find(b"\n", start)) != -1:
            line = bytes(self._buffer[start:end])
            out.append((decode(line) if line.strip() else None, end + 1 - start))
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) > self._max:
            raise FramingError(f"message longer than {self._max} bytes")
        return out


__all__ = ["FramingError", "LineDecoder", "MESSAGE_TYPES", "converter", "decode", "encode"]
