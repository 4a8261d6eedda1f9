"""A flood against the gateway as a hostile client on the same network would send it (issue 27).

It starts the real `llmgw server` (gateway.workers: 0, so the gateway, the admin API and the agent
link share one process: the worst case) in a temporary directory, then from this process:

- N silent connections from 127.0.0.2 (they never send a byte), opened as fast as the server
  takes them, for at most --seconds;
- M unauthenticated connections from 127.0.0.3, each announcing a --body-mib body with a wrong
  key and then writing it;
- meanwhile, GET /health on the gateway and GET /healthz on the admin API from 127.0.0.1, every
  --probe-interval seconds.

It prints the connections held and refused, the server's RSS before, at the peak of the flood and
after, the 401s the unauthenticated ones got and how many bytes of their bodies the server took,
and the probes' latencies. Every count and every wait is bounded; traffic stays on 127.0.0.1/8.

    .venv/bin/python scripts/bench_flood.py                  # 2000 silent, 50 x 15 MiB, 15 s
    .venv/bin/python scripts/bench_flood.py --silent 500 --bodies 10 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
import yaml
from benchproc import BenchError, Child, loopback_server_config, wait_for, write_private

DEADLINE_S = 60.0  # for the server to come up
CONNECT_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 5.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    def __init__(self, work: Path, per_peer: int | None) -> None:
        self.work = work
        self.data_dir = work / "server"
        gateway: dict = {"workers": 0}
        if per_peer is not None:
            gateway["max_connections_per_peer"] = per_peer
        config = loopback_server_config(self.data_dir, gateway)
        server_yaml = write_private(work / "server.yaml", yaml.safe_dump(config))
        self.child = Child(
            [sys.executable, "-m", "llmgw", "server", "--config", str(server_yaml)], work / "server.log"
        )
        self.endpoints = wait_for(
            self._endpoints, "the server to listen", time.monotonic() + DEADLINE_S, [self.child]
        )

    def _endpoints(self) -> dict | None:
        try:
            return json.loads((self.data_dir / "endpoints.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def address(self, name: str) -> tuple[str, int]:
        host, _, port = self.endpoints[name].rpartition(":")
        return host, int(port)

    @property
    def pid(self) -> int:
        return self.child.popen.pid


class Flood:
    def __init__(self) -> None:
        self.silent: list[trio.SocketStream] = []
        self.silent_failed = 0
        self.bodies_401 = 0
        self.bodies_other = 0
        self.body_bytes_taken = 0
        self.probes: dict[str, list[float]] = {"gateway /health": [], "admin /healthz": []}
        self.probe_failures: dict[str, int] = {"gateway /health": 0, "admin /healthz": 0}
        self.peak_rss = 0.0


async def open_silent(flood: Flood, address: tuple[str, int], count: int, until: float) -> None:
    for _ in range(count):
        if trio.current_time() >= until:
            return
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                flood.silent.append(await trio.open_tcp_stream(*address, local_address="127.0.0.2"))
        except (OSError, trio.TooSlowError):
            flood.silent_failed += 1


async def one_body(flood: Flood, address: tuple[str, int], size: int, until: float) -> None:
    try:
        with trio.move_on_at(until), trio.fail_after(max(0.1, until - trio.current_time())):
            stream = await trio.open_tcp_stream(*address, local_address="127.0.0.3")
    except (OSError, trio.TooSlowError):
        flood.bodies_other += 1
        return
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer sk-wrong\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % size
    )
    answer = b""
    async with stream:
        with trio.move_on_at(until):
            try:
                await stream.send_all(head)
                chunk = b"x" * (256 * 1024)
                sent = 0

                async def write() -> None:
                    nonlocal sent
                    while sent < size:
                        await stream.send_all(chunk)
                        sent += len(chunk)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write)
                    while data := await stream.receive_some(65536):
                        answer += data
                    nursery.cancel_scope.cancel()
                flood.body_bytes_taken += sent
            except (trio.BrokenResourceError, OSError):
                pass
    if answer.startswith(b"HTTP/1.1 401"):
        flood.bodies_401 += 1
    else:
        flood.bodies_other += 1


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One answer, to the end its content-length gives: hypercorn does not always close after
    `connection: close`, so the end of the stream is not waited for."""
    answer = b""
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        if sep:
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:") and len(body) >= int(line.split(b":")[1]):
                    return answer
        data = await stream.receive_some(65536)
        if not data:
            return answer
        answer += data


