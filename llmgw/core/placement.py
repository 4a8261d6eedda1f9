"""Placement: which nodes, GPUs and ports a replica's shards get, or why no node can take them.

Filter → fit → score → pick, as a pure function of a view of the cluster and a profile. A node
fits when it is online and has what one shard needs: ``gpus_per_node`` GPUs of the profile's class
that are healthy, not given to a replica and have ``memory_mib`` free (a CPU profile: host memory
and cores), and free ports. A multi-node profile needs ``nodes`` such nodes on one fabric, since
its collectives cross between them.

Among the nodes that fit, the score packs by default: the node left with the fewest free GPUs of
the class (for CPU, the least free memory) wins, so that whole nodes stay free for large profiles.
``Profile.spread`` inverts it. Ties go to the node name, so the same view always gives the same
answer, whatever the order of its nodes.

When nothing fits, :class:`Unplaceable` gives every node of the view its reason, in the view's
order: an operator asking "why is this pending?" looks for a node by name.

Deciding is cheap when a placement exists (one pass over the nodes, no text); the reasons are
written only when none does. The profile is assumed valid (:func:`~llmgw.core.catalog.validate_profile`).
"""

from __future__ import annotations

import collections

import attrs

from llmgw.core.catalog import Model, Profile
from llmgw.core.shard import Fabric, GpuRef, ShardSpec

frozen = attrs.frozen(kw_only=True)

# What the server knows from Gpu.problems (see llmgw.agent.discovery.nvml), as words.
_PROBLEM_TEXTS = {
    "ecc-uncorrected": "has uncorrected ECC errors",
    "foreign-memory": "holds memory of a process llmgw did not start",
}
# How many distinct reasons Unplaceable.summary names before it says "and N more".
_SUMMARY_REASONS = 3


# --- the view placement decides on --------------------------------------------------------------


@frozen
class GpuView:
    index: int  # NVML's index on its node
    uuid: str
    gpu_class: str
    compute_capability: str
    memory_total_mib: int
    # What is left: total − memory of processes llmgw did not start − what llmgw's shards hold.
    memory_free_mib: int
    allocated: bool = False  # already given to a replica
    healthy: bool = True
    problems: tuple[str, ...] = ()  # Gpu.problems: why it is not healthy


@frozen
class NodeView:
    name: str
    online: bool = True  # not lost: its replicas stand (see core.liveness)
    # Its agent's link is up. A node online but not connected is between an agent restart and
    # its reconnection: it keeps what it runs, but can take no new shard (nobody could start it).
    connected: bool = True
    address: str = ""  # management IP: where the router and the other ranks reach it
    mgmt_interface: str = ""  # the interface holding that address
    fabric: str = ""  # the island its multi-node placements may span; "" = a single-node island
    # The adapters and GID a shard's collectives use on that fabric (kind "" = TCP only).
    rdma: Fabric = Fabric()
    gpus: tuple[GpuView, ...] = ()
    memory_free_mib: int = 0  # host memory
    cpu_cores_free: int = 0
    ports_in_use: frozenset[int] = frozenset()


@frozen
class ClusterView:
    nodes: tuple[NodeView, ...] = ()


# --- the answer ----------------------------------------------------------------------------------


@frozen
class ShardPlacement:
    node: str
    rank: int
    gpu_indices: tuple[int, ...] = ()  # empty for a CPU shard
    port: int  # the engine's, on this node
    # Where the ranks meet on rank 0's node; the same on every shard; 0 = none needed.
    rendezvous_port: int = 0


@frozen
class Placement:
    shards: tuple[ShardPlacement, ...]  # rank 0 first


@frozen
class Unplaceable:
    profile: str
    request: str  # what one replica needs, in words
    reasons: tuple[tuple[str, str], ...]  # (node, why not) for every node of the view, in its order

    @property
    def summary(self) -> str:
        """One line: the request and its most common reasons, with how many nodes gave each."""
        head = f"profile {self.profile} ({self.request}) fits none of {_count(len(self.reasons), 'node')}"
        if not self.reasons:
            return head
        counts = collections.Counter(reason for _, reason in self.reasons)
        # most_common keeps first-seen order among equal counts: the view's order.
        common = counts.most_common()
        parts = [f"{reason} ({_count(n, 'node')})" for reason, n in common[:_SUMMARY_REASONS]]
        if len(common) > _SUMMARY_REASONS:
            parts.append(f"and {len(common) - _SUMMARY_REASONS} more reasons")
        return f"{head}: " + "; ".join(parts)


