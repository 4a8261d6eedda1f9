"""Multi-node replicas end to end, across agents in network namespaces, with the multi-rank fake
engine (tests/fake_multirank_engine.py) standing in for vLLM's and SGLang's ranks and Ray.

Each fake rank checks what llmgw told it (rank, nodes, master address and port, this node's own
address and interface for NCCL/Gloo, the fabric's adapter and GID index) and exits naming what
is wrong; rank 0 serves HTTP only once every worker has joined, and a worker serves none. So a
replica that turns Ready and answers through the gateway proves the whole multi-node start; the
stop checks prove, by the processes left in each node's namespace, that nothing of it survives.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fleet import ENGINE_PORTS, ENGINE_PYTHON, SIMULATED, Fleet, public_engines, require_netns
from tests.procs import wait_until

pytestmark = pytest.mark.slow

MODEL = "big"
PROFILE = "big-2n"
H100_ROCE = SIMULATED / "h100-x4-roce.yaml"
# What the roce fixture's one adapter makes llmgw promise each rank.
FABRIC_KNOBS = {"expect_ib_hca": "=mlx5_0", "expect_ib_gid_index": "3"}
READY_DEADLINE = 120.0


def catalog(**profile: object) -> dict:
    return {
        "models": {MODEL: {"path": "/models/big", "format": "safetensors"}},
        "profiles": {
            PROFILE: {
                "model": MODEL,
                "engine": "vllm",
                "gpu_class": "h100-80g",
                "gpus_per_node": 2,
                "nodes": 2,
                "tensor_parallel": 2,
                "pipeline_parallel": 2,
                "memory_mib": 40000,
                "min_replicas": 1,
                "max_replicas": 1,
                "startup_timeout": 180,
                **profile,
            }
        },
    }


@pytest.fixture
def engines(request):
    require_netns()  # first: under LLMGW_REQUIRE_NETNS=1 a missing root fails, not skips
    root, engines = public_engines(request.getfixturevalue("engine_user"), **FABRIC_KNOBS)
    yield engines
    shutil.rmtree(root, ignore_errors=True)


def shards_by_rank(replica: dict) -> dict[int, dict]:
    return {shard["rank"]: shard for shard in replica["shards"]}


def assert_served(fleet: Fleet) -> None:
    status, answer = fleet.chat(MODEL)
    assert status == 200, (status, answer, fleet.logs())
    assert answer["choices"][0]["message"]["content"] == "Hello from the fake engine."


def replica_pids(fleet: Fleet, replica: dict) -> dict[str, set[int]]:
    """Per node, the pids of the replica's processes (sidecars and engine), from the agents."""
    found: dict[str, set[int]] = {}
    for shard in replica["shards"]:
        processes = fleet.shard_processes(shard["node"]).get(shard["shard_id"], [])
        found.setdefault(shard["node"], set()).update(pid for _, pid in processes)
    return found


def wait_gone(fleet: Fleet, pids: dict[str, set[int]], what: str) -> None:
    for node, mine in pids.items():
        wait_until(
            lambda node=node, mine=mine: not mine.intersection(fleet.nodes[node].processes()),
            f"{what} on {node} to be gone",
            deadline=60,
        )


