"""Benchmark of the data-plane relay: the gateway's CPU per request and per streamed chunk.

Processes of their own, so that the figure is the gateway's: a fake engine (trio + h11: a fixed
JSON answer, or 100 SSE events at one of four paces, see PACES), the gateway (`serve_gateway` with
a static router; with --full-path also the control plane's gate), a bare byte relay to compare
streams against, and this script as the load generator, with N keep-alive connections. The
gateway gets a core to itself where there are enough; its CPU time is read from its process CPU
clock before and after each phase. Every load is bounded both by a request count and by a time
limit, whichever ends first. Network traffic stays on 127.0.0.1.

    .venv/bin/python scripts/bench_relay.py --full-path --requests 10000 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import h11
import trio

from llmgw.gateway import StaticRouter, Upstream, serve_gateway

ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
REQUEST = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
WARMUP_REQUESTS = 500
STREAM_CHUNKS = 100  # events per streamed answer
TOKEN_INTERVAL = 0.002  # between a stream's events, at the "spaced" pace
STEP_INTERVAL = 0.02  # between decode steps, at the "batched" pace
BATCHED_STREAMS = 64
# How the fake engine sends a stream's events, each in a write of its own:
PACES = {
    # as fast as its socket takes them, without yielding: the engine is not the bottleneck, the
    # gateway is, and events that queue up share its reads (the setting)
    "flood": "8 streams, the engine never the bottleneck",
    # through trio, yielding after each, as an engine's own HTTP server written in Python would
    "yielding": "8 streams, events back to back through trio",
    # a decode step every STEP_INTERVAL gives every running stream its next token at once, as a
    # batching engine (vLLM, llama.cpp's slots) does
    "batched": f"{BATCHED_STREAMS} streams, a decode step every {STEP_INTERVAL * 1e3:g} ms",
    # TOKEN_INTERVAL between a stream's events: every event arrives alone (the worst case)
    "spaced": f"8 streams, {TOKEN_INTERVAL * 1e3:g} ms between events (each arrives alone)",
}


def stream_request(pace: str) -> bytes:
    """A streamed chat request; `pace` (one of PACES) tells the fake engine how to send it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "pace": pace}
    return json.dumps(body, separators=(",", ":")).encode()


