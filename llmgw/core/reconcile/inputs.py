"""What a reconcile pass reads besides the catalog and the records: the shards agents report, and
its settings."""

from __future__ import annotations

import attrs

from llmgw.core.restart_policy import RestartPolicy

frozen = attrs.frozen(kw_only=True)


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
