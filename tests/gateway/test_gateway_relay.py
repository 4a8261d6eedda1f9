"""The data-plane relay against fake engines, over real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import h11
import pytest
import trio

from llmgw.gateway import GatewayError, RequestRecord, StaticRouter, Upstream, Usage, serve_gateway
from llmgw.gateway import pool as pool_module
from llmgw.gateway.engine_http import EngineConnection
from llmgw.gateway.h11_stream import H11Stream
from llmgw.gateway.pool import UpstreamPool
from llmgw.gateway.relay import Relay
from llmgw.gateway.usage_scan import StreamUsage

ENGINE_KEY = "engine-secret"
USAGE = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": USAGE,
}

Reply = Callable[[H11Stream, dict], Awaitable[None]]


@attrs.define
class Seen:
    path: str
    headers: dict[bytes, bytes]
    body: dict
    raw: bytes  # the body as it came


class FakeEngine:
    """An engine speaking just enough HTTP/1.1 (trio + h11), recording what it was sent."""

    def __init__(self, reply: Reply | None = None) -> None:
        self.reply = reply or json_reply
        self.seen: list[Seen] = []
        self.connections = 0

    async def start(self, nursery: trio.Nursery) -> Upstream:
        listeners = await nursery.start(partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
        return Upstream("127.0.0.1", listeners[0].socket.getsockname()[1], ENGINE_KEY)

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        engine = H11Stream(stream, h11.SERVER)
        try:
            while True:
                request = await engine.next_event()
                if type(request) is h11.ConnectionClosed:
                    return
                body = b""
                while type(event := await engine.next_event()) is h11.Data:
                    body += event.data
                self.seen.append(Seen(request.target.decode(), dict(request.headers), json.loads(body), body))
                await self.reply(engine, self.seen[-1].body)
                if not engine.reusable():
                    return
                engine.conn.start_next_cycle()
        except trio.BrokenResourceError:
            pass
        finally:
            await engine.aclose()


async def json_reply(engine: H11Stream, body: dict) -> None:
    data = json.dumps(ANSWER).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await engine.send(h11.Response(status_code=200, headers=headers), h11.Data(data=data), h11.EndOfMessage())


def sse(payload: object) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def token_chunk(text: str) -> dict:
    return {"id": "c", "choices": [{"index": 0, "delta": {"content": text}}], "usage": None}


USAGE_CHUNK = sse({"id": "c", "choices": [], "usage": USAGE})


def streaming_reply(gate: trio.Event | None = None) -> Reply:
    """An SSE answer that, given `gate`, waits on it after its first chunk."""

    async def reply(engine: H11Stream, body: dict) -> None:
        await engine.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
        await engine.send(h11.Data(data=sse(token_chunk("Hel"))))
        if gate is not None:
            await gate.wait()
        await engine.send(h11.Data(data=sse(token_chunk("lo"))))
        if (body.get("stream_options") or {}).get("include_usage"):
            await engine.send(h11.Data(data=USAGE_CHUNK))
        await engine.send(h11.Data(data=sse(b"[DONE]")), h11.EndOfMessage())

    return reply


async def silent_reply(engine: H11Stream, body: dict) -> None:
    await trio.sleep_forever()


class Client:
    """One keep-alive client connection to the gateway."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.http = H11Stream(stream, h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, method: str, path: str, body: bytes = b"", headers: list | None = None) -> None:
        head = [(b"host", b"gateway"), (b"content-length", b"%d" % len(body)), *(headers or [])]
        request = h11.Request(method=method, target=path, headers=head)
        await self.http.send(request, h11.Data(data=body), h11.EndOfMessage())

    async def head(self) -> h11.Response:
        event = await self.http.next_event()
        assert type(event) is h11.Response, event
        return event

    async def rest(self) -> bytes:
        body = b""
        while type(event := await self.http.next_event()) is h11.Data:
            body += event.data
        assert type(event) is h11.EndOfMessage, event
        return body

    async def call(self, method: str, path: str, body: object = b"", headers: list | None = None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        await self.send(method, path, data, headers)
        head = await self.head()
        answer = await self.rest()
        if self.http.reusable():
            self.http.conn.start_next_cycle()
        return head.status_code, json.loads(answer) if answer.startswith(b"{") else answer


class Gateway:
    def __init__(self) -> None:
        # The gateway hands a record over just after the answer's last bytes, maybe after the client
        # read them: tests wait for it on this channel rather than look at a list too early.
        self._records_in, self._records = trio.open_memory_channel[RequestRecord](math.inf)
        self.port = 0

    async def record(self) -> RequestRecord:
        return await self._records.receive()

    async def start(self, nursery: trio.Nursery, routes: dict, **options: object) -> Gateway:
        router = StaticRouter(routes)
        self.port = await nursery.start(
            lambda task_status: serve_gateway(
                router,
                "127.0.0.1",
                0,
                on_done=self._records_in.send_nowait,
                task_status=task_status,
                **options,
            )
        )
        return self

    async def call(self, method: str, path: str, body: object = b"", headers: list | None = None):
        client = await Client.open(self.port)
        try:
            return await client.call(method, path, body, headers)
        finally:
            await client.http.aclose()


# Streams are relayed by the stream pump where there is epoll, by a task each otherwise: both ways.
both_stream_relays = pytest.mark.parametrize("use_pump", [True, False], ids=["pump", "task"])


def chat(stream: bool = False, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}


async def test_non_streaming_relay_replaces_authorization_and_reads_usage(nursery):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    status, body = await gateway.call(
        "POST", "/v1/chat/completions", chat(), [(b"authorization", b"Bearer client-secret")]
    )
    assert (status, body) == (200, ANSWER)
    [seen] = engine.seen
    assert seen.path == "/v1/chat/completions"
    assert seen.headers[b"authorization"] == b"Bearer " + ENGINE_KEY.encode()
    assert b"client-secret" not in b"".join(seen.headers.values())
    assert "stream_options" not in seen.body
    record = await gateway.record()
    assert (record.model, record.status, record.completed) == ("m", 200, True)
    assert record.usage == Usage(3, 5, 8)


@both_stream_relays
async def test_stream_chunks_arrive_before_the_engine_finishes_and_usage_chunk_is_stripped(nursery, use_pump):
    gate = trio.Event()
    engine = FakeEngine(streaming_reply(gate))
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]}, use_pump=use_pump)
    client = await Client.open(gateway.port)
    await client.send("POST", "/v1/chat/completions", json.dumps(chat(stream=True)).encode())
    head = await client.head()
    assert head.status_code == 200
    assert (b"content-type", b"text/event-stream") in head.headers
    first = await client.http.next_event()
    assert first.data == sse(token_chunk("Hel"))  # the engine is still waiting on the gate
    gate.set()
    rest = await client.rest()
    assert rest == sse(token_chunk("lo")) + sse(b"[DONE]")
    assert engine.seen[0].body["stream_options"] == {"include_usage": True}
    record = await gateway.record()
    assert (record.stream, record.usage, record.completed) == (True, Usage(3, 5, 8), True)


