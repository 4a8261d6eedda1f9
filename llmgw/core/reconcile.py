"""The reconciler: the replicas wanted against what runs → actions, each with its reason.

One pass is a pure function of the catalog, the replica records, a view of the fleet, the count
each profile wants (from :mod:`llmgw.core.scaling`) and the time. It returns a :class:`Plan`: the
actions for the shell to carry out and log, and every replica record as it should be stored
afterwards. A pass runs in this order, so that repairs free what they free before anything is
counted, and the most important replicas choose first:

1. observe  — Starting/Loading/Ready follow their shards; a failed shard fails its replica, and
              a replica Ready for ``reset_after`` has its failures forgotten.
2. repair   — reap replicas with a shard on a lost node, evict those on a GPU that turned unhealthy,
              fail those not Ready within their startup timeout, drain those whose profile left
              the catalog, stop those still draining past their deadline.
3. orphans  — stop what agents run that no record lists.
4. scale    — drain (or drop, while Pending) the newest replicas above the wanted count; add
              Pending records below it. The wanted count is clamped to the profile's min and max.
5. place    — Pending replicas and due restarts, highest band first, then oldest: each placement is
              applied to the view before the next, so one pass never gives a GPU twice. A replica
              that fits nowhere tells why for every node, and may preempt lower bands.

The view of the fleet (``cluster``) is the fleet as discovered, before any replica: online flags,
GPUs with their health and the memory that processes llmgw did not start leave, host memory and
cores offered to shards, ports taken by other programs. The reconciler takes out what its own
replicas hold (every shard of a live or restartable replica, and the still-running shards of one
that drains or stops) and what orphan shards hold. A view that already marks a replica's GPUs as
allocated does no harm; one that already subtracts a CPU shard's memory counts it twice.

What stops also frees nothing within its own pass: a stopping shard holds its GPUs until the agent
reports it gone, so that a replacement never starts on a card an engine still holds.

The shell's part, around each pass:

- Keep each record's shard states as the agents report them (ShardStatus; Register). A shard
  whose StopShard or DrainShard is answered (stopped, or not running) is Stopped. A record's shard
  that a re-registering agent no longer lists is Failed ("not running after the agent restarted"),
  and so is one whose StartShard is refused, with the refusal as its reason.
- Pass every shard the agents list as ``reported``; build ``cluster`` as described above.
- Store ``Plan.replicas`` as the new set of records, then carry out the actions in order: StartShard
  per spec (with the replica's engine key) for starts and restarts; StopShard, or DrainShard for a
  drain, for each of an ending action's ``shards``; log every action's reason. StopOrphan repeats
  while the agent lists the shard: a stop already on its way need not be sent again. A command is
  not retried by a later pass: the link delivers it, or the node is lost and its shards with it.
- Make replica ids (``new_id``) that never repeat, e.g. random ones: an id names the engine key.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import attrs

from llmgw.core.catalog import Model, Profile
from llmgw.core.placement import (
    ClusterView,
    NodeView,
    Placement,
    ShardPlacement,
    Unplaceable,
    apply,
    place,
    to_shard_specs,
)
from llmgw.core.replica import (
    COUNTED,
    ENDED_SHARD_STATES,
    LIFECYCLE,
    RUNNING,
    Replica,
    ReplicaShard,
    ReplicaState,
    state_of_shards,
)
from llmgw.core.reports import ShardState
from llmgw.core.restart_policy import Decision, GiveUp, MoveElsewhere, RestartPolicy, decide
from llmgw.core.shard import ShardSpec

frozen = attrs.frozen(kw_only=True)

# Preemption searches one pass makes. Each may try every node of the fleet for the cheapest
# replicas to take (some 50 ms on 1,000 nodes and 5,000 replicas); more would hold the server's
# event loop too long. The other blocked replicas get theirs on the next pass, which costs little:
# what is preempted takes seconds to stop anyway.
PREEMPTION_SEARCHES_PER_PASS = 3

# Which replicas a scale-down takes first: those that serve nothing yet, then the newest.
_SCALE_DOWN_ORDER = {
    ReplicaState.PENDING: 0,
    ReplicaState.FAILED: 1,
    ReplicaState.STARTING: 2,
    ReplicaState.LOADING: 3,
    ReplicaState.READY: 4,
}


# --- inputs ----------------------------------------------------------------------------------------


@frozen
class ReportedShard:
    """A shard an agent says it runs (its Register, then ShardStatus), as the reconciler needs it."""

    node: str
    shard_id: str
    replica_id: str
    model: str
    gpu_indices: tuple[int, ...] = ()
    port: int
    rendezvous_port: int = 0


@frozen
class ReconcileConfig:
    port_range: tuple[int, int] = (20000, 29999)  # engines' and rendezvous ports on every node
    drain_timeout: float = 60.0  # a draining replica is stopped this long after, requests or not
    restart: RestartPolicy = RestartPolicy()


# --- actions ---------------------------------------------------------------------------------------
# Every action carries what the shell needs to carry it out without looking anything up, and a
# reason to log. Those that end shards list them in ``shards``: the ones still running on a
# reachable node (a lost node's shards are gone as far as anyone can tell; if the node comes back,
# its agent reports them and they are stopped as orphans).


@frozen
class ShardRef:
    node: str
    shard_id: str


@frozen
class StartReplica:
    """Send StartShard for each spec, rank 0 first: ``specs[i]`` runs on ``placement.shards[i].node``."""

    replica_id: str
    profile: str
    specs: tuple[ShardSpec, ...]
    placement: Placement
    reason: str


@frozen
class RestartReplica:
    """Start a Failed replica again: its old shards are all gone, so this is a StartShard per spec."""

    replica_id: str
    profile: str
    specs: tuple[ShardSpec, ...]
    placement: Placement
    moved: bool  # placed away from the nodes it failed on
    reason: str


@frozen
class StopReplica:
    replica_id: str
    shards: tuple[ShardRef, ...]  # may be empty: nothing runs, the record just goes
    reason: str


@frozen
class DrainReplica:
    """Stop routing to it; send DrainShard with a timeout that ends at ``deadline``."""

    replica_id: str
    shards: tuple[ShardRef, ...]
    deadline: float
    reason: str


@frozen
class MarkPending:
    """It fits nowhere (or waits for room being freed); sent when the reason changes."""

    replica_id: str
    profile: str
    reasons: tuple[tuple[str, str], ...]  # (node, why not) for every node
    reason: str


@frozen
class MarkFailed:
    """It failed to start or to keep running. Stop what is left of it: a multi-node replica's
    other ranks, or every shard of one not Ready in time."""

    replica_id: str
    shards: tuple[ShardRef, ...]
    restart_at: float | None  # None: given up, an operator must act
    reason: str


@frozen
class Preempt:
    """Stop a lower band's replica so that ``for_replica_id`` can be placed once it is gone."""

    victim_replica_id: str
    shards: tuple[ShardRef, ...]
    for_replica_id: str
    for_profile: str
    reason: str


