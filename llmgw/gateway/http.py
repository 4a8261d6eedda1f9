"""The data-plane listener: HTTP/1.1 with keep-alive, one task per client connection.

Each connection reads a request (its body whole, up to a limit), answers it, and goes on to the next
on the same connection while both sides keep it open. A connection's failure ends that connection
only: everything it raises is caught and logged here, never passed to the listener's nursery.

A request refused before its body was read (too large, unknown path, bad HTTP) is answered and its
connection closed with a lingering close, as nginx does: our side is shut for writing and what the
client still sends is read and dropped for a bounded time. Closing a socket with unread bytes makes
the kernel answer with a reset, which can reach a client that writes its whole body before reading
(Python's urllib) ahead of the answer it never got to read.

Deadlines and caps (see :mod:`llmgw.gateway.limits`): a request head has a deadline, a body a
minimum rate, an idle keep-alive a timeout; connections have caps per process and per peer, and
bodies in flight a budget. The API key is checked from the head, before any of the body is read
or budgeted: a stranger never makes the process hold a body. Accept failing for want of file
descriptors sheds connections that wait for a head and backs off, saying so once per interval.

``GET /health`` answers 200 while ``fresh()`` says this process can serve, 503 otherwise: no key,
and nothing in the body a stranger could learn from.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Sequence

import attrs
import h11
import trio

from llmgw import tracing
from llmgw.core.listener_limits import MAX_BODY_BYTES, ListenerLimits
from llmgw.gateway.contract import Gate, RequestRecord, Router
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.h11_stream import H11Stream
from llmgw.gateway.limits import BodyBudget, Connection, Connections, accept_forever
from llmgw.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from llmgw.gateway.pump import StreamPump
from llmgw.gateway.relay import UPSTREAM_TIMEOUT, Relay, RelayAborted
from llmgw.gateway.responder import Responder

log = logging.getLogger(__name__)

__all__ = ["MAX_BODY_BYTES", "ListenerLimits", "serve_gateway"]

MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
MODELS_PATH = "/v1/models"
# Prometheus text of the gateway, without a key (see gateway.metrics); 404 unless metrics are given.
METRICS_PATH = "/metrics"
# For load balancers and probes: no key, nothing revealed.
HEALTH_PATH = "/health"
_HEALTH_BODIES = {200: b'{"status":"ok"}', 503: b'{"status":"unavailable"}'}

# The lingering close's bounds: in all, and of silence from the client. A client writing a body to
# a refused request at loopback or LAN speed finishes well within them; one that keeps the
# connection open without sending is not worth waiting for. Every refused connection costs a task
# for no longer than LINGER_SECONDS.
LINGER_SECONDS = 5.0
LINGER_IDLE_SECONDS = 2.0
# What one read of the lingering close takes from the socket, into a buffer that is then dropped.
LINGER_READ_SIZE = 256 * 1024

_CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)

# A probe's (GET /health, /metrics) body: it has none; more is not read into memory.
PROBE_MAX_BODY_BYTES = 4096
# Retry-After of a 503 for want of room (connections, body budget): room comes back as requests end.
BUSY_RETRY_AFTER = 1.0


async def serve_gateway(
    router: Router,
    host: str,
    port: int,
    *,
    gate: Gate | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    metrics: GatewayMetrics | None = None,
    max_body_bytes: int | None = None,
    limits: ListenerLimits | None = None,
    upstream_timeout: float = UPSTREAM_TIMEOUT,
    use_pump: bool = True,
    fresh: Callable[[], bool] | None = None,
    listeners: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the OpenAI API on host:port (0: any free port) until cancelled; reports the bound port.

    `fresh()` says whether this process's state is fresh enough to serve, for GET /health (None:
    always). `limits`: deadlines and caps (`max_body_bytes` overrides its field). `use_pump=False`
    relays streams with a task each, as where epoll is missing (for comparison). `listeners`:
    sockets already listening (a gateway worker's, bound with SO_REUSEPORT beside its siblings');
    host and port are then not used."""
    limits = limits or ListenerLimits()
    if max_body_bytes is not None:
        limits = attrs.evolve(limits, max_body_bytes=max_body_bytes)
    if metrics is not None:
        on_done = _both(metrics.on_done, on_done)
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        pump = None
        if use_pump and StreamPump.available():
            pump = StreamPump()
            await nursery.start(pump.run)
        relay = Relay(router, gate=gate, on_done=on_done, upstream_timeout=upstream_timeout, pump=pump)
        await nursery.start(relay.watch)
        site = _Site(relay, metrics, limits, fresh or _always)
        try:
            async with trio.open_nursery() as connections:
                for listener in listeners:
                    connections.start_soon(
                        accept_forever,
                        listener,
                        site.connections,
                        lambda stream: _take(site, stream, connections),
                        site.counted,
                    )
                task_status.started(listeners[0].socket.getsockname()[1])
        finally:
            with trio.CancelScope(shield=True):
                await relay.aclose()


