"""Benchmark of a fleet on one machine: many simulated nodes, multi-node replicas started on them.

Each node is a network namespace of its own with one `llmgw agent` process reading four
simulated H100s and a RoCE port from tests/fixtures/simulated/h100-x4-roce.yaml (so every node is
on one fabric), and the server runs in a namespace of its own (tests/fleet.py builds it all). The
engines are tests/fake_multirank_engine.py, run as an unprivileged user: it checks every rank's
promises and serves HTTP on rank 0 once every worker joined, so a Ready replica here is a whole
multi-node start. The catalog has three multi-node profiles: vLLM mp, vLLM on Ray (head and join
sidecars) and SGLang, each over 2 nodes x 2 GPUs.

It prints: the time for every agent to register, the time from `llmgw ctl apply` to every replica
Ready, and at steady state (everything Ready, heartbeats flowing) the server's CPU seconds per
second and the agents' mean, from /proc. Every wait is bounded by --deadline; the steady window
by --steady. Needs root and `ip netns`; everything it starts is stopped, and its namespaces
removed, also on Ctrl-C.

    .venv/bin/python scripts/bench_fleet.py                      # 50 nodes, 4 replicas a profile
    .venv/bin/python scripts/bench_fleet.py --nodes 6 --replicas 1   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fleet import SIMULATED, Fleet, netns_missing, public_engines  # noqa: E402
from tests.procs import wait_until  # noqa: E402

ENGINE_USER = "llmgw-test-eng"  # the test suite's engine user (tests/conftest.py)
PROFILES = {
    "vllm-mp": {"engine": "vllm"},
    "vllm-ray": {"engine": "vllm", "launcher": "ray"},
    "sglang": {"engine": "sglang"},
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def catalog(replicas: int) -> dict:
    shape = {
        "model": "big",
        "gpu_class": "h100-80g",
        "gpus_per_node": 2,
        "nodes": 2,
        "tensor_parallel": 2,
        "pipeline_parallel": 2,
        "memory_mib": 40000,
        "min_replicas": replicas,
        "max_replicas": replicas,
        "startup_timeout": 900,
    }
    return {
        "models": {"big": {"path": "/models/big", "format": "safetensors"}},
        "profiles": {name: {**shape, **fields} for name, fields in PROFILES.items()},
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def ensure_engine_user() -> None:
    try:
        pwd.getpwnam(ENGINE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", ENGINE_USER], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=4, help="replicas of each of the three profiles")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="server.yaml link.heartbeat_interval")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of the steady-state window")
    parser.add_argument("--deadline", type=float, default=900.0, help="the longest any wait may take")
    args = parser.parse_args()
    if why := netns_missing():
        print(f"bench_fleet: {why}", file=sys.stderr)
        return 2
    wanted = args.replicas * len(PROFILES)
    if wanted * 2 * 2 > args.nodes * 4:
        print(
            f"bench_fleet: {wanted} replicas of 2 nodes x 2 GPUs do not fit {args.nodes} nodes of 4",
            file=sys.stderr,
        )
        return 2
    ensure_engine_user()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-fleet-"))
    engines_root, engines = public_engines(ENGINE_USER, expect_ib_hca="=mlx5_0", expect_ib_gid_index="3")
    nodes = {f"n{i + 1:02d}": SIMULATED / "h100-x4-roce.yaml" for i in range(args.nodes)}
    fleet = Fleet(tmp, nodes, engines, heartbeat_interval=args.heartbeat, missed_heartbeats=3)
    try:
        started = time.monotonic()
        fleet.start(register_deadline=args.deadline)
        registered = time.monotonic() - started
        print(f"{args.nodes} agents registered in {registered:.1f} s")

        applied = time.monotonic()
        fleet.apply(catalog(args.replicas))

        def all_ready() -> bool:
            records = fleet.server.admin("GET", "/admin/v1/replicas")["replicas"]
            return sum(1 for r in records if r["state"] == "Ready") == wanted

        wait_until(all_ready, f"{wanted} Ready replicas", deadline=args.deadline)
        to_ready = time.monotonic() - applied
        print(f"ctl apply to {wanted} multi-node replicas Ready ({args.replicas} of each of {len(PROFILES)} profiles "
              f"over 2 nodes x 2 GPUs): {to_ready:.1f} s")  # fmt: skip

        server_pid = fleet.server.proc.pid
        agent_pids = [node.agent.pid for node in fleet.nodes.values() if node.agent is not None]
        server_before, agents_before = cpu_seconds(server_pid), [cpu_seconds(p) for p in agent_pids]
        window_start = time.monotonic()
        time.sleep(args.steady)  # the measurement window itself: nothing is awaited here
        window = time.monotonic() - window_start
        server_cpu = (cpu_seconds(server_pid) - server_before) / window
        agents_cpu = sum(cpu_seconds(p) - b for p, b in zip(agent_pids, agents_before, strict=True)) / window
        assert all_ready(), "a replica left Ready during the steady-state window"
        print(f"steady state over {window:.1f} s (heartbeat every {args.heartbeat:g} s):")
        print(f"  server CPU: {server_cpu * 1000:.1f} ms per second ({server_cpu * 100:.2f} % of a core)")
        print(
            f"  agents CPU: {agents_cpu / len(agent_pids) * 1000:.1f} ms per second each, mean of {len(agent_pids)}"
        )
        return 0
    finally:
        fleet.close()
        shutil.rmtree(engines_root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