async def test_the_usage_request_goes_in_without_encoding_the_body_again(nursery):
    engine = FakeEngine(streaming_reply())
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    # Spacing, key order and escapes as a client wrote them: the engine gets them as they were.
    body = b' {"model" : "m", "messages": [{"role": "user", "content": "caf\\u00e9"}], "stream": true}'
    status, answer = await gateway.call("POST", "/v1/chat/completions", body)
    assert status == 200 and answer.endswith(sse(b"[DONE]")) and USAGE_CHUNK not in answer
    assert engine.seen[0].raw == b' {"stream_options":{"include_usage":true},' + body[2:]
    # A stream_options already there (here null) is replaced, never given a twin.
    status, _ = await gateway.call("POST", "/v1/chat/completions", chat(stream=True, stream_options=None))
    assert status == 200
    assert engine.seen[1].body["stream_options"] == {"include_usage": True}
    assert engine.seen[1].raw.count(b"stream_options") == 1


@both_stream_relays
async def test_stream_usage_chunk_kept_when_the_client_asked(nursery, use_pump):
    engine = FakeEngine(streaming_reply())
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]}, use_pump=use_pump)
    status, body = await gateway.call(
        "POST", "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})
    )
    assert status == 200
    assert body == sse(token_chunk("Hel")) + sse(token_chunk("lo")) + USAGE_CHUNK + sse(b"[DONE]")
    assert (await gateway.record()).usage == Usage(3, 5, 8)