class _Site:
    """What every connection of one listener shares."""

    __slots__ = ("relay", "metrics", "limits", "fresh", "connections", "budget")

    def __init__(
        self, relay: Relay, metrics: GatewayMetrics | None, limits: ListenerLimits, fresh: Callable[[], bool]
    ) -> None:
        self.relay = relay
        self.metrics = metrics
        self.limits = limits
        self.fresh = fresh
        self.connections = Connections(limits)
        self.budget = BodyBudget(limits.max_body_bytes_in_flight)

    def counted(self) -> None:
        if self.metrics is not None:
            self.metrics.connections_open = self.connections.open


def _take(site: _Site, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
    try:
        peer = stream.socket.getpeername()[0]
    except OSError:  # reset before we got to it
        stream.socket.close()
        return
    connection = site.connections.admit(peer)
    if connection is None:
        # Refused at once, without a task: a canned 503 into the empty send buffer, then close.
        _write_now(stream, _TOO_MANY_CONNECTIONS)
        stream.socket.close()
        if site.metrics is not None:
            site.metrics.connections_refused += 1
        return
    site.counted()
    if site.metrics is not None:
        site.metrics.connections_accepted += 1
    nursery.start_soon(_serve_connection, site, stream, connection)


def _canned(status: int, reason: bytes, error: GatewayError, retry_after: bool = False) -> bytes:
    """A whole answer written without h11: for a connection refused or timed out before its head."""
    body = error.body()
    extra = b"retry-after: %d\r\n" % BUSY_RETRY_AFTER if retry_after else b""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n%s"
        % (status, reason, len(body), extra, body)
    )


_TOO_MANY_CONNECTIONS = _canned(
    503,
    b"Service Unavailable",
    GatewayError(503, "Too many connections; retry shortly", code="too_many_connections"),
    retry_after=True,
)
_HEAD_TIMEOUT = _canned(
    408,
    b"Request Timeout",
    GatewayError(408, "The request head did not arrive in time", code="request_timeout"),
)


def _write_now(stream: trio.SocketStream, data: bytes) -> None:
    try:
        os.write(stream.socket.fileno(), data)  # non-blocking: what does not fit is dropped
    except OSError:
        pass


def _always() -> bool:
    return True


async def _serve_connection(site: _Site, stream: trio.SocketStream, connection: Connection) -> None:
    client = H11Stream(stream, h11.SERVER)
    try:
        first = True
        while await _serve_request(site, client, connection, first):
            client.conn.start_next_cycle()
            first = False
    except _CLIENT_GONE:
        pass  # the client went away: nothing to tell anyone
    except RelayAborted as error:
        log.warning("cut a client connection: %s", error)
    except Exception:
        log.exception("client connection failed")
    finally:
        site.connections.gone(connection)
        site.counted()
        await client.aclose()


