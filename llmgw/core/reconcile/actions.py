"""What a reconcile pass asks the shell to do: one action per thing to carry out, each with its reason.

Every action carries what the shell needs to carry it out without looking anything up, and a
reason to log. Those that end shards list them in ``shards``: the ones still running on a
reachable node (a lost node's shards are gone as far as anyone can tell; if the node comes back,
its agent reports them and they are stopped as orphans).
"""

from __future__ import annotations

import attrs

from llmgw.core.placement import Placement
from llmgw.core.replica import Replica
from llmgw.core.shard import ShardSpec

frozen = attrs.frozen(kw_only=True)


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
