"""The reconciler, pure: a pass turns wanted replicas and what runs into actions with reasons.

Examples first, one per action and reason; then a state machine that plays the shell and a fleet of
agents against it (engines that load, fail and hang, nodes that go and come back, GPUs that turn
unhealthy) and checks what must hold after every pass.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmgw.core.catalog import Model, Profile
from llmgw.core.placement import ClusterView, GpuView, NodeView
from llmgw.core.reconcile import (
    ENDING,
    PREEMPTION_SEARCHES_PER_PASS,
    DrainReplica,
    Evict,
    MarkFailed,
    MarkPending,
    Plan,
    Preempt,
    Reap,
    ReconcileConfig,
    ReportedShard,
    RestartReplica,
    StartReplica,
    StopOrphan,
    StopReplica,
    reconcile,
)
from llmgw.core.replica import (
    COUNTED,
    LIFECYCLE,
    RUNNING,
    Replica,
    ReplicaShard,
    ReplicaState,
    state_of_shards,
)
from llmgw.core.restart_policy import GiveUp, RestartPolicy, decide, restart_delay
from llmgw.wire.messages import ShardState

PORTS = (20000, 20099)
POLICY = RestartPolicy(initial=10, maximum=80, move_after=3, give_up_after=5, reset_after=600)
CONFIG = ReconcileConfig(port_range=PORTS, drain_timeout=60, restart=POLICY)
LLAMA = Model(name="llama", path="/models/llama", format="safetensors")
SMOL = Model(name="smol", path="/models/smol.gguf", format="gguf")
MODELS = {m.name: m for m in (LLAMA, SMOL)}
CHAT = Profile(
    name="chat",
    model="llama",
    engine="vllm",
    gpu_class="l40s-45g",
    gpus_per_node=1,
    memory_mib=20_000,
    startup_timeout=300,
)


def gpu(index: int, **changes: object) -> GpuView:
    defaults: dict[str, object] = {
        "uuid": f"GPU-{index}",
        "gpu_class": "l40s-45g",
        "compute_capability": "8.9",
        "memory_total_mib": 46_068,
        "memory_free_mib": 45_000,
    }
    return GpuView(index=index, **{**defaults, **changes})


def node(name: str, gpus: int | tuple[GpuView, ...] = 2, **changes: object) -> NodeView:
    """A node named like "node-3" (address 10.0.0.3); ``gpus`` is a count of healthy cards or the cards."""
    defaults: dict[str, object] = {
        "address": f"10.0.0.{name.rsplit('-', 1)[-1]}",
        "mgmt_interface": "eth0",
        "gpus": gpus if isinstance(gpus, tuple) else tuple(gpu(i) for i in range(gpus)),
        "memory_free_mib": 64_000,
        "cpu_cores_free": 16,
    }
    return NodeView(name=name, **{**defaults, **changes})


def cluster(*nodes: NodeView) -> ClusterView:
    return ClusterView(nodes=nodes)


def profile(**changes: object) -> Profile:
    return attrs.evolve(CHAT, **changes)


class Ids:
    """Replica ids the way a shell might make them, but predictable."""

    def __init__(self) -> None:
        self._numbers = itertools.count(1)

    def __call__(self) -> str:
        return f"r{next(self._numbers)}"


def run(
    replicas: tuple[Replica, ...] | list[Replica] = (),
    *,
    fleet: ClusterView,
    profiles: tuple[Profile, ...] = (CHAT,),
    desired: dict[str, int] | None = None,
    now: float = 0.0,
    reported: tuple[ReportedShard, ...] = (),
    ids: Ids | None = None,
    models: dict[str, Model] | None = None,
    awaiting: frozenset[str] = frozenset(),
) -> Plan:
    return reconcile(
        models=MODELS if models is None else models,
        profiles={p.name: p for p in profiles},
        replicas=replicas,
        cluster=fleet,
        desired=desired or {},
        now=now,
        config=CONFIG,
        new_id=ids or Ids(),
        reported=reported,
        awaiting=awaiting,
    )


def of(plan: Plan, kind: type) -> list:
    return [a for a in plan.actions if isinstance(a, kind)]


def record(plan: Plan, replica_id: str) -> Replica:
    return next(r for r in plan.replicas if r.id == replica_id)


def shards_are(plan: Plan, state: str, *replica_ids: str) -> list[Replica]:
    """The plan's records, with every shard of ``replica_ids`` (all, when none named) in ``state``."""
    return [
        attrs.evolve(r, shards=tuple(attrs.evolve(s, state=state) for s in r.shards))
        if not replica_ids or r.id in replica_ids
        else r
        for r in plan.replicas
    ]


def ready(
    fleet: ClusterView,
    *,
    profiles: tuple[Profile, ...] = (CHAT,),
    desired: dict[str, int] | None = None,
    now: float = 0.0,
) -> tuple[Plan, Ids]:
    """A fleet where the wanted replicas were started at ``now`` and all turned Ready."""
    ids = Ids()
    plan = run(fleet=fleet, profiles=profiles, desired=desired, now=now, ids=ids)
    plan = run(
        shards_are(plan, ShardState.READY),
        fleet=fleet,
        profiles=profiles,
        desired=desired,
        now=now + 1,
        ids=ids,
    )
    assert {r.state for r in plan.replicas} == {ReplicaState.READY}
    return plan, ids


# --- the replica's state from its shards -------------------------------------------------------------


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ((ShardState.READY,), ReplicaState.READY),
        ((ShardState.READY, ShardState.READY), ReplicaState.READY),
        ((ShardState.READY, ShardState.LOADING), ReplicaState.LOADING),
        ((ShardState.LOADING, ShardState.STARTING, ShardState.READY), ReplicaState.STARTING),
        ((ShardState.READY, ShardState.FAILED), ReplicaState.FAILED),
        ((ShardState.STOPPED, ShardState.FAILED), ReplicaState.FAILED),
        ((ShardState.READY, ShardState.STOPPED), ReplicaState.STOPPED),
        ((ShardState.DRAINING, ShardState.READY), ReplicaState.DRAINING),
    ],
)
def test_a_replica_is_as_far_along_as_its_slowest_shard_and_fails_with_any(states, expected):
    assert state_of_shards(states) == expected