async def _next_head(site: _Site, client: H11Stream, connection: Connection, first: bool) -> h11.Event | None:
    """The next request's head, or None when the connection is to close without a word: the
    client closed it, went quiet between requests, or was displaced for a newer connection.
    A head begun but not finished in time is a 408."""
    limits = site.limits
    conn = client.conn
    scope = trio.CancelScope()
    site.connections.waiting(connection, scope)
    try:
        with scope:
            if not first and not conn.trailing_data[0]:
                # Between requests: the keep-alive timeout for the first byte, then the head's.
                scope.deadline = trio.current_time() + limits.keepalive_timeout
                await client.receive()
            scope.deadline = trio.current_time() + limits.head_timeout
            return await client.next_event()
    finally:
        site.connections.working(connection)
        if scope.cancelled_caught and conn.trailing_data[0] and not connection.displaced:
            _write_now(client.stream, _HEAD_TIMEOUT)
            await _linger(client.stream)
    return None


async def _serve_request(site: _Site, client: H11Stream, connection: Connection, first: bool) -> bool:
    """Answer one request; whether the connection can carry another."""
    relay, metrics, limits = site.relay, site.metrics, site.limits
    responder = Responder(client)
    try:
        request = await _next_head(site, client, connection, first)
        if request is None or type(request) is h11.ConnectionClosed:
            return False
        assert type(request) is h11.Request, request  # h11 gives nothing else to a server here
        path = request.target.decode("ascii", "replace").partition("?")[0]
        method = request.method
        if path == METRICS_PATH and method == b"GET" and metrics is not None:
            await _BodyReader(client, request, limits, PROBE_MAX_BODY_BYTES)()  # h11 must see its end
            text = metrics.exposition()
            responder.start(200, [(b"content-type", CONTENT_TYPE), (b"content-length", b"%d" % len(text))])
            await responder.send(text)
            await responder.end()
            return client.reusable()
        if path == HEALTH_PATH:
            if method != b"GET" and method != b"HEAD":
                raise GatewayError(
                    405, f"{method.decode()} is not allowed on {path}", code="method_not_allowed"
                )
            await _BodyReader(client, request, limits, PROBE_MAX_BODY_BYTES)()
            await _answer_health(responder, site.fresh, head_only=method == b"HEAD")
            return client.reusable()
        if path in MODEL_PATHS and method != b"POST" or path == MODELS_PATH and method != b"GET":
            raise GatewayError(405, f"{method.decode()} is not allowed on {path}", code="method_not_allowed")
        if path not in MODEL_PATHS and path != MODELS_PATH:
            raise GatewayError(404, f"Unknown path {path}", code="not_found")
        authorization = _header(request, b"authorization")
        if path == MODELS_PATH:
            models = relay.models(authorization)  # a 401 here: the body is never read
            await _BodyReader(client, request, limits, PROBE_MAX_BODY_BYTES)()
    except GatewayError as error:
        # The rest of the request was not read, so the connection cannot carry another.
        await responder.error(error, close=True)
        await _linger(client.stream)
        return False
    except h11.RemoteProtocolError as error:
        if client.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            message = f"Malformed HTTP request: {error}"
            bad = GatewayError(error.error_status_hint, message, code="bad_http")
            await responder.error(bad, close=True)
            await _linger(client.stream)
        return False
    if path == MODELS_PATH:
        await responder.respond(200, _models_body(models))
        return client.reusable()
    trace_context = _trace_context(request) if tracing.enabled() else None
    # The relay checks the key first and reads the body only then, within the budget.
    body = _BodyReader(client, request, limits, limits.max_body_bytes, site.budget)
    try:
        await relay.forward(responder, path, body, authorization, trace_context)
    finally:
        site.budget.give(body.taken)
    if client.conn.their_state is h11.SEND_BODY:  # refused before its body was read
        await _linger(client.stream)
        return False
    return client.reusable()


async def _answer_health(responder: Responder, fresh: Callable[[], bool], *, head_only: bool) -> None:
    try:
        status = 200 if fresh() else 503
    except Exception:
        log.exception("the gateway's freshness check failed")
        status = 503
    body = _HEALTH_BODIES[status]
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"cache-control", b"no-store"),
    ]
    responder.start(status, headers)
    if not head_only:  # h11 frames a HEAD's answer with no body, whatever its content-length says
        await responder.send(body)
    await responder.end()