# --- deciding -------------------------------------------------------------------------------------


@attrs.frozen
class _Fit:
    node: NodeView
    gpu_indices: tuple[int, ...]
    left: int  # what the node keeps for others: free GPUs of the class, or MiB for a CPU shard


def place(cluster: ClusterView, profile: Profile, port_range: tuple[int, int]) -> Placement | Unplaceable:
    """Where one replica of ``profile`` runs; ports come from ``port_range`` (inclusive)."""
    ports_needed = _ports_needed(profile)
    fits = [f for f in (_fit(node, profile, port_range, ports_needed) for node in cluster.nodes) if f]
    # Pack: least left first; spread: most left first; then by name.
    sign = -1 if profile.spread else 1
    if profile.nodes == 1:
        if not fits:
            return _unplaceable(cluster, profile, port_range, ports_needed, {})
        chosen = [min(fits, key=lambda f: (sign * f.left, f.node.name))]
    else:
        by_fabric: dict[str, list[_Fit]] = collections.defaultdict(list)
        for fit in fits:
            by_fabric[fit.node.fabric].append(fit)
        groups = []
        for fabric, members in by_fabric.items():
            if len(members) >= profile.nodes:
                members.sort(key=lambda f: (sign * f.left, f.node.name))
                best = members[: profile.nodes]
                groups.append((sign * sum(f.left for f in best), fabric, best))
        if not groups:
            fitting = {fabric: len(members) for fabric, members in by_fabric.items()}
            return _unplaceable(cluster, profile, port_range, ports_needed, fitting)
        # The leader is the first by name: any of them could lead, and a name is what people read.
        chosen = sorted(min(groups)[2], key=lambda f: f.node.name)
    return _placement(chosen, port_range, ports_needed)


def _ports_needed(profile: Profile) -> int:
    # A rendezvous port on the leader when ranks meet there: several nodes, or a Ray head even on
    # one. Any node that fits could become the leader, so each must have room for both ports.
    return 2 if profile.nodes > 1 or profile.launcher == "ray" else 1


def _fit(node: NodeView, profile: Profile, port_range: tuple[int, int], ports_needed: int) -> _Fit | None:
    if not node.online or not node.connected or (profile.nodes > 1 and not node.fabric):
        return None
    if profile.gpu_class is None:
        if node.memory_free_mib < profile.memory_mib or node.cpu_cores_free < profile.cpu_cores:
            return None
        indices: tuple[int, ...] = ()
        left = node.memory_free_mib - profile.memory_mib
    else:
        free = 0
        usable = []
        for gpu in node.gpus:
            if gpu.gpu_class == profile.gpu_class and gpu.healthy and not gpu.allocated:
                free += 1
                if gpu.memory_free_mib >= profile.memory_mib:
                    usable.append(gpu.index)
        if len(usable) < profile.gpus_per_node:
            return None
        # The lowest indices: the same view always gives the same cards.
        indices = tuple(sorted(usable)[: profile.gpus_per_node])
        left = free - profile.gpus_per_node
    if len(_free_ports(node, port_range, ports_needed)) < ports_needed:
        return None
    return _Fit(node, indices, left)


def _free_ports(node: NodeView, port_range: tuple[int, int], count: int) -> list[int]:
    """The lowest ``count`` ports of the range this node does not use (fewer if it has fewer)."""
    low, high = port_range
    found = []
    port = low
    while port <= high and len(found) < count:
        if port not in node.ports_in_use:
            found.append(port)
        port += 1
    return found