SHARD_STATES = (
    ShardState.STARTING,
    ShardState.LOADING,
    ShardState.READY,
    ShardState.DRAINING,
    ShardState.STOPPED,
    ShardState.FAILED,
)


@given(states=st.lists(st.sampled_from(SHARD_STATES), min_size=1, max_size=8), seed=st.randoms())
def test_the_replica_state_depends_on_which_states_its_shards_are_in_not_their_order(states, seed):
    state = state_of_shards(states)
    shuffled = list(states)
    seed.shuffle(shuffled)
    assert state_of_shards(shuffled) == state
    assert (state == ReplicaState.READY) == all(s == ShardState.READY for s in states)
    assert (state == ReplicaState.FAILED) == (ShardState.FAILED in states)


def test_a_replica_state_needs_shards_in_known_states():
    with pytest.raises(ValueError, match="Pending"):
        state_of_shards(())
    with pytest.raises(ValueError, match="Exploded"):
        state_of_shards((ShardState.READY, "Exploded"))


# --- starting ----------------------------------------------------------------------------------------


def test_wanted_replicas_are_placed_and_started_without_sharing_a_gpu_or_port():
    fleet = cluster(node("node-1"), node("node-2"))
    plan = run(fleet=fleet, profiles=(profile(max_replicas=4),), desired={"chat": 3}, now=5.0)
    starts = of(plan, StartReplica)
    assert [s.replica_id for s in starts] == ["r1", "r2", "r3"]
    places = [(sh.node, sh.gpu_indices, sh.port) for s in starts for sh in s.placement.shards]
    assert places == [("node-1", (0,), 20000), ("node-1", (1,), 20001), ("node-2", (0,), 20000)]
    assert [s.reason for s in starts] == [
        "scale up: 0 of 3 wanted replicas exist; on node-1 (GPU 0)",
        "scale up: 1 of 3 wanted replicas exist; on node-1 (GPU 1)",
        "scale up: 2 of 3 wanted replicas exist; on node-2 (GPU 0)",
    ]
    assert starts[0].specs[0].shard_id == "r1-s0" and starts[0].specs[0].port == 20000
    r1 = record(plan, "r1")
    assert (r1.state, r1.since, r1.started, r1.created) == (ReplicaState.STARTING, 5.0, 5.0, 5.0)
    assert [(s.node, s.shard_id, s.state) for s in r1.shards] == [("node-1", "r1-s0", ShardState.STARTING)]


def test_a_replica_follows_its_shards_to_ready():
    fleet = cluster(node("node-1"))
    ids = Ids()
    plan = run(fleet=fleet, now=0, ids=ids)
    plan = run(shards_are(plan, ShardState.LOADING), fleet=fleet, now=10, ids=ids)
    assert (record(plan, "r1").state, record(plan, "r1").since) == (ReplicaState.LOADING, 10)
    plan = run(shards_are(plan, ShardState.READY), fleet=fleet, now=20, ids=ids)
    assert (record(plan, "r1").state, record(plan, "r1").since) == (ReplicaState.READY, 20)
    assert plan.actions == ()
    # A steady fleet: nothing to do, the same records back.
    again = run(plan.replicas, fleet=fleet, now=30, ids=ids)
    assert again == Plan(actions=(), replicas=plan.replicas)


def test_higher_bands_are_placed_first():
    fleet = cluster(node("node-1", gpus=1))
    low = profile(name="batch", band=0)
    high = profile(name="chat", band=5)
    plan = run(fleet=fleet, profiles=(low, high))
    assert [s.profile for s in of(plan, StartReplica)] == ["chat"]
    assert [p.profile for p in of(plan, MarkPending)] == ["batch"]


def test_the_same_inputs_give_the_same_plan():
    fleet = cluster(node("node-1"), node("node-2", gpus=4))
    profiles = (profile(max_replicas=3), profile(name="batch", gpus_per_node=2, tensor_parallel=2))
    first = run(fleet=fleet, profiles=profiles, desired={"chat": 3})
    assert run(fleet=fleet, profiles=profiles, desired={"chat": 3}) == first


def test_the_wanted_count_is_kept_within_the_profiles_bounds():
    fleet = cluster(node("node-1", gpus=4))
    chat = profile(min_replicas=1, max_replicas=2)
    assert len(run(fleet=fleet, profiles=(chat,), desired={"chat": 9}).replicas) == 2
    assert len(run(fleet=fleet, profiles=(chat,), desired={"chat": 0}).replicas) == 1
    assert len(run(fleet=fleet, profiles=(chat,)).replicas) == 1  # not given: min_replicas


def test_counts_hold_while_a_node_from_before_a_restart_has_not_reported():
    """A restarted server knows the node but not yet what it runs: a replica added now would
    duplicate the one it is about to report, and one drained now might be the one it serves."""
    fleet = cluster(node("node-1", gpus=4), node("node-2", gpus=4))
    waiting = run(fleet=fleet, awaiting=frozenset({"node-2"}))
    assert waiting.replicas == () and not waiting.actions
    plan, _ = ready(fleet, desired={"chat": 2}, profiles=(profile(max_replicas=2),))
    kept = run(
        plan.replicas, fleet=fleet, profiles=(profile(max_replicas=2),), awaiting=frozenset({"node-2"})
    )
    assert len(kept.replicas) == 2 and not of(kept, DrainReplica)
    assert len(run(fleet=fleet).replicas) == 1  # once every node has spoken


def test_cpu_replicas_keep_their_memory_from_one_pass_to_the_next():
    fleet = cluster(node("node-1", gpus=0, memory_free_mib=10_000))
    tiny = profile(
        name="tiny", model="smol", engine="llamacpp", gpu_class=None, memory_mib=4_096, max_replicas=3
    )
    ids = Ids()
    plan = run(fleet=fleet, profiles=(tiny,), desired={"tiny": 2}, ids=ids, now=0)
    assert [s.placement.shards[0].node for s in of(plan, StartReplica)] == ["node-1", "node-1"]
    # The view the shell passes does not show their memory in use yet: the records do.
    plan = run(plan.replicas, fleet=fleet, profiles=(tiny,), desired={"tiny": 3}, ids=ids, now=1)
    [pending] = of(plan, MarkPending)
    assert pending.reasons == (("node-1", "1,808 MiB free memory, needs 4,096"),)


