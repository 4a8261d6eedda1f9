"""The stream pump: streamed answers relayed by one task, over real sockets (through a gateway on
127.0.0.1, and on socket pairs for the pump by itself).

The relay's behaviour on streams (chunks as they come, usage stripped, silence cut off) is tested in
test_gateway_relay.py with and without the pump; here is what only the pump has to get right: a
client that cannot keep up, one that leaves, an engine that breaks off, HTTP/1.0 framing, many
streams at once, and an answer that is complete before it is attached.
"""

from __future__ import annotations

import json
import socket

import h11
import pytest
import trio
import trio.testing

from llmgw.gateway.engine_http import EngineConnection
from llmgw.gateway.pump import ClientGone, EngineBroke, PumpedStream, StreamPump
from llmgw.gateway.usage_scan import StreamUsage
from tests.gateway.test_gateway_relay import (
    USAGE_CHUNK,
    Client,
    FakeEngine,
    Gateway,
    chat,
    sse,
    token_chunk,
)

pytestmark = pytest.mark.skipif(not StreamPump.available(), reason="the stream pump needs epoll (Linux)")

STREAM_HEAD = h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")])


def numbered_stream(count: int, *, text: str = "t") -> object:
    """A reply of `count` events, each its own write, numbered so that order shows."""

    async def reply(engine, body: dict) -> None:
        await engine.send(STREAM_HEAD)
        for i in range(count):
            await engine.send(h11.Data(data=sse(token_chunk(f"{text}{i}"))), pause=False)
        await engine.send(h11.Data(data=USAGE_CHUNK + sse(b"[DONE]")), h11.EndOfMessage())

    return reply


def expected(count: int, *, text: str = "t") -> bytes:
    return b"".join(sse(token_chunk(f"{text}{i}")) for i in range(count)) + sse(b"[DONE]")


async def test_many_streams_at_once_each_reach_their_own_client(nursery):
    async def reply(engine, body: dict) -> None:
        await numbered_stream(50, text=body["messages"][0]["content"])(engine, body)

    engine = FakeEngine(reply)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    answers: dict[str, bytes] = {}

    async def one(name: str) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": name}], "stream": True}
        status, answers[name] = await gateway.call("POST", "/v1/chat/completions", body)
        assert status == 200

    async with trio.open_nursery() as clients:
        for n in range(16):
            clients.start_soon(one, f"c{n}-")
    for name, answer in answers.items():
        assert answer == expected(50, text=name)
    records = [await gateway.record() for _ in range(16)]
    assert all(r.completed and r.usage is not None and r.first_byte is not None for r in records)


async def test_a_whole_answer_sent_with_its_head_is_relayed(nursery):
    async def all_at_once(engine, body: dict) -> None:
        events = [h11.Data(data=sse(token_chunk(str(i)))) for i in range(3)]
        await engine.send(
            STREAM_HEAD, *events, h11.Data(data=USAGE_CHUNK + sse(b"[DONE]")), h11.EndOfMessage()
        )

    engine = FakeEngine(all_at_once)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    client = await Client.open(gateway.port)
    for _ in range(2):  # and the connections on both sides carry the next one
        status, body = await client.call("POST", "/v1/chat/completions", chat(stream=True))
        assert (status, body) == (200, b"".join(sse(token_chunk(str(i))) for i in range(3)) + sse(b"[DONE]"))
        assert (await gateway.record()).completed
    assert engine.connections == 1
    await client.http.aclose()


async def test_an_http_1_0_client_gets_the_events_unframed_up_to_the_close(nursery):
    engine = FakeEngine(numbered_stream(5))
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    body = json.dumps(chat(stream=True)).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", gateway.port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
    answer = b""
    with trio.fail_after(10):
        while data := await stream.receive_some(65536):
            answer += data
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"chunked" not in head.lower()
    assert rest == expected(5)
    assert (await gateway.record()).completed
    await stream.aclose()