@frozen
class Evict:
    """Stop a replica one of whose GPUs turned unhealthy; a replacement goes elsewhere."""

    replica_id: str
    shards: tuple[ShardRef, ...]
    reason: str


@frozen
class Reap:
    """A replica with a shard on a lost node: stop what is left of it; a replacement is placed."""

    replica_id: str
    lost_nodes: tuple[str, ...]
    shards: tuple[ShardRef, ...]  # its shards on nodes still there
    reason: str


@frozen
class StopOrphan:
    """A shard an agent runs that no record lists; repeated each pass while it is reported."""

    node: str
    shard_id: str
    reason: str


Action = (
    StartReplica
    | RestartReplica
    | StopReplica
    | DrainReplica
    | MarkPending
    | MarkFailed
    | Preempt
    | Evict
    | Reap
    | StopOrphan
)
# The actions that end a replica's shards: the shell sends StopShard (DrainShard) for their ``shards``.
ENDING = (StopReplica, DrainReplica, MarkFailed, Preempt, Evict, Reap)


@frozen
class Plan:
    actions: tuple[Action, ...]
    # Every record after the pass, in a stable order; a record not listed is to be deleted.
    replicas: tuple[Replica, ...]


def reconcile(
    *,
    models: Mapping[str, Model],
    profiles: Mapping[str, Profile],
    replicas: Iterable[Replica],
    cluster: ClusterView,
    desired: Mapping[str, int],
    now: float,
    config: ReconcileConfig,
    new_id: Callable[[], str],
    reported: Iterable[ReportedShard] = (),
    awaiting: frozenset[str] = frozenset(),
) -> Plan:
    """One pass. ``desired`` maps a profile to its wanted count (missing: its min_replicas).

    ``new_id`` names each replica the pass creates; it must not repeat an id (the engine key is
    derived from it). ``reported`` is every shard the agents say they run. ``awaiting`` names the
    nodes known from before a server restart that have not reported since, nor been declared
    lost: while there are any, counts are neither raised nor lowered, since what those nodes
    run is not known yet — a replica added now could be one they are serving already.
    """
    return _Pass(models, profiles, replicas, cluster, desired, now, config, new_id, reported, awaiting).run()


# --- one pass --------------------------------------------------------------------------------------


class _Hold(NamedTuple):
    """What one owner holds on one node (a tuple: a pass makes one per shard of the fleet)."""

    owner: str  # a replica id, or "node/shard" for an orphan
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    memory_mib: int = 0  # CPU shards only: a GPU shard's host needs are not modelled
    cpu_cores: int = 0


@attrs.frozen
class _Restart:
    record: Replica
    move: bool
    delay: float


