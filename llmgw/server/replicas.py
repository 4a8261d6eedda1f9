"""The reconciler's shell: keeps the replica records, runs passes, and carries out their actions.

Everything that decides is in :mod:`llmgw.core.reconcile`; this module only gathers its inputs
(the catalog, the records, a view of the fleet built from the agents' inventories, the shards
the agents report), stores what a pass returns, sends the commands it asks for on the agent
links, and logs each action with its reason.

A pass runs when the catalog or the fleet changed, when a command it sent was answered, and on a
tick (backoffs and timeouts come due with nothing else happening).

Records live in memory. After a server restart they are rebuilt from what the agents report when
they register (adoption: see :mod:`llmgw.core.reconcile.observe`), and no engine is restarted.

With several servers on one store, only the leader (:mod:`llmgw.server.leadership`) runs passes.
A follower's records are what the agents report, adopted afresh on every change and never acted
on: its gateway routes to the engines that run. When it comes to lead it starts as a restarted
server does, from the reports (every agent reports to every server, so it holds them already),
and when it stops leading, the commands it had under way are cancelled. A pass is skipped when
the lease has lapsed, so a leader that wakes after a pause does not act on what it saw before.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol

import attrs
import trio

from llmgw import tracing
from llmgw.core.catalog import AdapterUnavailable, Profile, StoredAdapter, with_stored_files
from llmgw.core.events import EventLog
from llmgw.core.keys import engine_key
from llmgw.core.liveness import NodeState
from llmgw.core.placement import ClusterView, GpuView, NodeView
from llmgw.core.rdma import chosen_fabric
from llmgw.core.reconcile import (
    ENDING,
    Action,
    DrainReplica,
    MarkFailed,
    MarkPending,
    ReconcileConfig,
    ReportedShard,
    RestartReplica,
    ShardRef,
    StartReplica,
    StopOrphan,
    reconcile,
)
from llmgw.core.reconcile.observe import observe
from llmgw.core.replica import COUNTED, Replica, ReplicaState
from llmgw.core.scaling import LoadSignals, ScaleState, desired_replicas
from llmgw.core.shard import ShardSpec
from llmgw.server.adapters import AdapterDelivery, DeliveryFailed, delivery_timeout
from llmgw.server.catalog import Catalog
from llmgw.server.nodes import Node, NodeRegistry, NodeUnavailable
from llmgw.wire.h2link import LinkClosed
from llmgw.wire.messages import CommandResult, DrainShard, ShardState, StartShard, StopShard

log = logging.getLogger(__name__)

# Backoffs and startup timeouts come due without any event: look at least this often.
TICK = 2.0
# A command is answered as soon as the agent has acted: a start once launched, a stop once the
# processes are gone — after the drain's timeout, if any, and the agent's stop grace, then the
# SIGKILL and reaping, which this margin allows for.
START_ANSWER_TIMEOUT = 60.0
STOP_ANSWER_MARGIN = 30.0


class Leading(Protocol):
    """What the reconciler asks of the leader lease (llmgw.server.leadership.Leadership)."""

    def acting(self) -> bool: ...

    async def wait_acting(self) -> None: ...

    async def wait_not_acting(self) -> None: ...


class ReplicaManager:
    def __init__(
        self,
        registry: NodeRegistry,
        catalog: Catalog,
        engine_secret: bytes | None,
        config: ReconcileConfig | None = None,
        on_pass: Callable[[], None] | None = None,
        signals: Callable[[Profile, list[Replica]], LoadSignals] | None = None,
        stored_adapters: Callable[[], Mapping[str, StoredAdapter]] | None = None,
        delivery: AdapterDelivery | None = None,
        clock: Callable[[], float] = time.time,
        leadership: Leading | None = None,
    ) -> None:
        # Wall-clock seconds: records keep when things happened, for people as well as for
        # backoffs and timeouts. Tests pass trio's clock to drive those with autojump_clock.
        self._clock = clock
        self._registry = registry
        self._catalog = catalog
        self._engine_secret = engine_secret
        self._config = config or ReconcileConfig()
        self._on_pass = on_pass  # told after every pass (the gateway's admission: capacity changed)
        # A profile's load (gateway queue, engines' metrics) for scaling; None: each profile's min.
        self._signals = signals
        # The adapters the server keeps, and how their files reach a node: a shard serving one
        # starts only once its node holds it. None: no adapter is kept (none can be served).
        self._stored_adapters = stored_adapters
        self._delivery = delivery
        # A profile loading adapters on demand without max_lora_rank: the highest rank its
        # stored adapters' configs say (None: the engine's default).
        self.adapter_rank: Callable[[str], Awaitable[int | None]] | None = None
        self._wanted: dict[str, tuple[int, ScaleState]] = {}  # per profile: count and its history
        self._scale_reasons: dict[str, str] = {}  # per profile: the scaler's last word
        self._records: dict[str, Replica] = {}
        # Per shard: the node's registration count when its start was answered. A shard missing
        # from a later registration's list is gone (the agent restarted without it).
        self._started_under: dict[str, int] = {}
        self._stopping: set[tuple[str, str]] = set()  # (node, shard id) with a stop on its way
        # Replicas this server ended (stopped, reaped, scaled down): a shard of one that an agent
        # reports later (its node was cut off while it was reaped) is an orphan to stop, never a
        # replica to adopt, or the profile would run one more replica than it wants.
        self._ended: set[str] = set()
        # Why each Pending replica fits on no node: (node, reason) for every node, as of the
        # last pass that could not place it. The record keeps only the summary line.
        self._candidates: dict[str, tuple[tuple[str, str], ...]] = {}
        self._kick = trio.Event()
        self._due: set[float] = set()  # wall-clock times a restart comes due (MarkFailed)
        self._nursery: trio.Nursery | None = None
        self._leadership = leadership  # None: this server always leads (tests of one server)
        self.events = EventLog()  # the actions carried out, for the status page's events

    # --- reading -------------------------------------------------------------------------------

    def list(self) -> list[Replica]:
        return sorted(self._records.values(), key=lambda r: (r.profile, r.created, r.id))

    def get(self, replica_id: str) -> Replica | None:
        return self._records.get(replica_id)

    def candidates(self, replica_id: str) -> tuple[tuple[str, str], ...]:
        """Every node's reason for not taking a Pending replica (empty otherwise)."""
        record = self._records.get(replica_id)
        if record is None or record.state != ReplicaState.PENDING:
            return ()
        return self._candidates.get(replica_id, ())

    def wanted(self, profile: str) -> tuple[int, str] | None:
        """The replicas the scaler wants of a profile and why, as of the last pass; None before
        its first decision."""
        if profile not in self._wanted or profile not in self._scale_reasons:
            return None
        return self._wanted[profile][0], self._scale_reasons[profile]

    def kick(self) -> None:
        """Run a pass now (a request waits for a model with no Ready replica, say)."""
        self._kick.set()

    def key_of(self, replica_id: str) -> str | None:
        return None if self._engine_secret is None else engine_key(self._engine_secret, replica_id)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Leads while this server leads, follows while it does not."""
        leadership = self._leadership
        if leadership is None:
            await self._lead()
            return
        while True:
            if not leadership.acting():
                with trio.CancelScope() as following:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._follow)
                        await leadership.wait_acting()
                        following.cancel()
            self._take_over()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._lead)
                await leadership.wait_not_acting()
                nursery.cancel_scope.cancel()  # the commands under way too: they are stale
            log.warning("stopped reconciling: this server no longer leads")
            self._nursery = None
            self._stopping.clear()
            self._due.clear()

    def _take_over(self) -> None:
        """Starts leading as a restarted server does: no records, every running shard adopted
        by the first pass from the reports (and the scaler starting from what runs)."""
        self._records, self._started_under, self._ended = {}, {}, set()
        self._wanted, self._scale_reasons, self._candidates = {}, {}, {}
        log.info("reconciling: this server leads")

    async def _follow(self) -> None:
        """A follower's records: the replicas the agents report, rebuilt on every change of the
        fleet or the catalog (a model the gateway must know)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._kick_on_changes)
            while True:
                self._kick = trio.Event()
                now = self._clock()
                self._records = observe({}, self._registry.list(), self._catalog.profiles(), {}, now).records
                self._candidates = {}
                if self._on_pass is not None:
                    self._on_pass()
                with trio.move_on_after(TICK):
                    await self._kick.wait()

    async def _lead(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._kick_on_changes)
            while True:
                self._kick = trio.Event()
                self.run_pass()
                # Sleep until something changes, the next restart comes due, or the tick.
                now = self._clock()
                self._due = {at for at in self._due if at > now}
                with trio.move_on_after(min([TICK, *(at - now for at in self._due)])):
                    await self._kick.wait()

    async def _kick_on_changes(self) -> None:
        async with trio.open_nursery() as nursery:
            for changes in (self._catalog.changes, self._registry.changes):
                nursery.start_soon(self._forward, changes)

    async def _forward(self, changes) -> None:
        seen = changes.version
        while True:
            seen = await changes.wait_past(seen)
            self._kick.set()

    def run_pass(self) -> None:
        """One reconcile pass, synchronous; the commands it needs go out in background tasks.
        A pass that does something is a trace (each action a span beneath it; a start goes on in
        the shard's task and, through the command, on the node)."""
        if self._leadership is not None and not self._leadership.acting():
            return  # the lease lapsed (a pause?): what this server saw may be stale
        began = time.time()
        now = self._clock()
        self._observe(now)
        plan = reconcile(
            models=self._catalog.models(),
            profiles=self._catalog.profiles(),
            replicas=self._records.values(),
            cluster=cluster_view(self._registry.list()),
            desired=self._desired(now),
            now=now,
            config=self._config,
            new_id=lambda: f"r-{secrets.token_hex(4)}",
            reported=self._reported(),
            awaiting=self._awaiting(),
        )
        records = {record.id: record for record in plan.replicas}
        self._ended.update(self._records.keys() - records.keys())
        self._records = records
        self._candidates = {rid: why for rid, why in self._candidates.items() if rid in self._records}
        pass_span = tracing.NO_SPAN
        if plan.actions and tracing.enabled():
            pass_span = tracing.start(
                "reconcile.pass", {"llmgw.actions": len(plan.actions)}, start_time=began
            )
        with tracing.use(pass_span):
            for action in plan.actions:
                self._carry_out(action, now)
        tracing.end(pass_span)
        if self._on_pass is not None:
            self._on_pass()

    # --- inputs --------------------------------------------------------------------------------

    def _desired(self, now: float) -> dict[str, int]:
        """How many replicas each profile wants, between its min and max, from its load."""
        if self._signals is None:
            return {}
        wanted = {}
        for name, profile in self._catalog.profiles().items():
            current, state = self._wanted.get(name, (profile.min_replicas, ScaleState()))
            records = [record for record in self._records.values() if record.profile == name]
            decision = desired_replicas(profile, current, self._signals(profile, records), state, now)
            if decision.count != current:
                log.info("scale %s from %d to %d: %s", name, current, decision.count, decision.reason)
            self._wanted[name] = (decision.count, decision.state)
            self._scale_reasons[name] = decision.reason
            wanted[name] = decision.count
        return wanted

    def _awaiting(self) -> frozenset[str]:
        """Nodes from before this server started that have neither registered since nor been
        declared lost: their shards are not reported yet."""
        return frozenset(
            node.name
            for node in self._registry.list()
            if node.registrations == 0 and node.state is not NodeState.LOST
        )

    def _reported(self) -> list[ReportedShard]:
        return [
            ReportedShard(
                node=node.name,
                shard_id=shard.shard_id,
                replica_id=shard.replica_id,
                model=shard.spec.model,
                gpu_indices=tuple(gpu.index for gpu in shard.spec.gpus),
                port=shard.spec.port,
                rendezvous_port=shard.spec.rendezvous_port,
            )
            for node in self._registry.list()
            if node.connected
            for shard in node.shards.values()
            if shard.spec is not None and shard.state not in (ShardState.STOPPED, ShardState.FAILED)
        ]

    def _observe(self, now: float) -> None:
        """The agents' reports into the records (core.reconcile.observe): shards adopted after
        a server restart, and every shard's reported state."""
        profiles = self._catalog.profiles()
        observed = observe(
            self._records, self._registry.list(), profiles, self._started_under, now, ended=self._ended
        )
        self._records = observed.records
        self._started_under.update(observed.started_under)
        for adoption in observed.adopted:
            log.info(
                "replica %s: adopted shard %s on node %s (%s)",
                adoption.replica_id,
                adoption.shard_id,
                adoption.node,
                adoption.state,
            )
        for name in {a.profile for a in observed.adopted if a.profile in profiles}:
            self._want_at_least_what_runs(profiles[name])

    def _want_at_least_what_runs(self, profile: Profile) -> None:
        """An adopted replica is wanted: after a restart the scaler starts from what runs, not
        from min_replicas, or it would stop a replica (of a min_replicas 0 profile, say) that
        serves while its clients wait for the server to come back."""
        running = sum(1 for r in self._records.values() if r.profile == profile.name and r.state in COUNTED)
        current, state = self._wanted.get(profile.name, (profile.min_replicas, ScaleState()))
        self._wanted[profile.name] = (max(current, min(running, profile.max_replicas)), state)

    # --- carrying out --------------------------------------------------------------------------

    def _carry_out(self, action: Action, now: float) -> None:
        if not tracing.enabled():
            self._carry_out_now(action, now)
            return
        with tracing.span(f"reconcile.{type(action).__name__}", _action_attributes(action)) as span:
            if isinstance(action, MarkPending):
                # Where it could not go: every candidate node with its reason.
                for node, why in action.reasons:
                    span.add_event("candidate refused", {"llmgw.node": node, "llmgw.reason": why})
                tracing.fail(span, action.reason)
            self._carry_out_now(action, now)

    def _carry_out_now(self, action: Action, now: float) -> None:
        log.info("%s: %s", _describe(action), action.reason)
        self.events.record(now, type(action).__name__, _describe(action).partition(" ")[2], action.reason)
        assert self._nursery is not None
        match action:
            case StartReplica() | RestartReplica():
                for spec, where in zip(action.specs, action.placement.shards, strict=True):
                    self._nursery.start_soon(self._start_shard, where.node, spec)
            case DrainReplica(shards=shards, deadline=deadline):
                for ref in shards:
                    self._send_stop(
                        ref, DrainShard(id=0, shard_id=ref.shard_id, timeout=max(0.0, deadline - now))
                    )
            case MarkPending(replica_id=replica_id, reasons=reasons):
                self._candidates[replica_id] = reasons
            case MarkFailed(restart_at=restart_at) if restart_at is not None:
                self._due.add(restart_at)
                self._stop_shards(action.shards)
            case StopOrphan(node=node, shard_id=shard_id):
                self._send_stop(ShardRef(node=node, shard_id=shard_id), StopShard(id=0, shard_id=shard_id))
            case _ if isinstance(action, ENDING):
                self._stop_shards(action.shards)

    def _stop_shards(self, shards: Iterable[ShardRef]) -> None:
        for ref in shards:
            self._send_stop(ref, StopShard(id=0, shard_id=ref.shard_id))

    async def _start_shard(self, node: str, spec: ShardSpec) -> None:
        attributes = {
            "llmgw.replica": spec.replica_id,
            "llmgw.shard": spec.shard_id,
            "llmgw.node": node,
            "llmgw.model": spec.model,
        }
        with tracing.span("replica.start_shard", attributes, kind="client"):
            await self._start_shard_traced(node, spec)

    async def _start_shard_traced(self, node: str, spec: ShardSpec) -> None:
        if spec.max_loaded_adapters and spec.max_lora_rank is None and self.adapter_rank is not None:
            # Loaded later, on demand: the engine is told now the highest rank among them.
            spec = attrs.evolve(spec, max_lora_rank=await self.adapter_rank(spec.profile))
        try:
            with tracing.span("adapter.delivery"):
                spec = await self._deliver_adapters(node, spec)
        except (AdapterUnavailable, DeliveryFailed) as exc:
            self._shard_failed(spec.replica_id, spec.shard_id, f"cannot start on {node}: {exc}")
            self._kick.set()
            return
        # The trace goes on on the node (W3C trace context; {} when tracing is off).
        command = StartShard(id=0, trace=tracing.inject(), spec=spec, engine_key=self.key_of(spec.replica_id))
        registrations = self._registry.get(node).registrations if self._registry.get(node) else 0
        try:
            with trio.fail_after(START_ANSWER_TIMEOUT):
                reply = await self._registry.call(node, command)
        except (NodeUnavailable, LinkClosed, trio.TooSlowError) as exc:
            self._shard_failed(spec.replica_id, spec.shard_id, f"start not delivered to {node}: {exc}")
            return
        if isinstance(reply, CommandResult) and reply.ok:
            self._started_under[spec.shard_id] = registrations
        else:
            message = reply.message if isinstance(reply, CommandResult) else "unexpected reply"
            self._shard_failed(spec.replica_id, spec.shard_id, f"{node} refused to start it: {message}")
        self._kick.set()

    async def _deliver_adapters(self, node: str, spec: ShardSpec) -> ShardSpec:
        """``spec`` with its stored adapters' files named, once ``node`` holds them all; raises
        AdapterUnavailable (not kept, or unfit) or DeliveryFailed (it did not get there)."""
        if not any(adapter.source for adapter in spec.adapters):
            return spec
        stored = self._stored_adapters() if self._stored_adapters is not None else {}
        spec = with_stored_files(spec, stored)
        for adapter in spec.adapters:
            if not adapter.source:
                continue
            if self._delivery is None:
                raise DeliveryFailed(f"adapter {adapter.source}: this server delivers no adapters")
            try:
                with trio.fail_after(delivery_timeout(adapter.files)):
                    await self._delivery.ensure(node, adapter.source, adapter.files)
            except trio.TooSlowError:
                raise DeliveryFailed(
                    f"adapter {adapter.source}: delivery to {node} took over "
                    f"{delivery_timeout(adapter.files):.0f} s"
                ) from None
        return spec

    def _send_stop(self, ref: ShardRef, command: StopShard | DrainShard) -> None:
        if (ref.node, ref.shard_id) in self._stopping:
            return  # already on its way
        self._stopping.add((ref.node, ref.shard_id))
        assert self._nursery is not None
        self._nursery.start_soon(self._stop_shard, ref, command)

    async def _stop_shard(self, ref: ShardRef, command: StopShard | DrainShard) -> None:
        try:
            with trio.fail_after(self._stop_answer_timeout(ref.node, command)):
                reply = await self._registry.call(ref.node, command)
            if isinstance(reply, CommandResult) and reply.ok:
                self._set_shard_state(ref.shard_id, ShardState.STOPPED, reply.message)
            else:
                log.warning("node %s did not stop shard %s: %s", ref.node, ref.shard_id, reply)
        except (NodeUnavailable, LinkClosed, trio.TooSlowError) as exc:
            log.warning("stop of shard %s on node %s not delivered: %s", ref.shard_id, ref.node, exc)
        finally:
            self._stopping.discard((ref.node, ref.shard_id))
            self._kick.set()

    def _stop_answer_timeout(self, node_name: str, command: StopShard | DrainShard) -> float:
        node = self._registry.get(node_name)
        grace = node.stop_grace if node is not None else 30.0
        if isinstance(command, StopShard) and command.grace is not None:
            grace = command.grace
        drain = command.timeout if isinstance(command, DrainShard) else 0.0
        return drain + grace + STOP_ANSWER_MARGIN

    def _shard_failed(self, replica_id: str, shard_id: str, reason: str) -> None:
        log.warning("replica %s: shard %s: %s", replica_id, shard_id, reason)
        tracing.fail(tracing.current(), reason)
        self._set_shard_state(shard_id, ShardState.FAILED, reason)

    def _set_shard_state(self, shard_id: str, state: str, reason: str) -> None:
        for record in list(self._records.values()):
            shards = tuple(
                attrs.evolve(piece, state=state, reason=reason) if piece.shard_id == shard_id else piece
                for piece in record.shards
            )
            if shards != record.shards:
                self._records[record.id] = attrs.evolve(record, shards=shards)


