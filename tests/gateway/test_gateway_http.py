"""The listener's own answers over real sockets on 127.0.0.1: refusals a client can read (413 with a
lingering close) and GET /health."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from email.message import Message
from functools import partial

import pytest
import trio

from llmgw.gateway import StaticRouter, serve_gateway
from llmgw.gateway import http as gateway_http

# What Python's urllib sends whole before it reads a byte of the answer. Far past the listener's
# limit, and past what the kernel's socket buffers hold, so the gateway must read it to answer.
URLLIB_BODY_BYTES = 64 * 1024 * 1024


async def start(nursery: trio.Nursery, **options: object) -> int:
    router = StaticRouter({"m": []})
    return await nursery.start(partial(serve_gateway, router, "127.0.0.1", 0, **options))


def urllib_post(port: int, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """POSTs `body` as urllib does (all of it, then reads); the status and JSON body."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


async def test_urllib_writing_a_64_mib_body_before_reading_gets_the_413(nursery):
    port = await start(nursery)  # the default limit, 16 MiB
    status, body = await trio.to_thread.run_sync(urllib_post, port, b"x" * URLLIB_BODY_BYTES)
    assert (status, body["error"]["code"]) == (413, "body_too_large")
    # A body refused on its path alone is read and dropped the same way.
    status, body = await trio.to_thread.run_sync(
        partial(urllib_post, port, b"x" * URLLIB_BODY_BYTES, path="/v1/nowhere")
    )
    assert (status, body["error"]["code"]) == (404, "not_found")


def raw_chunked_then_read(port: int, chunks: int, chunk: bytes) -> bytes:
    """A raw socket client: a chunked body (no length up front) written whole, then the answer read
    to the end the gateway gives it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n")
        framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        for _ in range(chunks):
            client.sendall(framed)
        client.sendall(b"0\r\n\r\n")
        answer = b""
        while data := client.recv(65536):
            answer += data
        return answer


async def test_a_chunked_body_over_the_limit_is_read_to_its_end_after_the_413(nursery):
    port = await start(nursery, max_body_bytes=1024 * 1024)
    answer = await trio.to_thread.run_sync(raw_chunked_then_read, port, 256, b"y" * 65536)  # 16 MiB
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "body_too_large"


def send_until_cut(port: int, budget: float) -> tuple[bytes, float]:
    """Claims a huge body and sends it slowly, never reading, for at most `budget` seconds; then
    reads what it was answered. Returns the answer and how long the gateway let it send."""
    with socket.create_connection(("127.0.0.1", port), timeout=budget) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 999999999\r\n\r\n")
        started = time.monotonic()
        try:
            while time.monotonic() - started < budget:
                client.sendall(b"z" * 1024)
                time.sleep(0.01)
        except OSError:
            pass  # cut off: what this test waits for
        sent_for = time.monotonic() - started
        try:
            answer = client.recv(65536)
        except OSError:
            answer = b""  # the reset that ended the lingering close may have taken the answer too
        return answer, sent_for


async def test_the_lingering_close_is_bounded_in_time(nursery, monkeypatch):
    monkeypatch.setattr(gateway_http, "LINGER_SECONDS", 0.5)
    port = await start(nursery, max_body_bytes=1000)
    budget = 30.0
    _, sent_for = await trio.to_thread.run_sync(send_until_cut, port, budget)
    # Never cut before the bound (the client never went quiet), always cut well after it.
    assert 0.5 <= sent_for < budget, f"the client could send for {sent_for:.2f} s"


def silent_after_head(port: int, wait: float) -> bytes:
    """Claims a body over the limit, sends none of it, and reads the answer to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 5000\r\n\r\n")
        answer = b""
        while data := client.recv(65536):  # ends at the gateway's half-close, or at its close
            answer += data
        return answer


async def test_a_refused_client_that_goes_quiet_reads_the_413_and_its_end(nursery, monkeypatch):
    monkeypatch.setattr(gateway_http, "LINGER_IDLE_SECONDS", 0.2)
    port = await start(nursery, max_body_bytes=1000)
    answer = await trio.to_thread.run_sync(silent_after_head, port, 30.0)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_too_large"


def get(port: int, path: str, method: str = "GET", headers: dict | None = None) -> tuple[int, bytes, Message]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read(), error.headers


async def test_health_is_200_without_a_key_and_by_default(nursery):
    port = await start(nursery)
    status, body, headers = await trio.to_thread.run_sync(get, port, "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert headers["Cache-Control"] == "no-store"
    status, body, _ = await trio.to_thread.run_sync(partial(get, port, "/health", method="HEAD"))
    assert (status, body) == (200, b"")
    status, body, _ = await trio.to_thread.run_sync(partial(get, port, "/health", method="POST"))
    assert (status, json.loads(body)["error"]["code"]) == (405, "method_not_allowed")


async def test_health_follows_freshness_and_reveals_nothing(nursery):
    state = {"fresh": True}
    port = await start(nursery, fresh=lambda: state["fresh"])
    secret = {"Authorization": "Bearer sk-not-a-key"}
    assert (await trio.to_thread.run_sync(partial(get, port, "/health", headers=secret)))[0] == 200
    state["fresh"] = False
    status, body, _ = await trio.to_thread.run_sync(partial(get, port, "/health", headers=secret))
    assert (status, json.loads(body)) == (503, {"status": "unavailable"})
    state["fresh"] = True
    assert (await trio.to_thread.run_sync(get, port, "/health"))[0] == 200


async def test_health_is_503_when_the_freshness_check_fails(nursery, caplog):
    def broken() -> bool:
        raise RuntimeError("state table is gone")

    port = await start(nursery, fresh=broken)
    status, body, _ = await trio.to_thread.run_sync(get, port, "/health")
    assert (status, json.loads(body)) == (503, {"status": "unavailable"})
    assert b"state table" not in body
    assert "freshness check failed" in caplog.text


@pytest.mark.parametrize("path", ["/health?verbose=1", "/health"])
async def test_health_keeps_the_connection_alive(nursery, path):
    port = await start(nursery)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        for _ in range(2):
            await client.send_all(f"GET {path} HTTP/1.1\r\nhost: gw\r\n\r\n".encode())
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                data = await client.receive_some(4096)
                assert data, answer
                answer += data
            assert answer.startswith(b"HTTP/1.1 200 ")
    finally:
        await client.aclose()