# --- pending -----------------------------------------------------------------------------------------


def test_an_unplaceable_replica_is_pending_with_every_nodes_reason_said_once():
    fleet = cluster(node("node-1", gpus=1), node("node-2", online=False))
    big = profile(gpus_per_node=2, tensor_parallel=2)
    ids = Ids()
    plan = run(fleet=fleet, profiles=(big,), ids=ids, now=0)
    [pending] = of(plan, MarkPending)
    assert pending.reasons == (("node-1", "1 free l40s-45g, needs 2"), ("node-2", "offline"))
    assert pending.reason == (
        "profile chat (2 × l40s-45g with 20,000 MiB free each on one node) fits none of 2 nodes: "
        "1 free l40s-45g, needs 2 (1 node); offline (1 node)"
    )
    r1 = record(plan, "r1")
    assert (r1.state, r1.reason, r1.shards) == (ReplicaState.PENDING, pending.reason, ())
    # Unchanged next pass: no new line for the log.
    later = run(plan.replicas, fleet=fleet, profiles=(big,), ids=ids, now=60)
    assert later.actions == () and later.replicas == plan.replicas
    # Room appears: it starts, and says how long it waited.
    roomy = cluster(node("node-1", gpus=1), node("node-2"))
    started = run(plan.replicas, fleet=roomy, profiles=(big,), ids=ids, now=90)
    [start] = of(started, StartReplica)
    assert start.reason == "pending for 90 s; on node-2 (GPUs 0, 1)"


# --- failures and restarts ---------------------------------------------------------------------------


def failed(plan: Plan, replica_id: str, reason: str = "engine exited with status 1") -> list[Replica]:
    """The records as the shell keeps them after the agent reported ``replica_id``'s rank 0 failed."""
    out = []
    for r in plan.replicas:
        if r.id == replica_id:
            first = attrs.evolve(r.shards[0], state=ShardState.FAILED, reason=reason)
            r = attrs.evolve(r, shards=(first, *r.shards[1:]))
        out.append(r)
    return out


def test_a_failed_replica_restarts_in_place_after_its_backoff_and_not_before():
    fleet = cluster(node("node-1"))
    plan, ids = ready(fleet)
    plan = run(failed(plan, "r1"), fleet=fleet, ids=ids, now=100)
    [mark] = of(plan, MarkFailed)
    assert mark == MarkFailed(
        replica_id="r1",
        shards=(),  # the failed shard is gone; nothing else to stop
        restart_at=110,
        reason="shard r1-s0 on node-1 failed: engine exited with status 1; starts again in 10 s (failure 1)",
    )
    r1 = record(plan, "r1")
    assert (r1.state, r1.failures, r1.last_failure, r1.failed_nodes) == (
        ReplicaState.FAILED,
        1,
        100,
        ("node-1",),
    )
    # Counted still: no replacement is made while it waits.
    assert [r.id for r in plan.replicas] == ["r1"]
    assert run(plan.replicas, fleet=fleet, ids=ids, now=109.9).actions == ()
    plan = run(plan.replicas, fleet=fleet, ids=ids, now=110)
    [restart] = of(plan, RestartReplica)
    assert (restart.replica_id, restart.moved) == ("r1", False)
    assert [(s.shard_id, s.node_address, [g.index for g in s.gpus], s.port) for s in restart.specs] == [
        ("r1-s0", "10.0.0.1", [0], 20000)
    ]
    assert restart.reason.startswith("restart after a 10 s backoff (shard r1-s0 on node-1 failed")
    assert restart.reason.endswith("; on node-1 (GPU 0)")
    r1 = record(plan, "r1")
    assert (r1.state, r1.started, r1.failures) == (ReplicaState.STARTING, 110, 1)


def test_its_gpus_stay_its_own_while_it_waits_to_restart():
    fleet = cluster(node("node-1", gpus=1))
    other = profile(name="batch")
    plan, ids = ready(fleet)
    waiting = run(failed(plan, "r1"), fleet=fleet, profiles=(CHAT, other), ids=ids, now=100)
    assert of(waiting, StartReplica) == []
    assert [p.replica_id for p in of(waiting, MarkPending)] == ["r2"]


def test_after_move_after_failures_it_moves_away_and_restarts_in_place_when_it_cannot():
    plan, ids = ready(cluster(node("node-1")))
    stuck = [attrs.evolve(plan.replicas[0], failures=2, last_failure=0)]
    # Third failure: move. Only node-1 exists, so it restarts there and says why.
    alone = cluster(node("node-1"))
    plan = run(failed(Plan(actions=(), replicas=tuple(stuck)), "r1"), fleet=alone, ids=ids, now=100)
    assert of(plan, MarkFailed)[0].reason.endswith("starts again on other nodes in 40 s (failure 3)")
    [restart] = of(run(plan.replicas, fleet=alone, ids=ids, now=140), RestartReplica)
    assert restart.moved is False
    assert "in place, as no other node can take it (profile chat" in restart.reason
    # With another node there, it goes there.
    two = cluster(node("node-1"), node("node-2"))
    [move] = of(run(plan.replicas, fleet=two, ids=ids, now=140), RestartReplica)
    assert move.moved is True
    assert move.reason.startswith("moved away from node-1 after a 40 s backoff")
    assert [s.node for s in move.placement.shards] == ["node-2"]


