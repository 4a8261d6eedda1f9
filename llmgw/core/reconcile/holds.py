"""What every owner holds on each node during one pass, and the nodes as that leaves them.

The view of the fleet a pass gets is the fleet before any replica. The ledger takes out what the
replicas hold (every shard of a live or restartable one, and the still-running shards of one that
drains or stops), what orphan shards hold, and what the pass itself gives away as it places, so
that one pass never gives a GPU, a port or a CPU shard's memory twice. It is built only when
something is to be placed: a pass with nothing to place never looks at the fleet's cards.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import NamedTuple

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.placement import ClusterView, NodeView, Placement, ShardPlacement, Unplaceable, apply, place
from llmgw.core.reconcile.inputs import ReportedShard
from llmgw.core.replica import Replica, ReplicaShard, ReplicaState


class Hold(NamedTuple):
    """What one owner holds on one node (a tuple: a pass makes one per shard of the fleet)."""

    owner: str  # a replica id, "node/shard" for an orphan, or a promise (see Ledger.promise)
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    memory_mib: int = 0  # CPU shards only: a GPU shard's host needs are not modelled
    cpu_cores: int = 0


class Ledger:
    def __init__(self, cluster: ClusterView, port_range: tuple[int, int]) -> None:
        self.cluster = cluster
        self.nodes = {node.name: node for node in cluster.nodes}
        self.port_range = port_range
        self.holds: dict[str, list[Hold]] = collections.defaultdict(list)
        # Nodes as the pass has left them, made as placement first looks at them.
        self.occupied: dict[str, NodeView] = {}
        # Per GPU class, the online nodes with healthy cards of it that nothing holds, and how
        # many, in the view's order: which nodes are worth a look for a placement.
        self.free_gpus: dict[str, dict[str, int]] = collections.defaultdict(dict)
        # Owners of holds that stand for room promised to a replica waiting for it (preemption).
        self.promised: set[str] = set()

    def collect(
        self,
        records: Iterable[Replica],
        orphans: Iterable[ReportedShard],
        profile_of: Callable[[Replica], Profile | None],
    ) -> None:
        """Takes in what the records and the orphans hold; call once, before any placement."""
        for record in records:
            if record.state != ReplicaState.PENDING and record.shards:
                self.hold(record.id, record.shards, profile_of(record))
        for shard in orphans:
            owner = f"{shard.node}/{shard.shard_id}"
            ports = (shard.port, shard.rendezvous_port)
            self.holds[shard.node].append(Hold(owner=owner, gpus=shard.gpu_indices, ports=ports))
        for node in self.cluster.nodes:
            if node.online:
                held = {index for hold in self.holds.get(node.name, ()) for index in hold.gpus}
                free = collections.Counter(
                    g.gpu_class for g in node.gpus if g.healthy and not g.allocated and g.index not in held
                )
                for gpu_class, cards in free.items():
                    self.free_gpus[gpu_class][node.name] = cards

    def hold(
        self, owner: str, shards: Iterable[ReplicaShard | ShardPlacement], profile: Profile | None
    ) -> None:
        memory_mib = cpu_cores = 0
        if profile is not None and profile.gpu_class is None:
            memory_mib, cpu_cores = profile.memory_mib, profile.cpu_cores
        for shard in shards:
            ports = (shard.port, shard.rendezvous_port)  # 0 = none; never in a port range
            self.holds[shard.node].append(Hold(owner, shard.gpu_indices, ports, memory_mib, cpu_cores))

    def take(self, owner: str, placement: Placement, profile: Profile) -> None:
        """Holds ``placement`` for ``owner`` for the rest of the pass."""
        self.hold(owner, placement.shards, profile)
        if profile.gpu_class is not None:
            free = self.free_gpus[profile.gpu_class]
            for shard in placement.shards:
                # A promise may take cards that are not free yet (those of replicas stopping).
                free[shard.node] = free.get(shard.node, 0) - profile.gpus_per_node
        nodes = ClusterView(nodes=tuple(self.node_now(s.node) for s in placement.shards))
        for node in apply(nodes, placement, profile).nodes:
            self.occupied[node.name] = node

    def promise(self, replica_id: str, placement: Placement, profile: Profile) -> None:
        """Holds ``placement`` for ``replica_id`` for the rest of the pass, as if it were placed,
        so that the next replica to fit nowhere does not count on the same room."""
        owner = f"promised to {replica_id}"
        self.promised.add(owner)
        self.take(owner, placement, profile)

    def node_now(self, name: str) -> NodeView:
        node = self.occupied.get(name)
        if node is None:
            node = self.occupied[name] = self.occupy((self.nodes[name],), frozenset())[0]
        return node

    def occupy(self, nodes: Iterable[NodeView], exclude: frozenset[str]) -> tuple[NodeView, ...]:
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

    def still_free(self, record: Replica, profile: Profile) -> bool:
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

    def place_now(self, profile: Profile, away: frozenset[str] = frozenset()) -> Placement | Unplaceable:
        """Placement on the fleet as the pass has left it, without the nodes in ``away``.

        Tried first on the nodes with enough healthy cards of its class that nothing holds: the
        others never fit, so the answer is the same, and on a busy fleet most nodes are skipped
        without building their view. Only an Unplaceable is worth the whole fleet: it names every
        node.
        """
        if profile.gpu_class is None:
            names: Iterable[str] = (n.name for n in self.cluster.nodes if n.online)
        else:
            free = self.free_gpus.get(profile.gpu_class, {})
            names = (name for name, cards in free.items() if cards >= profile.gpus_per_node)
        hosts = tuple(self.node_now(name) for name in names if name not in away)
        result = place(ClusterView(nodes=hosts), profile, self.port_range)
        if isinstance(result, Placement):
            return result
        every = tuple(self.node_now(n.name) for n in self.cluster.nodes if n.name not in away)
        return place(ClusterView(nodes=every), profile, self.port_range)

    def fit_without(
        self, nodes: list[NodeView], profile: Profile, without: frozenset[str]
    ) -> Placement | None:
        """Where ``profile`` would go on ``nodes`` if the owners in ``without`` held nothing."""
        if not self._enough_cards_without(nodes, profile, without):
            return None  # placement would say so too, at the cost of explaining why
        result = place(ClusterView(nodes=self.occupy(nodes, without)), profile, self.port_range)
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

    def islands(self, profile: Profile, owners: Iterable[str]) -> dict[str, list[NodeView]]:
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


def _could_host(node: NodeView, profile: Profile) -> bool:
    if not node.online or not node.connected:
        return False
    return profile.gpu_class is None or any(g.gpu_class == profile.gpu_class for g in node.gpus)
