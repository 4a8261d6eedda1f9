#!/usr/bin/env python
"""What the control plane costs under a fleet of agents: N simulated agents against a real server.

The product goal is that 1,000 agents heartbeating every 5 s cost the server under 10% of one core.
This script measures exactly that number:

- the server runs as a real, separate process (``python -m llmgw server``) with its link and
  admin API on 127.0.0.1, ephemeral ports and a temporary data directory;
- the agents are real ``AgentLink`` objects in this process (one trio run), each with a fake
  ``discover`` that returns an 8-GPU inventory, so the Register and inventory-bearing heartbeats
  are the size a real fleet sends;
- phases: start the server, ramp the agents in batches (so the listen backlog never overflows)
  and time until all have registered, let the fleet settle, then a steady-state window in which
  the server's CPU time (utime+stime from /proc/PID/stat) and RSS (/proc/PID/status) are sampled
  at both ends and the link messages are counted on the agents' side, in both directions.

This process's own CPU (1,000 client links) competes for the same cores but is not the figure
that matters; it is reported for context, as is the load average at the start.

Everything is bounded: ``--max-seconds`` cancels the whole run, and a watchdog alarm a little
later kills the server and exits even if cleanup hangs. The server is started in its own process
group and always stopped in a ``finally`` (SIGTERM, then SIGKILL); it also gets the kernel's
parent-death signal, so killing this script with SIGKILL does not leave it behind.

    .venv/bin/python scripts/bench_link.py --agents 50 --seconds 10      # smoke
    .venv/bin/python scripts/bench_link.py                               # 1,000 agents, 60 s
    .venv/bin/python scripts/bench_link.py --interval 1 --seconds 30     # stress: 5x the rate
    .venv/bin/python scripts/bench_link.py --json                        # the same, as JSON

Exit status: 0 when the server held every agent through the window, 1 when it did not (agents
not registered, reconnects, nodes lost), 2 when the run hit ``--max-seconds``. The CPU budget is
printed as a verdict; it does not change the exit status.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import attrs
import trio

import llmgw.agent.link as agent_link_module
from llmgw.agent.link import AgentLink, JoinRefused
from llmgw.wire.h2link import H2Link
from llmgw.wire.messages import Gpu, IbPort, Inventory, Message

# Connections opened at once. Each batch is waited for (registered) before the next one starts,
# so the server's listen backlog (somaxconn, often 4096; 128 on old kernels) never overflows
# and the registration time measures the server, not SYN retransmits.
DEFAULT_BATCH = 100
# A batch that has not registered by then is reported as a failure of the ramp.
BATCH_TIMEOUT = 60.0
# The server writes endpoints.json once it listens; a cold start imports quart and opens the store.
STARTUP_TIMEOUT = 30.0
# SIGTERM is a graceful stop for the server (it flushes its store); after this, SIGKILL.
STOP_GRACE = 5.0
# The watchdog fires this long after --max-seconds, in case cancellation itself hangs.
WATCHDOG_SLACK = 30.0
# File descriptors: one socket per agent here and on the server, plus the store, logs, threads.
FD_HEADROOM = 512
# How often the window checks the agents are still connected (in-process, costs the server nothing).
CONNECTED_CHECK = 1.0
# RSS is also sampled this often in the window, to tell steady growth (a leak) from warm-up.
RSS_SAMPLE_EVERY = 10.0
# Distinct warning messages kept from this process's log for the report.
MAX_WARNINGS_SHOWN = 10
BUDGET_PERCENT = 10.0
MIB = 1024 * 1024


# --- counting link messages -------------------------------------------------------------------


class MessageCounts:
    """Messages the agents sent and received, by type (counted where the agent link sends and
    receives them, so both directions of every link are seen from this side)."""

    def __init__(self) -> None:
        self.sent: collections.Counter[str] = collections.Counter()
        self.received: collections.Counter[str] = collections.Counter()

    def snapshot(self) -> tuple[collections.Counter[str], collections.Counter[str]]:
        return collections.Counter(self.sent), collections.Counter(self.received)


COUNTS = MessageCounts()


class CountingH2Link(H2Link):
    async def send(self, message: Message) -> None:
        await super().send(message)
        COUNTS.sent[type(message).__name__] += 1

    async def receive(self) -> Message:
        message = await super().receive()
        COUNTS.received[type(message).__name__] += 1
        return message


# AgentLink builds its H2Link by the module-level name; the counting subclass only adds counters.
agent_link_module.H2Link = CountingH2Link  # type: ignore[misc]


# --- the fake node ----------------------------------------------------------------------------


def fake_inventory(node: str, index: int, address: str) -> Inventory:
    """An 8-GPU node with 8 InfiniBand ports: the size of what a real agent reports."""
    gpus = tuple(
        Gpu(
            index=g,
            uuid=f"GPU-{index:08x}-{g:04x}-4000-8000-{random.Random(index * 8 + g).getrandbits(48):012x}",
            name="NVIDIA H100 80GB HBM3",
            gpu_class="h100-80g",
            memory_total_mib=81559,
            memory_used_mib=4,
            compute_capability="9.0",
        )
        for g in range(8)
    )
    ib_ports = tuple(
        IbPort(
            device=f"mlx5_{p}",
            port=1,
            state="ACTIVE",
            rate_gbps=400.0,
            link_layer="InfiniBand",
            subnet="fe80:0000:0000:0000",
        )
        for p in range(8)
    )
    return Inventory(
        hostname=node,
        cpu_count=192,
        memory_total_mib=2_063_000,
        memory_available_mib=1_980_000,
        gpus=gpus,
        ib_ports=ib_ports,
        fabric="ib-bench",
        mgmt_interface="eth0",
        mgmt_address=address,
    )


@attrs.define
class SimAgent:
    link: AgentLink
    error: str | None = None


def make_agents(count: int, port: int, token: str) -> list[SimAgent]:
    agents = []
    for i in range(count):
        node = f"bench-{i:05d}"
        inventory = fake_inventory(node, i, "127.0.0.1")
        link = AgentLink(
            node=node,
            host="127.0.0.1",
            port=port,
            join_token=token,
            discover=lambda _address, inventory=inventory: inventory,
            rng=random.Random(node),
        )
        agents.append(SimAgent(link))
    return agents


async def run_agent(agent: SimAgent) -> None:
    try:
        await agent.link.run()
    except JoinRefused as exc:
        agent.error = str(exc)


# --- the server process -----------------------------------------------------------------------


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Raises this process's soft RLIMIT_NOFILE to ``needed`` (capped by the hard limit); the
    server inherits it. Returns the limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _die_with_parent() -> None:
    """In the server child, before exec: SIGKILL it when this script dies (Linux only)."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def write_server_config(tmp: Path, interval: float, missed: int, log_level: str) -> Path:
    config = tmp / "server.yaml"
    config.write_text(
        f"data_dir: {json.dumps(str(tmp / 'data'))}\n"
        f"log_level: {log_level}\n"
        "link:\n"
        "  listen: 127.0.0.1:0\n"
        f"  heartbeat_interval: {interval!r}\n"
        f"  missed_heartbeats: {missed}\n"
        "admin:\n"
        "  listen: 127.0.0.1:0\n"
        "gateway:\n"
        "  listen: 127.0.0.1:0\n"
        "  stop_workers_on_exit: true\n"  # the gateway workers stop with the bench's server
    )
    return config