def test_after_give_up_after_failures_it_stays_failed_and_frees_its_gpus():
    fleet = cluster(node("node-1", gpus=1))
    plan, ids = ready(fleet)
    tired = attrs.evolve(plan.replicas[0], failures=POLICY.give_up_after - 1, last_failure=0)
    plan = run(failed(Plan(actions=(), replicas=(tired,)), "r1"), fleet=fleet, ids=ids, now=100)
    [mark] = of(plan, MarkFailed)
    assert mark.restart_at is None
    assert "gave up after 5 failed starts in a row; an operator must act" in mark.reason
    r1 = record(plan, "r1")
    assert (r1.state, r1.shards) == (ReplicaState.FAILED, ())
    # It still counts, so no fresh replica takes its place, and nothing restarts it, ever.
    later = run(plan.replicas, fleet=fleet, ids=ids, now=100_000)
    assert later.actions == () and [r.id for r in later.replicas] == ["r1"]
    # Its GPU is free for others.
    other = run(later.replicas, fleet=fleet, profiles=(CHAT, profile(name="batch")), ids=ids, now=100_001)
    assert [s.profile for s in of(other, StartReplica)] == ["batch"]


def test_failures_are_forgotten_once_it_has_been_ready_for_reset_after():
    fleet = cluster(node("node-1"))
    plan, ids = ready(fleet)
    shaky = attrs.evolve(plan.replicas[0], failures=2, last_failure=0, failed_nodes=("node-2",), reason="x")
    assert run([shaky], fleet=fleet, ids=ids, now=POLICY.reset_after).replicas[0].failures == 2
    proven = run([shaky], fleet=fleet, ids=ids, now=1 + POLICY.reset_after).replicas[0]
    assert (proven.failures, proven.last_failure, proven.failed_nodes, proven.reason) == (0, None, (), "")


def test_a_multi_node_replica_stops_its_other_ranks_and_restarts_only_once_they_are_gone():
    fleet = cluster(node("node-1", fabric="ib-a"), node("node-2", fabric="ib-a"))
    wide = profile(nodes=2, tensor_parallel=1, pipeline_parallel=2)
    plan, ids = ready(fleet, profiles=(wide,))
    plan = run(failed(plan, "r1"), fleet=fleet, profiles=(wide,), ids=ids, now=100)
    [mark] = of(plan, MarkFailed)
    assert [(s.node, s.shard_id) for s in mark.shards] == [("node-2", "r1-s1")]
    # Backoff over, but rank 1 still runs: no restart yet.
    assert run(plan.replicas, fleet=fleet, profiles=(wide,), ids=ids, now=200).actions == ()
    gone = shards_are(plan, ShardState.STOPPED)
    [restart] = of(run(gone, fleet=fleet, profiles=(wide,), ids=ids, now=200), RestartReplica)
    assert [s.shard_id for s in restart.specs] == ["r1-s0", "r1-s1"]


def test_a_replica_not_ready_within_its_startup_timeout_is_stopped_and_counted_as_a_failure():
    fleet = cluster(node("node-1"))
    ids = Ids()
    plan = run(fleet=fleet, ids=ids, now=0)
    plan = run(shards_are(plan, ShardState.LOADING), fleet=fleet, ids=ids, now=100)
    assert run(plan.replicas, fleet=fleet, ids=ids, now=300).actions == ()
    plan = run(plan.replicas, fleet=fleet, ids=ids, now=301)
    [mark] = of(plan, MarkFailed)
    assert [s.shard_id for s in mark.shards] == ["r1-s0"]
    assert mark.reason == (
        "not Ready within 300 s of starting (Loading for 201 s); starts again in 10 s (failure 1)"
    )


def test_a_shard_stopped_without_being_asked_gets_its_replica_replaced():
    fleet = cluster(node("node-1"), node("node-2"))
    plan, ids = ready(fleet)
    plan = run(shards_are(plan, ShardState.STOPPED), fleet=fleet, ids=ids, now=50)
    [stop] = of(plan, StopReplica)
    assert stop.reason == "shard r1-s0 on node-1 is Stopped without being asked"
    [start] = of(plan, StartReplica)
    assert start.replica_id == "r2"
    assert start.reason.startswith(
        "replaces r1: shard r1-s0 on node-1 is Stopped without being asked; on node-"
    )


# --- repairs -------------------------------------------------------------------------------------------


def test_a_replica_on_a_lost_node_is_reaped_and_replaced_elsewhere():
    plan, ids = ready(cluster(node("node-1"), node("node-2")), desired={"chat": 1})
    lost = cluster(node("node-1", online=False), node("node-2"))
    plan = run(plan.replicas, fleet=lost, ids=ids, now=100)
    [reap] = of(plan, Reap)
    assert reap == Reap(
        replica_id="r1", lost_nodes=("node-1",), shards=(), reason="node node-1 lost (with shard r1-s0)"
    )
    [start] = of(plan, StartReplica)
    assert start.reason == "replaces r1: node node-1 lost (with shard r1-s0); on node-2 (GPU 0)"
    # Nothing of r1 is left to wait for: its record is gone.
    assert [r.id for r in plan.replicas] == ["r2"]


def test_a_reaped_multi_node_replica_stops_its_rank_on_the_node_still_there():
    fleet = cluster(*(node(f"node-{i}", fabric="ib-a") for i in (1, 2, 3)))
    wide = profile(nodes=2, pipeline_parallel=2)
    plan, ids = ready(fleet, profiles=(wide,))
    lost = cluster(
        node("node-1", fabric="ib-a", online=False),
        node("node-2", fabric="ib-a"),
        node("node-3", fabric="ib-a"),
    )
    plan = run(plan.replicas, fleet=lost, profiles=(wide,), ids=ids, now=100)
    [reap] = of(plan, Reap)
    assert [(s.node, s.shard_id) for s in reap.shards] == [("node-2", "r1-s1")]
    r1 = record(plan, "r1")
    assert r1.state == ReplicaState.STOPPED and [s.node for s in r1.shards] == ["node-2"]
    # Its rank on node-2 holds that node's GPU 0 until it is gone: the replacement avoids it.
    [start] = of(plan, StartReplica)
    assert [(s.node, s.gpu_indices) for s in start.placement.shards] == [("node-2", (1,)), ("node-3", (0,))]


