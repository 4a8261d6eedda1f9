"""One keep-alive HTTP/1.1 connection to an engine: requests written as bytes, answers parsed by llhttp.

The client side of the gateway keeps h11, whose checks stand between the internet and us. This side
talks only to engines our agents started, with our key, so what it needs is speed: h11 spent about
a third of the gateway's time per request validating heads it had just built and re-framing bodies
in Python. Here a request is one preformatted byte string, and the answer is parsed by llhttp (the
C parser of Node.js, through httptools), which hands over the body with chunked framing removed.

A receive is parsed whole before anything is handed on, so body bytes that arrived together leave
together: a busy stream costs one client write per socket read, not one per chunk.
"""

from __future__ import annotations

import httptools
import trio

from llmgw.gateway.rawio import RawSocket

# One receive per read; SSE events and JSON answers are usually far smaller.
RECEIVE_SIZE = 64 * 1024
# An engine's head is a few hundred bytes; one that never ends is broken, not slow.
MAX_HEAD_BYTES = 64 * 1024
# The answer's headers kept in ``headers``: the relay passes on the first two, and the framing
# depends on the last two.
KEPT_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding"})
_KEPT_LENGTHS = frozenset(len(name) for name in KEPT_HEADERS)


class EngineFailed(Exception):
    """The engine broke HTTP: closed mid-answer, or sent what llhttp cannot parse."""


class EngineConnection:
    """A connection to one engine, one request at a time (no pipelining)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._raw = RawSocket(stream)
        self.reused = False  # it carried an earlier request (a kept-alive connection)
        self.received = 0  # bytes read so far: did the engine say anything since a given moment?
        self._parser = httptools.HttpResponseParser(self)
        self._next_message()

    def _next_message(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lowercased; only KEPT_HEADERS
        self._body: list[bytes] = []
        self._head_done = False
        self._complete = False
        self._keep_alive = False
        self._head_bytes = 0

    # --- llhttp's callbacks, called from inside feed_data --------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only those the relay reads: lowering every name an engine sends cost more than its parse.
        if len(name) in _KEPT_LENGTHS and (lowered := name.lower()) in KEPT_HEADERS:
            self.headers.append((lowered, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # --- the caller's side ---------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        await self._raw.send_all(data)

    async def read_head(self) -> int:
        """Wait for the answer's head; its status (headers are in ``headers``)."""
        while True:
            while not self._head_done:
                await self._receive()
            if not 100 <= self.status < 200:
                return self.status
            # An informational answer (100 Continue): the real head follows on the same message.
            self._next_message()

    async def read_body(self) -> bytes | None:
        """Body bytes as they arrive (all that one read brought), or None once the answer ended."""
        while not self._body:
            if self._complete:
                return None
            await self._receive()
        return self.take_body()

    def take_body(self) -> bytes:
        """The body bytes parsed so far and not yet taken (b"" if none)."""
        body = self._body
        if not body:
            return b""
        self._body = []
        return body[0] if len(body) == 1 else b"".join(body)

    @property
    def complete(self) -> bool:
        """Whether the whole answer has been parsed (some of its body may not be taken yet)."""
        return self._complete

    def fileno(self) -> int:
        return self.stream.socket.fileno()

    def reusable(self) -> bool:
        """Whether the answer ended cleanly and the engine will take another request here."""
        return self._complete and self._keep_alive and not self._body

    def next_cycle(self) -> None:
        self._next_message()
        self.reused = True

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    async def _receive(self) -> None:
        self.feed(await self._raw.receive(RECEIVE_SIZE))

    def feed(self, data: bytes) -> None:
        """Parses what one read brought (b"": the engine closed); for a reader of the socket other
        than this connection's own (the stream pump)."""
        if not data:
            if self._head_done and self._reads_until_close():
                self._complete = True  # a body without length or chunks ends with the connection
                return
            raise EngineFailed("the engine closed the connection")
        self.received += len(data)
        if not self._head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                raise EngineFailed(f"the engine's answer head exceeds {MAX_HEAD_BYTES} bytes")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            raise EngineFailed(f"the engine's answer is not HTTP/1.1: {error}") from None

    def _reads_until_close(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length" or name == b"transfer-encoding" and b"chunked" in value.lower():
                return False
        return True


def request_head(host: str, port: int, path: str, engine_key: str) -> bytes:
    """The head of a POST to an engine, up to the content-length value that each request adds.

    Everything in it comes from the control plane (the path is one of the gateway's own routes,
    the key is hex), never from the client, so nothing here can smuggle a header.
    """
    for value in (host, path, engine_key):
        if "\r" in value or "\n" in value:
            raise ValueError(f"a line break in a request head: {value!r}")
    return (
        f"POST {path} HTTP/1.1\r\n"
        f"host: {host}:{port}\r\n"
        "content-type: application/json\r\n"
        f"authorization: Bearer {engine_key}\r\n"
        "content-length: "
    ).encode("latin-1")


_LENGTH_NAME = b"content-length: "


def with_header(head: bytes, headers: dict[str, str]) -> bytes:
    """A head of :func:`request_head` with ``headers`` too (a trace context, which the tracing
    module formats; a value with a line break is left out rather than let it end the head)."""
    lines = b"".join(
        f"{name}: {value}\r\n".encode("latin-1")
        for name, value in headers.items()
        if "\r" not in value and "\n" not in value and "\r" not in name and "\n" not in name
    )
    return head[: -len(_LENGTH_NAME)] + lines + _LENGTH_NAME


def request_bytes(head: bytes, body: bytes) -> bytes:
    return b"".join((head, b"%d\r\n\r\n" % len(body), body))