def test_stream_usage_found_across_any_split():
    stream = sse(token_chunk("a")) + USAGE_CHUNK + sse(b"[DONE]")
    for strip in (True, False):
        events = StreamUsage(strip=strip)
        relayed = b"".join(events.feed(stream[i : i + 1]) for i in range(len(stream))) + events.flush()
        assert relayed == stream.replace(USAGE_CHUNK, b"") if strip else stream
        assert events.usage == Usage(3, 5, 8)


def test_usage_on_a_chunk_with_choices_is_read_but_not_stripped():
    last = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": USAGE})
    events = StreamUsage(strip=True)
    assert events.feed(last + sse(b"[DONE]")) == last + sse(b"[DONE]")
    assert events.usage == Usage(3, 5, 8)


async def test_connect_failure_is_retried_on_the_second_upstream(nursery):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = Upstream("127.0.0.1", unused.getsockname()[1], "dead-key")
    engine = FakeEngine()
    live = await engine.start(nursery)
    gateway = await Gateway().start(nursery, {"m": [dead, live]})
    status, body = await gateway.call("POST", "/v1/chat/completions", chat())
    assert (status, body) == (200, ANSWER)
    assert (await gateway.record()).upstream == live


async def test_connect_failure_on_every_upstream_is_502(nursery):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = Upstream("127.0.0.1", unused.getsockname()[1], "dead-key")
    gateway = await Gateway().start(nursery, {"m": [dead]})
    status, body = await gateway.call("POST", "/v1/chat/completions", chat())
    assert (status, body["error"]["code"]) == (502, "upstream_unreachable")


async def test_errors_are_openai_shaped(nursery):
    gateway = await Gateway().start(nursery, {"m": []}, max_body_bytes=100)
    cases = [
        (("POST", "/v1/chat/completions", chat()), 503, "no_ready_replica"),
        (("POST", "/v1/chat/completions", chat(model="other")), 404, "model_not_found"),
        (("POST", "/v1/nowhere", chat()), 404, "not_found"),
        (("GET", "/v1/chat/completions"), 405, "method_not_allowed"),
        (("POST", "/v1/embeddings", b"{not json"), 400, "invalid_json"),
        (("POST", "/v1/embeddings", b"[1]"), 400, "invalid_json"),
        (("POST", "/v1/completions", {"prompt": "x"}), 400, "missing_model"),
        (("POST", "/v1/completions", b"x" * 101), 413, "body_too_large"),
    ]
    for request, status, code in cases:
        got_status, body = await gateway.call(*request)
        assert (got_status, body["error"]["code"]) == (status, code), request
        assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_a_silent_engine_is_504(nursery):
    engine = FakeEngine(silent_reply)
    upstream = await engine.start(nursery)
    gateway = await Gateway().start(nursery, {"m": [upstream]}, upstream_timeout=0.2)
    status, body = await gateway.call("POST", "/v1/chat/completions", chat())
    assert (status, body["error"]["code"]) == (504, "upstream_timeout")
    assert (await gateway.record()).status == 504


@both_stream_relays
async def test_an_engine_silent_mid_stream_has_its_client_cut_off(nursery, use_pump):
    engine = FakeEngine(streaming_reply(gate=trio.Event()))  # never set: silent after one chunk
    gateway = await Gateway().start(
        nursery, {"m": [await engine.start(nursery)]}, upstream_timeout=1.0, use_pump=use_pump
    )
    client = await Client.open(gateway.port)
    await client.send("POST", "/v1/chat/completions", json.dumps(chat(stream=True)).encode())
    assert (await client.head()).status_code == 200
    first = await client.http.next_event()
    assert type(first) is h11.Data and b"Hel" in first.data
    with pytest.raises(h11.RemoteProtocolError):  # cut mid-body, after the timeout
        await client.http.next_event()
    record = await gateway.record()
    assert (record.status, record.completed) == (200, False)
    await client.http.aclose()


def slow_stream(chunks: int, interval: float) -> Reply:
    async def reply(engine: H11Stream, body: dict) -> None:
        await engine.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
        for i in range(chunks):
            await engine.send(h11.Data(data=sse(token_chunk(str(i)))))
            await trio.sleep(interval)
        await engine.send(h11.Data(data=sse(b"[DONE]")), h11.EndOfMessage())

    return reply


