"""The gateway's router over the control plane: a model's Ready replicas, with their engine keys.

A model is served when some catalog profile serves it; its upstreams are its replicas that are
Ready, at rank 0's node address and port. The list is rotated on every call, so that requests
spread over replicas (the relay tries the first, and the second only if the first refuses the
connection). Saturation-aware choice comes with the engines' metrics.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from llmgw.core.replica import ReplicaState
from llmgw.core.scaling import EngineLoad
from llmgw.gateway.router import Upstream
from llmgw.server.catalog import Catalog
from llmgw.server.nodes import NodeRegistry
from llmgw.server.replicas import ReplicaManager

# Requests one replica serves at once when its profile sets no `parallel`.
DEFAULT_SLOTS = 4
# An engine whose KV cache is this full takes no more than it already holds, whatever its slots.
SATURATED = 0.95


class ReplicaRouter:
    def __init__(
        self,
        catalog: Catalog,
        replicas: ReplicaManager,
        registry: NodeRegistry,
        load: Callable[[str], EngineLoad | None] | None = None,
    ) -> None:
        self._catalog = catalog
        self._replicas = replicas
        self._registry = registry
        self._load = load  # a replica's engine load as last scraped, None when unknown
        self._turn = itertools.count()

    def models(self) -> Sequence[str]:
        return sorted({profile.model for profile in self._catalog.profiles().values()})

    def capacity(self, model: str) -> int:
        """Requests the model's Ready replicas serve at once (the admission queue's room): each
        its profile's `parallel`, unless its engine says it is full — requests waiting inside it,
        or its KV cache nearly full — and then no more than it is running."""
        profiles = self._catalog.profiles()
        total = 0
        for record in self._replicas.list():
            if record.model != model or record.state != ReplicaState.READY:
                continue
            profile = profiles.get(record.profile)
            slots = (profile.parallel if profile is not None else None) or DEFAULT_SLOTS
            load = self._load(record.id) if self._load is not None else None
            if load is not None and (load.waiting > 0 or load.saturation >= SATURATED):
                slots = min(slots, load.running)
            total += slots
        return total

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        if model not in self.models():
            return None
        upstreams = []
        for record in self._replicas.list():
            if record.model != model or record.state != ReplicaState.READY or not record.shards:
                continue
            leader = record.shards[0]
            node = self._registry.get(leader.node)
            if node is None:
                continue
            # A node whose agent is reconnecting still serves: its engines never stopped.
            host = node.inventory.mgmt_address or "127.0.0.1"
            key = self._replicas.key_of(record.id) or ""
            upstreams.append(Upstream(host=host, port=leader.port, engine_key=key))
        if len(upstreams) > 1:
            turn = next(self._turn) % len(upstreams)
            upstreams = upstreams[turn:] + upstreams[:turn]
        return upstreams
