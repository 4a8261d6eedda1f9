"""Writing one response on a client connection.

The head is held back until the first body bytes (or the end) go out, so that a response whose body
is already at hand leaves in one write.
"""

from __future__ import annotations

import math

import h11

from llmgw.gateway.errors import GatewayError
from llmgw.gateway.h11_stream import H11Stream

Headers = list[tuple[bytes, bytes]]


class Responder:
    def __init__(self, client: H11Stream) -> None:
        self._client = client
        self._head: h11.Response | None = None

    def start(self, status: int, headers: Headers) -> None:
        self._head = h11.Response(status_code=status, headers=headers)

    async def send(self, data: bytes) -> None:
        """Body bytes; more follow (end() closes the answer), so the write does not pause."""
        await self._client.send(*self._take_head(), h11.Data(data=data), pause=False)

    def take_head_bytes(self) -> bytes:
        """The held-back head as h11 frames it, for a writer that sends the body itself (the
        stream pump). h11 still closes the message: `end()`."""
        return b"".join(self._client.conn.send(event) or b"" for event in self._take_head())

    def fileno(self) -> int:
        return self._client.stream.socket.fileno()

    async def end(self) -> None:
        await self._client.send(*self._take_head(), h11.EndOfMessage())

    async def finish(self, data: bytes) -> None:
        """The last body bytes and the end, in the write that may also carry the head."""
        await self._client.send(*self._take_head(), h11.Data(data=data), h11.EndOfMessage())

    async def respond(self, status: int, body: bytes, *, close: bool = False, extra: Headers = ()) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *extra]
        if close:
            headers.append((b"connection", b"close"))
        self.start(status, headers)
        await self._client.send(*self._take_head(), h11.Data(data=body), h11.EndOfMessage())

    async def error(self, error: GatewayError, *, close: bool = False) -> None:
        extra: Headers = []
        if error.retry_after is not None:
            # Whole seconds, rounded up: a client that waits exactly that long finds room.
            extra.append((b"retry-after", b"%d" % max(1, math.ceil(error.retry_after))))
        await self.respond(error.status, error.body(), close=close, extra=extra)

    def _take_head(self) -> list[h11.Event]:
        head, self._head = self._head, None
        return [head] if head is not None else []
