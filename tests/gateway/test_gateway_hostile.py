"""The listener against hostile clients, over real sockets on 127.0.0.1: deadlines on heads, bodies
and idle keep-alives, caps on connections (per process and per peer), the key checked before the
body is read, a budget of body bytes in flight, and accept failures (EMFILE) that back off quietly.

Times are trio's (autojump_clock): a client that stays silent costs the test nothing."""

from __future__ import annotations

import errno
import json
import logging
from functools import partial

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from llmgw.gateway import StaticRouter, serve_gateway
from llmgw.gateway.http import ListenerLimits
from llmgw.gateway.metrics import GatewayMetrics
from tests.gateway.test_gateway_relay import FakeEngine, FakeGate, chat

HEALTH = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"
LIMITS = ListenerLimits(
    head_timeout=20.0,
    keepalive_timeout=75.0,
    body_timeout=30.0,
    body_min_rate=1000,
    max_connections=None,
    max_connections_per_peer=None,
)
# Bounds on what a test waits for, in trio's (jumping) time: far past every deadline above.
PATIENCE = 1000.0


async def start(nursery: trio.Nursery, limits: ListenerLimits = LIMITS, **options: object) -> int:
    options.setdefault("router", StaticRouter({"m": []}))
    router = options.pop("router")
    return await nursery.start(partial(serve_gateway, router, "127.0.0.1", 0, limits=limits, **options))


async def connect(port: int, source: str = "127.0.0.1") -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port, local_address=source)


