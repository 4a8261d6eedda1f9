"""The reconciler's shell: how it turns load into each profile's wanted count."""

from __future__ import annotations

import trio

from llmgw.core.catalog import Model, Profile
from llmgw.core.inventory import Inventory
from llmgw.core.liveness import NodeState
from llmgw.core.reconcile import ReconcileConfig
from llmgw.core.replica import Replica, ReplicaState, state_of_shards
from llmgw.core.restart_policy import RestartPolicy
from llmgw.core.scaling import EngineLoad, LoadSignals, ScalePolicy
from llmgw.core.shard import ShardSpec
from llmgw.server.changes import Changes
from llmgw.server.nodes import Node, Shard
from llmgw.server.replicas import ReplicaManager
from llmgw.wire.messages import CommandResult, RunningShard, ShardState, StartShard

POLICY = ScalePolicy()


class Catalog:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def profiles(self) -> dict[str, Profile]:
        return {self.profile.name: self.profile}


def profile(**changes) -> Profile:
    base = dict(
        name="chat",
        model="m",
        engine="llamacpp",
        gpu_class=None,
        memory_mib=512,
        min_replicas=1,
        max_replicas=3,
    )
    return Profile(**{**base, **changes})


def manager(load: LoadSignals, p: Profile) -> ReplicaManager:
    return ReplicaManager(
        registry=None, catalog=Catalog(p), engine_secret=None, signals=lambda prof, records: load
    )


def test_without_signals_each_profile_wants_its_min():
    m = ReplicaManager(registry=None, catalog=Catalog(profile()), engine_secret=None)
    assert m._desired(now=0.0) == {}  # the reconciler then uses min_replicas


def test_sustained_load_adds_a_replica_and_idleness_removes_it_after_the_cooldowns():
    busy = LoadSignals(queue_depth=100, replicas=(EngineLoad(running=4, waiting=4, saturation=1.0),))
    m = manager(busy, profile())
    assert m._desired(now=0.0) == {"chat": 1}  # high, but not for long enough yet
    assert m._desired(now=POLICY.up_after + 1) == {"chat": 2}
    assert m._desired(now=POLICY.up_after + 2) == {"chat": 2}  # the up cooldown holds it
    m._signals = lambda prof, records: LoadSignals(
        replicas=(EngineLoad(running=0, waiting=0, saturation=0.0),) * 2
    )
    start = POLICY.up_after + 3
    assert m._desired(now=start) == {"chat": 2}
    later = start + max(POLICY.down_after, POLICY.down_cooldown) + 1
    assert m._desired(now=later) == {"chat": 1}
    assert m._desired(now=later + 10 * POLICY.down_cooldown) == {"chat": 1}  # never below min


def test_the_wanted_count_follows_a_changed_min_and_max():
    idle = LoadSignals()
    m = manager(idle, profile(min_replicas=2, max_replicas=2))
    assert m._desired(now=0.0) == {"chat": 2}
    m._catalog.profile = profile(min_replicas=0, max_replicas=0)  # ctl scale --replicas 0
    assert m._desired(now=1.0) == {"chat": 0}


def test_an_adopted_replica_is_wanted_even_below_min_replicas():
    """After a server restart, a min_replicas 0 profile's running replica is adopted: the scaler
    starts from it, instead of from 0, which would drain the replica its clients wait for."""
    m = manager(LoadSignals(), profile(min_replicas=0, max_replicas=2))
    m._records = {
        "r-1": Replica(id="r-1", profile="chat", model="m", state=ReplicaState.READY, since=0, created=0)
    }
    m._want_at_least_what_runs(m._catalog.profile)
    assert m._desired(now=0.0) == {"chat": 1}
    assert m.wanted("chat") == (
        1,
        "holding at 1: no requests and no replica is Ready; the last replica "
        "stays until 900 s without a request (idle 0 s)",
    )


