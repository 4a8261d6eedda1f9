"""What the agents report, into the records, before each pass: adoption and shard states.

**Adoption.** Records live in the server's memory. After a server restart they are rebuilt from
what the agents list when they register: a running shard whose spec names a profile still in the
catalog, serving that profile's model, becomes (part of) its replica again, with a fresh startup
timeout, and no engine is restarted. A shard that matches nothing is left to the pass, which stops
it as an orphan — and so is one of a replica this server has ended (stopped, reaped, scaled down):
its node was cut off while it was reaped, and adopting it would run one replica more than wanted.

**Following.** Each record's shards take the state their agents report. A shard a re-registering
agent no longer lists, though it was started under an earlier registration of that agent, is
Failed ("not running after the agent restarted"). A lost or disconnected node's shards keep their
last state: the pass reaps them.

**Ranks not heard from yet.** A multi-node replica is rebuilt rank by rank as its nodes register.
While it lists fewer ranks than its replica has nodes, its Ready and Loading shards count as
Starting, so that it is not Ready — and not routed to — until rank 0, the one that serves HTTP,
and every other rank have reported. A headless rank 1 that registers first would otherwise make
the replica Ready with no endpoint.

Pure: the shell passes its nodes as they are (anything with the attributes of
:class:`NodeReport`), the records, and which registration each shard was started under.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.replica import ENDED_SHARD_STATES, Replica, ReplicaShard, state_of_shards
from llmgw.core.reports import Compute, ShardState
from llmgw.core.shard import ShardSpec

frozen = attrs.frozen(kw_only=True)

ADOPTED_REASON = "adopted from a running engine"
GONE_AFTER_RESTART = "not running after the agent restarted"


class ShardReport(Protocol):
    spec: ShardSpec | None  # None for a shard only known from a status
    state: str
    reason: str
    compute: Compute | None


class NodeReport(Protocol):
    name: str
    connected: bool
    registrations: int  # since this server started
    shards: Mapping[str, ShardReport]  # by shard id, as the agent last listed them


@frozen
class Adoption:
    replica_id: str
    profile: str
    shard_id: str
    node: str
    state: str


@frozen
class Observed:
    records: dict[str, Replica]
    adopted: tuple[Adoption, ...] = ()  # shards taken back this time, for the log
    # The registration each adopted shard was found under: a later registration that does not
    # list it means its agent restarted without it.
    started_under: Mapping[str, int] = attrs.field(factory=dict)


def observe(
    records: Mapping[str, Replica],
    nodes: Iterable[NodeReport],
    profiles: Mapping[str, Profile],
    started_under: Mapping[str, int],
    now: float,
    ended: frozenset[str] | set[str] = frozenset(),
) -> Observed:
    """``ended``: the replicas this server has ended, whose shards are never adopted."""
    nodes = tuple(nodes)
    out = dict(records)
    adopted: list[Adoption] = []
    found_under: dict[str, int] = {}
    known = {shard.shard_id for record in out.values() for shard in record.shards}
    ranks: dict[str, int] = {}  # replica id → its node count, from any rank's spec
    for node in nodes:
        if not node.connected:
            continue
        for shard in node.shards.values():
            spec = shard.spec
            if spec is None:
                continue
            ranks[spec.replica_id] = spec.nodes
            if spec.shard_id in known or spec.replica_id in ended or shard.state in ENDED_SHARD_STATES:
                continue
            profile = profiles.get(spec.profile)
            if profile is None or profile.model != spec.model:
                continue  # an orphan: the pass stops it
            out[spec.replica_id] = _with_rank(out.get(spec.replica_id), node.name, spec, shard, now)
            known.add(spec.shard_id)
            found_under[spec.shard_id] = node.registrations
            adopted.append(
                Adoption(
                    replica_id=spec.replica_id,
                    profile=spec.profile,
                    shard_id=spec.shard_id,
                    node=node.name,
                    state=shard.state,
                )
            )
    by_name = {node.name: node for node in nodes}
    under = {**started_under, **found_under}
    for record in list(out.values()):
        shards = tuple(_followed(piece, by_name.get(piece.node), under) for piece in record.shards)
        shards = _held_back(shards, ranks.get(record.id))
        if shards != record.shards:
            out[record.id] = attrs.evolve(record, shards=shards)
    return Observed(records=out, adopted=tuple(adopted), started_under=found_under)


def _with_rank(record: Replica | None, node: str, spec: ShardSpec, shard: ShardReport, now: float) -> Replica:
    """The replica ``spec`` belongs to, rebuilt with this rank."""
    piece = ReplicaShard(
        node=node,
        shard_id=spec.shard_id,
        rank=spec.rank,
        gpu_indices=tuple(gpu.index for gpu in spec.gpus),
        port=spec.port,
        rendezvous_port=spec.rendezvous_port,
        state=shard.state,
        compute=shard.compute,
    )
    shards = tuple(sorted((*(record.shards if record else ()), piece), key=lambda s: s.rank))
    return Replica(
        id=spec.replica_id,
        profile=spec.profile,
        model=spec.model,
        state=state_of_shards(s.state for s in _held_back(shards, spec.nodes)),
        shards=shards,
        since=now,
        created=record.created if record else now,
        started=now,  # a full startup timeout from now, not from before the restart
        reason=ADOPTED_REASON,
    )


def _followed(piece: ReplicaShard, node: NodeReport | None, started_under: Mapping[str, int]) -> ReplicaShard:
    if node is None or not node.connected or piece.state in ENDED_SHARD_STATES:
        return piece  # a lost node's shards are the pass's to reap
    reported = node.shards.get(piece.shard_id)
    if reported is not None:
        return attrs.evolve(
            piece, state=reported.state, reason=reported.reason, compute=reported.compute or piece.compute
        )
    under = started_under.get(piece.shard_id)
    if under is not None and node.registrations > under:
        return attrs.evolve(piece, state=ShardState.FAILED, reason=GONE_AFTER_RESTART)
    return piece  # its start is on its way, or its first status is


def _held_back(shards: tuple[ReplicaShard, ...], nodes: int | None) -> tuple[ReplicaShard, ...]:
    """``shards``, with Ready and Loading counted as Starting while ranks are missing."""
    if nodes is None or len({s.rank for s in shards}) >= nodes:
        return shards
    return tuple(
        attrs.evolve(s, state=ShardState.STARTING) if s.state in (ShardState.READY, ShardState.LOADING) else s
        for s in shards
    )
