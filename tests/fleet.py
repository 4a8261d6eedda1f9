"""A fleet on one machine: a server and N agents, each in a network namespace the test makes.

Layout: one namespace for the server holds a bridge with the server's address; each node is a
namespace of its own with one end of a veth pair (named after the node, so names differ between
nodes as they do on real hosts) and the other end on the server's bridge. Every address lives in
a namespace made here; nothing is added to the machine's own namespace. The test process talks
to the server's admin API and gateway on its namespace's loopback, by opening those sockets from a
thread switched into that namespace (setns is per thread).

Everything is removed by ``Fleet.close()``, also when a test fails: the processes first (by
process group, then every pid the kernel still lists in our namespaces), then the namespaces,
which takes their links and the bridge with them.

Needs root and `ip netns`; ``require_netns()`` skips without them, or fails where
LLMGW_REQUIRE_NETNS=1 (scripts/test.sh), so the fleet tests never silently vanish.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.procs import DEADLINE, Proc, Server, agent_config, kill_recorded_shards, llmgw_command, wait_until

REQUIRE_ENV = "LLMGW_REQUIRE_NETNS"
HERE = Path(__file__).resolve().parent
SIMULATED = HERE / "fixtures" / "simulated"
SYSFS = HERE / "fixtures" / "sysfs"
CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"  # inside our namespaces only, so concurrent fleets cannot collide
SERVER_ADDRESS = f"{SUBNET}.1"
LINK_PORT, ADMIN_PORT, GATEWAY_PORT = 7070, 7071, 8080
# Engines inside the namespaces: every port is free there, so one fixed range serves every test.
ENGINE_PORTS = {"engine_port_min": 31000, "engine_port_max": 31049}
# /usr/bin/python3: the fake engines run as the unprivileged engine user, who cannot enter the
# directory the project's own interpreter lives under.
ENGINE_PYTHON = "/usr/bin/python3"

_serial = itertools.count()


def netns_missing() -> str:
    """Why fleets cannot run here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"llmgw-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def require_netns() -> None:
    why = netns_missing()
    if not why:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
    pytest.skip(why)


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=DEADLINE)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def netns_pids(namespace: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


# --- talking into a namespace from this process ------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_netns(namespace: str):
    """This thread in ``namespace`` for the block: sockets made there stay there."""
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{namespace}") as there:
        if _libc.setns(there.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            yield
        finally:
            if _libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back home")


class NetnsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, namespace: str, host: str, port: int, timeout: float = 60) -> None:
        super().__init__(host, port, timeout=timeout)
        self.namespace = namespace

    def connect(self) -> None:
        with in_netns(self.namespace):
            super().connect()


def http_json(
    namespace: str,
    address: str,
    method: str,
    path: str,
    body: dict | None = None,
    headers: dict | None = None,
) -> tuple[int, dict]:
    host, _, port = address.rpartition(":")
    connection = NetnsHTTPConnection(namespace, host, int(port))
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(
            method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else {}
        except ValueError:
            return response.status, {"text": raw.decode(errors="replace")}
    finally:
        connection.close()


# --- the pieces --------------------------------------------------------------------------------


class FleetServer(Server):
    """tests.procs.Server in the server's namespace: the link on the bridge, the rest on loopback."""

    def __init__(self, tmp: Path, namespace: str, **options: object) -> None:
        # Fixed ports, free in a namespace of its own: a restarted server listens where the
        # first did, so its agents find it again.
        super().__init__(
            tmp, link_port=LINK_PORT, admin_port=ADMIN_PORT, gateway_port=GATEWAY_PORT, **options
        )
        self.namespace = namespace
        config = yaml.safe_load(self.config.read_text())
        config["link"]["listen"] = f"{SERVER_ADDRESS}:{LINK_PORT}"
        self.config.write_text(yaml.safe_dump(config))

    def start(self) -> FleetServer:
        (self.data_dir / "endpoints.json").unlink(missing_ok=True)
        self.proc = Proc(
            ["ip", "netns", "exec", self.namespace, *llmgw_command(), "server", "--config", str(self.config)],
            self.tmp / "server.log",
        )
        from tests.procs import read_endpoints

        self.endpoints = wait_until(
            lambda: read_endpoints(self.data_dir), "the server to listen", proc=self.proc
        )
        return self

    def ctl(self, *args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *llmgw_command(), "ctl", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.ctl_env},
        )

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        status, answer = http_json(
            self.namespace,
            self.endpoints["admin"],
            method,
            path,
            body,
            {"Authorization": f"Bearer {self.ctl_env['LLMGW_TOKEN']}"},
        )
        if status >= 400:
            raise AssertionError(f"{method} {path}: {status} {answer}")
        return answer

    def nodes(self) -> dict[str, dict]:
        return {node["name"]: node for node in self.admin("GET", "/admin/v1/nodes")["nodes"]}


class Node:
    """One node: its namespace, interface, address, simulated hardware and agent."""

    def __init__(self, fleet: Fleet, index: int, name: str, simulate: Path) -> None:
        self.fleet = fleet
        self.name = name
        self.namespace = f"{fleet.tag}-{name}"
        self.interface = f"eth-{name}"[:15]
        self.peer = f"p{index}"  # its end on the bridge, in the server's namespace
        self.address = f"{SUBNET}.{10 + index}"
        self.simulate = simulate
        self.work_dir = fleet.tmp / f"agent-{name}"
        self.agent: Proc | None = None

    def start_agent(self) -> Proc:
        config = agent_config(
            self.fleet.tmp,
            self.fleet.server,
            self.name,
            engines=self.fleet.engines,
            discovery={"simulate": str(self.simulate)},
        )
        self.agent = Proc(
            ["ip", "netns", "exec", self.namespace, *llmgw_command(), "agent", "--config", str(config)],
            self.fleet.tmp / f"agent-{self.name}.log",
        )
        return self.agent

    def stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.stop()

    def cut(self) -> None:
        """The node's cable pulled: its end of the bridge goes down (both ends lose carrier)."""
        ip("-n", self.fleet.server_ns, "link", "set", self.peer, "down")

    def mend(self) -> None:
        ip("-n", self.fleet.server_ns, "link", "set", self.peer, "up")

    def run(self, args: list[str], log: str) -> Proc:
        """A process of the test's own in this node's namespace (stopped by ``Fleet.close``)."""
        return Proc(["ip", "netns", "exec", self.namespace, *args], self.fleet.tmp / log)

    def processes(self) -> list[int]:
        """Every process in this node's namespace but its agent: engines and sidecars."""
        agent = self.agent.pid if self.agent is not None and self.agent.popen.poll() is None else None
        return [pid for pid in netns_pids(self.namespace) if pid != agent]


class Fleet:
    """``nodes``: name → simulated hardware file. ``engines``: agent.yaml's engines section."""

    def __init__(
        self,
        tmp: Path,
        nodes: dict[str, Path],
        engines: dict,
        *,
        # A lost-node window of 3 s: short for the tests that wait it out, long enough that a
        # loaded 2-core machine delaying a heartbeat does not lose a healthy node.
        heartbeat_interval: float = 0.5,
        missed_heartbeats: int = 6,
        reconcile: dict | None = None,
    ) -> None:
        self.tmp = tmp
        # Short (namespace names are file names; link names are 15 bytes), and unique per test
        # process and fleet, since other test runs on this machine make fleets too.
        self.tag = f"lg{os.getpid() % 100000}x{next(_serial)}"
        self.server_ns = f"{self.tag}-srv"
        self.engines = engines
        self.nodes = {name: Node(self, i, name, path) for i, (name, path) in enumerate(nodes.items())}
        self.made: list[str] = []
        self.server = FleetServer(
            tmp,
            self.server_ns,
            heartbeat_interval=heartbeat_interval,
            missed_heartbeats=missed_heartbeats,
            reconcile={**ENGINE_PORTS, **(reconcile or {})},
        )
        self.key = ""

    # --- building and tearing down ------------------------------------------------------------

    def build(self) -> Fleet:
        self._namespace(self.server_ns)
        ip("-n", self.server_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.server_ns, "addr", "add", f"{SERVER_ADDRESS}/24", "dev", "br0")
        ip("-n", self.server_ns, "link", "set", "br0", "up")
        for node in self.nodes.values():
            self._namespace(node.namespace)
            ip("-n", self.server_ns, "link", "add", node.peer, "type", "veth", "peer", "name", node.interface,
               "netns", node.namespace)  # fmt: skip
            ip("-n", self.server_ns, "link", "set", node.peer, "master", "br0")
            ip("-n", self.server_ns, "link", "set", node.peer, "up")
            ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            ip("-n", node.namespace, "link", "set", node.interface, "up")
        return self

    def _namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def start(self, register_deadline: float = 2 * DEADLINE) -> Fleet:
        if not self.made:
            self.build()
        self.server.start()
        for node in self.nodes.values():
            node.start_agent()
        wait_until(self._all_connected, "every agent to register", deadline=register_deadline)
        return self

    def _all_connected(self) -> bool:
        nodes = self.server.nodes()
        return all(nodes.get(name, {}).get("connected") for name in self.nodes)

    def close(self) -> None:
        """Stops everything this fleet started and removes its namespaces; never raises early."""
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.stop_agent()
        with contextlib.suppress(Exception):
            if self.server.proc is not None:
                self.server.proc.stop()
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                kill_recorded_shards(node.work_dir)
        for namespace in self.made:
            # Whatever still runs in a namespace made here was started by this fleet.
            for pid in netns_pids(namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            end = time.monotonic() + DEADLINE
            while netns_pids(namespace) and time.monotonic() < end:
                time.sleep(0.05)
        for namespace in reversed(self.made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.made.clear()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- using it -------------------------------------------------------------------------------

    def ctl_ok(self, *args: str) -> str:
        result = self.server.ctl(*args)
        assert result.returncode == 0, f"ctl {' '.join(args)}: {result.stderr}{result.stdout}"
        return result.stdout

    def apply(self, catalog: dict) -> None:
        path = self.tmp / "catalog.yaml"
        path.write_text(yaml.safe_dump(catalog))
        self.ctl_ok("apply", "-f", str(path))

    def make_key(self, model: str) -> str:
        self.ctl_ok("tenant", "create", "fleet")
        self.key = json.loads(self.ctl_ok("keys", "create", "--tenant", "fleet", "--model", model, "--json"))[
            "secret"
        ]
        return self.key

    def replicas(self, profile: str) -> list[dict]:
        return [
            r for r in self.server.admin("GET", "/admin/v1/replicas")["replicas"] if r["profile"] == profile
        ]

    def wait_ready(self, profile: str, count: int = 1, deadline: float = 3 * DEADLINE) -> list[dict]:
        def ready() -> list[dict] | None:
            found = [r for r in self.replicas(profile) if r["state"] == "Ready"]
            return found if len(found) == count else None

        try:
            return wait_until(ready, f"{count} Ready replica(s) of {profile}", deadline=deadline)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.replicas(profile)}\n{self.logs()}") from None

    def chat(self, model: str) -> tuple[int, dict]:
        return http_json(
            self.server_ns,
            self.server.endpoints["gateway"],
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi"}]},
            {"Authorization": f"Bearer {self.key}"},
        )

    def shard_processes(self, node: str) -> dict[str, list[tuple[str, int]]]:
        """Per shard on ``node``, as the agent reports it: (command name, pid) of each process."""
        from llmgw.agent import shard_state

        found: dict[str, list[tuple[str, int]]] = {}
        for _directory, record in shard_state.read_all(self.nodes[node].work_dir / "shards"):
            if isinstance(record, ValueError):
                continue
            found[record.spec.shard_id] = [(p.name, p.pid) for p in record.processes]
        return found

    def logs(self, tail: int = 4000) -> str:
        parts = []
        for path in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {path.name} (tail) ---\n{path.read_text(errors='replace')[-tail:]}")
        for path in sorted(self.tmp.glob("agent-*/shards/*/*.log")):
            parts.append(
                f"--- {path.relative_to(self.tmp)} (tail) ---\n{path.read_text(errors='replace')[-1500:]}"
            )
        return "\n".join(parts)


def public_engines(engine_user: str, **knobs: str) -> tuple[Path, dict]:
    """A directory the engine user can read, with the fake engines and wrappers for vllm, ray and
    SGLang's python in it; and agent.yaml's engines section pointing at them. ``knobs`` are
    FAKE_ENGINE_* settings (without the prefix) every wrapper exports."""
    root = Path(tempfile.mkdtemp(prefix="llmgw-fleet-"))
    root.chmod(0o755)
    for name in ("fake_engine.py", "fake_multirank_engine.py"):
        shutil.copyfile(HERE / name, root / name)
        (root / name).chmod(0o644)
    exports = "".join(f"export FAKE_ENGINE_{key.upper()}='{value}'\n" for key, value in knobs.items())
    wrapper = root / "engine"
    wrapper.write_text(f'#!/bin/sh\n{exports}exec {ENGINE_PYTHON} {root / "fake_multirank_engine.py"} "$@"\n')
    wrapper.chmod(0o755)
    engines = {
        "vllm": str(wrapper),
        "ray": str(wrapper),
        "python": str(wrapper),
        "run_as": engine_user,
        "stop_grace": "3s",
        "leader_wait": "60s",
    }
    return root, engines


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone as far as the test is concerned: it runs nothing and holds no port.
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


__all__ = [
    "ENGINE_PYTHON",
    "Fleet",
    "FleetServer",
    "SIMULATED",
    "SYSFS",
    "http_json",
    "in_netns",
    "netns_missing",
    "process_alive",
    "public_engines",
    "require_netns",
]
