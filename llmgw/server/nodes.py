"""The server's view of the fleet: which nodes exist, whether they are online, and their links.

Liveness is decided by :mod:`llmgw.core.liveness` on the trio clock; wall-clock times are kept only
for display and for the store. The store holds what must outlive a server restart (that a node
exists, its last inventory and state), written behind: a change marks the node dirty and one
task saves every dirty node in one transaction. Nothing on the link waits for the disk — with
synchronous=FULL a fleet reconnecting at once would otherwise queue a fsync per node in front of
its Registered and miss its own liveness window. Heartbeats stay in memory: at 1,000 agents a
write per heartbeat would be 200 writes/s for nothing a restart needs.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from llmgw.core.liveness import Liveness, NodeState, node_state
from llmgw.core.shard import ShardSpec
from llmgw.server.changes import Changes
from llmgw.server.store import NodeRow, Store
from llmgw.wire.codec import converter
from llmgw.wire.messages import Compute, Inventory, Register, RunningShard, ShardState, ShardStatus

if TYPE_CHECKING:
    from llmgw.wire.messages import Message

log = logging.getLogger(__name__)

# Lines of a failed shard's output the server log repeats (the whole tail is in the API).
FAILED_TAIL_LINES = 8


class Session(Protocol):
    """What the registry needs from a node's live link (see :mod:`llmgw.server.link`)."""

    node: str

    async def call(self, command: Message) -> Message: ...

    async def send(self, message: Message) -> None: ...

    def close(self, reason: str) -> None: ...


@attrs.define
class Shard:
    """A shard as its agent last reported it. The agent is the truth: Register replaces the whole
    set, statuses update it in between."""

    shard_id: str
    replica_id: str
    state: str  # a ShardState value
    since: float  # wall clock, for display
    spec: ShardSpec | None = None  # None for a shard only known from a status
    reason: str = ""
    pid: int = 0
    compute: Compute | None = None
    log_tail: tuple[str, ...] = ()
    adopted: bool = False

    @classmethod
    def from_running(cls, running: RunningShard, now: float) -> Shard:
        return cls(
            shard_id=running.spec.shard_id,
            replica_id=running.spec.replica_id,
            state=running.state,
            since=now,
            spec=running.spec,
            pid=running.pid,
            compute=running.compute,
            adopted=running.adopted,
        )


@attrs.define
class Node:
    name: str
    agent_version: str
    inventory: Inventory
    state: NodeState
    first_seen: float  # wall clock, for display
    last_seen: float  # wall clock, for display
    state_since: float  # wall clock, for display
    last_heard: float  # trio clock, for decisions
    session: Session | None = None
    shards: dict[str, Shard] = attrs.field(factory=dict)
    # Registrations since this server started: a shard missing from a newer registration's list
    # than the one it was started under is gone.
    registrations: int = 0
    stop_grace: float = 30.0  # the agent's engines.stop_grace, as its last Register said

    @property
    def connected(self) -> bool:
        return self.session is not None


class NodeWatcher(Protocol):
    """Told when a node registers, loses its link, or is declared lost (the job manager)."""

    def node_attached(self, node: str, register: Register) -> None: ...

    def node_detached(self, node: str) -> None: ...

    def node_lost(self, node: str) -> None: ...


class NodeUnavailable(Exception):
    """A command was addressed to a node that has no live link."""