async def _linger(stream: trio.SocketStream) -> None:
    """Half-closes `stream` and drops what the client still sends, until it closes its side or a
    bound passes (see LINGER_SECONDS); the caller then closes the socket."""
    sock = stream.socket
    try:
        sock.shutdown(socket.SHUT_WR)  # the client reads our answer, then the end of it
    except OSError:
        return  # already gone
    drop = bytearray(LINGER_READ_SIZE)
    with trio.move_on_after(LINGER_SECONDS):
        while True:
            with trio.move_on_after(LINGER_IDLE_SECONDS) as idle:
                try:
                    received = await sock.recv_into(drop)
                except OSError:
                    return
            if idle.cancelled_caught or not received:
                return


class _BodyReader:
    """Reads one request's body whole, at most `limit` bytes, within its deadline: BODY_TIMEOUT
    plus its size so far at the minimum rate. With a budget, the body's bytes are taken from it
    first (all of a declared length at once; a chunked body's as they come); ``taken`` is what
    the caller gives back when the request ends."""

    __slots__ = ("client", "request", "limits", "limit", "budget", "taken")

    def __init__(
        self,
        client: H11Stream,
        request: h11.Request,
        limits: ListenerLimits,
        limit: int,
        budget: BodyBudget | None = None,
    ) -> None:
        self.client = client
        self.request = request
        self.limits = limits
        self.limit = limit
        self.budget = budget
        self.taken = 0

    async def _take(self, size: int) -> None:
        if self.budget is None:
            return
        if not await self.budget.take(size, self.limits.body_budget_wait):
            raise GatewayError(
                503, "The gateway holds too many request bodies; retry shortly", code="busy", retry_after=1.0
            )
        self.taken += size

    async def __call__(self) -> bytes:
        limit, limits = self.limit, self.limits
        too_large = GatewayError(413, f"The body exceeds {limit} bytes", code="body_too_large")
        declared = None
        for name, value in self.request.headers:
            if name == b"content-length":
                declared = int(value)  # h11 checked it is a number
                if declared > limit:
                    raise too_large
        if declared:
            await self._take(declared)
        parts = []
        size = 0
        started = trio.current_time()
        with trio.CancelScope(deadline=started + limits.body_timeout) as scope:
            while True:
                event = await self.client.next_event()
                if type(event) is h11.Data:
                    size += len(event.data)
                    if size > limit:
                        raise too_large
                    if declared is None:
                        await self._take(len(event.data))
                    parts.append(event.data)
                    scope.deadline = started + limits.body_timeout + size / limits.body_min_rate
                elif type(event) is h11.EndOfMessage:
                    return b"".join(parts)
                else:
                    raise trio.BrokenResourceError(f"client connection ended mid-request: {event!r}")
        raise GatewayError(408, "The request body did not arrive in time", code="request_timeout")


def _both(first: Callable[[RequestRecord], None], second: Callable[[RequestRecord], None] | None):
    if second is None:
        return first

    def on_done(record: RequestRecord) -> None:
        first(record)
        second(record)

    return on_done


def _header(request: h11.Request, name: bytes) -> str | None:
    for key, value in request.headers:  # h11 lowercases names
        if key == name:
            return value.decode("latin-1")
    return None


def _trace_context(request: h11.Request) -> dict[str, str]:
    """The client's W3C trace context headers, for the request's span to continue."""
    return {
        key.decode("latin-1"): value.decode("latin-1")
        for key, value in request.headers
        if key == b"traceparent" or key == b"tracestate"
    }


def _models_body(models: Sequence[tuple[str, str | None]]) -> bytes:
    # An adapter names its base model in `parent`, as vLLM lists its own adapters.
    data = [
        {"id": name, "object": "model", "owned_by": "llmgw", **({"parent": parent} if parent else {})}
        for name, parent in models
    ]
    return json.dumps({"object": "list", "data": data}).encode()