async def test_an_engine_that_breaks_off_mid_stream_has_its_client_cut(nursery):
    async def breaks_off(engine, body: dict) -> None:
        await engine.send(STREAM_HEAD, h11.Data(data=sse(token_chunk("Hel"))))
        await engine.aclose()

    engine = FakeEngine(breaks_off)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    client = await Client.open(gateway.port)
    await client.send("POST", "/v1/chat/completions", json.dumps(chat(stream=True)).encode())
    assert (await client.head()).status_code == 200
    first = await client.http.next_event()
    assert type(first) is h11.Data and b"Hel" in first.data
    with pytest.raises(h11.RemoteProtocolError):  # the client sees the cut: no last chunk
        await client.http.next_event()
    record = await gateway.record()
    assert (record.status, record.completed) == (200, False)
    await client.http.aclose()


async def test_a_client_that_leaves_mid_stream_frees_the_engine_connection(nursery):
    gone = trio.Event()
    ended = trio.Event()

    async def long_stream(engine, body: dict) -> None:
        await engine.send(STREAM_HEAD, h11.Data(data=sse(token_chunk("first"))))
        await gone.wait()
        try:
            # The gateway finds the client gone on a write, and closes this connection.
            for _ in range(10_000):
                await engine.send(h11.Data(data=sse(token_chunk("more"))))
        except trio.BrokenResourceError:
            ended.set()
            raise

    engine = FakeEngine(long_stream)
    gateway = await Gateway().start(nursery, {"m": [await engine.start(nursery)]})
    client = await Client.open(gateway.port)
    await client.send("POST", "/v1/chat/completions", json.dumps(chat(stream=True)).encode())
    await client.head()
    await client.http.next_event()
    await client.http.aclose()
    gone.set()
    record = await gateway.record()
    assert (record.status, record.completed, record.usage) == (200, False, None)
    with trio.fail_after(10):
        await ended.wait()


# --- the pump by itself, on socket pairs ----------------------------------------------------------