class _Pass:
    def __init__(
        self,
        models: Mapping[str, Model],
        profiles: Mapping[str, Profile],
        replicas: Iterable[Replica],
        cluster: ClusterView,
        desired: Mapping[str, int],
        now: float,
        config: ReconcileConfig,
        new_id: Callable[[], str],
        reported: Iterable[ReportedShard],
        awaiting: frozenset[str] = frozenset(),
    ) -> None:
        self.awaiting = awaiting
        self.models = models
        self.profiles = profiles
        self.records: dict[str, Replica] = {r.id: r for r in replicas}
        self.cluster = cluster
        self.nodes = {node.name: node for node in cluster.nodes}
        self.online = {node.name for node in cluster.nodes if node.online}
        self.desired = desired
        self.now = now
        self.config = config
        self.new_id = new_id
        self.reported = tuple(reported)
        self.actions: list[Action] = []
        self.touched: set[str] = set()  # replicas an action of this pass is about
        # Per profile, why replacements are wanted (reaped, evicted): the reasons of new records.
        self.replacing: dict[str, list[str]] = collections.defaultdict(list)
        self.orphans: list[ReportedShard] = []
        self.holds: dict[str, list[_Hold]] = collections.defaultdict(list)
        self.fresh: set[str] = set()  # replicas this pass created
        # Nodes as this pass has left them (what replicas hold taken out), made as placement
        # first looks at them: a pass with nothing to place builds none.
        self.occupied: dict[str, NodeView] = {}
        # Per GPU class, the online nodes with healthy cards of it that nothing holds, and how
        # many, in the view's order: which nodes are worth a look for a placement.
        self.free_gpus: dict[str, dict[str, int]] = collections.defaultdict(dict)
        # Owners of holds that stand for room promised to a replica waiting for it (preemption).
        self.promised: set[str] = set()
        self.searches_left = PREEMPTION_SEARCHES_PER_PASS

    def run(self) -> Plan:
        self._observe()
        self._repair()
        self._find_orphans()
        self._scale()
        self._place()
        return Plan(actions=tuple(self.actions), replicas=tuple(self.records.values()))

    # --- small helpers ---------------------------------------------------------------------------

    def _running(self, record: Replica) -> tuple[ReplicaShard, ...]:
        """Its shards still running on a reachable node."""
        return tuple(s for s in record.shards if s.state not in ENDED_SHARD_STATES and s.node in self.online)

    def _act(self, action: Action, replica_id: str = "") -> None:
        self.actions.append(action)
        if replica_id:
            self.touched.add(replica_id)

    def _profile_of(self, record: Replica) -> Profile | None:
        """Its profile, unless that (or the profile's model) has left the catalog."""
        profile = self.profiles.get(record.profile)
        return profile if profile is not None and profile.model in self.models else None

    def _end(self, record: Replica, state: ReplicaState, reason: str, **changes: object) -> tuple[ShardRef, ...]:
        """Moves ``record`` to Draining or Stopped, keeping its running shards; those go in the action.

        A record left with nothing running is removed at once.
        """
        running = self._running(record)
        if running:
            self.records[record.id] = LIFECYCLE.move(
                record, state, since=self.now, shards=running, reason=reason, **changes
            )
        else:
            del self.records[record.id]
        return tuple(ShardRef(node=s.node, shard_id=s.shard_id) for s in running)

    def _decision(self, record: Replica) -> Decision:
        last = record.last_failure if record.last_failure is not None else record.since
        return decide(record.failures, last, self.config.restart)

    def _drain(self, record: Replica, reason: str) -> None:
        deadline = self.now + self.config.drain_timeout
        shards = self._end(record, ReplicaState.DRAINING, reason, drain_deadline=deadline)
        if shards:
            self._act(
                DrainReplica(replica_id=record.id, shards=shards, deadline=deadline, reason=reason), record.id
            )
        else:
            self._act(StopReplica(replica_id=record.id, shards=(), reason=reason), record.id)

    def _fail(self, record: Replica, why: str, nodes: Iterable[str]) -> None:
        """A failed start: count it, stop what still runs, and say when it starts again."""
        failures = record.failures + 1
        decision = decide(failures, self.now, self.config.restart)
        if isinstance(decision, GiveUp):
            next_step, restart_at = decision.reason, None
        else:
            where = " on other nodes" if isinstance(decision, MoveElsewhere) else ""
            next_step = f"starts again{where} in {decision.delay:.3g} s (failure {failures})"
            restart_at = decision.at
        failed = LIFECYCLE.move(
            record,
            ReplicaState.FAILED,
            since=self.now,
            failures=failures,
            last_failure=self.now,
            failed_nodes=tuple(sorted({*record.failed_nodes, *nodes})),
            reason=f"{why}; {next_step}",
        )
        # Survivors of a multi-node replica cannot rejoin a new leader, and they hold the ports a
        # restart in place needs: they stop now, and the restart waits until they are gone.
        running = self._running(failed)
        if restart_at is None and not running:
            failed = attrs.evolve(failed, shards=())  # see _observe: given up, its GPUs go back
        self.records[record.id] = failed
        refs = tuple(ShardRef(node=s.node, shard_id=s.shard_id) for s in running)
        self._act(
            MarkFailed(replica_id=record.id, shards=refs, restart_at=restart_at, reason=failed.reason),
            record.id,
        )

    # --- 1. observe ------------------------------------------------------------------------------

    def _observe(self) -> None:
        for record in list(self.records.values()):
            if record.state in RUNNING:
                # One with a shard on a lost node is left to repair, which reaps it: what that
                # node last said is stale, and a failed replica's restart would wait for a shard
                # that nobody can reach to stop.
                if all(s.node in self.online for s in record.shards):
                    self._follow_shards(record)
            elif record.state in (ReplicaState.DRAINING, ReplicaState.STOPPED):
                running = self._running(record)
                if not running:
                    del self.records[record.id]
                elif running != record.shards:
                    self.records[record.id] = attrs.evolve(record, shards=running)
            elif record.state == ReplicaState.FAILED and record.shards:
                if isinstance(self._decision(record), GiveUp) and not self._running(record):
                    # Given up: nothing will start here again, so its GPUs go back to the fleet.
                    self.records[record.id] = attrs.evolve(record, shards=())

    def _follow_shards(self, record: Replica) -> None:
        if record.state == ReplicaState.READY and not record.failures:
            if all(s.state == ShardState.READY for s in record.shards):
                return  # the common case, on every pass, for nearly every replica
        observed = state_of_shards(s.state for s in record.shards)
        if observed == ReplicaState.FAILED:
            failed = [s for s in record.shards if s.state == ShardState.FAILED]
            why = "; ".join(
                f"shard {s.shard_id} on {s.node} failed" + (f": {s.reason}" if s.reason else "")
                for s in failed
            )
            self._fail(record, why, (s.node for s in failed))
        elif observed in (ReplicaState.STOPPED, ReplicaState.DRAINING):
            # Nothing here asked for it (the agent shutting down, an operator by hand): the
            # replica cannot serve whole, so the rest of it stops and a replacement is placed.
            ended = next(s for s in record.shards if s.state in (ShardState.STOPPED, ShardState.DRAINING))
            reason = f"shard {ended.shard_id} on {ended.node} is {ended.state} without being asked"
            shards = self._end(record, ReplicaState.STOPPED, reason)
            self._act(StopReplica(replica_id=record.id, shards=shards, reason=reason), record.id)
            self.replacing[record.profile].append(f"replaces {record.id}: {reason}")
        else:
            if observed != record.state:
                record = LIFECYCLE.move(record, observed, since=self.now)
            proven = self.now - record.since >= self.config.restart.reset_after
            if observed == ReplicaState.READY and record.failures and proven:
                record = attrs.evolve(record, failures=0, last_failure=None, failed_nodes=(), reason="")
            self.records[record.id] = record

    # --- 2. repair -------------------------------------------------------------------------------

    def _repair(self) -> None:
        sick = self._unhealthy_gpus()
        for record in list(self.records.values()):
            if record.id in self.touched:
                continue  # acted on while observed: the next pass looks again
            profile = self._profile_of(record)
            if profile is None:
                self._leave_catalog(record)
            elif record.state in RUNNING or record.state == ReplicaState.FAILED:
                # Most replicas of a large fleet have nothing wrong under them: one cheap look.
                if any(s.node not in self.online or s.node in sick for s in record.shards):
                    self._repair_under(record, sick)
                elif record.state in (ReplicaState.STARTING, ReplicaState.LOADING):
                    self._check_startup(record, profile)
            elif record.state == ReplicaState.DRAINING:
                if record.drain_deadline is not None and self.now >= record.drain_deadline:
                    reason = "still draining at its deadline"
                    shards = self._end(record, ReplicaState.STOPPED, reason)
                    self._act(StopReplica(replica_id=record.id, shards=shards, reason=reason), record.id)

    def _repair_under(self, record: Replica, sick: dict[str, dict[int, tuple[str, ...]]]) -> None:
        """Reaps ``record`` when a node of it is lost, or evicts it from a GPU that turned unhealthy."""
        lost = sorted({s.node for s in record.shards if s.node not in self.online})
        if lost:
            self._reap(record, lost)
            return
        problems = [p for s in record.shards for p in self._problems(s, sick)]
        if problems:
            reason = "; ".join(problems)
            shards = self._end(record, ReplicaState.STOPPED, reason)
            self._act(Evict(replica_id=record.id, shards=shards, reason=reason), record.id)
            self.replacing[record.profile].append(f"replaces {record.id}, evicted: {reason}")
        elif record.state in (ReplicaState.STARTING, ReplicaState.LOADING):
            self._check_startup(record, self.profiles[record.profile])

    def _leave_catalog(self, record: Replica) -> None:
        if record.state in (ReplicaState.DRAINING, ReplicaState.STOPPED):
            return
        if record.profile not in self.profiles:
            self._drain(record, f"profile {record.profile} is not in the catalog any more")
        else:
            self._drain(record, f"model {self.profiles[record.profile].model} is not in the catalog any more")

    def _reap(self, record: Replica, lost: list[str]) -> None:
        gone = [s.shard_id for s in record.shards if s.node in lost]
        reason = f"{_listing('node', lost)} lost (with {_listing('shard', gone)})"
        shards = self._end(record, ReplicaState.STOPPED, reason)
        self._act(Reap(replica_id=record.id, lost_nodes=tuple(lost), shards=shards, reason=reason), record.id)
        self.replacing[record.profile].append(f"replaces {record.id}: {reason}")

    def _unhealthy_gpus(self) -> dict[str, dict[int, tuple[str, ...]]]:
        """Per node, its unhealthy GPUs and their problems (most nodes have none)."""
        sick: dict[str, dict[int, tuple[str, ...]]] = {}
        for node in self.cluster.nodes:
            for gpu in node.gpus:
                if not gpu.healthy:
                    sick.setdefault(node.name, {})[gpu.index] = gpu.problems
        return sick

    @staticmethod
    def _problems(shard: ReplicaShard, sick: dict[str, dict[int, tuple[str, ...]]]) -> list[str]:
        on_node = sick.get(shard.node)
        if not on_node:
            return []
        return [
            f"GPU {index} on {shard.node} is unhealthy ({', '.join(on_node[index]) or 'marked unhealthy'})"
            for index in shard.gpu_indices
            if index in on_node
        ]

    def _check_startup(self, record: Replica, profile: Profile) -> None:
        started = record.started if record.started is not None else record.since
        if self.now - started > profile.startup_timeout:
            why = (
                f"not Ready within {profile.startup_timeout:.0f} s of starting "
                f"({record.state} for {self.now - record.since:.0f} s)"
            )
            self._fail(record, why, (s.node for s in record.shards))

    # --- 3. orphans ------------------------------------------------------------------------------

    def _find_orphans(self) -> None:
        listed = {(s.node, s.shard_id) for r in self.records.values() for s in r.shards}
        for shard in self.reported:
            if (shard.node, shard.shard_id) in listed or shard.node not in self.online:
                continue
            if shard.model not in self.models:
                reason = f"model {shard.model} is not in the catalog"
            elif shard.replica_id in self.records:
                reason = f"replica {shard.replica_id} does not run on {shard.node}"
            else:
                reason = f"no replica {shard.replica_id} is known"
            self.orphans.append(shard)
            self._act(StopOrphan(node=shard.node, shard_id=shard.shard_id, reason=reason))

    # --- 4. scale --------------------------------------------------------------------------------

    def _scale(self) -> None:
        if self.awaiting:
            return  # the next pass after the last of them reports (or is lost) scales
        counted: dict[str, list[Replica]] = collections.defaultdict(list)
        for record in self.records.values():
            if record.state in COUNTED:
                counted[record.profile].append(record)
        for name, profile in self.profiles.items():
            if profile.model not in self.models:
                continue
            wanted = min(
                max(self.desired.get(name, profile.min_replicas), profile.min_replicas), profile.max_replicas
            )
            have = counted[name]
            if len(have) > wanted:
                self._scale_down(have, wanted)
            for n in range(len(have), wanted):
                notes = self.replacing[name]
                self._add(
                    profile, notes.pop(0) if notes else f"scale up: {n} of {wanted} wanted replicas exist"
                )

    def _add(self, profile: Profile, reason: str) -> None:
        """A new Pending replica of ``profile``; placement looks at it in this pass or the next."""
        replica_id = self.new_id()
        self.fresh.add(replica_id)
        self.records[replica_id] = Replica(
            id=replica_id,
            profile=profile.name,
            model=profile.model,
            state=ReplicaState.PENDING,
            since=self.now,
            created=self.now,
            reason=reason,
        )

    def _scale_down(self, have: list[Replica], wanted: int) -> None:
        # Serving replicas go last, and among equals the newest first: it has the least warm
        # cache, and the older ones have proved themselves.
        order = sorted(have, key=lambda r: (_SCALE_DOWN_ORDER[r.state], -r.created, r.id))
        reason = f"scale down: {_count(len(have), 'replica')} of {have[0].profile}, {wanted} wanted"
        for record in order[: len(have) - wanted]:
            self._drain(record, reason)

    # --- 5. place --------------------------------------------------------------------------------

    def _place(self) -> None:
        queue: list[tuple[Replica, _Restart | None]] = []
        for record in self.records.values():
            if record.state == ReplicaState.PENDING:
                queue.append((record, None))
            elif record.state == ReplicaState.FAILED and record.shards and record.id not in self.touched:
                restart = self._due_restart(record)
                if restart is not None:
                    queue.append((record, restart))
        if not queue:
            return
        self._collect_holds()
        unplaceable: dict[str, Unplaceable] = {}  # the view only shrinks within a pass
        queue.sort(key=lambda item: (-self.profiles[item[0].profile].band, item[0].created, item[0].id))
        for record, restart in queue:
            if self.records.get(record.id) is not record:
                continue  # preempted for one placed before it
            profile = self.profiles[record.profile]
            if restart is None:
                self._place_pending(record, profile, unplaceable)
            else:
                self._restart(restart, profile)

    def _place_on(self, profile: Profile, away: frozenset[str] = frozenset()) -> Placement | Unplaceable:
        """Placement on the view as this pass has left it, without the nodes in ``away``.

        Tried first on the nodes with enough healthy cards of its class that nothing holds: the
        others never fit, so the answer is the same, and on a busy fleet most nodes are skipped
        without building their view. Only an Unplaceable is worth the whole fleet: it names every
        node.
        """
        if profile.gpu_class is None:
            names: Iterable[str] = (n.name for n in self.cluster.nodes if n.name in self.online)
        else:
            free = self.free_gpus.get(profile.gpu_class, {})
            names = (name for name, cards in free.items() if cards >= profile.gpus_per_node)
        hosts = tuple(self._node_now(name) for name in names if name not in away)
        result = place(ClusterView(nodes=hosts), profile, self.config.port_range)
        if isinstance(result, Placement):
            return result
        every = tuple(self._node_now(n.name) for n in self.cluster.nodes if n.name not in away)
        return place(ClusterView(nodes=every), profile, self.config.port_range)

    def _node_now(self, name: str) -> NodeView:
        node = self.occupied.get(name)
        if node is None:
            node = self.occupied[name] = self._occupy((self.nodes[name],), frozenset())[0]
        return node

    def _due_restart(self, record: Replica) -> _Restart | None:
        decision = self._decision(record)
        if isinstance(decision, GiveUp) or self.now < decision.at or self._running(record):
            return None
        return _Restart(record=record, move=isinstance(decision, MoveElsewhere), delay=decision.delay)

    def _place_pending(self, record: Replica, profile: Profile, unplaceable: dict[str, Unplaceable]) -> None:
        result = unplaceable.get(profile.name) or self._place_on(profile)
        if isinstance(result, Placement):
            why = record.reason if record.id in self.fresh else f"pending for {self.now - record.since:.0f} s"
            self._start(record, profile, result, why)
            return
        unplaceable[profile.name] = result
        self._mark_pending(record, profile, result, result.summary + self._make_room(record, profile))

    def _mark_pending(self, record: Replica, profile: Profile, result: Unplaceable, reason: str) -> None:
        was_pending = record.state == ReplicaState.PENDING
        if was_pending and reason == record.reason:
            return  # said once: a replica pending for an hour is not a line in every pass's log
        self.records[record.id] = LIFECYCLE.move(
            record,
            ReplicaState.PENDING,
            since=record.since if was_pending else self.now,
            shards=(),
            reason=reason,
        )
        self._act(
            MarkPending(replica_id=record.id, profile=profile.name, reasons=result.reasons, reason=reason),
            record.id,
        )

    def _restart(self, restart: _Restart, profile: Profile) -> None:
        record = restart.record
        why = f"after a {restart.delay:.3g} s backoff ({record.reason})"
        old = self._placement_of(record) if self._still_free(record, profile) else None
        if restart.move or old is None:
            away = frozenset(record.failed_nodes if restart.move else ())
            result = self._place_on(profile, away)
            if isinstance(result, Placement):
                how = f"moved away from {', '.join(sorted(away))}" if away else "placed anew"
                self._start(record, profile, result, f"{how} {why}", moved=True)
                return
            if old is None:
                # Neither its own place nor another: it waits as Pending, its failures kept.
                self._mark_pending(record, profile, result, result.summary)
                return
            why += f"; in place, as no other node can take it ({result.summary})"
        # Its own GPUs and ports were held for it all along: nothing more to take.
        self._start(record, profile, old, f"restart {why}", moved=False, take=False)

    def _start(
        self,
        record: Replica,
        profile: Profile,
        placement: Placement,
        reason: str,
        *,
        moved: bool | None = None,
        take: bool = True,
    ) -> None:
        """Launches ``record`` at ``placement``: a StartReplica, or a RestartReplica when ``moved``
        says whether it left its old place; ``take`` holds the placement's GPUs and ports."""
        specs = self._launch(record, profile, placement)
        fields = {
            "replica_id": record.id,
            "profile": profile.name,
            "specs": specs,
            "placement": placement,
            "reason": f"{reason}; on {_where(placement)}",
        }
        action = StartReplica(**fields) if moved is None else RestartReplica(moved=moved, **fields)
        self._act(action, record.id)
        if take:
            self._take(record.id, placement, profile)

    def _launch(self, record: Replica, profile: Profile, placement: Placement) -> tuple[ShardSpec, ...]:
        """The specs to start ``record`` with at ``placement``; the record becomes Starting."""
        specs = to_shard_specs(placement, profile, self.models[profile.model], record.id, self.cluster)
        shards = tuple(
            ReplicaShard(
                node=p.node,
                shard_id=spec.shard_id,
                rank=p.rank,
                gpu_indices=p.gpu_indices,
                port=p.port,
                rendezvous_port=p.rendezvous_port,
            )
            for p, spec in zip(placement.shards, specs, strict=True)
        )
        self.records[record.id] = LIFECYCLE.move(
            record,
            ReplicaState.STARTING,
            model=profile.model,  # the profile's model, should the catalog have changed it
            since=self.now,
            started=self.now,
            shards=shards,
            reason="",
        )
        return specs

    def _take(self, owner: str, placement: Placement, profile: Profile) -> None:
        """Holds ``placement`` for ``owner`` for the rest of the pass."""
        self._hold(owner, placement.shards, profile)
        if profile.gpu_class is not None:
            free = self.free_gpus[profile.gpu_class]
            for shard in placement.shards:
                # A promise may take cards that are not free yet (those of replicas stopping).
                free[shard.node] = free.get(shard.node, 0) - profile.gpus_per_node
        nodes = ClusterView(nodes=tuple(self._node_now(s.node) for s in placement.shards))
        for node in apply(nodes, placement, profile).nodes:
            self.occupied[node.name] = node

    def _placement_of(self, record: Replica) -> Placement:
        return Placement(
            shards=tuple(
                ShardPlacement(
                    node=s.node,
                    rank=s.rank,
                    gpu_indices=s.gpu_indices,
                    port=s.port,
                    rendezvous_port=s.rendezvous_port,
                )
                for s in record.shards
            )
        )

    def _still_free(self, record: Replica, profile: Profile) -> bool:
        """Whether its GPUs and ports are its alone, in the shape its profile asks for now."""
        if len(record.shards) != profile.nodes:
            return False
        for shard in record.shards:
            if profile.gpu_class is not None and len(shard.gpu_indices) != profile.gpus_per_node:
                return False
            mine = {*shard.gpu_indices}, {shard.port, shard.rendezvous_port} - {0}
            for hold in self.holds.get(shard.node, ()):
                if hold.owner != record.id and (
                    mine[0].intersection(hold.gpus) or mine[1].intersection(hold.ports)
                ):
                    return False
        return True

    # --- what is held, and by whom ----------------------------------------------------------------

    def _collect_holds(self) -> None:
        for record in self.records.values():
            if record.state != ReplicaState.PENDING and record.shards:
                self._hold(record.id, record.shards, self._profile_of(record))
        for shard in self.orphans:
            owner = f"{shard.node}/{shard.shard_id}"
            ports = (shard.port, shard.rendezvous_port)
            self.holds[shard.node].append(_Hold(owner=owner, gpus=shard.gpu_indices, ports=ports))
        for node in self.cluster.nodes:
            if node.online:
                held = {index for hold in self.holds.get(node.name, ()) for index in hold.gpus}
                free = collections.Counter(
                    g.gpu_class for g in node.gpus if g.healthy and not g.allocated and g.index not in held
                )
                for gpu_class, cards in free.items():
                    self.free_gpus[gpu_class][node.name] = cards

    def _hold(
        self, owner: str, shards: Iterable[ReplicaShard | ShardPlacement], profile: Profile | None
    ) -> None:
        memory_mib = cpu_cores = 0
        if profile is not None and profile.gpu_class is None:
            memory_mib, cpu_cores = profile.memory_mib, profile.cpu_cores
        for shard in shards:
            ports = (shard.port, shard.rendezvous_port)  # 0 = none; never in a port range
            self.holds[shard.node].append(_Hold(owner, shard.gpu_indices, ports, memory_mib, cpu_cores))

    def _occupy(self, nodes: Iterable[NodeView], exclude: frozenset[str]) -> tuple[NodeView, ...]:
        """``nodes`` with what every owner but ``exclude`` holds taken out."""
        out = []
        for node in nodes:
            holds = [h for h in self.holds.get(node.name, ()) if h.owner not in exclude]
            if not holds:
                out.append(node)
                continue
            gpus = {index for h in holds for index in h.gpus}
            gpu_views = node.gpus
            if gpus:
                gpu_views = tuple(
                    attrs.evolve(g, allocated=True) if g.index in gpus and not g.allocated else g
                    for g in node.gpus
                )
            out.append(
                attrs.evolve(
                    node,
                    gpus=gpu_views,
                    ports_in_use=node.ports_in_use.union(*(h.ports for h in holds)) - {0},
                    memory_free_mib=node.memory_free_mib - sum(h.memory_mib for h in holds),
                    cpu_cores_free=node.cpu_cores_free - sum(h.cpu_cores for h in holds),
                )
            )
        return tuple(out)

    # --- preemption --------------------------------------------------------------------------------

    def _make_room(self, record: Replica, profile: Profile) -> str:
        """What is done so that ``record`` can be placed later, as words to add to its reason.

        Room being freed already (replicas draining or stopping, orphans) is waited for. Otherwise
        the cheapest set of lower-band replicas on one node (a fabric, for a multi-node profile)
        whose removal would let it fit is preempted: lowest band first, then fewest, then newest.
        Either way the room is promised to ``record`` for the rest of the pass, so that the next
        replica to fit nowhere does not count on the same room, and nothing placed in this pass
        is taken back.
        """
        leaving = frozenset(h.owner for hs in self.holds.values() for h in hs if self._is_leaving(h.owner))
        for nodes in self._islands(profile, leaving).values():
            placement = self._fit_without(nodes, profile, leaving)
            if placement is not None:
                self._promise(record, placement, profile)
                return "; waiting for room that replicas being stopped are freeing"
        candidates = sorted(
            (
                r
                for r in self.records.values()
                if r.shards
                and r.id not in self.touched
                and (r.state in RUNNING or r.state == ReplicaState.FAILED)
                and (victim_profile := self.profiles.get(r.profile)) is not None
                and victim_profile.band < profile.band
            ),
            key=self._preference,
        )
        if not candidates:
            return ""
        if not self.searches_left:
            return "; whether to preempt is decided on the next pass"
        self.searches_left -= 1
        best = self._cheapest_victims(candidates, profile, leaving)
        if best is None:
            return ""
        victims, placement = best
        self._promise(record, placement, profile)
        for victim in victims:
            reason = (
                f"preempted for {record.id} of profile {profile.name} (band {profile.band}), "
                f"which fits nowhere else; {victim.id} is band {self.profiles[victim.profile].band}"
            )
            shards = self._end(victim, ReplicaState.STOPPED, reason)
            self._act(
                Preempt(
                    victim_replica_id=victim.id,
                    shards=shards,
                    for_replica_id=record.id,
                    for_profile=profile.name,
                    reason=reason,
                ),
                victim.id,
            )
            # Its profile still wants as many as before: the replacement waits its turn (its band
            # is lower) as Pending, and may in turn preempt a lower band still.
            self._add(self.profiles[victim.profile], f"replaces {victim.id}, preempted for {record.id}")
        return f"; preempting {', '.join(v.id for v in victims)} to make room"

    def _cheapest_victims(
        self, candidates: list[Replica], profile: Profile, leaving: frozenset[str]
    ) -> tuple[list[Replica], Placement] | None:
        """Which of ``candidates`` to preempt, and where ``profile`` would go once they are gone."""
        on_node: dict[str, list[Replica]] = collections.defaultdict(list)
        for candidate in candidates:
            for node in dict.fromkeys(s.node for s in candidate.shards):
                on_node[node].append(candidate)
        best: tuple[tuple[object, ...], list[Replica], Placement] | None = None
        for island, nodes in self._islands(profile, {c.id for c in candidates}).items():
            local = sorted({c.id: c for n in nodes for c in on_node[n.name]}.values(), key=self._preference)
            found = self._victims(local, nodes, profile, leaving)
            if found is not None:
                chosen, placement = found
                bands = [self.profiles[c.profile].band for c in chosen]
                key = (max(bands), len(chosen), -max(c.created for c in chosen), island)
                if best is None or key < best[0]:
                    best = (key, chosen, placement)
        return None if best is None else (best[1], best[2])

    def _preference(self, record: Replica) -> tuple[int, float, str]:
        """Which replica is preempted first: the lowest band, then the newest."""
        return (self.profiles[record.profile].band, -record.created, record.id)

    def _is_leaving(self, owner: str) -> bool:
        if owner in self.promised:
            return False
        record = self.records.get(owner)
        # Owners that are not records are orphans (or replicas gone this pass): going too.
        return record is None or record.state in (ReplicaState.DRAINING, ReplicaState.STOPPED)

    def _victims(
        self, local: list[Replica], nodes: list[NodeView], profile: Profile, leaving: frozenset[str]
    ) -> tuple[list[Replica], Placement] | None:
        """The first of ``local`` (in preference order) whose removal lets ``profile`` fit, pruned."""
        chosen: list[Replica] = []
        for candidate in local:
            chosen.append(candidate)
            placement = self._fit_without(nodes, profile, leaving | {c.id for c in chosen})
            if placement is not None:
                break
        else:
            return None
        # Freeing more never makes a fit impossible, so the last one taken was needed; an earlier
        # one may not be (a small replica taken before the large one that alone makes room).
        for candidate in reversed(chosen[:-1]):
            fewer = [c for c in chosen if c is not candidate]
            smaller = self._fit_without(nodes, profile, leaving | {c.id for c in fewer})
            if smaller is not None:
                chosen, placement = fewer, smaller
        return chosen, placement

    def _islands(self, profile: Profile, owners: Iterable[str]) -> dict[str, list[NodeView]]:
        """The nodes one replica of ``profile`` could use together, where ``owners`` hold something.

        One node for a single-node profile; a fabric's nodes for a multi-node one. Removing a
        holder changes only its own nodes, so a fit is checked on those alone: cheap on a big fleet.
        """
        owners = set(owners)
        holding = [
            self.nodes[name]
            for name, holds in self.holds.items()
            if name in self.nodes and any(h.owner in owners for h in holds)
        ]
        if profile.nodes == 1:
            return {node.name: [node] for node in holding if _could_host(node, profile)}
        fabrics = {node.fabric for node in holding if node.fabric}
        islands: dict[str, list[NodeView]] = {fabric: [] for fabric in sorted(fabrics)}
        for node in self.cluster.nodes:
            if node.fabric in islands and _could_host(node, profile):
                islands[node.fabric].append(node)
        return islands

    def _fit_without(
        self, nodes: list[NodeView], profile: Profile, without: frozenset[str]
    ) -> Placement | None:
        """Where ``profile`` would go on ``nodes`` if the owners in ``without`` held nothing."""
        if not self._enough_cards_without(nodes, profile, without):
            return None  # placement would say so too, at the cost of explaining why
        result = place(ClusterView(nodes=self._occupy(nodes, without)), profile, self.config.port_range)
        return result if isinstance(result, Placement) else None

    def _enough_cards_without(self, nodes: list[NodeView], profile: Profile, without: frozenset[str]) -> bool:
        """Whether enough of ``nodes`` would have enough healthy cards of the profile's class.

        Needed for a fit, and cheap: a preemption search asks it of every node, and placement is
        asked only where it holds (memory and ports are left to placement).
        """
        if profile.gpu_class is None:
            return True
        enough = 0
        for node in nodes:
            held = {i for h in self.holds.get(node.name, ()) if h.owner not in without for i in h.gpus}
            cards = sum(
                1
                for g in node.gpus
                if g.gpu_class == profile.gpu_class and g.healthy and not g.allocated and g.index not in held
            )
            enough += cards >= profile.gpus_per_node
        return enough >= profile.nodes

    def _promise(self, record: Replica, placement: Placement, profile: Profile) -> None:
        """Holds ``placement`` for ``record`` for the rest of the pass, as if it were placed."""
        owner = f"promised to {record.id}"
        self.promised.add(owner)
        self._take(owner, placement, profile)


def _could_host(node: NodeView, profile: Profile) -> bool:
    if not node.online or not node.connected:
        return False
    return profile.gpu_class is None or any(g.gpu_class == profile.gpu_class for g in node.gpus)


def _where(placement: Placement) -> str:
    return ", ".join(
        f"{s.node} (GPU{'s' if len(s.gpu_indices) > 1 else ''} {', '.join(map(str, s.gpu_indices))})"
        if s.gpu_indices
        else f"{s.node} (CPU)"
        for s in placement.shards
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _listing(noun: str, names: list[str]) -> str:
    return f"{noun} {names[0]}" if len(names) == 1 else f"{noun}s {', '.join(names)}"