class FakeNode:
    """What the shell reads of a registered node."""

    def __init__(self, name: str, shards: list) -> None:
        self.name = name
        self.connected = True
        self.registrations = 1
        self.shards = {shard.shard_id: shard for shard in shards}


class FakeRegistry:
    def __init__(self) -> None:
        self.nodes: list[FakeNode] = []

    def list(self) -> list[FakeNode]:
        return self.nodes


def reported_rank(rank: int, node: str) -> Shard:
    spec = ShardSpec(
        shard_id=f"r-1-s{rank}",
        replica_id="r-1",
        profile="chat",
        model="m",
        model_path="/m",
        engine="vllm",
        nodes=2,
        rank=rank,
        port=20000,
        rendezvous_port=20001,
    )
    return Shard.from_running(RunningShard(spec=spec, state=ShardState.READY, pid=10 + rank), now=0.0)


def test_an_adopted_replica_is_not_ready_until_its_rank_0_reports():
    """After a server restart, the headless rank 1 (Ready by staying alive, no HTTP) reports
    first: its replica must not be Ready, or the gateway would route to a rank that serves
    nothing. Once rank 0 reports too, it is."""
    registry = FakeRegistry()
    m = ReplicaManager(registry=registry, catalog=Catalog(profile(nodes=2)), engine_secret=None)
    registry.nodes = [FakeNode("n2", [reported_rank(1, "n2")])]
    m._observe(now=0.0)
    (record,) = m._records.values()
    assert [s.rank for s in record.shards] == [1]
    assert record.state == ReplicaState.STARTING
    assert state_of_shards(s.state for s in record.shards) == ReplicaState.STARTING

    registry.nodes.append(FakeNode("n1", [reported_rank(0, "n1")]))
    m._observe(now=1.0)
    (record,) = m._records.values()
    assert [s.rank for s in record.shards] == [0, 1]
    assert state_of_shards(s.state for s in record.shards) == ReplicaState.READY


class FleetOfOne:
    """A registry with one CPU node whose agent answers every command at once, and a catalog
    of one profile: what ReplicaManager.run needs, with no link and no process."""

    def __init__(self, p: Profile) -> None:
        self.node = Node(
            name="n1",
            agent_version="test",
            inventory=Inventory(
                hostname="n1", cpu_count=8, memory_total_mib=16_000, memory_available_mib=16_000
            ),
            state=NodeState.ONLINE,
            first_seen=0.0,
            last_seen=0.0,
            state_since=0.0,
            last_heard=0.0,
            session=object(),  # connected
            registrations=1,  # registered since this server started: its shards are known
        )
        self.changes = Changes()
        self.started: list[tuple[float, StartShard]] = []
        self._started_more = trio.Event()
        self.profile = p

    async def wait_for_starts(self, count: int) -> None:
        while len(self.started) < count:
            await self._started_more.wait()

    # the registry
    def list(self) -> list[Node]:
        return [self.node]

    def get(self, name: str) -> Node | None:
        return self.node if name == self.node.name else None

    async def call(self, name: str, command):
        if isinstance(command, StartShard):
            self.started.append((trio.current_time(), command))
            self._started_more.set()
            self._started_more = trio.Event()
        return CommandResult(reply_to=0, ok=True, message="")

    # the catalog
    def models(self) -> dict[str, Model]:
        return {"m": Model(name="m", path="/m.gguf", format="gguf")}

    def profiles(self) -> dict[str, Profile]:
        return {self.profile.name: self.profile}

    def report(self, spec: ShardSpec, state: str, reason: str = "") -> None:
        """A ShardStatus from the agent."""
        self.node.shards[spec.shard_id] = Shard(
            shard_id=spec.shard_id,
            replica_id=spec.replica_id,
            state=state,
            since=0.0,
            spec=spec,
            reason=reason,
        )
        self.changes.bump()


