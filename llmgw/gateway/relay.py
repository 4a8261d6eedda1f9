"""Relaying one OpenAI request to an engine and its answer back, bytes as they come.

The body is decoded once, for the model name (and, for streams, to ask for usage). The answer is
not decoded: non-streaming bodies are passed on as they arrive and searched for their usage at the
end; streams are passed on event by event (see :mod:`llmgw.gateway.usage_scan`), by the stream pump
(:mod:`llmgw.gateway.pump`) where there is one.

Where to: the gate's ticket carries the upstreams in the order chosen for the request (see
:mod:`llmgw.core.routing`); without a gate, the router's order. The relay never reorders them.

Silence: the engine has ``upstream_timeout`` to answer with a head, and may then stay silent that
long between reads. One task (``Relay.watch``, which the listener runs) looks at every exchange in
flight a few times per timeout and cancels those whose engine connection has received nothing
since: a deadline of its own per request cost as much as a socket read.

Traces (when tracing is on; see :mod:`llmgw.tracing`): each model request is a server span named
as OpenTelemetry's GenAI conventions say (``chat m``, ``text_completion m``, ``embeddings m``),
continuing the client's ``traceparent``, with the gate's spans beneath it (authentication, quota,
admission and the routing choice), one ``gateway.upstream`` client span per engine tried (connect,
send, until the answer's head; its context goes to the engine as ``traceparent``, for engines
that trace) and ``gateway.relay`` from the head to the answer's end. The first byte to the client
is an event; the usage and status are attributes. Never the prompt, the answer or a key. Off,
nothing is built: one check per request.

Retries, on the next upstream in that order: a failed connect, and a connection the engine
dropped before a byte of answer (an engine dying, or one just started in a killed one's place):
neither served anything. Once an answer has begun, the request is never sent again — the engine
has worked on it, and running it twice would bill the tokens twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from llmgw import tracing
from llmgw.gateway.contract import Gate, RequestRecord, Router, Upstream
from llmgw.gateway.engine_http import (
    EngineConnection,
    EngineFailed,
    request_bytes,
    request_head,
    with_header,
)
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.pool import MAX_IDLE_PER_UPSTREAM, UpstreamPool
from llmgw.gateway.pump import ClientGone, PumpedStream, StreamPump
from llmgw.gateway.responder import Headers, Responder
from llmgw.gateway.usage_scan import StreamUsage, usage_in_body

log = logging.getLogger(__name__)

# Seconds the engine may take to answer with a head, and then may stay silent between body reads.
# Non-streaming answers only come once generation ends, so this is long.
UPSTREAM_TIMEOUT = 600.0

_UPSTREAM_FAILURES = (trio.BrokenResourceError, EngineFailed, OSError)
# Request heads kept per (upstream, path); a bound, as upstreams change over the process's life.
MAX_CACHED_HEADS = 1024
# How often the silence watch looks, per upstream timeout: the precision of a cut.
WATCHES_PER_TIMEOUT = 4
# Members of a request body that select an engine's adapter or model by other means than `model`:
# SGLang's lora_path, vLLM's lora_request / lora_name, llama.cpp's lora. Only the gateway sets them
# (an Upstream's body_members), after its own checks of what the key may use: from a client, they
# would let a key limited to a base model reach another tenant's adapter.
ENGINE_SELECTING_MEMBERS = ("lora_path", "lora_request", "lora_name", "lora")
_SELECTING_HINT = b'"lora'  # a cheap test before any of them is looked for

# gen_ai.operation.name per path (OpenTelemetry's GenAI semantic conventions).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}


class _NoAnswer(Exception):
    """The engine dropped the connection without a byte of answer to this request; ``reused``:
    on a kept-alive connection, which it may simply have closed before the request came."""

    def __init__(self, error: BaseException, reused: bool) -> None:
        super().__init__(repr(error))
        self.error = error
        self.reused = reused


class RelayAborted(Exception):
    """The engine failed after the answer had begun: the client connection can only be cut."""


class _Exchange:
    """One request's time with its engines, as the silence watch sees it: the scope to cancel,
    the connection it reads, and since when that has received nothing new."""

    __slots__ = ("scope", "connection", "seen", "since")

    def __init__(self, scope: trio.CancelScope, since: float) -> None:
        self.scope = scope
        self.connection: EngineConnection | None = None
        self.seen = -1  # the connection's `received` at the last look
        self.since = since


class Relay:
    def __init__(
        self,
        router: Router,
        *,
        gate: Gate | None = None,
        on_done: Callable[[RequestRecord], None] | None = None,
        upstream_timeout: float = UPSTREAM_TIMEOUT,
        max_idle: int = MAX_IDLE_PER_UPSTREAM,
        pump: StreamPump | None = None,
    ) -> None:
        self.router = router
        self.pump = pump  # relays streamed answers; without one, each request's task does
        self.gate = gate
        self.on_done = on_done
        self.upstream_timeout = upstream_timeout
        self.max_idle = max_idle
        self.pools: dict[tuple[str, int], UpstreamPool] = {}
        self._heads: dict[tuple[Upstream, str], bytes] = {}
        self._exchanges: set[_Exchange] = set()

    async def watch(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Cancels every exchange whose engine has been silent for `upstream_timeout`, until
        cancelled. It looks WATCHES_PER_TIMEOUT times per timeout (at least once a second), so
        a silent engine is cut between one timeout and that plus two looks."""
        interval = min(1.0, self.upstream_timeout / WATCHES_PER_TIMEOUT)
        task_status.started()
        while True:
            await trio.sleep(interval)
            now = trio.current_time()
            for exchange in list(self._exchanges):
                connection = exchange.connection
                received = connection.received if connection is not None else -1
                if received != exchange.seen:
                    exchange.seen = received
                    exchange.since = now
                elif now - exchange.since >= self.upstream_timeout:
                    exchange.scope.cancel()

    def models(self, authorization: str | None) -> list[tuple[str, str | None]]:
        """GET /v1/models: the served models this caller may use, each with its base model when
        it is an adapter (None when it is not). 401 (GatewayError) for an unknown key."""
        served = self.router.models()
        if self.gate is not None:
            served = self.gate.models(self.gate.authenticate(authorization), served)
        return [(name, self.router.parent(name)) for name in served]

    async def forward(
        self,
        client: Responder,
        path: str,
        body: bytes | Callable[[], Awaitable[bytes]],
        authorization: str | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> None:
        """Answers one model request. ``body``: the body, or what reads it, called once the key
        was accepted, so that an unknown caller never makes the process hold one; a refusal
        before it was read closes the connection (the caller lingers). ``trace_context``: the
        client's traceparent (and tracestate) headers, when tracing is on."""
        record = RequestRecord(path=path, started=trio.current_time())
        if not tracing.enabled():  # the one check a request pays for tracing when it is off
            await self._answer(client, path, body, authorization, record, tracing.NO_SPAN)
            return
        operation = OPERATIONS.get(path, path)
        span = tracing.start(
            operation,
            {"gen_ai.operation.name": operation, "http.request.method": "POST", "url.path": path},
            parent=trace_context or None,
            kind="server",
        )
        try:
            with tracing.use(span):
                await self._answer(client, path, body, authorization, record, span)
        finally:
            _end_request_span(span, record)

    async def _answer(
        self,
        client: Responder,
        path: str,
        read: bytes | Callable[[], Awaitable[bytes]],
        authorization: str | None,
        record: RequestRecord,
        span: Any,
    ) -> None:
        """``span``: the request's (current), or NO_SPAN: then nothing here touches tracing."""
        traced = span is not tracing.NO_SPAN
        ticket = None
        body = read if isinstance(read, bytes) else None
        try:
            if self.gate is None:
                caller = None
            elif traced:
                with tracing.span("gateway.authenticate"):
                    caller = self.gate.authenticate(authorization)
            else:
                caller = self.gate.authenticate(authorization)
            if body is None:
                body = await read()  # type: ignore[operator]
            payload = _json_object(body)
            model = payload.get("model")
            if model is None:
                raise GatewayError(400, "the body has no 'model' string", code="missing_model", param="model")
            check_fields(payload)
            if _SELECTING_HINT in body:
                body = _without_selecting_members(payload, body)
            record.model = model
            if traced:
                _request_attributes(span, model, payload)
            if self.gate is not None:
                if model not in self.router.models():
                    raise GatewayError(404, f"The model '{model}' does not exist", code="model_not_found")
                ticket = await self.gate.admit(caller, model, payload, len(body))
            await self._forward(client, path, payload, body, record, ticket, traced)
        except GatewayError as error:
            record.status = error.status
            # Refused before its body was read: the connection cannot carry another request.
            await client.error(error, close=body is None)
            record.completed = True
            if traced and error.status >= 500:  # the gateway's failure; a 4xx is the client's
                tracing.fail(span, f"{error.status} {error.code}: {error}")
        finally:
            record.finished = trio.current_time()
            if ticket is not None:
                self.gate.finish(ticket, record)
            if self.on_done is not None:
                self.on_done(record)

    async def _forward(
        self,
        client: Responder,
        path: str,
        payload: dict,
        body: bytes,
        record: RequestRecord,
        ticket: Any = None,
        traced: bool = False,
    ) -> None:
        model = record.model
        record.stream = payload.get("stream") is True  # check_fields: a bool, or null / absent
        strip_usage = False
        if record.stream:
            options = payload.get("stream_options")
            if options is None or options.get("include_usage") is not True:
                # Always ask for the usage chunk (it is what the request is billed at), and take
                # it out again when the client did not ask for it.
                strip_usage = True
                if "stream_options" not in payload:
                    body = _usage_requested(body)
                else:
                    payload["stream_options"] = {**(options or {}), "include_usage": True}
                    body = json.dumps(payload, separators=(",", ":")).encode()

        upstreams = ticket.upstreams if ticket is not None else self.router.ready_upstreams(model)
        if upstreams is None:
            raise GatewayError(404, f"The model '{model}' does not exist", code="model_not_found")
        if not upstreams:
            raise GatewayError(503, f"No replica of '{model}' is ready", code="no_ready_replica")
        # One scope for the whole exchange, without a deadline: the watch cancels it (see watch).
        scope = trio.CancelScope()
        exchange = _Exchange(scope, record.started)
        self._exchanges.add(exchange)
        try:
            with scope:
                pool, connection = await self._send(upstreams, path, body, record, exchange, traced)
                record.status = connection.status
                if traced:
                    with tracing.span("gateway.relay"):
                        await self._relay_body(client, pool, connection, strip_usage, record)
                else:
                    await self._relay_body(client, pool, connection, strip_usage, record)
        finally:
            self._exchanges.discard(exchange)
        if scope.cancelled_caught:
            if not record.status:
                raise GatewayError(504, "The engine did not answer in time", code="upstream_timeout")
            raise RelayAborted("engine went silent mid-answer")

    def _head(self, upstream: Upstream, path: str) -> bytes:
        key = (upstream, path)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= MAX_CACHED_HEADS:
                self._heads.clear()  # replicas come and go; the live ones are back in one request
            head = self._heads[key] = request_head(upstream.host, upstream.port, path, upstream.engine_key)
        return head

    async def _send(
        self,
        upstreams: Sequence[Upstream],
        path: str,
        body: bytes,
        record: RequestRecord,
        exchange: _Exchange | None = None,
        traced: bool = False,
    ) -> tuple[UpstreamPool, EngineConnection]:
        """Sends the request to the first upstream that takes it, and reads the answer's head.
        A failed connect, or a connection dropped before a byte of answer, moves on to the next:
        that engine served nothing."""
        failure: BaseException | None = None
        for upstream in upstreams:
            key = (upstream.host, upstream.port)
            pool = self.pools.get(key)
            if pool is None:
                pool = self.pools[key] = UpstreamPool(upstream.host, upstream.port, max_idle=self.max_idle)
            sent = _with_members(body, upstream.body_members) if upstream.body_members else body
            head = self._head(upstream, path)
            attempt = tracing.NO_SPAN
            if traced:
                attributes = {"server.address": upstream.host, "server.port": upstream.port}
                attempt = tracing.start(
                    "gateway.upstream", {**attributes, "llmgw.replica": upstream.replica}, kind="client"
                )
                # The engine continues the trace, where it traces (vLLM with an OTLP endpoint).
                head = with_header(head, tracing.inject(attempt))
            request = request_bytes(head, sent)
            try:
                connection = await pool.acquire()
                record.upstream = upstream
                if exchange is not None:
                    exchange.connection = connection
                try:
                    await _exchange(connection, request)
                except _NoAnswer as dropped:
                    if not dropped.reused:
                        raise
                    # The engine closed this kept-alive connection as we reused it (llama.cpp
                    # does after a stream): it never read the request, so a fresh one may carry
                    # it — unless the engine is gone, and then the connect fails like any other.
                    connection = await pool.connect()
                    if exchange is not None:
                        exchange.connection = connection
                    await _exchange(connection, request)
            except OSError as error:  # only a connect raises it: _exchange turns failures into 502s
                log.warning("cannot connect to %s:%d: %s", upstream.host, upstream.port, error)
                failure = error
                why = f"connect: {error}"
            except _NoAnswer as dropped:
                # A fresh connection dropped without a byte of answer: an engine dying (or one
                # just started in its place) that served nothing, so the next may serve it.
                log.warning(
                    "%s:%d dropped a request unanswered: %r", upstream.host, upstream.port, dropped.error
                )
                failure = dropped.error
                why = f"dropped unanswered: {dropped.error!r}"
            except BaseException as error:
                if traced:  # a 502 from _exchange, or a cancellation (not the engine's failure)
                    tracing.end(attempt, error=str(error) if isinstance(error, Exception) else None)
                raise
            else:
                if traced:
                    attempt.set_attribute("http.response.status_code", connection.status)
                    tracing.end(attempt)
                return pool, connection
            if traced:
                tracing.end(attempt, error=why)
            record.upstream = None
        if isinstance(failure, OSError):
            raise GatewayError(502, f"Cannot reach the engine: {failure}", code="upstream_unreachable")
        raise GatewayError(502, f"The engine failed: {failure!r}", code="upstream_failed")

    async def _relay_body(
        self,
        client: Responder,
        pool: UpstreamPool,
        connection: EngineConnection,
        strip_usage: bool,
        record: RequestRecord,
    ) -> None:
        content_type = b"application/json"
        length = None
        for name, value in connection.headers:
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                length = value
        events = StreamUsage(strip=strip_usage) if content_type.startswith(b"text/event-stream") else None
        headers: Headers = [(b"content-type", content_type)]
        if length is not None and events is None:
            headers.append((b"content-length", length))  # otherwise h11 sends it chunked
        client.start(record.status, headers)
        if events is not None and self.pump is not None:
            await self._pump_stream(client, pool, connection, events, record)
            return
        parts: list[bytes] = []
        whole = None  # a non-streaming answer that came in one read
        try:
            while True:
                try:
                    data = await connection.read_body()
                except _UPSTREAM_FAILURES as error:
                    raise RelayAborted(f"engine failed mid-answer: {error!r}") from error
                if data is None:
                    break
                if events is None:
                    if not parts and connection.complete:
                        whole = data  # the usual case: it leaves with its end in one write, below
                        break
                    parts.append(data)
                else:
                    data = events.feed(data)
                if data:
                    await client.send(data)
                    if record.first_byte is None:
                        record.first_byte = trio.current_time()
        except BaseException:
            await connection.aclose()
            raise
        await pool.release(connection)
        if whole is not None:
            record.usage = usage_in_body(whole)
            await client.finish(whole)
            record.first_byte = trio.current_time()
        elif events is None:
            record.usage = usage_in_body(b"".join(parts))
            await client.end()
        else:
            if rest := events.flush():
                await client.send(rest)
            record.usage = events.usage
            await client.end()
        record.completed = True

    async def _pump_stream(
        self,
        client: Responder,
        pool: UpstreamPool,
        connection: EngineConnection,
        events: StreamUsage,
        record: RequestRecord,
    ) -> None:
        """A streamed answer relayed by the pump, while this task watches for silence."""
        head = client.take_head_bytes()
        chunked = b"\r\ntransfer-encoding: chunked\r\n" in head.lower()
        stream = PumpedStream(connection, client.fileno(), events, head=head, chunked=chunked)
        # The stream keeps the time of its last read at no cost; this task wakes once per timeout
        # at most to look at it (the silence watch would cut it too, a look or two later).
        try:
            try:
                self.pump.attach(stream)
                while not stream.done.is_set():
                    with trio.move_on_at(stream.last_read + self.upstream_timeout):
                        await stream.done.wait()
                    if (
                        not stream.done.is_set()
                        and trio.current_time() >= stream.last_read + self.upstream_timeout
                    ):
                        raise RelayAborted("engine went silent mid-answer")
            finally:
                self.pump.detach(stream)
                record.first_byte = stream.first_byte
            if isinstance(stream.failure, ClientGone):
                raise trio.BrokenResourceError(str(stream.failure))
            if stream.failure is not None:
                raise RelayAborted(f"stream cut mid-answer: {stream.failure}")
        except BaseException:
            await connection.aclose()
            raise
        await pool.release(connection)
        record.usage = events.usage
        await client.end()
        record.completed = True

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


async def _exchange(connection: EngineConnection, request: bytes) -> None:
    """Send the request (it carries the engine's key, never the client's) and read the answer's head."""
    received_before = connection.received
    try:
        await connection.send(request)
        await connection.read_head()
    except BaseException as error:
        await connection.aclose()
        failed = isinstance(error, _UPSTREAM_FAILURES)
        if failed and connection.received == received_before:
            raise _NoAnswer(error, connection.reused) from error
        if failed:
            raise GatewayError(502, f"The engine failed: {error!r}", code="upstream_failed") from error
        raise


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


def _usage_requested(body: bytes) -> bytes:
    """`body` (a JSON object with members, none of them stream_options) asking for the usage
    chunk: the member goes in first, and the client's bytes stay as they are. Encoding the payload
    again would cost time that grows with the conversation, for one small member."""
    start = body.index(b"{") + 1  # only whitespace (or a BOM) may come before it
    with memoryview(body) as view:
        return b"".join((view[:start], _INCLUDE_USAGE, b",", view[start:]))


def _with_members(body: bytes, members: bytes) -> bytes:
    """``body`` (a JSON object) with ``members`` (a JSON object's) set in it, replacing the
    client's own of those names: only the gateway chooses what it selects for the engine."""
    return json.dumps({**json.loads(body), **json.loads(members)}, separators=(",", ":")).encode()


def _request_attributes(span: Any, model: str, payload: dict) -> None:
    """What the request asked for, as the GenAI conventions name it: never its messages."""
    span.update_name(f"{span.name} {model}")  # "chat m", as the conventions name it
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("llmgw.stream", payload.get("stream") is True)
    for member in ("max_tokens", "max_completion_tokens"):
        value = payload.get(member)
        if type(value) is int:
            span.set_attribute("gen_ai.request.max_tokens", value)


def _end_request_span(span: Any, record: RequestRecord) -> None:
    span.set_attribute("http.response.status_code", record.status)
    if record.upstream is not None:
        span.set_attribute("llmgw.replica", record.upstream.replica)
    if record.usage is not None:
        span.set_attribute("gen_ai.usage.input_tokens", record.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", record.usage.completion_tokens)
    now = trio.current_time()
    if record.first_byte is not None:
        # A stream's first token; a plain answer's whole body.
        tracing.event(span, "first_byte", at=tracing.epoch(record.first_byte, now))
        span.set_attribute("llmgw.time_to_first_byte_ms", (record.first_byte - record.started) * 1000)
    if not record.completed:
        tracing.fail(span, "the answer did not reach the client whole")
    tracing.end(span, end_time=tracing.epoch(record.finished, now))


def _is_count(value: Any) -> bool:
    """A JSON integer >= 1 (a bool is not one, though Python says it is an int)."""
    return type(value) is int and value >= 1


def check_fields(payload: dict) -> None:
    """The members the gateway acts on (routing, billing, the usage it asks for) have the JSON
    types OpenAI's API documents, else 400 naming the member. Engines parse leniently (vLLM and
    SGLang read "true", 1 or "yes" as a stream): a value the gateway read one way and the engine
    another would be served unbilled."""
    if not isinstance(payload.get("model"), str):
        _bad("model", "a string")
    stream = payload.get("stream")
    if stream is not None and type(stream) is not bool:
        _bad("stream", "a boolean")
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            _bad("stream_options", "an object")
        include = options.get("include_usage")
        if include is not None and type(include) is not bool:
            _bad("stream_options.include_usage", "a boolean")
    for member in ("max_tokens", "max_completion_tokens", "n"):
        value = payload.get(member)
        if value is not None and not _is_count(value):
            _bad(member, "an integer >= 1")


def _bad(member: str, expected: str) -> None:
    raise GatewayError(
        400, f"Invalid type for '{member}': expected {expected}", code="invalid_type", param=member
    )


def _without_selecting_members(payload: dict, body: bytes) -> bytes:
    """`body` without the client's ENGINE_SELECTING_MEMBERS (`payload` loses them too)."""
    found = [member for member in ENGINE_SELECTING_MEMBERS if member in payload]
    if not found:
        return body  # the bytes were in a string, not a key
    for member in found:
        del payload[member]
    return json.dumps(payload, separators=(",", ":")).encode()


def _json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except ValueError:
        raise GatewayError(400, "The body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        # Brackets nested past the interpreter's recursion limit (a few hundred bytes do it).
        raise GatewayError(400, "The body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise GatewayError(400, "The body must be a JSON object", code="invalid_json")
    return payload