@both_stream_relays
async def test_a_stream_that_keeps_talking_outlives_the_silence_timeout(nursery, use_pump):
    engine = FakeEngine(slow_stream(chunks=8, interval=0.2))  # 1.6 s in all, never 1 s silent
    gateway = await Gateway().start(
        nursery, {"m": [await engine.start(nursery)]}, upstream_timeout=1.0, use_pump=use_pump
    )
    status, body = await gateway.call("POST", "/v1/chat/completions", chat(stream=True))
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert all(b'"content": "%d"' % i in body for i in range(8))


async def test_a_non_streaming_answer_in_pieces_is_relayed_whole_with_its_usage(nursery):
    """An answer that comes in two reads takes the path of bodies in parts, not the one-read one."""
    second_half = trio.Event()

    async def in_two_pieces(engine: H11Stream, body: dict) -> None:
        data = json.dumps(ANSWER).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await engine.send(h11.Response(status_code=200, headers=headers), h11.Data(data=data[:10]))
        await second_half.wait()
        await engine.send(h11.Data(data=data[10:]), h11.EndOfMessage())

    engine = FakeEngine(in_two_pieces)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    client = await Client.open(gateway.port)
    await client.send("POST", "/v1/chat/completions", json.dumps(chat()).encode())
    assert (await client.head()).status_code == 200
    first = await client.http.next_event()
    assert first.data == json.dumps(ANSWER).encode()[:10]  # passed on before the rest came
    second_half.set()
    assert json.loads(first.data + await client.rest()) == ANSWER
    record = await gateway.record()
    assert (record.usage, record.completed) == (Usage(3, 5, 8), True)
    await client.http.aclose()


async def test_keep_alive_on_both_sides(nursery):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    client = await Client.open(gateway.port)
    for _ in range(2):
        assert await client.call("POST", "/v1/chat/completions", chat()) == (200, ANSWER)
    assert await client.call("GET", "/v1/models") == (
        200,
        {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llmgw"}]},
    )
    assert engine.connections == 1
    assert len(engine.seen) == 2


async def test_a_client_connection_failure_leaves_others_served(nursery):
    engine = FakeEngine()
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    broken = await trio.open_tcp_stream("127.0.0.1", gateway.port)
    await broken.send_all(b"NOT HTTP AT ALL\r\n\r\n")
    assert b" 400 " in await broken.receive_some(1000)
    await broken.aclose()
    assert await gateway.call("POST", "/v1/chat/completions", chat()) == (200, ANSWER)


@attrs.frozen
class FakeTicket:
    caller: str
    upstreams: tuple[Upstream, ...]  # where the gate sends the request, best first


class FakeGate:
    """Callers are "Bearer good" (may use m) and "Bearer limited" (out of quota)."""

    def __init__(self, routes: dict[str, list[Upstream]]) -> None:
        self.routes = routes
        self.finished: list[tuple[object, RequestRecord]] = []

    def authenticate(self, authorization):
        if authorization not in ("Bearer good", "Bearer limited"):
            raise GatewayError(401, "Incorrect API key", code="invalid_api_key")
        return authorization.removeprefix("Bearer ")

    def models(self, caller, served):
        return [m for m in served if m == "m"]

    async def admit(self, caller, model, payload, body_size):
        if model != "m":
            raise GatewayError(403, f"this key may not use '{model}'", code="model_not_allowed")
        if caller == "limited":
            raise GatewayError(429, "tokens per minute exceeded", code="rate_limited", retry_after=2.5)
        return FakeTicket(caller, tuple(self.routes[model]))

    def finish(self, ticket, record):
        self.finished.append((ticket, record))


async def test_the_gate_authenticates_admits_and_settles(nursery):
    engine = FakeEngine()
    upstream = await engine.start(nursery)
    routes = {"m": [upstream], "other": [upstream]}
    gate = FakeGate(routes)
    gateway = await Gateway().start(nursery, routes, gate=gate)
    good = [(b"authorization", b"Bearer good")]

    assert (await gateway.call("POST", "/v1/chat/completions", chat()))[0] == 401
    assert (await gateway.call("POST", "/v1/chat/completions", chat(), [(b"authorization", b"Bearer x")]))[
        0
    ] == 401
    status, body = await gateway.call("POST", "/v1/chat/completions", {**chat(), "model": "other"}, good)
    assert (status, body["error"]["code"]) == (403, "model_not_allowed")
    status, body = await gateway.call("POST", "/v1/chat/completions", {**chat(), "model": "nope"}, good)
    assert status == 404

    client = await Client.open(gateway.port)
    await client.send(
        "POST", "/v1/chat/completions", json.dumps(chat()).encode(), [(b"authorization", b"Bearer limited")]
    )
    head = await client.head()
    await client.rest()
    assert head.status_code == 429 and (b"retry-after", b"3") in head.headers
    await client.http.aclose()

    assert (await gateway.call("POST", "/v1/chat/completions", chat(), good)) == (200, ANSWER)
    status, models = await gateway.call("GET", "/v1/models", b"", good)
    assert [m["id"] for m in models["data"]] == ["m"]
    assert (await gateway.call("GET", "/v1/models"))[0] == 401
    # Only the admitted request was settled, with what it cost.
    [(ticket, record)] = gate.finished
    assert ticket.caller == "good" and record.usage == Usage(3, 5, 8) and record.status == 200
    assert len(engine.seen) == 1  # nothing refused reached the engine


async def test_a_kept_alive_connection_the_engine_closed_is_replaced_not_a_502(nursery):
    """llama.cpp closes a connection after a streamed answer without saying so: the next request
    on the pooled connection meets a close before any byte of answer. The engine never read it,
    so it goes again on a fresh connection instead of failing with 502."""
    connections = 0

    async def one_answer_per_connection(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        engine = H11Stream(stream, h11.SERVER)
        request = await engine.next_event()
        assert type(request) is h11.Request
        while type(await engine.next_event()) is not h11.EndOfMessage:
            pass
        await json_reply(engine, {})
        # Then the next request arrives on this connection, and the engine hangs up on it without
        # a byte of answer (and without having said "Connection: close").
        engine.conn.start_next_cycle()
        await engine.next_event()
        await engine.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, one_answer_per_connection, 0, host="127.0.0.1"))
    upstream = Upstream("127.0.0.1", listeners[0].socket.getsockname()[1], ENGINE_KEY)
    gateway = await Gateway().start(nursery, {"m": [upstream]})
    client = await Client.open(gateway.port)
    for _ in range(3):
        assert await client.call("POST", "/v1/chat/completions", chat()) == (200, ANSWER)
    assert connections == 3  # each later request went again on a fresh connection
    await client.http.aclose()


