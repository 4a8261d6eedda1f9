"""The data-plane listener: HTTP/1.1 with keep-alive, one task per client connection.

Each connection reads a request (its body whole, up to a limit), answers it, and goes on to the next
on the same connection while both sides keep it open. A connection's failure ends that connection
only: everything it raises is caught and logged here, never passed to the listener's nursery.

A request refused before its body was read (too large, unknown path, bad HTTP) is answered and its
connection closed with a lingering close, as nginx does: our side is shut for writing and what the
client still sends is read and dropped for a bounded time. Closing a socket with unread bytes makes
the kernel answer with a reset, which can reach a client that writes its whole body before reading
(Python's urllib) ahead of the answer it never got to read.

``GET /health`` answers 200 while ``fresh()`` says this process can serve, 503 otherwise: no key,
and nothing in the body a stranger could learn from.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Sequence
from functools import partial

import h11
import trio

from llmgw import tracing
from llmgw.gateway.contract import Gate, RequestRecord, Router
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.h11_stream import H11Stream
from llmgw.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from llmgw.gateway.pump import StreamPump
from llmgw.gateway.relay import UPSTREAM_TIMEOUT, Relay, RelayAborted
from llmgw.gateway.responder import Responder

log = logging.getLogger(__name__)

# Chat requests with long contexts run to a few MB of JSON; past this it is a mistake or an attack.
MAX_BODY_BYTES = 16 * 1024 * 1024

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


async def serve_gateway(
    router: Router,
    host: str,
    port: int,
    *,
    gate: Gate | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    metrics: GatewayMetrics | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    upstream_timeout: float = UPSTREAM_TIMEOUT,
    use_pump: bool = True,
    fresh: Callable[[], bool] | None = None,
    listeners: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the OpenAI API on host:port (0: any free port) until cancelled; reports the bound port.

    `fresh()` says whether this process's state is fresh enough to serve, for GET /health (None:
    always). `use_pump=False` relays streams with a task each, as where epoll is missing (for
    comparison). `listeners`: sockets already listening (a gateway worker's, bound with
    SO_REUSEPORT beside its siblings'); host and port are then not used."""
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
        try:
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(
                partial(_serve_connection, _Site(relay, metrics, max_body_bytes, fresh or _always)), listeners
            )
        finally:
            with trio.CancelScope(shield=True):
                await relay.aclose()


class _Site:
    """What every connection of one listener shares."""

    __slots__ = ("relay", "metrics", "max_body_bytes", "fresh")

    def __init__(
        self, relay: Relay, metrics: GatewayMetrics | None, max_body_bytes: int, fresh: Callable[[], bool]
    ) -> None:
        self.relay = relay
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.fresh = fresh


def _always() -> bool:
    return True


async def _serve_connection(site: _Site, stream: trio.SocketStream) -> None:
    client = H11Stream(stream, h11.SERVER)
    metrics = site.metrics
    if metrics is not None:
        metrics.connections_open += 1
        metrics.connections_accepted += 1
    try:
        while await _serve_request(site, client):
            client.conn.start_next_cycle()
    except _CLIENT_GONE:
        pass  # the client went away: nothing to tell anyone
    except RelayAborted as error:
        log.warning("cut a client connection: %s", error)
    except Exception:
        log.exception("client connection failed")
    finally:
        if metrics is not None:
            metrics.connections_open -= 1
        await client.aclose()


async def _serve_request(site: _Site, client: H11Stream) -> bool:
    """Answer one request; whether the connection can carry another."""
    relay, metrics, max_body_bytes = site.relay, site.metrics, site.max_body_bytes
    responder = Responder(client)
    try:
        request = await client.next_event()
        if type(request) is h11.ConnectionClosed:
            return False
        assert type(request) is h11.Request, request  # h11 gives nothing else to a server here
        path = request.target.decode("ascii", "replace").partition("?")[0]
        method = request.method
        if path == METRICS_PATH and method == b"GET" and metrics is not None:
            await _read_body(client, request, max_body_bytes)  # a GET has none, but h11 must see its end
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
            await _read_body(client, request, max_body_bytes)
            await _answer_health(responder, site.fresh, head_only=method == b"HEAD")
            return client.reusable()
        if path in MODEL_PATHS and method != b"POST" or path == MODELS_PATH and method != b"GET":
            raise GatewayError(405, f"{method.decode()} is not allowed on {path}", code="method_not_allowed")
        if path not in MODEL_PATHS and path != MODELS_PATH:
            raise GatewayError(404, f"Unknown path {path}", code="not_found")
        body = await _read_body(client, request, max_body_bytes)
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
    authorization = _header(request, b"authorization")
    if path == MODELS_PATH:
        try:
            models = relay.models(authorization)
        except GatewayError as error:
            await responder.error(error)
            return client.reusable()
        await responder.respond(200, _models_body(models))
    else:
        trace_context = _trace_context(request) if tracing.enabled() else None
        await relay.forward(responder, path, body, authorization, trace_context)
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


async def _read_body(client: H11Stream, request: h11.Request, limit: int) -> bytes:
    too_large = GatewayError(413, f"The body exceeds {limit} bytes", code="body_too_large")
    for name, value in request.headers:
        if name == b"content-length" and int(value) > limit:  # h11 checked it is a number
            raise too_large
    parts = []
    size = 0
    while True:
        event = await client.next_event()
        if type(event) is h11.Data:
            size += len(event.data)
            if size > limit:
                raise too_large
            parts.append(event.data)
        elif type(event) is h11.EndOfMessage:
            return b"".join(parts)
        else:
            raise trio.BrokenResourceError(f"client connection ended mid-request: {event!r}")


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