def start_server(config: Path, log_path: Path) -> subprocess.Popen:
    log_file = log_path.open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw", "server", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping it stops all it started
            preexec_fn=_die_with_parent,
        )
    finally:
        log_file.close()


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, STOP_GRACE)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def process_memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak RSS) in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024  # kB
    return values


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def message_shape(text: str) -> str:
    """A log message without the words that differ per node (names, numbers, delays)."""
    return " ".join(word for word in text.split() if not any(ch.isdigit() for ch in word))


def server_log_problems(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """Counts of WARNING/ERROR lines in (part of) the server's log, and of a few distinct kinds
    of them ("date time LEVEL logger: message"; traceback lines are not counted)."""
    levels: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[2] in ("WARNING", "ERROR", "CRITICAL"):
            levels[parts[2]] += 1
            kind = f"{parts[2]} {message_shape(parts[3])}"
            if kind in kinds or len(kinds) < MAX_WARNINGS_SHOWN:
                kinds[kind] += 1
    return dict(levels), dict(kinds)


# --- this process's own warnings --------------------------------------------------------------


class WarningTally(logging.Handler):
    """Counts warnings from the agents (link down, retries) and keeps a few distinct ones;
    1,000 agents printing each would bury the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.total = 0
        self.distinct: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.total += 1
        key = message_shape(record.getMessage())
        if key in self.distinct or len(self.distinct) < MAX_WARNINGS_SHOWN:
            self.distinct[key] += 1


# --- the admin API ----------------------------------------------------------------------------


def fetch_nodes(admin: str, token: str) -> list[dict]:
    request = urllib.request.Request(
        f"http://{admin}/admin/v1/nodes",
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["nodes"]


async def server_view(admin: str, token: str) -> dict[str, int]:
    nodes = await trio.to_thread.run_sync(fetch_nodes, admin, token)
    return {
        "nodes": len(nodes),
        "connected": sum(1 for n in nodes if n["connected"]),
        "online": sum(1 for n in nodes if n["state"] == "online"),
        "lost": sum(1 for n in nodes if n["state"] == "lost"),
    }


# --- the run ----------------------------------------------------------------------------------


class BenchFailed(Exception):
    pass


@attrs.define
class Bench:
    args: argparse.Namespace
    server: subprocess.Popen
    data_dir: Path
    log_path: Path
    report: dict = attrs.field(factory=dict)
    phase: str = "starting the server"
    log_offset_after_window: int = 0

    def check_server(self) -> None:
        if self.server.poll() is not None:
            raise BenchFailed(
                f"the server exited with status {self.server.returncode} while {self.phase};"
                f" last lines of its log:\n{log_tail(self.log_path)}"
            )

    async def wait_endpoints(self) -> dict[str, str]:
        path = self.data_dir / "endpoints.json"
        with trio.move_on_after(STARTUP_TIMEOUT):
            while not path.exists():
                self.check_server()
                await trio.sleep(0.05)
            return json.loads(path.read_text())
        raise BenchFailed(
            f"the server wrote no {path} within {STARTUP_TIMEOUT:g}s:\n{log_tail(self.log_path)}"
        )

    async def run(self, nursery: trio.Nursery, agents_out: list[SimAgent]) -> None:
        args, report = self.args, self.report
        endpoints = await self.wait_endpoints()
        report["server_pid"] = self.server.pid
        report["endpoints"] = endpoints
        join_token = (self.data_dir / "join-token").read_text().strip()
        admin_token = (self.data_dir / "admin-token").read_text().strip()
        link_host, _, link_port = endpoints["link"].rpartition(":")
        assert link_host == "127.0.0.1", endpoints  # loopback only
        report["server_rss_mib_idle"] = round(process_memory_mib(self.server.pid)["VmRSS"], 1)

        # Phase 1: ramp in batches, each waited for before the next.
        self.phase = "connecting the agents"
        agents = make_agents(args.agents, int(link_port), join_token)
        agents_out.extend(agents)  # for the caller's report, even on failure
        started = trio.current_time()
        for first in range(0, len(agents), args.batch):
            batch = agents[first : first + args.batch]
            for agent in batch:
                nursery.start_soon(run_agent, agent)
            with trio.move_on_after(BATCH_TIMEOUT):
                while not all(a.link.registrations for a in batch):  # noqa: ASYNC110 (plain attributes)
                    self.check_server()
                    refused = [a.error for a in batch if a.error]
                    if refused:
                        raise BenchFailed(f"an agent was refused: {refused[0]}")
                    await trio.sleep(0.02)
            missing = sum(1 for a in batch if not a.link.registrations)
            if missing:
                raise BenchFailed(
                    f"{missing} of the {len(batch)} agents of batch {first // args.batch + 1}"
                    f" (agents {first}..{first + len(batch) - 1}) did not register within"
                    f" {BATCH_TIMEOUT:g}s"
                )
        report["registration_s"] = round(trio.current_time() - started, 2)
        report["registration_rate_per_s"] = round(args.agents / max(report["registration_s"], 1e-9), 1)

        # The server's own count, once (1,000 inventories are a few MiB of JSON: not in the window).
        self.phase = "confirming the registrations with the admin API"
        with trio.move_on_after(BATCH_TIMEOUT):
            while (view := await server_view(endpoints["admin"], admin_token))["connected"] < args.agents:
                self.check_server()
                await trio.sleep(0.5)
        report["server_confirmed_s"] = round(trio.current_time() - started, 2)
        report["server_view_after_ramp"] = view
        if view["connected"] < args.agents:
            raise BenchFailed(f"the admin API shows {view['connected']} of {args.agents} nodes connected")

        # Phase 2: settle (the store's write-behind of every new node, the first inventory
        # heartbeats), then the steady-state window.
        self.phase = "settling"
        await trio.sleep(args.settle)
        self.check_server()
        self.phase = "measuring"
        registrations_before = sum(a.link.registrations for a in agents)
        cpu0, wall0 = process_cpu_seconds(self.server.pid), time.monotonic()
        mem0 = process_memory_mib(self.server.pid)
        bench_cpu0 = time.process_time()
        sent0, received0 = COUNTS.snapshot()
        min_connected = args.agents
        rss_samples = [round(mem0["VmRSS"], 1)]
        window_start = trio.current_time()
        window_end = window_start + args.seconds
        next_rss = window_start + RSS_SAMPLE_EVERY
        while (now := trio.current_time()) < window_end:
            await trio.sleep(min(CONNECTED_CHECK, window_end - now))
            self.check_server()
            min_connected = min(min_connected, sum(1 for a in agents if a.link.connected))
            if trio.current_time() >= next_rss and trio.current_time() < window_end:
                rss_samples.append(round(process_memory_mib(self.server.pid)["VmRSS"], 1))
                next_rss += RSS_SAMPLE_EVERY
        cpu1, wall1 = process_cpu_seconds(self.server.pid), time.monotonic()
        mem1 = process_memory_mib(self.server.pid)
        bench_cpu1 = time.process_time()
        sent1, received1 = COUNTS.snapshot()
        elapsed = wall1 - wall0

        sent, received = sent1 - sent0, received1 - received0
        report["window_s"] = round(elapsed, 2)
        report["server_cpu_s"] = round(cpu1 - cpu0, 3)
        report["server_cpu_percent_of_one_core"] = round(100 * (cpu1 - cpu0) / elapsed, 2)
        report["server_rss_mib_start"] = round(mem0["VmRSS"], 1)
        report["server_rss_mib_end"] = round(mem1["VmRSS"], 1)
        report["server_rss_mib_peak"] = round(mem1["VmHWM"], 1)
        report["server_rss_mib_every_10s"] = [*rss_samples, round(mem1["VmRSS"], 1)]
        report["bench_cpu_percent_of_one_core"] = round(100 * (bench_cpu1 - bench_cpu0) / elapsed, 1)
        report["messages_per_s"] = {
            "agent_to_server": round(sum(sent.values()) / elapsed, 1),
            "server_to_agent": round(sum(received.values()) / elapsed, 1),
            "total": round((sum(sent.values()) + sum(received.values())) / elapsed, 1),
        }
        report["messages_in_window"] = {"agent_to_server": dict(sent), "server_to_agent": dict(received)}
        report["reconnects_in_window"] = sum(a.link.registrations for a in agents) - registrations_before
        report["min_connected_in_window"] = min_connected
        report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

        self.phase = "checking the server's view after the window"
        report["server_view_after_window"] = await server_view(endpoints["admin"], admin_token)
        self.log_offset_after_window = self.log_path.stat().st_size


def held_all(report: dict, agents: int) -> bool:
    view = report.get("server_view_after_window", {})
    return (
        report.get("min_connected_in_window") == agents
        and report.get("reconnects_in_window") == 0
        and view.get("connected") == agents
        and view.get("lost") == 0
    )


async def bench_main(bench: Bench, tally: WarningTally) -> None:
    args = bench.args
    agents: list[SimAgent] = []
    with trio.move_on_after(args.max_seconds) as overall:
        try:
            async with trio.open_nursery() as nursery:
                await bench.run(nursery, agents)
                # Stop the agents before the server, so that they leave politely instead of
                # retrying against a dead port.
                bench.phase = "stopping the agents"
                stopping = trio.current_time()
                nursery.cancel_scope.cancel()
            bench.report["agents_stop_s"] = round(trio.current_time() - stopping, 2)
        except* BenchFailed as group:
            bench.report["error"] = f"{bench.phase}: {group.exceptions[0]}"
    if overall.cancelled_caught:
        bench.report["error"] = f"hit --max-seconds ({args.max_seconds:g}s) while {bench.phase}"
        bench.report["timed_out"] = True
    bench.report["agents_registered"] = sum(1 for a in agents if a.link.registrations)
    bench.report["agent_warnings"] = tally.total
    bench.report["agent_warning_kinds"] = dict(tally.distinct)


# --- output -----------------------------------------------------------------------------------


def render(report: dict) -> str:
    r = report
    lines = ["llmgw agent-link bench (server: a separate process; agents: real AgentLinks here)"]

    def row(label: str, value: str) -> None:
        lines.append(f"  {label:<24}{value}")

    load = " ".join(f"{x:.2f}" for x in r["loadavg_start"])
    row("agents", str(r["agents"]))
    row("heartbeat interval", f"{r['heartbeat_interval_s']:g} s (missed_heartbeats {r['missed_heartbeats']})")
    row("load average at start", f"{load} (1/5/15 min; {r['cpus']} CPUs)")
    if "registration_s" in r:
        row(
            "registration",
            f"all {r['agents']} registered in {r['registration_s']:.2f} s"
            f" ({r['registration_rate_per_s']:.0f}/s, batches of {r['batch']});"
            f" admin API confirmed at {r['server_confirmed_s']:.2f} s",
        )
    if "window_s" in r:
        m = r["messages_per_s"]
        row(
            "server CPU",
            f"{r['server_cpu_percent_of_one_core']:.2f} % of one core"
            f" ({r['server_cpu_s']:.2f} s CPU in a {r['window_s']:.1f} s window)",
        )
        row(
            "server RSS",
            f"{r['server_rss_mib_start']:.1f} MiB at start, {r['server_rss_mib_end']:.1f} MiB at end"
            f" of window (peak {r['server_rss_mib_peak']:.1f}, idle before agents {r['server_rss_mib_idle']:.1f})",
        )
        row("server RSS every 10 s", " ".join(f"{x:.1f}" for x in r["server_rss_mib_every_10s"]))
        row(
            "link messages/s",
            f"agent->server {m['agent_to_server']:.1f}, server->agent {m['server_to_agent']:.1f},"
            f" total {m['total']:.1f}",
        )
        view = r["server_view_after_window"]
        row(
            "held",
            f"min connected {r['min_connected_in_window']}, reconnects {r['reconnects_in_window']};"
            f" server: {view['connected']} connected, {view['online']} online, {view['lost']} lost",
        )
        row("bench process CPU", f"{r['bench_cpu_percent_of_one_core']:.1f} % of one core (not the server's)")
        row("load average at end", " ".join(f"{x:.2f}" for x in r["loadavg_end"]))
        over = r["server_cpu_percent_of_one_core"] >= BUDGET_PERCENT
        row("budget", f"{'OVER' if over else 'within'} {BUDGET_PERCENT:g} % of one core")
    levels = r.get("server_log_levels", {})
    row(
        "server log",
        (", ".join(f"{n} {k}" for k, n in sorted(levels.items())) or "no warnings or errors")
        + " until the end of the window",
    )
    for text, n in r.get("server_log_kinds", {}).items():
        lines.append(f"      {n} x {text}")
    if r.get("agent_warnings"):
        row("agent warnings", str(r["agent_warnings"]))
        for text, n in r["agent_warning_kinds"].items():
            lines.append(f"      {n} x {text}")
    teardown = r.get("server_log_levels_teardown", {})
    if teardown:
        row(
            "server log, teardown",
            ", ".join(f"{n} {k}" for k, n in sorted(teardown.items()))
            + f" after the agents left (stopping them took {r.get('agents_stop_s', '?')} s)",
        )
    if "kept" in r:
        row("kept", f"{r['kept']} (server.log, server.yaml, data/)")
    if "error" in r:
        row("FAILED", r["error"])
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=1000, help="simulated agents (default 1000)")
    parser.add_argument(
        "--interval", type=float, default=5.0, help="link.heartbeat_interval in seconds (default 5)"
    )
    parser.add_argument("--missed", type=int, default=3, help="link.missed_heartbeats (default 3)")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="steady-state measurement window (default 60)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="wait after all registered, before the window (default: 2 intervals, at least 5 s)",
    )
    parser.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, help=f"agents connected at once (default {DEFAULT_BATCH})"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=300.0, help="hard limit on the whole run (default 300)"
    )
    parser.add_argument(
        "--server-log-level", default="info", help="the server's log_level (default info; goes to a file)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (server log, store)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.agents < 1 or args.batch < 1 or args.seconds <= 0 or args.interval <= 0:
        parser.error("--agents and --batch must be >= 1; --seconds and --interval > 0")
    if args.settle is None:
        args.settle = max(2 * args.interval, 5.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tally = WarningTally()
    printed = logging.StreamHandler(sys.stderr)
    printed.setLevel(logging.ERROR)  # warnings are tallied for the report, errors also printed
    logging.basicConfig(level=logging.WARNING, handlers=[printed, tally])

    report: dict = {
        "agents": args.agents,
        "heartbeat_interval_s": args.interval,
        "missed_heartbeats": args.missed,
        "batch": args.batch,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }
    report["fd_limit"] = raise_fd_limit(args.agents + FD_HEADROOM)[0]
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-link-"))
    log_path = tmp / "server.log"
    config = write_server_config(tmp, args.interval, args.missed, args.server_log_level)
    server = start_server(config, log_path)

    def watchdog(_signum, _frame) -> None:
        # Cancellation did not finish in time: do not leave the server behind, whatever else.
        stop_server(server)
        print(f"bench_link: watchdog: still running {WATCHDOG_SLACK:g}s past --max-seconds", file=sys.stderr)
        os._exit(2)

    signal.signal(signal.SIGALRM, watchdog)
    signal.alarm(int(args.max_seconds + WATCHDOG_SLACK))
    try:
        bench = Bench(args=args, server=server, data_dir=tmp / "data", log_path=log_path, report=report)
        trio.run(bench_main, bench, tally)
    finally:
        stop_server(server)
        signal.alarm(0)
        # Up to the end of the window, and after it: once the agents leave, the server rightly
        # marks their nodes lost (at 1 s heartbeats that happens before it is stopped).
        try:
            log_bytes = log_path.read_bytes()
        except OSError:
            log_bytes = b""
        split = bench.log_offset_after_window or len(log_bytes)
        report["server_log_levels"], report["server_log_kinds"] = server_log_problems(
            log_bytes[:split].decode(errors="replace")
        )
        report["server_log_levels_teardown"], _ = server_log_problems(
            log_bytes[split:].decode(errors="replace")
        )
        if args.keep:
            report["kept"] = str(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    if report.get("timed_out"):
        return 2
    return 0 if "error" not in report and held_all(report, args.agents) else 1


if __name__ == "__main__":
    sys.exit(main())