class NodeRegistry:
    def __init__(self, store: Store, liveness: Liveness) -> None:
        self._store = store
        self.liveness = liveness
        self._nodes: dict[str, Node] = {}
        self._dirty: set[str] = set()
        self._dirty_event = trio.Event()
        # Bumped whenever what the reconciler sees changes: a node comes, goes, is lost, or one
        # of its shards changes state.
        self.changes = Changes()
        self.watchers: list[NodeWatcher] = []

    # --- reading ---------------------------------------------------------------------------------

    def list(self) -> list[Node]:
        return [self._nodes[name] for name in sorted(self._nodes)]

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    # --- the link's events ----------------------------------------------------------------------

    async def load(self) -> None:
        """Nodes known from before a restart. Each gets a full liveness window, counted from now,
        to reconnect before it is declared lost."""
        now = trio.current_time()
        for row in await self._store.list_nodes():
            inventory = converter.structure(json.loads(row.inventory), Inventory)
            self._nodes[row.name] = Node(
                name=row.name,
                agent_version=row.agent_version,
                inventory=inventory,
                state=NodeState(row.state),
                first_seen=row.first_seen,
                last_seen=row.last_seen,
                state_since=row.state_since,
                last_heard=now,
            )

    async def attach(self, session: Session, register: Register) -> None:
        """A node registered on a new link; a link it still had is closed (an agent that restarted
        or lost its connection without the server noticing)."""
        now, wall = trio.current_time(), time.time()
        node = self._nodes.get(register.node)
        previous_session = node.session if node else None
        if node is None:
            node = self._nodes[register.node] = Node(
                name=register.node,
                agent_version=register.agent_version,
                inventory=register.inventory,
                state=NodeState.ONLINE,
                first_seen=wall,
                last_seen=wall,
                state_since=wall,
                last_heard=now,
            )
            log.info("node %s registered (agent %s)", node.name, register.agent_version)
        else:
            if node.state is not NodeState.ONLINE:
                log.info("node %s is back online", node.name)
                node.state, node.state_since = NodeState.ONLINE, wall
            node.agent_version, node.inventory = register.agent_version, register.inventory
            node.last_heard, node.last_seen = now, wall
        node.session = session
        node.registrations += 1
        node.stop_grace = register.stop_grace
        node.shards = {s.spec.shard_id: Shard.from_running(s, wall) for s in register.shards}
        for watcher in self.watchers:
            watcher.node_attached(node.name, register)
        self.changes.bump()
        if previous_session is not None:
            log.info("node %s: a new link replaces the old one", node.name)
            previous_session.close("replaced by a newer link from the same node")
        self._mark_dirty(node.name)

    def heard(self, name: str, inventory: Inventory | None = None) -> None:
        node = self._nodes.get(name)
        if node is None:
            return
        node.last_heard, node.last_seen = trio.current_time(), time.time()
        if inventory is not None:
            node.inventory = inventory

    def shard_status(self, name: str, status: ShardStatus) -> None:
        node = self._nodes.get(name)
        if node is None:
            return
        wall = time.time()
        shard = node.shards.get(status.shard_id)
        if status.state == ShardState.STOPPED:
            node.shards.pop(status.shard_id, None)
        elif shard is None:
            node.shards[status.shard_id] = Shard(
                shard_id=status.shard_id,
                replica_id=status.replica_id,
                state=status.state,
                since=wall,
                reason=status.reason,
                pid=status.pid,
                compute=status.compute,
                log_tail=status.log_tail,
                spec=status.spec,
            )
        else:
            shard.spec = shard.spec or status.spec
            if shard.state != status.state:
                shard.state, shard.since = status.state, wall
            shard.reason = status.reason
            shard.pid = status.pid or shard.pid
            shard.compute = status.compute or shard.compute
            shard.log_tail = status.log_tail or shard.log_tail
        self.changes.bump()
        log.info(
            "node %s: shard %s %s%s",
            name,
            status.shard_id,
            status.state,
            f" ({status.reason})" if status.reason else "",
        )
        if status.state == ShardState.FAILED and status.log_tail:
            # The engine's own last words are usually the diagnosis (a port taken, a bad flag).
            log.warning(
                "node %s: shard %s output before it failed:\n  %s",
                name,
                status.shard_id,
                "\n  ".join(status.log_tail[-FAILED_TAIL_LINES:]),
            )

    def detach(self, session: Session, reason: str) -> None:
        node = self._nodes.get(session.node)
        if node is None or node.session is not session:
            return  # already replaced by a newer link
        node.session = None
        log.info("node %s disconnected: %s", node.name, reason)
        for watcher in self.watchers:
            watcher.node_detached(node.name)
        self._mark_dirty(node.name)
        self.changes.bump()

    # --- liveness -------------------------------------------------------------------------------

    async def sweep(self) -> None:
        now, wall = trio.current_time(), time.time()
        for node in list(self._nodes.values()):
            state = node_state(self.liveness, last_heard=node.last_heard, now=now)
            if state is node.state:
                continue
            node.state, node.state_since = state, wall
            log.warning("node %s is %s: nothing heard for %.1fs", node.name, state, now - node.last_heard)
            if state is NodeState.LOST:
                for watcher in self.watchers:
                    watcher.node_lost(node.name)
            # A connected node that went silent has its link closed by the link's own watchdog,
            # which applies the same rule.
            self._mark_dirty(node.name)
            self.changes.bump()

    async def run(self) -> None:
        """The registry's own work: marking silent nodes lost, and saving what changed."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sweep_forever)
            nursery.start_soon(self._persist_forever)

    async def _sweep_forever(self) -> None:
        # Half the interval: a node is marked lost at most half a heartbeat after its deadline.
        while True:
            await trio.sleep(self.liveness.interval / 2)
            await self.sweep()

    # --- persistence ----------------------------------------------------------------------------

    def _mark_dirty(self, name: str) -> None:
        self._dirty.add(name)
        self._dirty_event.set()

    async def _persist_forever(self) -> None:
        try:
            while True:
                await self._dirty_event.wait()
                await self.flush()
        finally:
            with trio.CancelScope(shield=True):
                await self.flush()  # a graceful stop loses nothing

    async def flush(self) -> None:
        """Saves every node changed since the last flush, in one transaction."""
        self._dirty_event = trio.Event()
        names, self._dirty = self._dirty, set()
        rows = [self._row(self._nodes[name]) for name in sorted(names) if name in self._nodes]
        if rows:
            await self._store.save_nodes(rows)

    @staticmethod
    def _row(node: Node) -> NodeRow:
        inventory_json = json.dumps(converter.unstructure(node.inventory))
        return NodeRow(
            node.name,
            node.agent_version,
            inventory_json,
            node.state.value,
            node.first_seen,
            node.last_seen,
            node.state_since,
        )

    # --- commands -------------------------------------------------------------------------------

    def session(self, name: str) -> Session | None:
        """The node's live link, for exchanges that must stay on one link (an adapter's
        delivery: pieces sent on a newer link would continue nothing there)."""
        node = self._nodes.get(name)
        return None if node is None else node.session

    async def call(self, name: str, command: Message) -> Message:
        """Sends a command to a node's agent and returns its reply (bound it with fail_after)."""
        node = self._nodes.get(name)
        if node is None or node.session is None:
            raise NodeUnavailable(f"node {name} is not connected")
        return await node.session.call(command)
