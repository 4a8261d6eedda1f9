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

The package, one stage per module as Nomad's scheduler splits its own: ``observe`` (the agents'
reports into the records, before a pass), ``inputs`` (what a pass reads), ``actions`` (what it
asks for, and the :class:`Plan`), ``holds`` (the ledger of what every owner holds while a pass
places), ``preemption`` (the search for the cheapest victims), and ``passes`` (the pass itself).

The view of the fleet (``cluster``) is the fleet as discovered, before any replica: online flags,
GPUs with their health and the memory that processes llmgw did not start leave, host memory and
cores offered to shards, ports taken by other programs. The reconciler takes out what its own
replicas hold (every shard of a live or restartable replica, and the still-running shards of one
that drains or stops) and what orphan shards hold. A view that already marks a replica's GPUs as
allocated does no harm; one that already subtracts a CPU shard's memory counts it twice.

What stops also frees nothing within its own pass: a stopping shard holds its GPUs until the agent
reports it gone, so that a replacement never starts on a card an engine still holds.

The shell's part, around each pass:

- Before each pass, bring the agents' reports into the records with :func:`observe.observe`
  (adoption after a server restart, shard states, shards a restarted agent lost). Between passes,
  a shard whose StopShard or DrainShard is answered (stopped, or not running) is Stopped, and one
  whose StartShard is refused is Failed, with the refusal as its reason.
- Pass every shard the agents list as ``reported``; build ``cluster`` as described above.
- Store ``Plan.replicas`` as the new set of records, then carry out the actions in order: StartShard
  per spec (with the replica's engine key) for starts and restarts; StopShard, or DrainShard for a
  drain, for each of an ending action's ``shards``; log every action's reason. StopOrphan repeats
  while the agent lists the shard: a stop already on its way need not be sent again. A command is
  not retried by a later pass: the link delivers it, or the node is lost and its shards with it.
- Make replica ids (``new_id``) that never repeat, e.g. random ones: an id names the engine key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from llmgw.core.catalog import Model, Profile
from llmgw.core.placement import ClusterView
from llmgw.core.reconcile.actions import (
    ENDING,
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
from llmgw.core.reconcile.inputs import ReconcileConfig, ReportedShard
from llmgw.core.reconcile.passes import Pass
from llmgw.core.reconcile.preemption import SEARCHES_PER_PASS as PREEMPTION_SEARCHES_PER_PASS
from llmgw.core.replica import Replica

__all__ = [
    "ENDING",
    "PREEMPTION_SEARCHES_PER_PASS",
    "Action",
    "DrainReplica",
    "Evict",
    "MarkFailed",
    "MarkPending",
    "Plan",
    "Preempt",
    "Reap",
    "ReconcileConfig",
    "ReportedShard",
    "RestartReplica",
    "ShardRef",
    "StartReplica",
    "StopOrphan",
    "StopReplica",
    "reconcile",
]


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
    return Pass(models, profiles, replicas, cluster, desired, now, config, new_id, reported, awaiting).run()
