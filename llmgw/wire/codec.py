"""Encoding and framing of link messages.

Framing is newline-delimited JSON: one message per line, UTF-8. JSON text never contains a raw
newline, so a line is a message, and a capture of the stream reads as plain text. A line longer
than ``MAX_MESSAGE_BYTES`` is a protocol error: it bounds what a broken or hostile peer can make us
buffer before we give up on the connection.

A message of a type this side does not know is skipped, with one log line per type: a peer one
version newer sends it, and dropping the link for it would make every agent flap through a
rolling upgrade. Anything else that does not decode (not JSON, no type, a known type with wrong
fields) still ends the connection. Fields a newer peer added to a known type are ignored.
"""

from __future__ import annotations

import json
import logging

import cattrs
from cattrs.strategies import configure_tagged_union

from llmgw.wire.messages import MESSAGE_TYPES, Message

# Inventory of a 8-GPU node with processes is a few KiB; later messages (adapter pieces) are sent
# in chunks far below this.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

log = logging.getLogger(__name__)
_KNOWN_TYPES = frozenset(cls.__name__ for cls in MESSAGE_TYPES)


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


class UnknownMessage(Exception):
    """A well-formed message of a type this side does not know (a newer peer's)."""

    def __init__(self, type_name: str) -> None:
        super().__init__(type_name)
        self.type_name = type_name


def decode(line: bytes) -> Message:
    """The message on ``line``; UnknownMessage for a type this side lacks, FramingError for
    anything else that is not a message."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise FramingError(f"undecodable message: {exc}") from None
    except RecursionError:
        # A few thousand nested brackets fit well within a line: a protocol error, not a crash.
        raise FramingError("undecodable message: nested too deeply") from None
    type_name = data.get("type") if isinstance(data, dict) else None
    if isinstance(type_name, str) and type_name and type_name not in _KNOWN_TYPES:
        raise UnknownMessage(type_name)
    try:
        return converter.structure(data, Message)
    except (ValueError, cattrs.BaseValidationError, KeyError, TypeError) as exc:
        raise FramingError(f"undecodable message: {exc}") from None
    except RecursionError:
        raise FramingError("undecodable message: nested too deeply") from None


class LineDecoder:
    """Splits received bytes into messages; keeps the unfinished tail."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_message_bytes
        self._skipped: set[str] = set()  # unknown types already logged

    @property
    def buffered(self) -> int:
        """Bytes of a message that has not finished arriving."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        return [message for message, _ in self.feed_sized(data) if message is not None]

    def feed_sized(self, data: bytes) -> list[tuple[Message | None, int]]:
        """Complete messages in ``data`` and the buffered bytes before it, each with the number
        of bytes it took on the wire (newline included), so that a receiver can return exactly
        that much flow-control credit when the message is consumed. Blank lines, and messages of
        a type this side does not know, come back as ``(None, size)``."""
        self._buffer += data
        out: list[tuple[Message | None, int]] = []
        start = 0
        while (end := self._buffer.find(b"\n", start)) != -1:
            line = bytes(self._buffer[start:end])
            out.append((self._decode(line) if line.strip() else None, end + 1 - start))
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) > self._max:
            raise FramingError(f"message longer than {self._max} bytes")
        return out

    def _decode(self, line: bytes) -> Message | None:
        try:
            return decode(line)
        except UnknownMessage as unknown:
            if unknown.type_name not in self._skipped:
                self._skipped.add(unknown.type_name)
                log.warning(
                    "skipping link messages of type %r, which this version does not know (the peer "
                    "is newer); said once per connection",
                    unknown.type_name[:64],
                )
            return None


__all__ = ["FramingError", "LineDecoder", "MESSAGE_TYPES", "UnknownMessage", "converter", "decode", "encode"]