def _action_attributes(action: Action) -> dict[str, str]:
    """What an operator searches a reconcile span by: never a key (actions carry none)."""
    found = {"llmgw.reason": action.reason}
    for field, name in [
        ("replica_id", "llmgw.replica"),
        ("victim_replica_id", "llmgw.replica"),
        ("profile", "llmgw.profile"),
        ("node", "llmgw.node"),
        ("shard_id", "llmgw.shard"),
    ]:
        value = getattr(action, field, None)
        if isinstance(value, str) and value:
            found[name] = value
    placement = getattr(action, "placement", None)
    if placement is not None:
        found["llmgw.nodes"] = ",".join(where.node for where in placement.shards)
    return found


def _describe(action: Action) -> str:
    name = type(action).__name__
    subject = getattr(action, "replica_id", None) or getattr(action, "victim_replica_id", None)
    if subject is None:
        subject = f"{action.node}/{action.shard_id}"
    return f"{name} {subject}"


# --- the fleet as the reconciler sees it --------------------------------------------------------


def cluster_view(nodes: Iterable[Node]) -> ClusterView:
    """The fleet before any replica (see core.reconcile): what each node offers to shards."""
    return ClusterView(nodes=tuple(node_view(node) for node in nodes))


def node_view(node: Node) -> NodeView:
    inventory = node.inventory
    return NodeView(
        name=node.name,
        # Lost nodes' replicas are reaped; a node merely reconnecting keeps them, takes nothing new.
        online=node.state is NodeState.ONLINE,
        connected=node.connected,
        address=inventory.mgmt_address,
        mgmt_interface=inventory.mgmt_interface,
        fabric=inventory.fabric,
        rdma=chosen_fabric(inventory.ib_ports, inventory.fabric),
        gpus=tuple(
            GpuView(
                index=gpu.index,
                uuid=gpu.uuid,
                gpu_class=gpu.gpu_class,
                compute_capability=gpu.compute_capability,
                memory_total_mib=gpu.memory_total_mib,
                # What processes llmgw did not start leave; our own shards are the reconciler's.
                memory_free_mib=max(0, gpu.memory_total_mib - sum(p.used_mib for p in gpu.foreign_processes)),
                allocated=False,
                healthy=gpu.healthy,
                problems=gpu.problems,
            )
            for gpu in inventory.gpus
        ),
        # Host memory and cores are offered whole: what shards hold is counted by the reconciler,
        # and the agent's own "available" figure already has our CPU shards taken out.
        memory_free_mib=inventory.memory_total_mib,
        cpu_cores_free=inventory.cpu_count,
        ports_in_use=frozenset(inventory.ports_in_use),
    )