async def test_a_failed_replica_restarts_after_its_backoff_on_the_injected_clock(autojump_clock):
    """The shell reads time from one injected clock, so its backoffs run on trio's: the restart
    comes due after the policy's delay without the test sleeping through it."""
    fleet = FleetOfOne(profile())
    policy = RestartPolicy(initial=30.0)
    m = ReplicaManager(
        registry=fleet,
        catalog=fleet,
        engine_secret=None,
        config=ReconcileConfig(restart=policy),
        clock=trio.current_time,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(m.run)
        with trio.fail_after(10):
            await fleet.wait_for_starts(1)
        _, first = fleet.started[0]
        failed_at = trio.current_time()
        fleet.report(first.spec, ShardState.FAILED, "engine exited with status 1")
        with trio.fail_after(policy.initial + 10):
            await fleet.wait_for_starts(2)
        restarted_at, second = fleet.started[1]
        assert second.spec.replica_id == first.spec.replica_id
        assert restarted_at - failed_at >= policy.initial
        nursery.cancel_scope.cancel()


class FakeLeadership:
    """The leader lease as the test sets it."""

    def __init__(self, leading: bool) -> None:
        self.leading = leading
        self.changes = Changes()

    def acting(self) -> bool:
        return self.leading

    def set(self, leading: bool) -> None:
        self.leading = leading
        self.changes.bump()

    async def wait_acting(self) -> None:
        while not self.leading:
            await self.changes.wait_past(self.changes.version)

    async def wait_not_acting(self) -> None:
        while self.leading:
            await self.changes.wait_past(self.changes.version)


async def test_a_follower_acts_on_nothing_routes_what_runs_and_leads_from_the_reports(autojump_clock):
    """Servers sharing a store: a follower places nothing but knows the replica an agent reports
    (its gateway routes to it); once it leads it adopts that replica instead of placing another,
    and acts on changes; once it no longer leads it acts on nothing again."""
    fleet = FleetOfOne(profile(min_replicas=1, max_replicas=3))
    running = ShardSpec(
        shard_id="r-old-s0", replica_id="r-old", profile="chat", model="m", model_path="/m.gguf",
        engine="llamacpp", port=20000,
    )  # fmt: skip
    fleet.report(running, ShardState.READY)
    lease = FakeLeadership(leading=False)
    m = ReplicaManager(
        registry=fleet, catalog=fleet, engine_secret=None, clock=trio.current_time, leadership=lease
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(m.run)
        await trio.sleep(30)  # many ticks
        assert fleet.started == []
        assert [(r.id, r.state) for r in m.list()] == [("r-old", ReplicaState.READY)]
        fleet.profile = profile(min_replicas=2, max_replicas=3)
        fleet.changes.bump()
        await trio.sleep(30)
        assert fleet.started == []  # wanted, but a follower does not place

        lease.set(True)
        with trio.fail_after(10):
            await fleet.wait_for_starts(1)
        await trio.sleep(30)
        # One more (the second of two wanted), not two: the reported one was adopted.
        assert len(fleet.started) == 1 and fleet.started[0][1].spec.replica_id != "r-old"
        assert "r-old" in {r.id for r in m.list()}

        lease.set(False)
        await trio.sleep(1)
        fleet.profile = profile(min_replicas=3, max_replicas=3)
        fleet.changes.bump()
        await trio.sleep(30)
        assert len(fleet.started) == 1
        nursery.cancel_scope.cancel()


async def test_a_pass_is_skipped_once_the_lease_has_lapsed(autojump_clock):
    """A leader that wakes from a pause runs no pass before its step-down is noticed."""
    fleet = FleetOfOne(profile(min_replicas=1))
    lease = FakeLeadership(leading=True)
    m = ReplicaManager(registry=fleet, catalog=fleet, engine_secret=None, leadership=lease)
    lease.leading = False  # lapsed, and the shell has not been told yet
    m.run_pass()
    assert m.list() == []