def test_a_replica_on_a_gpu_that_turned_unhealthy_is_evicted_and_replaced():
    plan, ids = ready(cluster(node("node-1")))
    sick = cluster(node("node-1", gpus=(gpu(0, healthy=False, problems=("ecc-uncorrected",)), gpu(1))))
    plan = run(plan.replicas, fleet=sick, ids=ids, now=100)
    [evict] = of(plan, Evict)
    assert evict.reason == "GPU 0 on node-1 is unhealthy (ecc-uncorrected)"
    assert [(s.node, s.shard_id) for s in evict.shards] == [("node-1", "r1-s0")]
    assert record(plan, "r1").state == ReplicaState.STOPPED
    # The replacement can only go to GPU 1: GPU 0 is unhealthy (and still held until r1 is gone).
    [start] = of(plan, StartReplica)
    assert start.placement.shards[0].gpu_indices == (1,)
    assert start.reason.startswith("replaces r1, evicted: GPU 0 on node-1 is unhealthy")


def test_a_stopping_replica_holds_its_gpus_until_its_shards_are_gone():
    fleet = cluster(node("node-1", gpus=1))
    plan, ids = ready(fleet)
    plan = run(
        plan.replicas, fleet=fleet, profiles=(profile(min_replicas=0),), desired={"chat": 0}, ids=ids, now=10
    )
    [drain] = of(plan, DrainReplica)
    assert (drain.deadline, drain.reason) == (70, "scale down: 1 replica of chat, 0 wanted")
    batch = profile(name="batch")
    both = (profile(min_replicas=0), batch)
    held = run(plan.replicas, fleet=fleet, profiles=both, desired={"chat": 0}, ids=ids, now=20)
    assert of(held, StartReplica) == [] and len(of(held, MarkPending)) == 1
    assert record(held, "r1").state == ReplicaState.DRAINING
    # Its shard reported Stopped: the record goes, and the GPU is free.
    freed = run(
        shards_are(held, ShardState.STOPPED, "r1"),
        fleet=fleet,
        profiles=both,
        desired={"chat": 0},
        ids=ids,
        now=30,
    )
    assert [r.id for r in freed.replicas] == ["r2"]
    assert [s.replica_id for s in of(freed, StartReplica)] == ["r2"]


def test_a_draining_replica_whose_node_is_lost_is_simply_gone():
    fleet = cluster(node("node-1"))
    plan, ids = ready(fleet)
    zero = (profile(min_replicas=0),)
    plan = run(plan.replicas, fleet=fleet, profiles=zero, desired={"chat": 0}, ids=ids, now=10)
    lost = cluster(node("node-1", online=False))
    assert run(plan.replicas, fleet=lost, profiles=zero, desired={"chat": 0}, ids=ids, now=20) == Plan(
        actions=(), replicas=()
    )


def test_a_replica_still_draining_at_its_deadline_is_stopped():
    fleet = cluster(node("node-1"))
    plan, ids = ready(fleet)
    zero = (profile(min_replicas=0),)
    plan = run(plan.replicas, fleet=fleet, profiles=zero, desired={"chat": 0}, ids=ids, now=10)
    assert run(plan.replicas, fleet=fleet, profiles=zero, desired={"chat": 0}, ids=ids, now=69).actions == ()
    plan = run(plan.replicas, fleet=fleet, profiles=zero, desired={"chat": 0}, ids=ids, now=70)
    [stop] = of(plan, StopReplica)
    assert (stop.reason, [s.shard_id for s in stop.shards]) == ("still draining at its deadline", ["r1-s0"])
    assert record(plan, "r1").state == ReplicaState.STOPPED


def test_replicas_whose_profile_or_model_left_the_catalog_are_drained():
    fleet = cluster(node("node-1"))
    plan, ids = ready(fleet, profiles=(CHAT, profile(name="tiny", model="smol", engine="llamacpp")))
    after = run(plan.replicas, fleet=fleet, profiles=(), ids=ids, now=10, models={"smol": SMOL})
    assert [d.reason for d in of(after, DrainReplica)] == [
        "profile chat is not in the catalog any more",
        "profile tiny is not in the catalog any more",
    ]
    tiny = profile(name="tiny", model="smol", engine="llamacpp")
    no_model = run(plan.replicas, fleet=fleet, profiles=(CHAT, tiny), ids=ids, now=10, models={"smol": SMOL})
    assert [d.reason for d in of(no_model, DrainReplica)] == ["model llama is not in the catalog any more"]
    assert of(no_model, StartReplica) == []


def test_orphan_shards_are_stopped_and_hold_their_gpus_meanwhile():
    fleet = cluster(node("node-1", gpus=1), node("node-2", gpus=1, online=False))
    orphans = (
        ReportedShard(
            node="node-1", shard_id="old-s0", replica_id="old", model="llama", gpu_indices=(0,), port=20000
        ),
        ReportedShard(
            node="node-2", shard_id="far-s0", replica_id="far", model="llama", gpu_indices=(0,), port=20000
        ),
    )
    plan = run(fleet=fleet, reported=orphans)
    assert of(plan, StopOrphan) == [
        StopOrphan(node="node-1", shard_id="old-s0", reason="no replica old is known")
    ]
    assert of(plan, StartReplica) == []
    assert of(plan, MarkPending)[0].reason.endswith(
        "; waiting for room that replicas being stopped are freeing"
    )
    gone_model = (attrs.evolve(orphans[0], model="mistral"),)
    assert (
        of(run(fleet=fleet, reported=gone_model), StopOrphan)[0].reason
        == "model mistral is not in the catalog"
    )


# --- scaling down --------------------------------------------------------------------------------------


