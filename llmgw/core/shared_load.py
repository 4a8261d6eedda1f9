"""The gateway load of every server sharing a store, for the leader's scaler.

Each server serves a gateway, but only the leader scales. Every server reports, with each look
at the leader lease (every lease/3), what its gateway has waiting for each model and how long
each model has been idle there; the leader adds the others' figures to its own: requests waiting
anywhere count, and a model is idle only as long as it has been idle at every gateway. A request
waiting at a follower for a model scaled to zero so starts a replica within about lease/3 plus
one pass. Figures from a server no longer live are not counted (the store lists live servers
only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from llmgw.core.scaling import LoadSignals


@attrs.frozen
class GatewayLoad:
    """One server's gateway, for one model."""

    queued: int = 0
    idle_for: float = 0.0


def encode(loads: Mapping[str, GatewayLoad]) -> dict:
    return {
        model: {"queued": load.queued, "idle_for": round(load.idle_for, 3)} for model, load in loads.items()
    }


def decode(data: object) -> dict[str, GatewayLoad]:
    """What another server reported; anything not of that shape counts as nothing."""
    if not isinstance(data, dict):
        return {}
    loads = {}
    for model, entry in data.items():
        if isinstance(model, str) and isinstance(entry, dict):
            queued, idle = entry.get("queued", 0), entry.get("idle_for", 0.0)
            if isinstance(queued, int) and isinstance(idle, int | float) and queued >= 0 and idle >= 0:
                loads[model] = GatewayLoad(queued=queued, idle_for=float(idle))
    return loads


def combine(own: LoadSignals, model: str, others: Iterable[Mapping[str, GatewayLoad]]) -> LoadSignals:
    """``own`` (this server's gateway and the engines' loads) with the other servers' gateways."""
    queued, idle = own.queue_depth, own.idle_for
    for loads in others:
        load = loads.get(model)
        if load is None:
            continue  # that gateway has never seen the model: idle there since ever
        queued += load.queued
        idle = min(idle, load.idle_for)
    return attrs.evolve(own, queue_depth=queued, idle_for=idle)