def _placement(chosen: list[_Fit], port_range: tuple[int, int], ports_needed: int) -> Placement:
    leader_ports = _free_ports(chosen[0].node, port_range, ports_needed)
    rendezvous = leader_ports[1] if ports_needed == 2 else 0
    return Placement(
        shards=tuple(
            ShardPlacement(
                node=fit.node.name,
                rank=rank,
                gpu_indices=fit.gpu_indices,
                port=_free_ports(fit.node, port_range, 1)[0],
                rendezvous_port=rendezvous,
            )
            for rank, fit in enumerate(chosen)
        )
    )


# --- explaining -----------------------------------------------------------------------------------


def _unplaceable(
    cluster: ClusterView,
    profile: Profile,
    port_range: tuple[int, int],
    ports_needed: int,
    fitting: dict[str, int],
) -> Unplaceable:
    """Every node with its reason; ``fitting`` counts, per fabric, the nodes that fit alone."""
    reasons = []
    for node in cluster.nodes:
        if node.fabric in fitting and _fit(node, profile, port_range, ports_needed):
            reason = (
                f"fits, but fabric {node.fabric} has {_count(fitting[node.fabric], 'node')} that fit, "
                f"needs {profile.nodes}"
            )
        else:
            reason = _why_not(node, profile, port_range, ports_needed)
        reasons.append((node.name, reason))
    return Unplaceable(profile=profile.name, request=_request(profile), reasons=tuple(reasons))


def _why_not(node: NodeView, profile: Profile, port_range: tuple[int, int], ports_needed: int) -> str:
    """Why ``node`` cannot take one shard of ``profile``; only asked of a node that does not fit."""
    if not node.online:
        return "offline"
    if not node.connected:
        return "its agent is not connected (restarting?)"
    if profile.nodes > 1 and not node.fabric:
        return f"on no fabric (a single-node island), needs {profile.nodes} nodes on one"
    if profile.gpu_class is None:
        shortages = []
        if node.memory_free_mib < profile.memory_mib:
            shortages.append(f"{node.memory_free_mib:,} MiB free memory, needs {profile.memory_mib:,}")
        if node.cpu_cores_free < profile.cpu_cores:
            shortages.append(f"{_count(node.cpu_cores_free, 'free core')}, needs {profile.cpu_cores}")
        if shortages:
            return "; ".join(shortages)
    else:
        gpu_reason = _why_no_gpus(node, profile)
        if gpu_reason:
            return gpu_reason
    low, high = port_range
    free = (high - low + 1) - sum(1 for port in node.ports_in_use if low <= port <= high)
    if free <= 0:
        return f"no free port in {low}-{high}"
    return f"{_count(free, 'free port')} in {low}-{high}, needs {ports_needed}"


def _why_no_gpus(node: NodeView, profile: Profile) -> str:
    gpu_class, needed = profile.gpu_class, profile.gpus_per_node
    of_class = sorted((g for g in node.gpus if g.gpu_class == gpu_class), key=lambda g: g.index)
    if not of_class:
        return f"no {gpu_class} GPUs"
    unallocated = [g for g in of_class if not g.allocated]
    unusable = [g for g in unallocated if not g.healthy or g.memory_free_mib < profile.memory_mib]
    usable = len(unallocated) - len(unusable)
    if usable >= needed:
        return ""
    if len(unallocated) >= needed:
        # Enough cards that no replica holds: name the ones that let the request down.
        return "; ".join(_gpu_problem(g, profile.memory_mib) for g in unusable)
    return f"{usable} free {gpu_class}, needs {needed}"


def _gpu_problem(gpu: GpuView, memory_mib: int) -> str:
    if not gpu.healthy:
        texts = [_PROBLEM_TEXTS.get(p, f"reports {p}") for p in gpu.problems] or ["is marked unhealthy"]
        return f"GPU {gpu.index} " + " and ".join(texts)
    return f"GPU {gpu.index} has {gpu.memory_free_mib:,} MiB free, needs {memory_mib:,}"