class Pair:
    """An engine connection and a client socket, as the relay hands them to the pump."""

    def __init__(self) -> None:
        engine_side, self.engine = socket.socketpair()
        self.client, client_side = socket.socketpair()
        for one in (engine_side, self.engine, self.client, client_side):
            one.setblocking(False)
        # Small buffers, so that a client that does not read fills them soon.
        for one in (self.client, client_side):
            one.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            one.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.client_side = client_side
        self.connection = EngineConnection(trio.SocketStream(trio.socket.from_stdlib_socket(engine_side)))

    async def stream(self, pump: StreamPump) -> PumpedStream:
        self.engine.send(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        await self.connection.read_head()
        self.pump = pump
        self.pumped = PumpedStream(
            self.connection, self.client.fileno(), StreamUsage(strip=True), head=b"HEAD\r\n\r\n", chunked=True
        )
        pump.attach(self.pumped)
        return self.pumped

    def close(self) -> None:
        """As the relay does: the pump lets go of the stream, then its sockets close."""
        self.pump.detach(self.pumped)
        for one in (self.engine, self.client, self.client_side, self.connection.stream.socket):
            one.close()


def chunk(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            more = sock.recv(65536)
        except BlockingIOError:
            return data
        if not more:
            return data
        data += more


async def test_a_client_that_does_not_read_stops_the_pump_reading_its_engine(nursery):
    pump = StreamPump()
    await nursery.start(pump.run)
    pair = Pair()
    stream = await pair.stream(pump)
    event = sse(token_chunk("x" * 1000))
    frame = chunk(event)
    sent = 0  # bytes of frames in the engine's socket
    # The engine writes until its socket is full. That happens only if the pump stopped reading
    # (it would take bytes for ever otherwise): every buffer on the way holds far less than this.
    full = False
    while sent < 4 * 1024 * 1024 and not full:
        try:
            sent += pair.engine.send(frame[sent % len(frame) :])
        except BlockingIOError:
            full = True
        await trio.testing.wait_all_tasks_blocked()
    assert full, f"the pump took {sent} bytes from the engine for a client that reads none"
    assert stream.blocked and stream.watching_client
    # Then the client reads, and gets every event in order; the engine gets to finish.
    frames, part = divmod(sent, len(frame))
    rest = frame[part:] if part else b""
    frames += 1 if part else 0
    pair.engine.setblocking(True)
    received = b""

    async def client_reads() -> None:
        nonlocal received
        while True:
            await trio.lowlevel.wait_readable(pair.client_side)
            try:
                more = pair.client_side.recv(65536)
            except BlockingIOError:
                continue
            if not more:
                return
            received += more

    async def engine_finishes() -> None:
        await trio.to_thread.run_sync(pair.engine.sendall, rest + b"0\r\n\r\n")
        await stream.done.wait()
        pair.client.close()  # the pump is done with it: the client reads to the end

    async with trio.open_nursery() as both:
        both.start_soon(client_reads)
        both.start_soon(engine_finishes)
    assert stream.failure is None and stream.ended
    assert received.startswith(b"HEAD\r\n\r\n")
    assert h11_chunks(received.removeprefix(b"HEAD\r\n\r\n")) == event * frames
    pair.close()


def h11_chunks(body: bytes) -> bytes:
    """The data of a chunked body (up to and without its last chunk)."""
    data = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            break
        data, body = data + body[:length], body[length + 2 :]
    return data


async def test_a_detached_stream_is_never_touched_again(nursery):
    pump = StreamPump()
    await nursery.start(pump.run)
    pair = Pair()
    stream = await pair.stream(pump)
    pump.detach(stream)
    pump.detach(stream)  # twice is fine: the relay detaches whatever happened
    pair.engine.send(chunk(sse(token_chunk("late"))))
    await trio.testing.wait_all_tasks_blocked()
    assert read_all(pair.client_side) == b"HEAD\r\n\r\n"  # what went at attach, and no more
    assert not stream.done.is_set()
    pair.close()


async def test_a_stream_attached_as_the_pump_stops_fails_at_once():
    pump = StreamPump()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            scope.cancel()
    pair = Pair()
    stream = await pair.stream(pump)
    assert stream.done.is_set() and isinstance(stream.failure, EngineBroke)
    pair.close()


async def test_a_failed_client_write_is_client_gone(nursery):
    pump = StreamPump()
    await nursery.start(pump.run)
    pair = Pair()
    stream = await pair.stream(pump)
    pair.client_side.close()
    pair.engine.send(chunk(sse(token_chunk("to nobody"))))
    with trio.fail_after(10):
        await stream.done.wait()
    assert isinstance(stream.failure, ClientGone)
    pair.close()


async def test_while_several_streams_are_ready_the_pump_lingers_and_relays_chunks_together(nursery):
    pump = StreamPump(linger=0.5)  # long, so that the test can write during it
    await nursery.start(pump.run)
    first, second = Pair(), Pair()
    one = await first.stream(pump)
    await second.stream(pump)
    for pair in (first, second):
        read_all(pair.client_side)  # the heads
    a, b, c, d = (sse(token_chunk(text)) for text in "abcd")
    # Two streams ready at one look: the next wake-up lingers.
    first.engine.send(chunk(a))
    second.engine.send(chunk(a))
    await trio.testing.wait_all_tasks_blocked()
    assert read_all(first.client_side) == chunk(a) and read_all(second.client_side) == chunk(a)
    first.engine.send(chunk(b))
    await trio.testing.wait_all_tasks_blocked()  # the pump woke, and waits
    assert read_all(first.client_side) == b""
    first.engine.send(chunk(c))
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(first.client_side)
    assert read_all(first.client_side) == chunk(b + c)  # one read, one write for both
    # That look found one stream ready: the next chunk goes at once.
    first.engine.send(chunk(d))
    await trio.testing.wait_all_tasks_blocked()
    assert read_all(first.client_side) == chunk(d)
    assert not one.done.is_set()
    first.close()
    second.close()
