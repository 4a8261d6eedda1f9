"""The gateway's engine-side HTTP/1.1: answers as engines frame them, and as broken ones do."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.lowlevel

from llmgw.gateway.engine_http import (
    MAX_HEAD_BYTES,
    EngineConnection,
    EngineFailed,
    request_bytes,
    request_head,
)


async def canned_engine(nursery: trio.Nursery, writes: list[bytes], *, close: bool = True):
    """An engine that reads one request head and answers with `writes`, one send each.

    Returns (connection to it, the request bytes it received)."""
    seen = bytearray()

    async def serve(stream: trio.SocketStream) -> None:
        while b"\r\n\r\n" not in seen:
            data = await stream.receive_some(65536)
            if not data:
                return
            seen.extend(data)
        for data in writes:
            await stream.send_all(data)
            await trio.lowlevel.checkpoint()  # separate reads on the other side, most of the time
        if close:
            await stream.aclose()
        else:
            await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return EngineConnection(await trio.open_tcp_stream("127.0.0.1", port)), seen


async def read_all(connection: EngineConnection) -> bytes:
    parts = []
    while (data := await connection.read_body()) is not None:
        assert data, "read_body never returns empty bytes"
        parts.append(data)
    return b"".join(parts)


def test_request_head_carries_the_engine_key_and_the_length():
    head = request_head("10.0.0.5", 8000, "/v1/chat/completions", "k" * 64)
    data = request_bytes(head, b'{"model":"m"}')
    assert data.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.5:8000\r\n")
    assert b"\r\nauthorization: Bearer " + b"k" * 64 + b"\r\n" in data
    assert data.endswith(b"\r\ncontent-length: 13\r\n\r\n" + b'{"model":"m"}')


@pytest.mark.parametrize("field", ["host", "path", "key"])
def test_a_line_break_cannot_reach_a_request_head(field):
    values = {"host": "h", "path": "/v1/completions", "key": "k"}
    values[field] += "\r\nx-injected: 1"
    with pytest.raises(ValueError, match="line break"):
        request_head(values["host"], 1, values["path"], values["key"])


async def test_content_length_answer_and_keep_alive(nursery):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
    connection, seen = await canned_engine(nursery, [head, b'{"a":', b"12345}"], close=False)
    await connection.send(request_bytes(request_head("e", 1, "/v1/completions", "key"), b"{}"))
    assert await connection.read_head() == 200
    assert (b"content-type", b"application/json") in connection.headers  # names lowercased
    assert await read_all(connection) == b'{"a":12345}'
    assert connection.reusable()
    assert seen.endswith(b"content-length: 2\r\n\r\n{}")


async def test_chunked_stream_comes_unframed_and_coalesced(nursery):
    events = [b"data: %d\n\n" % i for i in range(50)]
    chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    # All in one write: what arrives together is handed on together.
    connection, _ = await canned_engine(nursery, [head + b"".join(chunks) + b"0\r\n\r\n"], close=False)
    await connection.send(request_bytes(request_head("e", 1, "/v1/completions", "key"), b"{}"))
    assert await connection.read_head() == 200
    first = await connection.read_body()
    assert first == b"".join(events)
    assert await connection.read_body() is None
    assert connection.reusable()


async def test_an_informational_head_is_skipped(nursery):
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"
    connection, _ = await canned_engine(nursery, [answer], close=False)
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    assert await connection.read_head() == 201
    assert await read_all(connection) == b"ok"


async def test_a_body_without_length_ends_with_the_connection_and_is_not_reused(nursery):
    connection, _ = await canned_engine(nursery, [b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"close"])
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    assert await connection.read_head() == 200
    assert await read_all(connection) == b"until close"
    assert not connection.reusable()


async def test_connection_close_answer_is_not_reused(nursery):
    head = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    connection, _ = await canned_engine(nursery, [head])
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    await connection.read_head()
    assert await read_all(connection) == b"ok"
    assert not connection.reusable()


async def test_closed_mid_body_fails(nursery):
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n"
    connection, _ = await canned_engine(nursery, [head, b"only part"])
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    await connection.read_head()
    assert await connection.read_body() == b"only part"
    with pytest.raises(EngineFailed, match="closed"):
        await connection.read_body()


async def test_closed_before_a_head_fails(nursery):
    connection, _ = await canned_engine(nursery, [])
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    with pytest.raises(EngineFailed, match="closed"):
        await connection.read_head()


async def test_not_http_fails(nursery):
    connection, _ = await canned_engine(nursery, [b"SSH-2.0-OpenSSH_9.2\r\n\r\n"], close=False)
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    with pytest.raises(EngineFailed, match="not HTTP"):
        await connection.read_head()


async def test_a_head_that_never_ends_fails(nursery):
    endless = b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * (MAX_HEAD_BYTES + 10)
    connection, _ = await canned_engine(nursery, [endless], close=False)
    await connection.send(b"GET / HTTP/1.1\r\nhost: e\r\n\r\n")
    with pytest.raises(EngineFailed, match="head exceeds"):
        await connection.read_head()