STREAM_HEADERS = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
)
USAGE_EVENT = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":100,"total_tokens":103}}\n\n'


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--connections", type=int, default=64, help="keep-alive connections for the throughput phase"
    )
    parser.add_argument("--requests", type=int, default=20000, help="stop after this many")
    parser.add_argument("--seconds", type=float, default=20.0, help="or after this long")
    parser.add_argument(
        "--full-path",
        action="store_true",
        help="the whole gateway path: API key check, quota reservation and settlement, admission"
        " queue, routing, relay and a usage record written to a real store",
    )
    parser.add_argument(
        "--no-pump",
        action="store_true",
        help="relay streams with a task each instead of the stream pump (for comparison)",
    )
    parser.add_argument(
        "--role", choices=["engine", "gateway", "full-gateway", "floor"], help=argparse.SUPPRESS
    )
    parser.add_argument("--engine-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "engine":
        trio.run(serve_engine)
    elif args.role == "gateway":
        router = StaticRouter({"m": [Upstream("127.0.0.1", args.engine_port, "bench-key")]})
        serve = partial(serve_gateway, router, "127.0.0.1", 0, use_pump=not args.no_pump)
        trio.run(serve_and_say_port, serve)
    elif args.role == "full-gateway":
        trio.run(serve_full_gateway, args.engine_port, not args.no_pump)
    elif args.role == "floor":
        serve_floor(args.engine_port)
    else:
        run_benchmark(args)


def run_benchmark(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    # The gateway alone on the first core; the engine and this client share the others.
    gateway_cores, other_cores = {cores[0]}, set(cores[1:]) or {cores[0]}
    engine = spawn(["--role", "engine"], other_cores)
    try:
        engine_port = int(engine.stdout.readline())
        role = "full-gateway" if args.full_path else "gateway"
        pump = ["--no-pump"] if args.no_pump else []
        gateway = spawn(["--role", role, "--engine-port", str(engine_port), *pump], gateway_cores)
        try:
            gateway_port = int(gateway.stdout.readline())
            # The full path's gateway hands out a real API key; the bare relay checks none.
            key = gateway.stdout.readline().strip().encode() if args.full_path else b"client-key"
            os.sched_setaffinity(0, other_cores)
            trio.run(load, gateway_port, key, 1, WARMUP_REQUESTS, args.seconds)
            for connections, count in ((1, min(args.requests, 2000)), (args.connections, args.requests)):
                cpu_before = cpu_seconds(gateway.pid)
                done, elapsed, latencies = trio.run(load, gateway_port, key, connections, count, args.seconds)
                cpu = cpu_seconds(gateway.pid) - cpu_before
                print(
                    f"{connections:3d} connections: {done} requests in {elapsed:.2f} s = {done / elapsed:,.0f}"
                    f" req/s; gateway CPU {cpu / done * 1e6:,.0f} µs/request;"
                    f" latency p50 {statistics.median(latencies) * 1e3:.2f} ms"
                )

            # Streaming: the gateway's cost per relayed chunk (its per-request cost included), and
            # beside it a bare byte relay's under the same load: the least any relay pays here.
            floor = spawn(["--role", "floor", "--engine-port", str(engine_port)], gateway_cores)
            try:
                floor_port = int(floor.stdout.readline())
                regimes = [
                    ("flood", 8, min(args.requests, 500)),
                    ("yielding", 8, min(args.requests, 500)),
                    ("batched", BATCHED_STREAMS, BATCHED_STREAMS * 2),
                    ("spaced", 8, min(args.requests, 80)),
                ]
                for pace, connections, count in regimes:
                    figures = [
                        stream_cost(pid, port, key, stream_request(pace), connections, count, args.seconds)
                        for pid, port in ((gateway.pid, gateway_port), (floor.pid, floor_port))
                    ]
                    print(
                        f"  streaming, {PACES[pace]}: gateway CPU {figures[0]:,.1f} µs/chunk"
                        f" (a bare byte relay: {figures[1]:,.1f})"
                    )
            finally:
                floor.kill()
                floor.wait()
            print(
                f"  for scale, the kernel's part: one loopback write and read of a chunk {loopback_cost():.1f} µs"
            )
            # What the gateway adds to one request's latency: the same load straight at the engine.
            _, _, direct = trio.run(load, engine_port, b"bench-key", 1, 2000, args.seconds)
            _, _, relayed = trio.run(load, gateway_port, key, 1, 2000, args.seconds)
            added = statistics.median(relayed) - statistics.median(direct)
            print(
                f"  latency at 1 connection: engine alone p50 {statistics.median(direct) * 1e3:.2f} ms,"
                f" through the gateway {statistics.median(relayed) * 1e3:.2f} ms: +{added * 1e3:.2f} ms"
            )
            print(f"cores: gateway {sorted(gateway_cores)}, engine and client {sorted(other_cores)}")
        finally:
            gateway.kill()
            gateway.wait()
    finally:
        engine.kill()
        engine.wait()


def stream_cost(
    pid: int, port: int, key: bytes, body: bytes, connections: int, count: int, seconds: float
) -> float:
    """CPU µs of process `pid` per chunk relayed, over up to `count` streamed answers."""
    cpu_before = cpu_seconds(pid)
    done, _, _ = trio.run(load, port, key, connections, count, seconds, body)
    return (cpu_seconds(pid) - cpu_before) / (done * STREAM_CHUNKS) * 1e6


def serve_floor(engine_port: int) -> None:
    """A relay of bytes and nothing else: no HTTP, no key, no usage, no framing; each client
    connection is spliced to an engine connection of its own. One thread, epoll, level-triggered,
    no event loop library. What it costs per chunk is what the kernel and a wake-up cost."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    epoll = select.epoll()
    epoll.register(listener, select.EPOLLIN)
    peers: dict[int, socket.socket] = {}
    sockets: dict[int, socket.socket] = {}
    while True:
        for fd, _ in epoll.poll():
            if fd == listener.fileno():
                client, _ = listener.accept()
                engine = socket.create_connection(("127.0.0.1", engine_port))
                for one, other in ((client, engine), (engine, client)):
                    peers[one.fileno()], sockets[one.fileno()] = other, one
                    epoll.register(one, select.EPOLLIN)
                continue
            # Blocking sockets: a read only follows readiness, and a write that waits is fine here.
            data = sockets[fd].recv(65536)
            if data:
                peers[fd].sendall(data)
            else:
                for one in (sockets[fd], peers[fd]):
                    epoll.unregister(one)
                    del peers[one.fileno()], sockets[one.fileno()]
                    one.close()


def spawn(role: list[str], cores: set[int]) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, __file__, *role], stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(child.pid, cores)
    return child


def cpu_seconds(pid: int) -> float:
    """CPU time of `pid`, user and system, from its process CPU clock (CPUCLOCK_SCHED, the
    scheduler's own count). Not /proc/PID/stat: its ticks are samples, and a process that wakes
    briefly thousands of times a second is sampled badly (the gateway's spaced chunks read 63 µs
    each on ticks, 83 on this clock)."""
    return time.clock_gettime(((~pid) << 3) | 2)


def loopback_cost() -> float:
    """µs for one chunk written to a loopback TCP socket and read at the other end: the kernel's
    share of a relayed chunk, which no relay in user space avoids (it does both, per chunk, when
    chunks arrive one at a time)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as writer:
            reader, _ = server.accept()
            with reader:
                rounds = 20000
                started = time.process_time()
                for _ in range(rounds):
                    writer.send(CHUNK)
                    reader.recv(65536)
                return (time.process_time() - started) / rounds * 1e6


async def serve_full_gateway(engine_port: int, use_pump: bool) -> None:
    """The gateway with the control plane's gate: a real store (temporary), a tenant with
    generous quotas (counted, never hit) and a key whose secret goes to the parent."""
    from llmgw.core.quota import Limits
    from llmgw.server.gate import ControlPlaneGate
    from llmgw.server.routing import FixedRoutes
    from llmgw.server.store import open_store
    from llmgw.server.tenants import Tenants
    from llmgw.server.usage_book import UsageRecorder

    with tempfile.TemporaryDirectory() as data_dir:
        store = await open_store(Path(data_dir))
        try:
            tenants = await Tenants.load(store)
            await tenants.create_tenant("bench", Limits(rpm=10**9, tpm=10**12, tpd=10**13))
            _, secret = await tenants.create_key("bench")
            usage = UsageRecorder(store)
            table = {"m": [Upstream("127.0.0.1", engine_port, "bench-key")]}
            router = StaticRouter(table)
            gate = ControlPlaneGate(tenants, FixedRoutes(table, slots=1024), usage)
            async with trio.open_nursery() as nursery:
                await nursery.start(usage.run)
                port = await nursery.start(
                    partial(serve_gateway, router, "127.0.0.1", 0, gate=gate, use_pump=use_pump)
                )
                print(port, flush=True)
                print(secret, flush=True)
        finally:
            await store.aclose()


async def serve_and_say_port(serve) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve)
        print(port, flush=True)


async def serve_engine() -> None:
    """The fake engine: h11 over trio's own SocketStream (not the gateway's socket code, so its
    pace, one write and one yield per event as an engine sending tokens, is its own)."""

    step = trio.Event()  # set at each decode step, then replaced

    async def decode_steps() -> None:
        nonlocal step
        while True:
            await trio.sleep(STEP_INTERVAL)
            step.set()
            step = trio.Event()

    async def connection(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        head = h11.Response(
            status_code=200,
            headers=[(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))],
        )

        async def next_event() -> h11.Event:
            while (event := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            return event

        async def send(*events: h11.Event) -> None:
            await stream.send_all(b"".join(conn.send(event) or b"" for event in events))

        async def send_now(data: bytes) -> None:
            """A write that yields only if the socket is full."""
            while data:
                try:
                    data = data[os.write(stream.socket.fileno(), data) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(stream.socket)

        try:
            while type(await next_event()) is h11.Request:
                body = b""
                while type(event := await next_event()) is not h11.EndOfMessage:
                    body += event.data
                if b'"stream":true' in body:
                    # One write per event, as an engine sends tokens: the gateway sees each chunk.
                    await send(h11.Response(status_code=200, headers=STREAM_HEADERS))
                    pace = _PACE.search(body)[1]
                    for _ in range(STREAM_CHUNKS):
                        if pace == b"flood":
                            await send_now(b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK))  # h11 is not told
                            continue
                        if pace == b"batched":
                            await step.wait()
                        await send(h11.Data(data=CHUNK))
                        if pace == b"spaced":
                            await trio.sleep(TOKEN_INTERVAL)
                    await send(h11.Data(data=USAGE_EVENT + b"data: [DONE]\n\n"), h11.EndOfMessage())
                else:
                    await send(head, h11.Data(data=ANSWER), h11.EndOfMessage())
                conn.start_next_cycle()
        except trio.BrokenResourceError:
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(decode_steps)
        await trio.serve_listeners(connection, listeners)


async def load(
    port: int, key: bytes, connections: int, count: int, seconds: float, body: bytes = REQUEST
) -> tuple[int, float, list[float]]:
    """Send up to `count` requests for up to `seconds` over `connections` keep-alive connections.

    The request is preformatted bytes and answers are framed by hand (a head, then its
    content-length or chunks up to the last one): this side must cost far less than the gateway,
    or on two cores it, not the gateway, sets the pace, and the gateway's CPU per request would
    be measured half idle, where every read wakes it for one request alone."""
    latencies: list[float] = []
    deadline = trio.current_time() + seconds
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )

    async def client() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buffer = bytearray()

        async def fill() -> None:
            data = await stream.receive_some(65536)
            if not data:
                raise trio.BrokenResourceError("the gateway closed the connection")
            buffer.extend(data)

        try:
            while len(latencies) < count and trio.current_time() < deadline:
                sent = trio.current_time()
                await stream.send_all(request)
                while (end := buffer.find(b"\r\n\r\n")) < 0:
                    await fill()
                head = bytes(buffer[:end]).lower()
                del buffer[: end + 4]
                assert head.startswith(b"http/1.1 200 "), head
                length = _CONTENT_LENGTH.search(head)
                if length is not None:
                    while len(buffer) < int(length[1]):
                        await fill()
                    del buffer[: int(length[1])]
                else:  # chunked: SSE data never holds CRLF, so this is the last chunk
                    while (last := buffer.find(b"\r\n0\r\n\r\n")) < 0:
                        await fill()
                    del buffer[: last + 7]
                latencies.append(trio.current_time() - sent)
        finally:
            await stream.aclose()

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(client)
    return len(latencies), trio.current_time() - started, latencies


_PACE = re.compile(rb'"pace":"(\w+)"')
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)")


if __name__ == "__main__":
    main()