def test_scaling_down_takes_pending_replicas_then_the_newest_and_never_goes_below_min():
    fleet = cluster(node("node-1", gpus=3))
    chat = profile(min_replicas=1, max_replicas=4)
    ids = Ids()
    plan = run(fleet=fleet, profiles=(chat,), desired={"chat": 1}, ids=ids, now=0)
    plan = run(plan.replicas, fleet=fleet, profiles=(chat,), desired={"chat": 2}, ids=ids, now=5)
    plan = run(plan.replicas, fleet=fleet, profiles=(chat,), desired={"chat": 4}, ids=ids, now=10)
    assert [r.state for r in plan.replicas] == [ReplicaState.STARTING] * 3 + [ReplicaState.PENDING]
    plan = run(
        shards_are(plan, ShardState.READY),
        fleet=fleet,
        profiles=(chat,),
        desired={"chat": 4},
        ids=ids,
        now=20,
    )
    down = run(plan.replicas, fleet=fleet, profiles=(chat,), desired={"chat": 0}, ids=ids, now=30)
    # r4 was pending (just dropped), then r3 (the newest) and r2 drain; min_replicas keeps r1.
    assert [(type(a).__name__, a.replica_id) for a in down.actions] == [
        ("StopReplica", "r4"),
        ("DrainReplica", "r3"),
        ("DrainReplica", "r2"),
    ]
    assert [(r.id, r.state) for r in down.replicas] == [
        ("r1", ReplicaState.READY),
        ("r2", ReplicaState.DRAINING),
        ("r3", ReplicaState.DRAINING),
    ]


# --- preemption ----------------------------------------------------------------------------------------


def test_a_higher_band_that_fits_nowhere_preempts_the_newest_lowest_band_replica_and_waits():
    fleet = cluster(node("node-1", gpus=2))
    batch = profile(name="batch", band=0, max_replicas=2)
    plan, ids = ready(fleet, profiles=(batch,), desired={"batch": 1})
    plan = run(plan.replicas, fleet=fleet, profiles=(batch,), desired={"batch": 2}, ids=ids, now=5)
    plan = run(
        shards_are(plan, ShardState.READY),
        fleet=fleet,
        profiles=(batch,),
        desired={"batch": 2},
        ids=ids,
        now=6,
    )
    chat = profile(name="chat", band=5)
    plan = run(plan.replicas, fleet=fleet, profiles=(batch, chat), desired={"batch": 2}, ids=ids, now=50)
    [preempt] = of(plan, Preempt)
    assert (preempt.victim_replica_id, preempt.for_replica_id, preempt.for_profile) == ("r2", "r3", "chat")
    assert preempt.reason == (
        "preempted for r3 of profile chat (band 5), which fits nowhere else; r2 is band 0"
    )
    [pending] = of(plan, MarkPending)
    assert pending.reason.endswith("; preempting r2 to make room")
    # Next pass the victim is still stopping: chat waits instead of preempting again, and batch's
    # replacement for r2 waits too.
    plan = run(plan.replicas, fleet=fleet, profiles=(batch, chat), desired={"batch": 2}, ids=ids, now=51)
    assert of(plan, Preempt) == []
    assert record(plan, "r3").reason.endswith("; waiting for room that replicas being stopped are freeing")
    # Gone: chat takes the GPU, before batch's replacement (higher band first).
    plan = run(
        shards_are(plan, ShardState.STOPPED, "r2"),
        fleet=fleet,
        profiles=(batch, chat),
        desired={"batch": 2},
        ids=ids,
        now=52,
    )
    assert [s.replica_id for s in of(plan, StartReplica)] == ["r3"]


def serving(
    replica_id: str, profile_name: str, node_name: str, gpus: tuple[int, ...], created: float
) -> Replica:
    """A Ready replica of one shard, as a record."""
    return Replica(
        id=replica_id,
        profile=profile_name,
        model="llama",
        state=ReplicaState.READY,
        shards=(
            ReplicaShard(
                node=node_name,
                shard_id=f"{replica_id}-s0",
                rank=0,
                gpu_indices=gpus,
                port=20000 + gpus[0],
                state=ShardState.READY,
            ),
        ),
        since=created,
        created=created,
        started=created,
    )


def test_preemption_takes_the_fewest_replicas_and_no_more_than_it_needs():
    tiny = profile(name="tiny", band=0, max_replicas=3)
    pair = profile(name="pair", band=0, gpus_per_node=2, tensor_parallel=2)
    big = profile(name="big", band=9, gpus_per_node=2, tensor_parallel=2)
    # node-1: two tiny ones, the newest replicas of all; node-2: one older pair.
    fleet = cluster(node("node-1"), node("node-2"))
    records = [
        serving("t1", "tiny", "node-1", (0,), created=20),
        serving("t2", "tiny", "node-1", (1,), created=30),
        serving("p1", "pair", "node-2", (0, 1), created=10),
    ]
    wanted = {"tiny": 2, "pair": 1, "big": 1}
    plan = run(records, fleet=fleet, profiles=(tiny, pair, big), desired=wanted, ids=Ids(), now=50)
    # Taking the pair alone beats taking both tiny ones, newer as they are.
    assert [p.victim_replica_id for p in of(plan, Preempt)] == ["p1"]
    # On one node of 3 cards: the tiny one is newer and tried first, but the pair alone makes
    # room, so the tiny one is spared.
    fleet = cluster(node("node-1", gpus=3))
    records = [
        serving("t1", "tiny", "node-1", (2,), created=30),
        serving("p1", "pair", "node-1", (0, 1), created=10),
    ]
    plan = run(
        records, fleet=fleet, profiles=(tiny, pair, big), desired={"tiny": 1, "pair": 1}, ids=Ids(), now=50
    )
    assert [p.victim_replica_id for p in of(plan, Preempt)] == ["p1"]


def test_two_blocked_replicas_never_count_on_the_same_room():
    fleet = cluster(node("node-1", gpus=2))
    batch = profile(name="batch", band=0, max_replicas=2)
    plan, ids = ready(fleet, profiles=(batch,), desired={"batch": 2})
    chat = profile(name="chat", band=5, max_replicas=2)
    plan = run(
        plan.replicas, fleet=fleet, profiles=(batch, chat), desired={"batch": 2, "chat": 2}, ids=ids, now=50
    )
    # The first chat replica takes one batch replica's GPU; the second does not wait for that
    # one too, but takes the other.
    assert sorted((p.victim_replica_id, p.for_replica_id) for p in of(plan, Preempt)) == [
        ("r1", "r3"),
        ("r2", "r4"),
    ]