async def probe(
    flood: Flood, name: str, address: tuple[str, int], path: str, interval: float, until: float
) -> None:
    request = f"GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n".encode()
    while trio.current_time() < until:
        started = time.monotonic()
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                stream = await trio.open_tcp_stream(*address)
                async with stream:
                    await stream.send_all(request)
                    answer = await read_answer(stream)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise OSError(answer[:40])
            flood.probes[name].append((time.monotonic() - started) * 1000)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError):
            flood.probe_failures[name] += 1
        await trio.sleep(interval)


async def watch_rss(flood: Flood, pid: int, until: float) -> None:
    while trio.current_time() < until:
        flood.peak_rss = max(flood.peak_rss, rss_mib(pid))
        await trio.sleep(0.2)


async def count_held(flood: Flood) -> tuple[int, int]:
    """Of the silent connections, those still open and those the server closed (refused)."""
    held = closed = 0
    for stream in flood.silent:
        with trio.move_on_after(0.001):
            try:
                data = await stream.receive_some(1)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            closed += 1  # any answer (a 503) or end is a refusal
            del data
            continue
        held += 1
    return held, closed


async def run(args: argparse.Namespace, server: Server) -> None:
    flood = Flood()
    gateway, admin = server.address("gateway"), server.address("admin")
    await trio.sleep(1.0)
    rss_before = rss_mib(server.pid)
    until = trio.current_time() + args.seconds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_rss, flood, server.pid, until)
        nursery.start_soon(probe, flood, "gateway /health", gateway, "/health", args.probe_interval, until)
        nursery.start_soon(probe, flood, "admin /healthz", admin, "/healthz", args.probe_interval, until)
        nursery.start_soon(open_silent, flood, gateway, args.silent, until)
        for _ in range(args.bodies):
            nursery.start_soon(one_body, flood, gateway, args.body_mib * 1024 * 1024, until)
    held, refused = await count_held(flood)
    rss_during = rss_mib(server.pid)
    for stream in flood.silent:
        await stream.aclose()
    await trio.sleep(2.0)
    rss_after = rss_mib(server.pid)

    print(
        f"silent connections from 127.0.0.2: {args.silent} asked, {len(flood.silent)} opened "
        f"({flood.silent_failed} connects failed), {held} held by the server at the end, {refused} closed by it (refused, displaced or timed out)"
    )
    print(
        f"unauthenticated {args.body_mib} MiB bodies from 127.0.0.3: {args.bodies}; {flood.bodies_401} answered 401, "
        f"{flood.bodies_other} other; {flood.body_bytes_taken / 2**20:.1f} MiB written by them in all"
    )
    print(
        f"server RSS: {rss_before:.0f} MiB before, {flood.peak_rss:.0f} MiB peak, {rss_during:.0f} MiB at the end "
        f"of the flood, {rss_after:.0f} MiB after"
    )
    for name, latencies in flood.probes.items():
        if latencies:
            print(
                f"{name} during the flood: {len(latencies)} answered, {flood.probe_failures[name]} failed; "
                f"p50 {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms"
            )
        else:
            print(f"{name} during the flood: none answered, {flood.probe_failures[name]} failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silent", type=int, default=2000, help="silent connections (default 2000)")
    parser.add_argument("--bodies", type=int, default=50, help="unauthenticated large-body connections")
    parser.add_argument("--body-mib", type=int, default=15, help="each one's announced body (MiB)")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the flood lasts, at most")
    parser.add_argument("--probe-interval", type=float, default=0.25)
    parser.add_argument("--per-peer", type=int, default=None, help="gateway.max_connections_per_peer")
    args = parser.parse_args()
    if not (0 < args.silent <= 20000 and 0 <= args.bodies <= 1000 and 0 < args.seconds <= 300):
        parser.error("--silent 1..20000, --bodies 0..1000, --seconds up to 300")
    with tempfile.TemporaryDirectory(prefix="llmgw-flood-") as work:
        server = Server(Path(work), args.per_peer)
        try:
            trio.run(run, args, server)
        except BenchError as error:
            print(f"bench_flood: {error}", file=sys.stderr)
            return 1
        finally:
            server.child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
