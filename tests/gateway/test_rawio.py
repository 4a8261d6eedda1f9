"""The relay's direct socket reads and writes: what trio's SocketStream promised, kept."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.gateway.rawio import MAX_STREAK, RawSocket


async def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted: list[trio.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
    await listener.aclose()
    return client, accepted[0]


async def test_bytes_go_both_ways_and_a_close_reads_as_empty():
    a, b = await socket_pair()
    raw_a, raw_b = RawSocket(a), RawSocket(b)
    await raw_a.send_all(b"hello")
    assert await raw_b.receive(100) == b"hello"
    big = bytes(range(256)) * 40_000  # 10 MB: more than the socket buffers, so the writer waits
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw_b.send_all, big)
        got = bytearray()
        while len(got) < len(big):
            got += await raw_a.receive(65536)
    assert got == big
    await b.aclose()
    assert await raw_a.receive(100) == b""
    await a.aclose()


async def test_a_waiting_read_is_cancelled():
    a, b = await socket_pair()
    with trio.move_on_after(0.05) as scope:
        await RawSocket(a).receive(100)  # nothing comes
    assert scope.cancelled_caught
    await a.aclose()
    await b.aclose()


async def test_a_read_that_never_blocks_still_yields_and_takes_a_cancel():
    a, b = await socket_pair()
    raw = RawSocket(a)
    await b.send_all(b"x" * (MAX_STREAK * 4))
    await trio.testing.wait_all_tasks_blocked()
    with trio.CancelScope() as scope:
        scope.cancel()
        for _ in range(MAX_STREAK * 4):
            await raw.receive(1)  # always ready: only the streak's checkpoint can deliver the cancel
    assert scope.cancelled_caught
    await a.aclose()
    await b.aclose()


async def test_other_tasks_run_while_one_connection_reads_without_blocking():
    a, b = await socket_pair()
    raw = RawSocket(a)
    await b.send_all(b"y" * 1000)
    await trio.testing.wait_all_tasks_blocked()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        before = ticks
        for _ in range(MAX_STREAK * 3):
            await raw.receive(1)
        assert ticks - before >= 2  # the reader yielded along the way
        nursery.cancel_scope.cancel()
    await a.aclose()
    await b.aclose()


async def test_socket_errors_become_broken_resource_errors():
    a, b = await socket_pair()
    raw = RawSocket(a)
    await a.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await raw.send_all(b"after close")
    with pytest.raises(trio.BrokenResourceError):
        await raw.receive(10)
    await b.aclose()
