"""Faults across nodes, with agents in network namespaces and the multi-rank fake engine: a
worker's engine killed, a node's link cut for longer than the lost-node window, a worker node's
agent restarted, and the server restarted while only the headless rank 1 has reported."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.e2e.test_fleet_multinode import (
    FABRIC_KNOBS,
    H100_ROCE,
    MODEL,
    PROFILE,
    READY_DEADLINE,
    assert_served,
    catalog,
    replica_pids,
    shards_by_rank,
)
from tests.fleet import Fleet, process_alive, public_engines, require_netns
from tests.procs import wait_until

pytestmark = pytest.mark.slow

# A failed replica is started again soon, so the test sees it come back.
QUICK_RESTART = {"restart": {"initial_delay": "500ms", "max_delay": "2s"}}


@pytest.fixture
def engines(request):
    require_netns()  # first: under LLMGW_REQUIRE_NETNS=1 a missing root fails, not skips
    root, engines = public_engines(request.getfixturevalue("engine_user"), **FABRIC_KNOBS)
    yield engines
    shutil.rmtree(root, ignore_errors=True)


def fleet_of(tmp_path: Path, engines: dict, count: int, **options: object) -> Fleet:
    nodes = {f"n{i + 1}": H100_ROCE for i in range(count)}
    return Fleet(tmp_path, nodes, engines, reconcile=QUICK_RESTART, **options)


def start_replica(fleet: Fleet) -> dict:
    fleet.apply(catalog())
    fleet.make_key(MODEL)
    (replica,) = fleet.wait_ready(PROFILE, deadline=READY_DEADLINE)
    assert_served(fleet)
    return replica


def engine_pid(fleet: Fleet, shard: dict) -> int:
    return fleet.shard_processes(shard["node"])[shard["shard_id"]][-1][1]


def test_a_killed_worker_engine_fails_the_replica_and_it_is_placed_again(tmp_path, engines):
    with fleet_of(tmp_path, engines, 2) as fleet:
        replica = start_replica(fleet)
        old = replica_pids(fleet, replica)
        worker = shards_by_rank(replica)[1]
        os.kill(engine_pid(fleet, worker), signal.SIGKILL)

        def again() -> dict | None:
            for r in fleet.replicas(PROFILE):
                if r["state"] == "Ready" and r["failures"] >= 1:
                    return r
            return None

        back = wait_until(again, "the replica to fail and be Ready again", deadline=READY_DEADLINE)
        assert len(fleet.replicas(PROFILE)) == 1
        new = replica_pids(fleet, back)
        # Every process of the first start is gone, on both nodes; the new ones serve.
        assert not any(process_alive(pid) for pids in old.values() for pid in pids), old
        assert all(pids and not pids & old.get(node, set()) for node, pids in new.items()), (old, new)
        assert_served(fleet)


def test_a_node_cut_off_past_the_lost_window_is_reaped_and_its_old_shards_stopped_on_return(
    tmp_path, engines
):
    with fleet_of(tmp_path, engines, 3, heartbeat_interval=0.5, missed_heartbeats=4) as fleet:
        replica = start_replica(fleet)
        worker = shards_by_rank(replica)[1]
        cut = fleet.nodes[worker["node"]]
        stranded = replica_pids(fleet, replica)[cut.name]
        cut.cut()
        wait_until(lambda: fleet.server.nodes()[cut.name]["state"] == "lost", "the cut node to be lost")

        def placed_elsewhere() -> dict | None:
            found = [r for r in fleet.replicas(PROFILE) if r["state"] == "Ready"]
            if found and cut.name not in {s["node"] for s in found[0]["shards"]}:
                return found[0]
            return None

        moved = wait_until(placed_elsewhere, "a replica on the two other nodes", deadline=READY_DEADLINE)
        assert {s["node"] for s in moved["shards"]} == set(fleet.nodes) - {cut.name}
        assert_served(fleet)

        # Back on the network: its agent reconnects and reports the old worker, which is stopped;
        # at no point are there two replicas of a profile that wants one.
        cut.mend()
        seen: list[int] = []

        def old_shard_gone() -> bool:
            seen.append(len(fleet.replicas(PROFILE)))
            node = fleet.server.nodes()[cut.name]
            return node["connected"] and not stranded.intersection(cut.processes())

        wait_until(old_shard_gone, "the returned node's old shard to stop", deadline=60)
        assert max(seen) == 1, seen
        (only,) = fleet.replicas(PROFILE)
        assert only["id"] == moved["id"] and only["state"] == "Ready"
        assert_served(fleet)


def test_a_worker_nodes_agent_restarted_adopts_its_engine(tmp_path, engines):
    with fleet_of(tmp_path, engines, 2) as fleet:
        replica = start_replica(fleet)
        worker = shards_by_rank(replica)[1]
        node = fleet.nodes[worker["node"]]
        before = replica_pids(fleet, replica)
        node.stop_agent()  # stop_shards_on_exit is off: the engine keeps running
        node.start_agent()

        def adopted() -> bool:
            shards = {s["shard_id"]: s for s in fleet.server.nodes()[node.name]["shards"]}
            shard = shards.get(worker["shard_id"])
            return fleet.server.nodes()[node.name]["connected"] and bool(shard and shard["adopted"])

        wait_until(adopted, "the restarted agent to adopt the worker shard", deadline=60)
        assert replica_pids(fleet, replica) == before
        assert all(process_alive(pid) for pids in before.values() for pid in pids)
        (same,) = fleet.replicas(PROFILE)
        assert same["id"] == replica["id"] and same["state"] == "Ready" and same["failures"] == 0
        assert_served(fleet)


def test_after_a_server_restart_rank_1_alone_is_not_ready(tmp_path, engines):
    with fleet_of(tmp_path, engines, 2) as fleet:
        replica = start_replica(fleet)
        leader = fleet.nodes[shards_by_rank(replica)[0]["node"]]
        before = replica_pids(fleet, replica)
        leader.stop_agent()  # its engine keeps serving, unreported
        fleet.server.proc.stop()
        fleet.server.start()

        def adopted_alone() -> dict | None:
            found = fleet.replicas(PROFILE)
            return found[0] if found and len(found[0]["shards"]) == 1 else None

        alone = wait_until(adopted_alone, "rank 1 to be adopted", deadline=60)
        assert alone["id"] == replica["id"] and alone["shards"][0]["rank"] == 1
        assert alone["state"] != "Ready", alone

        leader.start_agent()
        (whole,) = fleet.wait_ready(PROFILE, deadline=60)
        assert whole["id"] == replica["id"] and len(whole["shards"]) == 2
        assert replica_pids(fleet, whole) == before  # adopted, not restarted
        assert_served(fleet)