def _request(profile: Profile) -> str:
    if profile.gpu_class is None:
        each = f"{profile.memory_mib:,} MiB and {_count(profile.cpu_cores, 'core')} on the CPU"
    else:
        each = f"{profile.gpus_per_node} × {profile.gpu_class} with {profile.memory_mib:,} MiB free each"
    if profile.nodes == 1:
        return f"{each} on one node"
    return f"{each} on each of {profile.nodes} nodes of one fabric"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# --- after deciding ---------------------------------------------------------------------------------


def apply(cluster: ClusterView, placement: Placement, profile: Profile) -> ClusterView:
    """The view once ``placement`` holds its GPUs, memory, cores and ports.

    A reconcile pass that places several replicas decides each against the view the previous ones
    left, so that two of them never get the same card.
    """
    shards = {shard.node: shard for shard in placement.shards}
    nodes = []
    for node in cluster.nodes:
        shard = shards.get(node.name)
        if shard is None:
            nodes.append(node)
            continue
        ports = {shard.port}
        if shard.rank == 0 and shard.rendezvous_port:
            ports.add(shard.rendezvous_port)
        changes: dict[str, object] = {"ports_in_use": node.ports_in_use | ports}
        if profile.gpu_class is None:
            changes["memory_free_mib"] = node.memory_free_mib - profile.memory_mib
            changes["cpu_cores_free"] = node.cpu_cores_free - profile.cpu_cores
        else:
            taken = set(shard.gpu_indices)
            changes["gpus"] = tuple(
                attrs.evolve(gpu, allocated=True, memory_free_mib=gpu.memory_free_mib - profile.memory_mib)
                if gpu.index in taken
                else gpu
                for gpu in node.gpus
            )
        nodes.append(attrs.evolve(node, **changes))
    return ClusterView(nodes=tuple(nodes))


def to_shard_specs(
    placement: Placement, profile: Profile, model: Model, replica_id: str, cluster: ClusterView
) -> tuple[ShardSpec, ...]:
    """What each node is told to run, rank 0 first; ``cluster`` is the view it was placed on."""
    nodes = {node.name: node for node in cluster.nodes}
    leader = nodes[placement.shards[0].node]
    specs = []
    for shard in placement.shards:
        node = nodes[shard.node]
        gpus = {gpu.index: gpu for gpu in node.gpus}
        specs.append(
            ShardSpec(
                shard_id=f"{replica_id}-s{shard.rank}",
                replica_id=replica_id,
                profile=profile.name,
                model=model.name,
                model_path=model.path,
                model_sha256=model.sha256,
                engine=profile.engine,
                engine_version=profile.engine_version,
                launcher=profile.launcher,
                gpus=tuple(
                    GpuRef(
                        index=i,
                        uuid=gpus[i].uuid,
                        gpu_class=gpus[i].gpu_class,
                        compute_capability=gpus[i].compute_capability,
                        memory_total_mib=gpus[i].memory_total_mib,
                    )
                    for i in shard.gpu_indices
                ),
                tensor_parallel=profile.tensor_parallel,
                pipeline_parallel=profile.pipeline_parallel,
                nodes=profile.nodes,
                rank=shard.rank,
                leader_address=leader.address,
                node_address=node.address,
                mgmt_interface=node.mgmt_interface,
                port=shard.port,
                rendezvous_port=shard.rendezvous_port,
                ctx_size=profile.ctx_size,
                parallel=profile.parallel,
                cpu_threads=profile.cpu_cores if profile.gpu_class is None else None,
                cpu_memory_mib=profile.memory_mib if profile.gpu_class is None else None,
                # What fit() found free on each card and apply() took: the engine stays within it.
                gpu_memory_mib=profile.memory_mib if profile.gpu_class is not None else None,
                dtype=profile.dtype,
                quantization=profile.quantization,
                extra_flags=profile.flags,
                # On demand, the engine starts with none: the gateway has them loaded as wanted.
                adapters=() if profile.max_loaded_adapters else profile.adapters,
                max_loaded_adapters=profile.max_loaded_adapters,
                max_lora_rank=profile.max_lora_rank,
                # One node's ranks talk over NVLink or PCIe; only a multi-node shard uses the fabric.
                fabric=node.rdma if profile.nodes > 1 else Fabric(),
            )
        )
    return tuple(specs)