def test_a_pass_makes_at_most_a_few_preemption_searches():
    fleet = cluster(node("node-1", gpus=4))
    batch = profile(name="batch", band=0, max_replicas=4)
    plan, ids = ready(fleet, profiles=(batch,), desired={"batch": 4})
    chat = profile(name="chat", band=5, max_replicas=4)
    both = {"batch": 4, "chat": 4}
    plan = run(plan.replicas, fleet=fleet, profiles=(batch, chat), desired=both, ids=ids, now=50)
    assert len(of(plan, Preempt)) == PREEMPTION_SEARCHES_PER_PASS == 3
    [last] = [p for p in of(plan, MarkPending) if not p.reason.endswith("to make room")]
    assert last.reason.endswith("; whether to preempt is decided on the next pass")
    plan = run(plan.replicas, fleet=fleet, profiles=(batch, chat), desired=both, ids=ids, now=51)
    assert [p.for_replica_id for p in of(plan, Preempt)] == [last.replica_id]


def test_nothing_is_preempted_for_a_band_that_is_not_higher():
    fleet = cluster(node("node-1", gpus=1))
    plan, ids = ready(fleet, profiles=(profile(name="batch", band=3),))
    plan = run(
        plan.replicas, fleet=fleet, profiles=(profile(name="batch", band=3), profile(band=3)), ids=ids, now=5
    )
    assert of(plan, Preempt) == [] and len(of(plan, MarkPending)) == 1


# --- the state machine -------------------------------------------------------------------------------

FLEET_NODES = ("node-1", "node-2", "node-3", "node-4")
FLEET_PROFILES = (
    profile(name="big", band=2, gpus_per_node=2, tensor_parallel=2, min_replicas=1, max_replicas=2),
    profile(name="small", band=0, min_replicas=1, max_replicas=4),
    profile(name="wide", band=1, nodes=2, pipeline_parallel=2, min_replicas=0, max_replicas=1),
)


@attrs.define
class AgentShard:
    """A shard as its agent runs it."""

    replica_id: str
    model: str
    gpus: tuple[int, ...]
    port: int
    rendezvous_port: int
    state: str = ShardState.STARTING
    stopping: bool = False
    slow: bool = False  # never gets Ready: the startup timeout's business


