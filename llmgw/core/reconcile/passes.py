"""One reconcile pass: observe, repair, orphans, scale, place — in that order (see the package)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

import attrs

from llmgw.core.catalog import Model, Profile
from llmgw.core.placement import ClusterView, Placement, ShardPlacement, Unplaceable, to_shard_specs
from llmgw.core.reconcile.actions import (
    Action,
    DrainReplica,
    Evict,
    MarkFailed,
    MarkPending,
    Plan,
    Preempt,
    Reap,
    RestartReplica,
    ShardRef,
    StartReplica,
    StopOrphan,
    StopReplica,
)
from llmgw.core.reconcile.holds import Ledger
from llmgw.core.reconcile.inputs import ReconcileConfig, ReportedShard
from llmgw.core.reconcile.preemption import SEARCHES_PER_PASS, cheapest_victims, preference, room_being_freed
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
from llmgw.core.restart_policy import Decision, GiveUp, MoveElsewhere, decide
from llmgw.core.shard import ShardSpec

# Which replicas a scale-down takes first: those that serve nothing yet, then the newest.
_SCALE_DOWN_ORDER = {
    ReplicaState.PENDING: 0,
    ReplicaState.FAILED: 1,
    ReplicaState.STARTING: 2,
    ReplicaState.LOADING: 3,
    ReplicaState.READY: 4,
}


@attrs.frozen
class _Restart:
    record: Replica
    move: bool
    delay: float


class Pass:
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
        self.fresh: set[str] = set()  # replicas this pass created
        self.ledger = Ledger(cluster, config.port_range)  # filled once something is to be placed
        self.searches_left = SEARCHES_PER_PASS

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

    def _end(
        self, record: Replica, state: ReplicaState, reason: str, **changes: object
    ) -> tuple[ShardRef, ...]:
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
        self.ledger.collect(self.records.values(), self.orphans, self._profile_of)
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

    def _due_restart(self, record: Replica) -> _Restart | None:
        decision = self._decision(record)
        if isinstance(decision, GiveUp) or self.now < decision.at or self._running(record):
            return None
        return _Restart(record=record, move=isinstance(decision, MoveElsewhere), delay=decision.delay)

    def _place_pending(self, record: Replica, profile: Profile, unplaceable: dict[str, Unplaceable]) -> None:
        result = unplaceable.get(profile.name) or self.ledger.place_now(profile)
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
        old = self._placement_of(record) if self.ledger.still_free(record, profile) else None
        if restart.move or old is None:
            away = frozenset(record.failed_nodes if restart.move else ())
            result = self.ledger.place_now(profile, away)
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
            self.ledger.take(record.id, placement, profile)

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

    # --- preemption --------------------------------------------------------------------------------

    def _make_room(self, record: Replica, profile: Profile) -> str:
        """What is done so that ``record`` can be placed later, as words to add to its reason.

        Room being freed already (replicas draining or stopping, orphans) is waited for. Otherwise
        the cheapest set of lower-band replicas (see :mod:`.preemption`) is preempted. Either way
        the room is promised to ``record`` for the rest of the pass, so that the next replica to
        fit nowhere does not count on the same room, and nothing placed in this pass is taken back.
        """
        leaving = frozenset(
            h.owner for hs in self.ledger.holds.values() for h in hs if self._is_leaving(h.owner)
        )
        placement = room_being_freed(self.ledger, profile, leaving)
        if placement is not None:
            self.ledger.promise(record.id, placement, profile)
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
            key=preference(self._band),
        )
        if not candidates:
            return ""
        if not self.searches_left:
            return "; whether to preempt is decided on the next pass"
        self.searches_left -= 1
        best = cheapest_victims(self.ledger, candidates, profile, leaving, self._band)
        if best is None:
            return ""
        victims, placement = best
        self.ledger.promise(record.id, placement, profile)
        for victim in victims:
            reason = (
                f"preempted for {record.id} of profile {profile.name} (band {profile.band}), "
                f"which fits nowhere else; {victim.id} is band {self._band(victim)}"
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

    def _band(self, record: Replica) -> int:
        return self.profiles[record.profile].band

    def _is_leaving(self, owner: str) -> bool:
        if owner in self.ledger.promised:
            return False
        record = self.records.get(owner)
        # Owners that are not records are orphans (or replicas gone this pass): going too.
        return record is None or record.state in (ReplicaState.DRAINING, ReplicaState.STOPPED)


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
