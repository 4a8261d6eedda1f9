"""The observe step (core/reconcile/observe.py): agents' reports into the replica records.

What a user relies on after a server restart: the engines that kept serving are taken back as
their replicas, nothing is restarted, a multi-node replica is not routed to before its serving
rank is back, a replica the server already ended is never revived, and a shard an agent lost in
its own restart counts as failed.
"""

from __future__ import annotations

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.reconcile.observe import ADOPTED_REASON, GONE_AFTER_RESTART, observe
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState, state_of_shards
from llmgw.core.reports import ShardState
from llmgw.core.shard import ShardSpec


@attrs.define
class Report:
    spec: ShardSpec | None
    state: str = ShardState.READY
    reason: str = ""
    compute: None = None


@attrs.define
class Node:
    name: str
    shards: dict
    connected: bool = True
    registrations: int = 1


def profile(nodes: int = 1, model: str = "m") -> Profile:
    return Profile(name="chat", model=model, engine="vllm", gpu_class=None, nodes=nodes, memory_mib=1024)


PROFILES = {"chat": profile(nodes=2)}


def spec(
    rank: int = 0, replica: str = "r-1", nodes: int = 2, profile: str = "chat", model: str = "m"
) -> ShardSpec:
    return ShardSpec(
        shard_id=f"{replica}-s{rank}",
        replica_id=replica,
        profile=profile,
        model=model,
        model_path="/m",
        engine="vllm",
        nodes=nodes,
        rank=rank,
        port=20000,
        rendezvous_port=20001,
    )


def node(name: str, *reports: Report, **changes) -> Node:
    return Node(name=name, shards={r.spec.shard_id: r for r in reports}, **changes)


def replica_state(record: Replica) -> ReplicaState:
    return state_of_shards(s.state for s in record.shards)


def test_a_running_replica_is_adopted_whole_with_a_fresh_startup_timeout():
    nodes = [node("n1", Report(spec(0))), node("n2", Report(spec(1)), registrations=3)]
    observed = observe({}, nodes, PROFILES, {}, now=50.0)
    (record,) = observed.records.values()
    assert (record.id, record.profile, record.started, record.reason) == ("r-1", "chat", 50.0, ADOPTED_REASON)
    assert [(s.node, s.rank) for s in record.shards] == [("n1", 0), ("n2", 1)]
    assert replica_state(record) == ReplicaState.READY
    assert observed.started_under == {"r-1-s0": 1, "r-1-s1": 3}
    assert [a.shard_id for a in observed.adopted] == ["r-1-s0", "r-1-s1"]


def test_a_multi_node_replica_is_not_ready_while_its_serving_rank_has_not_reported():
    observed = observe({}, [node("n2", Report(spec(1)))], PROFILES, {}, now=0.0)
    (record,) = observed.records.values()
    assert record.state == ReplicaState.STARTING
    assert replica_state(record) == ReplicaState.STARTING
    later = observe(
        observed.records, [node("n2", Report(spec(1))), node("n1", Report(spec(0)))], PROFILES, {}, 1.0
    )
    assert replica_state(later.records["r-1"]) == ReplicaState.READY


def test_a_replica_this_server_ended_is_never_adopted_again():
    nodes = [node("n1", Report(spec(0))), node("n2", Report(spec(1)))]
    assert observe({}, nodes, PROFILES, {}, now=0.0, ended={"r-1"}).records == {}


def test_a_shard_of_no_profile_or_of_another_model_is_left_for_the_pass_to_stop():
    nodes = [node("n1", Report(spec(0, profile="gone")), Report(spec(0, replica="r-2", model="other")))]
    assert observe({}, nodes, PROFILES, {}, now=0.0).records == {}


def test_ended_and_disconnected_shards_are_not_adopted():
    nodes = [
        node("n1", Report(spec(0), state=ShardState.FAILED)),
        node("n2", Report(spec(1)), connected=False),
    ]
    assert observe({}, nodes, PROFILES, {}, now=0.0).records == {}


def record_of(*shards: ReplicaShard) -> Replica:
    return Replica(
        id="r-1",
        profile="chat",
        model="m",
        state=ReplicaState.STARTING,
        shards=shards,
        since=0.0,
        created=0.0,
    )


def piece(rank: int, node: str, state: str = ShardState.STARTING) -> ReplicaShard:
    return ReplicaShard(node=node, shard_id=f"r-1-s{rank}", rank=rank, port=20000, state=state)


def test_shards_follow_what_their_agents_report():
    records = {"r-1": record_of(piece(0, "n1"), piece(1, "n2"))}
    nodes = [node("n1", Report(spec(0), state=ShardState.LOADING)), node("n2", Report(spec(1), reason="x"))]
    observed = observe(records, nodes, PROFILES, {}, now=0.0)
    assert [(s.state, s.reason) for s in observed.records["r-1"].shards] == [
        (ShardState.LOADING, ""),
        (ShardState.READY, "x"),
    ]
    assert observed.adopted == ()


def test_a_shard_a_restarted_agent_no_longer_lists_has_failed_but_one_still_starting_waits():
    records = {"r-1": record_of(piece(0, "n1"), piece(1, "n2"))}
    nodes = [node("n1", registrations=2), node("n2", registrations=1)]
    observed = observe(records, nodes, PROFILES, {"r-1-s0": 1, "r-1-s1": 1}, now=0.0)
    first, second = observed.records["r-1"].shards
    assert (first.state, first.reason) == (ShardState.FAILED, GONE_AFTER_RESTART)
    assert second.state == ShardState.STARTING  # its start, or its first status, is on the way


def test_a_lost_nodes_shards_keep_their_last_state_for_the_pass_to_reap():
    records = {"r-1": record_of(piece(0, "n1", ShardState.READY), piece(1, "n2", ShardState.READY))}
    nodes = [node("n1", Report(spec(0), state=ShardState.FAILED), connected=False)]
    observed = observe(records, nodes, PROFILES, {}, now=0.0)
    assert [s.state for s in observed.records["r-1"].shards] == [ShardState.READY, ShardState.READY]