async def read_to_close(stream: trio.SocketStream) -> bytes:
    """Everything the gateway sends until it closes the connection (a reset counts as a close)."""
    answer = b""
    with trio.fail_after(PATIENCE):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return answer
            if not data:
                return answer
            answer += data


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One answer with a content-length, read whole (the connection may stay open)."""
    answer = b""
    with trio.fail_after(PATIENCE):
        while True:
            head, sep, body = answer.partition(b"\r\n\r\n")
            if sep:
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                if len(body) >= length:
                    return answer
            data = await stream.receive_some(65536)
            assert data, answer
            answer += data


async def health(port: int, source: str = "127.0.0.1") -> bytes:
    stream = await connect(port, source)
    try:
        await stream.send_all(HEALTH)
        return await read_answer(stream)
    finally:
        await stream.aclose()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def code_of(answer: bytes) -> str:
    return json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"]


# --- deadlines --------------------------------------------------------------------------------


async def test_a_silent_connection_is_closed_at_the_head_deadline(nursery, autojump_clock):
    port = await start(nursery)
    stream = await connect(port)
    opened = trio.current_time()
    assert await read_to_close(stream) == b""  # nothing said to a client that said nothing
    assert trio.current_time() - opened == pytest.approx(LIMITS.head_timeout, abs=1.0)


async def test_a_head_dripped_a_byte_at_a_time_is_408_at_the_head_deadline(nursery, autojump_clock):
    port = await start(nursery)
    stream = await connect(port)
    opened = trio.current_time()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + b"x-pad: y\r\n" * 100

    async def drip() -> None:
        try:
            for byte in head:  # one byte a second: it would take minutes
                await stream.send_all(bytes([byte]))
                await trio.sleep(1.0)
        except trio.BrokenResourceError:
            pass

    async with trio.open_nursery() as dripping:
        dripping.start_soon(drip)
        answer = await read_to_close(stream)
        dripping.cancel_scope.cancel()
    assert status_of(answer) == 408 and code_of(answer) == "request_timeout"
    assert trio.current_time() - opened < LIMITS.head_timeout + 2.0


async def test_an_idle_keep_alive_is_closed_at_the_keep_alive_timeout_not_the_head_deadline(
    nursery, autojump_clock
):
    port = await start(nursery)
    stream = await connect(port)
    await stream.send_all(HEALTH)
    assert status_of(await read_answer(stream)) == 200
    # Idle between requests past the head deadline, within the keep-alive timeout: still served.
    await trio.sleep(LIMITS.head_timeout + 10.0)
    await stream.send_all(HEALTH)
    assert status_of(await read_answer(stream)) == 200
    idle_from = trio.current_time()
    assert await read_to_close(stream) == b""
    assert trio.current_time() - idle_from == pytest.approx(LIMITS.keepalive_timeout, abs=1.0)


async def test_a_body_that_stops_coming_is_408(nursery, autojump_clock):
    port = await start(nursery)
    stream = await connect(port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 5000\r\n\r\n" + b"{" * 100
    )
    sent = trio.current_time()
    answer = await read_to_close(stream)
    assert status_of(answer) == 408 and code_of(answer) == "request_timeout"
    assert trio.current_time() - sent < LIMITS.body_timeout + 1.0


async def test_a_body_slower_than_the_minimum_rate_is_cut_and_one_at_the_rate_is_served(
    nursery, autojump_clock
):
    engine = FakeEngine()
    port = await start(nursery, router=StaticRouter({"m": [await engine.start(nursery)]}))
    body = json.dumps(chat(), separators=(",", ":")).encode()
    body += b" " * (70_000 - len(body))  # JSON allows trailing whitespace

    async def send_at(rate: float) -> tuple[bytes, float]:
        stream = await connect(port)
        started = trio.current_time()
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        piece = 1000

        async def feed() -> None:
            try:
                for at in range(0, len(body), piece):
                    await stream.send_all(body[at : at + piece])
                    await trio.sleep(piece / rate)
            except trio.BrokenResourceError:
                pass

        async with trio.open_nursery() as feeding:
            feeding.start_soon(feed)
            answer = await read_answer(stream)
            feeding.cancel_scope.cancel()
        await stream.aclose()
        return answer, trio.current_time() - started

    # Half the minimum rate: 140 s to send, cut after body_timeout plus what came at that rate.
    answer, took = await send_at(LIMITS.body_min_rate / 2)
    assert status_of(answer) == 408
    assert took < 2 * LIMITS.body_timeout + 2.0
    # Twice the minimum rate: 35 s of sending, past body_timeout, and served.
    answer, took = await send_at(LIMITS.body_min_rate * 2)
    assert status_of(answer) == 200 and took > LIMITS.body_timeout


# --- caps on connections ----------------------------------------------------------------------


async def test_a_peer_over_its_cap_is_refused_and_others_are_served(nursery, autojump_clock):
    port = await start(nursery, attrs.evolve(LIMITS, max_connections_per_peer=3))
    flood = [await connect(port, "127.0.0.2") for _ in range(3)]
    refused = await connect(port, "127.0.0.2")
    answer = await read_to_close(refused)
    # 503 with its reason, or a bare close when the kernel's reset overtook it.
    assert answer == b"" or (status_of(answer), code_of(answer)) == (503, "too_many_connections")
    assert status_of(await health(port, "127.0.0.1")) == 200
    for stream in flood:
        await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()  # the gateway saw them close
    assert status_of(await health(port, "127.0.0.2")) == 200  # the peer's room came back


async def test_health_answers_through_a_flood_of_silent_connections_at_the_process_cap(
    nursery, autojump_clock
):
    metrics = GatewayMetrics()
    cap = 20
    port = await start(nursery, attrs.evolve(LIMITS, max_connections=cap), metrics=metrics)
    flood = []
    try:
        for _ in range(5 * cap):  # each new one displaces the oldest that has sent no head
            flood.append(await connect(port, "127.0.0.2"))
            assert metrics.connections_open <= cap
        with trio.fail_after(5.0):
            for _ in range(10):
                assert status_of(await health(port)) == 200
        assert metrics.connections_open <= cap
    finally:
        for stream in flood:
            await stream.aclose()


async def test_at_the_process_cap_with_every_connection_busy_a_new_one_is_503(nursery, autojump_clock):
    port = await start(nursery, attrs.evolve(LIMITS, max_connections=2))
    busy = []
    for _ in range(2):  # each mid-body: working, not idle, so neither is displaced
        stream = await connect(port)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 9000\r\n\r\n{")
        busy.append(stream)
    await trio.sleep(1.0)
    refused = await connect(port)
    answer = await read_to_close(refused)
    assert answer == b"" or (status_of(answer), code_of(answer)) == (503, "too_many_connections")
    for stream in busy:
        await stream.aclose()


class FlakyListener(trio.abc.Listener[trio.SocketStream]):
    """A real listener whose accept first fails `failures` times with EMFILE, as at the fd limit."""

    def __init__(self, sock: trio.socket.SocketType, failures: int) -> None:
        self._real = trio.SocketListener(sock)
        self.socket = sock
        self.failures = failures

    async def accept(self) -> trio.SocketStream:
        if self.failures:
            self.failures -= 1
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, "Too many open files")
        return await self._real.accept()

    async def aclose(self) -> None:
        await self._real.aclose()


async def test_emfile_on_accept_backs_off_and_logs_once_per_interval(nursery, autojump_clock, caplog):
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    listener = FlakyListener(sock, failures=200)
    port = await start(nursery, listeners=[listener])
    caplog.set_level(logging.WARNING)
    stream = await connect(port)  # waits in the backlog while accept fails
    await stream.send_all(HEALTH)
    assert status_of(await read_answer(stream)) == 200
    about_accept = [r for r in caplog.records if "accept" in r.getMessage()]
    assert 1 <= len(about_accept) <= 10, [r.getMessage() for r in about_accept]
    assert all(r.exc_info is None for r in about_accept)  # no traceback per failure
    assert "EMFILE" in about_accept[0].getMessage()


# --- the key before the body, and the budget of bodies in flight ------------------------------


async def test_an_unknown_key_is_401_from_the_head_without_the_body_being_read(nursery, autojump_clock):
    engine = FakeEngine()
    upstream = await engine.start(nursery)
    port = await start(nursery, router=StaticRouter({"m": [upstream]}), gate=FakeGate({"m": [upstream]}))
    stream = await connect(port)
    # Ten MiB announced, none sent: the answer comes from the head alone.
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer wrong\r\n"
        b"content-length: 10485760\r\n\r\n"
    )
    with trio.fail_after(5.0):
        answer = await read_to_close(stream)
    assert status_of(answer) == 401 and code_of(answer) == "invalid_api_key"
    assert b"connection: close" in answer.lower()
    assert engine.seen == []


async def test_models_without_a_key_is_401_and_the_connection_closes(nursery, autojump_clock):
    upstream = await FakeEngine().start(nursery)
    port = await start(nursery, router=StaticRouter({"m": [upstream]}), gate=FakeGate({"m": [upstream]}))
    stream = await connect(port)
    await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\ncontent-length: 100000\r\n\r\n")
    with trio.fail_after(5.0):
        answer = await read_to_close(stream)
    assert status_of(answer) == 401


async def test_bodies_in_flight_share_a_budget_a_request_waits_briefly_for_then_503(nursery, autojump_clock):
    engine = FakeEngine()
    upstream = await engine.start(nursery)
    limits = attrs.evolve(LIMITS, max_body_bytes_in_flight=10_000, body_budget_wait=2.0)
    port = await start(nursery, limits, router=StaticRouter({"m": [upstream]}))
    body = json.dumps(chat(), separators=(",", ":")).encode()
    body += b" " * (6000 - len(body))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % len(body)

    holder = await connect(port)
    await holder.send_all(head + body[:10])  # holds 6000 of the 10000 while it sends the rest
    await trio.sleep(0.5)
    late = await connect(port)
    await late.send_all(head)
    answer = await read_to_close(late)
    assert (status_of(answer), code_of(answer)) == (503, "busy")
    assert b"retry-after:" in answer.lower()

    # One that asks while the holder finishes within the wait goes through.
    waiter = await connect(port)
    await waiter.send_all(head)
    await trio.sleep(0.5)
    await holder.send_all(body[10:])
    assert status_of(await read_answer(holder)) == 200
    await waiter.send_all(body)
    assert status_of(await read_answer(waiter)) == 200
    assert len(engine.seen) == 2 and engine.seen[0].body == chat()


async def test_a_body_larger_than_the_whole_budget_is_503_at_once(nursery, autojump_clock):
    limits = attrs.evolve(LIMITS, max_body_bytes_in_flight=1000)
    port = await start(nursery, limits)
    stream = await connect(port)
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 5000\r\n\r\n")
    with trio.fail_after(LIMITS.body_budget_wait / 2):
        answer = await stream.receive_some(65536)
    assert (status_of(answer), code_of(answer)) == (503, "busy")