def run_two_node_replica(tmp_path: Path, engines: dict, names: tuple[str, ...], **profile: object) -> None:
    """One replica over two nodes Ready and served; a second one; scale down; stop everything."""
    with Fleet(tmp_path, dict.fromkeys(("n1", "n2"), H100_ROCE), engines) as fleet:
        fleet.apply(catalog(**profile))
        fleet.make_key(MODEL)
        (first,) = fleet.wait_ready(PROFILE, deadline=READY_DEADLINE)
        ranks = shards_by_rank(first)
        assert set(ranks) == {0, 1} and {ranks[0]["node"], ranks[1]["node"]} == {"n1", "n2"}
        assert all(len(s["gpu_indices"]) == 2 for s in ranks.values())
        assert_served(fleet)
        pids = replica_pids(fleet, first)
        for shard in first["shards"]:
            processes = fleet.shard_processes(shard["node"])[shard["shard_id"]]
            expected = names[0] if shard["rank"] == 0 else names[1]
            assert tuple(name for name, _ in processes) == expected, (shard, processes)
            # Every process of the shard runs in its own node's namespace.
            assert {pid for _, pid in processes} <= set(fleet.nodes[shard["node"]].processes())

        # Scale to two (the same two nodes have room for another), then back to one: the one
        # taken away leaves nothing on either node, and the other keeps serving.
        fleet.server.admin("POST", f"/admin/v1/profiles/{PROFILE}/scale", {"replicas": 2})
        both = fleet.wait_ready(PROFILE, 2, deadline=READY_DEADLINE)
        (second,) = [r for r in both if r["id"] != first["id"]]
        second_pids = replica_pids(fleet, second)
        fleet.server.admin("POST", f"/admin/v1/profiles/{PROFILE}/scale", {"replicas": 1})
        wait_until(lambda: len(fleet.replicas(PROFILE)) == 1, "the scale-down", deadline=60)
        (kept,) = fleet.replicas(PROFILE)
        gone = second_pids if kept["id"] == first["id"] else pids
        wait_gone(fleet, gone, "the scaled-down replica's processes")
        assert_served(fleet)

        # Removing the profile stops the last one: nothing of it is left on any node.
        fleet.ctl_ok("delete", "profile", PROFILE)
        wait_until(lambda: not fleet.replicas(PROFILE), "the replica to go", deadline=60)
        for node in fleet.nodes.values():
            wait_until(
                lambda node=node: not node.processes(), f"every process on {node.name} to stop", deadline=60
            )


def test_vllm_mp_over_two_nodes(tmp_path: Path, engines: dict) -> None:
    run_two_node_replica(tmp_path, engines, (("engine",), ("engine",)))


def test_vllm_on_ray_over_two_nodes(tmp_path: Path, engines: dict) -> None:
    run_two_node_replica(tmp_path, engines, (("ray-head", "engine"), ("ray-worker",)), launcher="ray")


def test_sglang_over_two_nodes(tmp_path: Path, engines: dict) -> None:
    run_two_node_replica(tmp_path, engines, (("engine",), ("engine",)), engine="sglang")


# Holds ports in its namespace, as another program on the node would, and says when it does.
HOLD_PORTS = (
    "import socket, sys, time\n"
    "held = [socket.create_server(('0.0.0.0', int(p))) for p in sys.argv[1:]]\n"
    "print('holding', flush=True)\n"
    "time.sleep(3600)\n"
)


def test_ports_another_program_holds_on_a_node_are_not_given_to_engines(
    tmp_path: Path, engines: dict
) -> None:
    fleet = Fleet(tmp_path, dict.fromkeys(("n1", "n2"), H100_ROCE), engines)
    try:
        fleet.build()
        low = ENGINE_PORTS["engine_port_min"]
        holder = fleet.nodes["n1"].run(
            [ENGINE_PYTHON, "-c", HOLD_PORTS, str(low), str(low + 1)], "holder.log"
        )
        wait_until(lambda: "holding" in holder.output(), "the ports to be held", proc=holder)
        fleet.start()
        assert {low, low + 1} <= set(fleet.server.nodes()["n1"]["inventory"]["ports_in_use"])
        fleet.apply(catalog())
        fleet.make_key(MODEL)
        (replica,) = fleet.wait_ready(PROFILE, deadline=READY_DEADLINE)
        (on_n1,) = [shard for shard in replica["shards"] if shard["node"] == "n1"]
        assert {on_n1["port"], on_n1["rendezvous_port"]}.isdisjoint({low, low + 1}), replica
        assert_served(fleet)
        # Our own engines' ports are not reported in use: they are the reconciler's to count.
        mine = {on_n1["port"], on_n1["rendezvous_port"]}
        wait_until(
            lambda: mine.isdisjoint(fleet.server.nodes()["n1"]["inventory"]["ports_in_use"]),
            "n1's next inventory",
        )
    finally:
        fleet.close()
