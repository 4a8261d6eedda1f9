"""The gateway's router over the control plane: a model's Ready replicas, as routing candidates.

A model is served when some catalog profile serves it; its replicas that are Ready, at rank 0's
node address and port, are where its requests may go. This module only gathers them — each
with its engine key, its slots and its engine's last scraped load — into a :class:`Routes`; the
order a request tries them in is the gate's to ask of :func:`llmgw.core.routing.decide`, since
the gate holds the in-flight count per replica that the choice depends on.

An adapter a profile lists is served under its own name (``models`` lists it, ``parent`` names
its base): its requests share the base model's routes and queue, and go only to the replicas
whose profile lists it, each :class:`Route` holding the upstream to send them to (with the
members that select the adapter in the body, for an engine that selects per request).

A model's routes are built once and kept until :meth:`ReplicaRouter.refresh` (after each
reconcile pass and each scrape round): a request reads them, it does not rebuild them (the
engine key alone is an HMAC).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence

import attrs

from llmgw.core.catalog import Profile
from llmgw.core.engines import registry
from llmgw.core.replica import ReplicaState
from llmgw.core.routing import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_PREFIX_CHARS
from llmgw.core.scaling import EngineLoad
from llmgw.gateway.contract import Upstream
from llmgw.server.catalog import Catalog
from llmgw.server.nodes import NodeRegistry
from llmgw.server.replicas import ReplicaManager

log = logging.getLogger(__name__)

# Requests one replica serves at once when its profile sets no `parallel`.
DEFAULT_SLOTS = 4


@attrs.frozen
class Route:
    """One Ready replica of a model: where it is, and what the choice needs to know of it."""

    replica: str
    upstream: Upstream
    slots: int
    load: EngineLoad | None  # as last scraped; None when unknown
    # The adapters it serves, by name, each with the upstream its requests go to.
    adapters: Mapping[str, Upstream] = attrs.field(factory=dict)


def adapter_upstreams(
    engine: str, names: Sequence[str], upstream: Upstream
) -> tuple[Upstream, dict[str, Upstream]]:
    """The upstream for the base model's requests, and per adapter of ``names`` (in the order the
    engine was started with them) the one that selects it: for an engine selecting per request,
    each sets the members that do (the base model's too, which deselect every adapter)."""
    select = registry.ENGINES[engine].select_adapter if engine in registry.ENGINES else None
    if select is None or not names:
        return upstream, dict.fromkeys(names, upstream)

    def selecting(name: str | None) -> Upstream:
        members = json.dumps(select(names, name), separators=(",", ":")).encode()
        return attrs.evolve(upstream, body_members=members)

    return selecting(None), {name: selecting(name) for name in names}


@attrs.frozen
class Routes:
    """A served model's Ready replicas, and how its profile wants them chosen."""

    policy: str = DEFAULT_POLICY
    load_factor: float = DEFAULT_LOAD_FACTOR
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    replicas: tuple[Route, ...] = ()
    # Its adapters are loaded on demand (max_loaded_adapters): each route's adapters are those
    # its engine holds now, and a request for another asks the gate's adapter loader first.
    loads_adapters: bool = False


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
        # For an on-demand profile's replica, the adapters its engine holds now (AdapterLoads).
        self.held: Callable[[str], Sequence[str]] | None = None
        self._routes: dict[str, Routes | None] = {}
        self._models: list[str] | None = None
        self._parents: dict[str, str] = {}  # adapter name -> its base model
        self._mixed: set[str] = set()  # models whose profiles disagree on routing (warned once)

    def refresh(self) -> None:
        """The replicas, the catalog or the engines' loads changed: build routes anew."""
        self._routes.clear()
        self._models = None

    def models(self) -> Sequence[str]:
        """The served models, and every adapter of theirs, by name."""
        if self._models is None:
            profiles = self._catalog.profiles().values()
            self._parents = {a.name: p.model for p in profiles for a in p.adapters}
            self._models = sorted({profile.model for profile in profiles} | set(self._parents))
        return self._models

    def parent(self, name: str) -> str | None:
        """The base model of adapter ``name``; None when it is no adapter."""
        self.models()
        return self._parents.get(name)

    def routes(self, model: str) -> Routes | None:
        """The model's Ready replicas; None when no profile serves it (a 404, not a wait)."""
        try:
            return self._routes[model]
        except KeyError:
            routes = self._routes[model] = self._build(model)
            return routes

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        """The Router protocol, for a relay without a gate: the Ready replicas as listed."""
        routes = self.routes(model)
        return None if routes is None else [route.upstream for route in routes.replicas]

    def _build(self, model: str) -> Routes | None:
        profiles = self._catalog.profiles()
        serving = sorted((p for p in profiles.values() if p.model == model), key=lambda p: p.name)
        if not serving:
            return None
        routes = []
        for record in self._replicas.list():
            if record.model != model or record.state != ReplicaState.READY or not record.shards:
                continue
            leader = record.shards[0]
            node = self._registry.get(leader.node)
            if node is None:
                continue
            # A node whose agent is reconnecting still serves: its engines never stopped.
            host = node.inventory.reached_at
            key = self._replicas.key_of(record.id) or ""
            profile = profiles.get(record.profile)
            slots = (profile.parallel if profile is not None else None) or DEFAULT_SLOTS
            load = self._load(record.id) if self._load is not None else None
            upstream = Upstream(host=host, port=leader.port, engine_key=key, replica=record.id)
            names = [a.name for a in profile.adapters] if profile is not None else []
            if profile is not None and profile.max_loaded_adapters:
                names = list(self.held(record.id)) if self.held is not None else []
            adapters: dict[str, Upstream] = {}
            if profile is not None:
                upstream, adapters = adapter_upstreams(profile.engine, names, upstream)
            routes.append(
                Route(replica=record.id, upstream=upstream, slots=slots, load=load, adapters=adapters)
            )
        first = serving[0]
        self._warn_if_mixed(model, serving)
        return Routes(
            policy=first.routing,
            load_factor=first.routing_load_factor,
            prefix_chars=first.routing_prefix_chars,
            replicas=tuple(routes),
            loads_adapters=any(p.max_loaded_adapters for p in serving),
        )

    def _warn_if_mixed(self, model: str, serving: list[Profile]) -> None:
        # One model, one policy: its requests share one queue and one set of replicas.
        settings = {(p.routing, p.routing_load_factor, p.routing_prefix_chars) for p in serving}
        if len(settings) > 1 and model not in self._mixed:
            self._mixed.add(model)
            log.warning(
                "profiles of model %s disagree on routing; %s's (%s) applies to all of them",
                model,
                serving[0].name,
                serving[0].routing,
            )
        elif len(settings) == 1:
            self._mixed.discard(model)


@attrs.frozen
class FixedRoutes:
    """A fixed table of models to upstreams, each a replica with ``slots``: the gate's routes for
    tests and benchmarks that have engines but no replica records."""

    table: Mapping[str, Sequence[Upstream]]
    slots: int = DEFAULT_SLOTS
    policy: str = DEFAULT_POLICY
    _built: dict[str, Routes | None] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def parent(self, name: str) -> str | None:
        return None

    def routes(self, model: str) -> Routes | None:
        # Built once per model, as ReplicaRouter keeps its own: a request only reads them.
        if model not in self._built:
            self._built[model] = self._build(model)
        return self._built[model]

    def _build(self, model: str) -> Routes | None:
        upstreams = self.table.get(model)
        if upstreams is None:
            return None
        return Routes(
            policy=self.policy,
            replicas=tuple(
                Route(replica=u.replica or f"{u.host}:{u.port}", upstream=u, slots=self.slots, load=None)
                for u in upstreams
            ),
        )