async def test_a_kept_alive_connection_to_an_engine_that_died_moves_on_to_the_next_upstream(
    nursery, monkeypatch
):
    """The engine died just after its idle connection was checked: the request finds the
    connection closed, the fresh connect that would replace it is refused, and the request —
    which reached no engine — goes to the next upstream instead of cutting the client off."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        doomed = Upstream("127.0.0.1", unused.getsockname()[1], "dead-key")  # nothing listens now
    live_engine = FakeEngine()
    live = await live_engine.start(nursery)
    router = StaticRouter({"m": [doomed, live]})
    relay = Relay(router)
    # An idle connection the dead engine left behind, closed at its end, that still looks quiet
    # (it was checked a moment before the engine died).
    ours, theirs = socket.socketpair()
    theirs.close()
    stale = EngineConnection(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    stale.reused = True
    pool = relay.pools[(doomed.host, doomed.port)] = UpstreamPool(doomed.host, doomed.port)
    pool._idle.append(stale)
    monkeypatch.setattr(pool_module, "_quiet", lambda connection: True)
    record = RequestRecord(path="/v1/chat/completions", started=0.0, model="m")
    body = json.dumps(chat()).encode()
    _, connection = await relay._send([doomed, live], "/v1/chat/completions", body, record)
    assert record.upstream == live and connection.status == 200
    await connection.aclose()


async def test_an_engine_that_drops_a_request_unanswered_is_passed_over_for_the_next(nursery):
    """An engine that takes the connection and hangs up without a byte of answer (dying, or
    just started in a killed one's place) served nothing: the next upstream gets the request.
    With no next one, it is a 502."""

    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
    dropping = Upstream("127.0.0.1", listeners[0].socket.getsockname()[1], ENGINE_KEY)
    live_engine = FakeEngine()
    live = await live_engine.start(nursery)
    gateway = await Gateway().start(nursery, {"m": [dropping, live], "alone": [dropping]})
    assert await gateway.call("POST", "/v1/chat/completions", chat()) == (200, ANSWER)
    assert (await gateway.record()).upstream == live and len(live_engine.seen) == 1
    status, body = await gateway.call("POST", "/v1/chat/completions", chat(model="alone"))
    assert (status, body["error"]["code"]) == (502, "upstream_failed")