class Fleet(RuleBasedStateMachine):
    """The shell and four agents (4 GPUs each) around the pure reconciler.

    With all four nodes there and healthy, every wanted replica fits (at most 10 GPUs of 16 wanted,
    in pieces of at most 2), so a fleet left alone long enough must serve them all.
    """

    @initialize()
    def setup(self) -> None:
        self.now = 0.0
        self.ids = Ids()
        self.online = dict.fromkeys(FLEET_NODES, True)
        self.sick: set[tuple[str, int]] = set()
        self.agents: dict[str, dict[str, AgentShard]] = {n: {} for n in FLEET_NODES}
        self.records: tuple[Replica, ...] = ()
        self.desired = {p.name: p.min_replicas for p in FLEET_PROFILES}
        self.profiles = {p.name: p for p in FLEET_PROFILES}
        self.plans = 0

    # --- the world -----------------------------------------------------------------------------

    def view(self) -> ClusterView:
        return ClusterView(
            nodes=tuple(
                node(
                    name,
                    online=self.online[name],
                    fabric="ib-a",
                    gpus=tuple(
                        gpu(i, healthy=False, problems=("ecc-uncorrected",))
                        if (name, i) in self.sick
                        else gpu(i)
                        for i in range(4)
                    ),
                )
                for name in FLEET_NODES
            )
        )

    def reported(self) -> tuple[ReportedShard, ...]:
        return tuple(
            ReportedShard(
                node=name,
                shard_id=shard_id,
                replica_id=shard.replica_id,
                model=shard.model,
                gpu_indices=shard.gpus,
                port=shard.port,
                rendezvous_port=shard.rendezvous_port,
            )
            for name in FLEET_NODES
            if self.online[name]
            for shard_id, shard in self.agents[name].items()
        )

    def tell(self, node_name: str, shard_id: str, state: str, reason: str = "") -> None:
        """The shell hears a ShardStatus and updates the record that lists the shard."""
        out = []
        for r in self.records:
            if any(s.node == node_name and s.shard_id == shard_id for s in r.shards):
                r = attrs.evolve(
                    r,
                    shards=tuple(
                        attrs.evolve(s, state=state, reason=reason)
                        if (s.node, s.shard_id) == (node_name, shard_id)
                        else s
                        for s in r.shards
                    ),
                )
            out.append(r)
        self.records = tuple(out)

    def end(self, node_name: str, shard_id: str, state: str, reason: str = "") -> None:
        del self.agents[node_name][shard_id]
        self.tell(node_name, shard_id, state, reason)

    # --- rules -----------------------------------------------------------------------------------

    @rule()
    def reconcile_pass(self) -> None:
        self.pass_once()

    @rule(dt=st.floats(1, 120), progress=st.lists(st.booleans(), min_size=12, max_size=12))
    def time_passes(self, dt: float, progress: list[bool]) -> None:
        """Stops finish; engines move on a step (or not), unless they are the slow kind."""
        self.now += dt
        for name in FLEET_NODES:
            if not self.online[name]:
                continue  # nothing heard from a lost node
            for n, (shard_id, shard) in enumerate(sorted(self.agents[name].items())):
                if shard.stopping:
                    self.end(name, shard_id, ShardState.STOPPED)
                elif shard.state != ShardState.READY and not shard.slow and progress[n % len(progress)]:
                    shard.state = (
                        ShardState.LOADING if shard.state == ShardState.STARTING else ShardState.READY
                    )
                    self.tell(name, shard_id, shard.state)

    @rule(pick=st.integers(0, 100), slow=st.booleans())
    def an_engine_fails(self, pick: int, slow: bool) -> None:
        running = [
            (name, shard_id)
            for name in FLEET_NODES
            if self.online[name]
            for shard_id, shard in sorted(self.agents[name].items())
            if not shard.stopping
        ]
        if running:
            name, shard_id = running[pick % len(running)]
            if slow:
                self.agents[name][shard_id].slow = True
            else:
                self.end(name, shard_id, ShardState.FAILED, "engine exited with status 1")

    @rule(pick=st.sampled_from(FLEET_NODES))
    def a_node_goes_silent(self, pick: str) -> None:
        self.online[pick] = False

    @rule(pick=st.sampled_from(FLEET_NODES), survived=st.booleans())
    def a_node_comes_back(self, pick: str, survived: bool) -> None:
        """Its agent registers again; its engines ran on, or died with the node."""
        if self.online[pick]:
            return
        self.online[pick] = True
        for shard_id in list(self.agents[pick]):
            if not survived:
                self.end(pick, shard_id, ShardState.FAILED, "not running after the node came back")

    @rule(pick=st.sampled_from(FLEET_NODES), index=st.integers(0, 3))
    def a_gpu_turns_unhealthy(self, pick: str, index: int) -> None:
        self.sick.add((pick, index))

    @rule()
    def gpus_are_repaired(self) -> None:
        self.sick.clear()

    @rule(profile_name=st.sampled_from([p.name for p in FLEET_PROFILES]), count=st.integers(0, 6))
    def the_wanted_count_changes(self, profile_name: str, count: int) -> None:
        self.desired[profile_name] = count

    @rule()
    def left_alone_it_serves_every_wanted_replica(self) -> None:
        """With the fleet whole, passes and time alone bring every wanted replica to Ready."""
        for name in FLEET_NODES:
            self.a_node_comes_back(name, survived=True)
        self.sick.clear()
        for shards in self.agents.values():
            for shard in shards.values():
                shard.slow = False
        for _ in range(40):
            self.pass_once()
            self.time_passes(60, [True] * 12)
        self.pass_once()
        for name, profile_ in self.profiles.items():
            wanted = min(max(self.desired[name], profile_.min_replicas), profile_.max_replicas)
            mine = [r for r in self.records if r.profile == name]
            given_up = [
                r for r in mine if r.state == ReplicaState.FAILED and isinstance(self.decision(r), GiveUp)
            ]
            serving = [r for r in mine if r.state == ReplicaState.READY]
            assert len(serving) + len(given_up) == wanted, (name, [(r.id, r.state, r.reason) for r in mine])

    # --- one pass, as the shell runs it ------------------------------------------------------------

    def decision(self, r: Replica):
        return decide(r.failures, r.last_failure if r.last_failure is not None else r.since, POLICY)

    def pass_once(self) -> None:
        before = {r.id: r for r in self.records}
        plan = reconcile(
            models=MODELS,
            profiles=self.profiles,
            replicas=self.records,
            cluster=self.view(),
            desired=self.desired,
            now=self.now,
            config=CONFIG,
            new_id=self.ids,
            reported=self.reported(),
        )
        self.plans += 1
        self.check_plan(plan, before)
        self.records = plan.replicas
        for action in plan.actions:
            if isinstance(action, StartReplica | RestartReplica):
                for spec, where in zip(action.specs, action.placement.shards, strict=True):
                    name = where.node
                    assert self.online[name], f"{action.replica_id} started on lost {name}"
                    agent = self.agents[name]
                    assert spec.shard_id not in agent, f"{spec.shard_id} started while its old self runs"
                    agent[spec.shard_id] = AgentShard(
                        replica_id=spec.replica_id,
                        model=spec.model,
                        gpus=tuple(g.index for g in spec.gpus),
                        port=spec.port,
                        rendezvous_port=spec.rendezvous_port if spec.rank == 0 else 0,
                    )
            elif isinstance(action, ENDING):
                for ref in action.shards:
                    assert self.online[ref.node], f"{type(action).__name__} sent to lost {ref.node}"
                    if ref.shard_id in self.agents[ref.node]:
                        self.agents[ref.node][ref.shard_id].stopping = True
                    else:
                        self.tell(ref.node, ref.shard_id, ShardState.STOPPED)  # "not running"
            elif isinstance(action, StopOrphan):
                assert self.online[action.node]
                if action.shard_id in self.agents[action.node]:
                    self.agents[action.node][action.shard_id].stopping = True

    def check_plan(self, plan: Plan, before: dict[str, Replica]) -> None:
        assert all(action.reason for action in plan.actions)
        ending = {
            a.replica_id if not isinstance(a, Preempt) else a.victim_replica_id
            for a in plan.actions
            if isinstance(a, ENDING)
        }
        starting = {a.replica_id for a in plan.actions if isinstance(a, StartReplica | RestartReplica)}
        assert not ending & starting, "the same pass stops and starts a replica"
        # Every record kept made a move its lifecycle allows (the reconciler's moves raise on an
        # illegal one; this also catches a record rebuilt by hand in the wrong state).
        for r in plan.replicas:
            if r.id in before:
                assert LIFECYCLE.allows(before[r.id].state, r.state), (r.id, before[r.id].state, r.state)
        for action in plan.actions:
            if isinstance(action, RestartReplica):
                old = before[action.replica_id]
                assert old.state in (ReplicaState.FAILED, ReplicaState.PENDING)
                if old.state == ReplicaState.FAILED:
                    assert old.last_failure is not None
                    assert self.now >= old.last_failure + restart_delay(old.failures, POLICY)
        # The count each profile wants, after every pass, in records that count.
        for name, profile_ in self.profiles.items():
            wanted = min(max(self.desired[name], profile_.min_replicas), profile_.max_replicas)
            assert sum(1 for r in plan.replicas if r.profile == name and r.state in COUNTED) == wanted
        view = {n.name: n for n in self.view().nodes}
        for r in plan.replicas:
            if r.state in RUNNING:
                assert all(view[s.node].online for s in r.shards), f"{r.id} {r.state} on a lost node"

    @invariant()
    def no_gpu_is_held_twice(self) -> None:
        # By the engines on the nodes, stopping ones included ...
        for name, shards in self.agents.items():
            cards = [g for shard in shards.values() for g in shard.gpus]
            assert len(cards) == len(set(cards)), (name, shards)
        # ... and by the records, which is what the next placement believes.
        if not hasattr(self, "records"):
            return
        claimed = [
            (s.node, g)
            for r in self.records
            if r.state != ReplicaState.PENDING
            for s in r.shards
            for g in s.gpu_indices
        ]
        assert len(claimed) == len(set(claimed))


Fleet.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFleet = Fleet.TestCase
