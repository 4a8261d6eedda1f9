"""Replicas: one running copy of a profile, made of one shard per node.

The control plane keeps a record per replica; the agents report its shards. A record is what the
reconciler reads and writes (see :mod:`llmgw.core.reconcile`) and the shell stores. Its life:

    Pending             → Starting   placed; else it stays Pending with every node's reason
    Starting → Loading  → Ready      as its shards report (:func:`state_of_shards`)
    Starting … Ready    → Failed     a shard failed, or not Ready within the startup timeout
    Failed              → Starting   after the restart backoff, in place or moved; given up: stays
    Failed              → Pending    due to restart, but neither its own place nor another is free
    Starting … Failed   → Draining   scaled down, or its profile left the catalog
    Pending             → removed    scaled down, or its profile left the catalog
    Draining            → Stopped    its drain deadline passed
    any holding shards  → Stopped    its node was lost, a GPU turned unhealthy, it was preempted,
                                     or a shard stopped without being asked
    Draining, Stopped   → removed    once every shard is gone

:data:`LIFECYCLE` is that table as code: the reconciler moves a record only through it, so a move
not drawn above raises where it is made.

Every type here is frozen attrs over plain values, so cattrs stores them without hooks.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from llmgw.core.reports import Compute, ShardState
from llmgw.core.states import Lifecycle

frozen = attrs.frozen(kw_only=True)


class ReplicaState(enum.StrEnum):
    PENDING = "Pending"  # wanted, not placed: no node can take it (reason says why, per node)
    STARTING = "Starting"  # shards sent; some engine does not answer /health yet
    LOADING = "Loading"  # every engine answers, some have not loaded the model yet
    READY = "Ready"  # serving: the gateway routes to it
    DRAINING = "Draining"  # no new requests; stops once in-flight ones finish or its deadline passes
    STOPPED = "Stopped"  # told to stop; the record goes once its shards are gone
    FAILED = "Failed"  # a shard failed; restarts after a backoff, unless given up


_ENDING = (ReplicaState.DRAINING, ReplicaState.STOPPED)
LIFECYCLE = Lifecycle.of(
    "replica",
    ReplicaState,
    {
        ReplicaState.PENDING: {ReplicaState.STARTING},
        # Following its shards, a running replica may go back as well as forward: a shard whose
        # agent restarted reports Starting again before it is adopted as Ready.
        ReplicaState.STARTING: {ReplicaState.LOADING, ReplicaState.READY, ReplicaState.FAILED, *_ENDING},
        ReplicaState.LOADING: {ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED, *_ENDING},
        ReplicaState.READY: {ReplicaState.STARTING, ReplicaState.LOADING, ReplicaState.FAILED, *_ENDING},
        # Restarted (in place or moved), or back to Pending when no place is free for it.
        ReplicaState.FAILED: {ReplicaState.STARTING, ReplicaState.PENDING, *_ENDING},
        ReplicaState.DRAINING: {ReplicaState.STOPPED},
        ReplicaState.STOPPED: set(),
    },
)


# The states a replica counts towards its profile's wanted number in. Draining and Stopped ones
# are on their way out; a Failed one is restarted in place, and one given up still counts, so that
# a model that cannot load is not replaced in an endless loop of fresh replicas.
COUNTED = frozenset(
    {
        ReplicaState.PENDING,
        ReplicaState.STARTING,
        ReplicaState.LOADING,
        ReplicaState.READY,
        ReplicaState.FAILED,
    }
)
# Following the shards: what the agents say decides the state.
RUNNING = frozenset({ReplicaState.STARTING, ReplicaState.LOADING, ReplicaState.READY})
# A shard in one of these has no process left on its node.
ENDED_SHARD_STATES = frozenset({ShardState.STOPPED, ShardState.FAILED})


@frozen
class ReplicaShard:
    node: str
    shard_id: str
    rank: int
    gpu_indices: tuple[int, ...] = ()  # empty for a CPU shard
    port: int
    rendezvous_port: int = 0  # on every rank: where they meet on rank 0's node; 0 = none
    state: str = ShardState.STARTING  # as the agent reports it (a ShardState value)
    reason: str = ""  # the agent's, when it failed
    compute: Compute | None = None  # what it computes on, once the agent knows


@frozen
class Replica:
    id: str
    profile: str
    model: str
    state: ReplicaState  # changed only through LIFECYCLE
    shards: tuple[ReplicaShard, ...] = ()  # rank 0 first; empty while Pending or once given up
    since: float  # when it entered ``state``
    created: float
    # When its shards were last sent to start: the startup timeout counts from here. A replica
    # rebuilt from an agent's report after a server restart starts its count afresh.
    started: float | None = None
    failures: int = 0  # consecutive failed starts
    last_failure: float | None = None
    failed_nodes: tuple[str, ...] = ()  # nodes it failed on since it last proved itself, to move away
    # Why it is in its state, for people: every node's reason while Pending, the failure while
    # Failed, why it stops while Draining or Stopped.
    reason: str = ""
    drain_deadline: float | None = None  # Draining: when it is stopped whether or not requests remain


# From the most to the least decisive: one failed shard fails the replica, one that stopped stops
# it, and otherwise the replica is as far along as its slowest shard.
_PRECEDENCE = (
    ShardState.FAILED,
    ShardState.STOPPED,
    ShardState.DRAINING,
    ShardState.STARTING,
    ShardState.LOADING,
    ShardState.READY,
)
_AS_REPLICA_STATE = {
    ShardState.FAILED: ReplicaState.FAILED,
    ShardState.STOPPED: ReplicaState.STOPPED,
    ShardState.DRAINING: ReplicaState.DRAINING,
    ShardState.STARTING: ReplicaState.STARTING,
    ShardState.LOADING: ReplicaState.LOADING,
    ShardState.READY: ReplicaState.READY,
}


def state_of_shards(states: Iterable[str]) -> ReplicaState:
    """The state a replica's shards add up to: Ready only when every one of them is."""
    present = set(states)
    if not present:
        raise ValueError("a replica without shards has no state of its own (it is Pending)")
    unknown = present.difference(_PRECEDENCE)
    if unknown:
        raise ValueError(f"not shard states: {', '.join(sorted(unknown))}")
    return _AS_REPLICA_STATE[next(state for state in _PRECEDENCE if state in present)]
