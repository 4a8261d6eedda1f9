"""Adapters loaded on demand, carried out: the server loads and unloads them on the engines.

For a profile with ``max_loaded_adapters``, its engines start with no adapter and the gateway
asks this module (:meth:`AdapterLoads.need`) when a request names an adapter that no replica
with room holds. What to do is :mod:`llmgw.core.adapter_residency`'s to decide; this shell does
it: ``POST`` the engine's unload (the victim's) and load endpoints (its descriptor's
:class:`~llmgw.core.engines.descriptor.RuntimeAdapters`), with the replica's engine key, and
reports back. Every gateway — this process's, or each worker's by the server — asks here, so
one place decides for every replica and a cold adapter is loaded once however many ask.

Why the server and not each agent: only the server sees every replica and every gateway's
requests, which the choice of replica, single flight and a victim with no request in flight
all need; it already reaches each engine (its scrapes) with its key.

What a replica holds is learned from its engine (``GET /v1/models``) when it is first seen Ready
— after a server restart too — and only then does it take loads: nothing is loaded twice
because the server forgot.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

from llmgw.core.adapter_residency import Await, Load, NoRoom, Queue, ReplicaView, Residency, Use
from llmgw.core.catalog import AdapterUnavailable, Profile, StoredAdapter, served_files
from llmgw.core.engines import registry
from llmgw.core.replica import ReplicaState
from llmgw.core.training import lora_rank
from llmgw.gateway import GatewayError, Upstream
from llmgw.http_probe import ProbeFailed, http_get, http_post
from llmgw.server.adapters import AdapterDelivery, DeliveryFailed, delivery_timeout
from llmgw.server.catalog import Catalog
from llmgw.server.nodes import NodeRegistry
from llmgw.server.replicas import ReplicaManager

log = logging.getLogger(__name__)

# How long a request waits for its adapter to be loaded (or for an adapter slot to free) before
# it is answered 503: a vLLM load reads the files and copies them to the GPU in seconds.
LOAD_TIMEOUT = 60.0
# One engine call (a load, an unload, its model list).
ENGINE_TIMEOUT = 30.0
# While every slot holds an adapter in use, a waiter looks again this often at the latest, as
# well as whenever a request ends.
RECHECK_INTERVAL = 0.5


class _Flight:
    """One load under way; the requests awaiting it read ``error`` once ``done`` is set."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = None


class AdapterLoads:
    def __init__(
        self,
        catalog: Catalog,
        replicas: ReplicaManager,
        nodes: NodeRegistry,
        *,
        in_flight: Callable[[], Mapping[tuple[str, str], int]],
        waiting: Callable[[], Mapping[str, int]],
        replica_in_flight: Callable[[str], Mapping[str, int]],
        on_change: Callable[[], None],
        quiesce: Callable[[str, str], Awaitable[bool]] | None = None,
        load_timeout: float = LOAD_TIMEOUT,
    ) -> None:
        self._catalog = catalog
        self._replicas = replicas
        self._nodes = nodes
        self._in_flight = in_flight  # requests in flight per (replica, adapter), every gateway's
        self._waiting = waiting  # requests naming an adapter waiting in a lane, per adapter
        # Gateway workers: returns once every worker has taken the routes without (replica,
        # adapter) and has no request on it (False: not in time). None: this process's gate,
        # which reads the routes it is given at once.
        self.quiesce = quiesce
        # Stored adapters (a profile's `source`): their files reach the node before a load.
        self.delivery: AdapterDelivery | None = None
        self.stored_adapters: Callable[[], Mapping[str, StoredAdapter]] = dict
        # A stored adapter's adapter_config.json, read from the server's copy (blocking).
        self.adapter_config: Callable[[str], str] | None = None
        self._replica_in_flight = replica_in_flight  # model -> per replica
        self._on_change = on_change  # what replicas hold changed: routes again
        self._load_timeout = load_timeout
        self.residency = Residency()
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._learning: set[str] = set()
        self._wake = trio.Event()
        # Loads run here, not in the task of the request that started one: the others awaiting
        # it are not failed by that one's client going away.
        self._nursery: trio.Nursery | None = None
        self.loads = 0  # loads done, for tests and logs
        self.unloads = 0

    # --- what the router reads ---------------------------------------------------------------------

    def on_demand(self, profile_name: str) -> Profile | None:
        profile = self._catalog.profiles().get(profile_name)
        return profile if profile is not None and profile.max_loaded_adapters else None

    def held(self, replica: str) -> list[str]:
        return self.residency.held(replica)

    # --- keeping up with the replicas ----------------------------------------------------------------

    def sync(self) -> None:
        """The replicas changed (a reconcile pass, a scrape round): follow them, and start
        learning what each new one holds. Synchronous: the residency is right before the
        routes are built again."""
        capacities = {}
        for record in self._replicas.list():
            if record.state != ReplicaState.READY:
                continue
            profile = self.on_demand(record.profile)
            if profile is not None:
                capacities[record.id] = profile.max_loaded_adapters
        if not capacities and not self.residency.replicas():
            return  # no profile loads adapters on demand: nothing to follow
        for replica in self.residency.sync(capacities):
            if replica not in self._learning and self._nursery is not None:
                self._learning.add(replica)
                self._nursery.start_soon(self._learn, replica)

    def attach(self, nursery: trio.Nursery) -> None:
        """The server's nursery, which holds the learning and the loads (see _fly)."""
        self._nursery = nursery
        self.sync()  # replicas known before it was given one

    async def _learn(self, replica: str) -> None:
        """What the engine holds: its model list, asked until it answers (it is Ready)."""
        try:
            while True:
                found = self._engine(replica)
                if found is None:
                    return  # gone
                upstream, profile = found
                api = registry.ENGINES[profile.engine].runtime_adapters
                try:
                    status, body = await http_get(
                        upstream.host,
                        upstream.port,
                        api.list_path,
                        headers=_auth(upstream),
                        timeout=ENGINE_TIMEOUT,
                    )
                    if status == 200:
                        held = api.held(json.loads(body), profile.model)
                        self.residency.relearn(replica, held, trio.current_time())
                        log.info("replica %s holds adapters: %s", replica, ", ".join(held) or "none")
                        self._changed()
                        return
                    log.warning("replica %s: %s answered %d", replica, api.list_path, status)
                except (ProbeFailed, ValueError) as e:
                    log.warning("replica %s: cannot read its adapters: %s", replica, e)
                await trio.sleep(1.0)
        finally:
            self._learning.discard(replica)

    def request_ended(self) -> None:
        """A request ended: an adapter may be idle now, or a replica have room."""
        self._wake.set()
        self._wake = trio.Event()

    # --- a gateway's question ----------------------------------------------------------------------

    async def need(self, model: str, adapter: str) -> None:
        """Returns once a request for ``adapter`` of ``model`` may go into its lane: a replica
        holds it (or every holder is busy and none other can take it: it waits there). Raises
        GatewayError: 502 with the engine's reason when the load failed, 503 after the timeout."""
        try:
            with trio.fail_after(self._load_timeout):
                await self._need(model, adapter)
        except trio.TooSlowError:
            raise GatewayError(
                503,
                f"Adapter '{adapter}' could not be loaded within {self._load_timeout:g} s",
                code="adapter_load_timeout",
            ) from None

    async def _need(self, model: str, adapter: str) -> None:
        while True:
            answer = self.residency.want(
                adapter, self._views(model, adapter), self._busy(), trio.current_time()
            )
            if isinstance(answer, Use | Queue):
                return
            if isinstance(answer, Await):
                flight = self._flights[(answer.replica, adapter)]
                await flight.done.wait()
                if flight.error is not None:
                    raise GatewayError(502, flight.error, code="adapter_load_failed")
                continue
            if isinstance(answer, Load):
                flight = self._flights[(answer.replica, adapter)] = _Flight()
                if answer.evict is not None:
                    # The victim is no longer resident: the routes must stop offering it before
                    # this task yields. Else a fresh request for it, sent there meanwhile by
                    # routes that still list it, would have it unloaded from under it.
                    self._changed()
                if self._nursery is not None:
                    self._nursery.start_soon(self._fly, answer, adapter, flight)
                    await flight.done.wait()
                else:
                    await self._fly(answer, adapter, flight)
                if flight.error is not None:
                    raise GatewayError(502, flight.error, code="adapter_load_failed")
                continue
            assert isinstance(answer, NoRoom)
            with trio.move_on_after(RECHECK_INTERVAL):
                await self._wake.wait()

    def _busy(self) -> dict[tuple[str, str], int]:
        """Requests per (replica, adapter) that keep an adapter loaded: those in flight, and
        those waiting for a replica that holds theirs (counted against every holder)."""
        busy = dict(self._in_flight())
        for adapter, n in self._waiting().items():
            for holder in self.residency.holders(adapter):
                busy[(holder, adapter)] = busy.get((holder, adapter), 0) + n
        return busy

    def _views(self, model: str, adapter: str) -> list[ReplicaView]:
        in_flight = self._replica_in_flight(model)
        views = []
        for record in self._replicas.list():
            profile = self.on_demand(record.profile)
            if record.model != model or profile is None or record.state != ReplicaState.READY:
                continue
            if adapter not in {a.name for a in profile.adapters}:
                continue
            slots = profile.parallel or 4
            n = in_flight.get(record.id, 0)
            views.append(ReplicaView(id=record.id, load=n / slots, has_room=n < slots))
        return views

    async def _fly(self, load: Load, adapter: str, flight: _Flight) -> None:
        try:
            flight.error = await self._carry_out(load, adapter)
        except BaseException:
            # Cancelled (the server stops): what the engine did is learned again at the next start.
            flight.error = f"adapter {adapter}: its load on replica {load.replica} was cancelled"
            self.residency.load_failed(load.replica, adapter)
            if load.evict is not None:
                self.residency.unloaded(load.replica, load.evict)
            raise
        finally:
            del self._flights[(load.replica, adapter)]
            flight.done.set()
            self._changed()

    async def _carry_out(self, load: Load, adapter: str) -> str | None:
        """The unload of the victim, then the load; None when done, else why not."""
        found = self._engine(load.replica)
        if found is None:
            self.residency.load_failed(load.replica, adapter)
            if load.evict is not None:
                self.residency.unloaded(load.replica, load.evict)
            return f"replica {load.replica} went before adapter {adapter} could be loaded on it"
        upstream, profile = found
        api = registry.ENGINES[profile.engine].runtime_adapters
        if load.evict is not None:
            # The victim left the routes when the load was decided (see _need): no request goes
            # to it, once every gateway has the routes that say so.
            if self.quiesce is not None and not await self.quiesce(load.replica, load.evict):
                self.residency.unload_failed(load.replica, load.evict, trio.current_time())
                self.residency.load_failed(load.replica, adapter)
                return (
                    f"adapter {adapter}: {load.evict} on replica {load.replica} was still in use by a "
                    "gateway worker when it was to make room"
                )
            problem = await self._post(upstream, api.unload_path, api.unload_body(load.evict))
            if problem is not None:
                self.residency.unload_failed(load.replica, load.evict, trio.current_time())
                self.residency.load_failed(load.replica, adapter)
                return (
                    f"adapter {adapter}: unloading {load.evict} from replica {load.replica} failed: {problem}"
                )
            self.residency.unloaded(load.replica, load.evict)
            self.unloads += 1
            log.info("replica %s: unloaded adapter %s (least recently used)", load.replica, load.evict)
        try:
            path = await self._path_on_node(record_node(self._replicas, load.replica), profile, adapter)
        except (AdapterUnavailable, DeliveryFailed) as e:
            self.residency.load_failed(load.replica, adapter)
            return f"adapter {adapter}: {e}"
        problem = await self._post(upstream, api.load_path, api.load_body(adapter, path))
        if problem is not None:
            self.residency.load_failed(load.replica, adapter)
            log.warning("replica %s: loading adapter %s failed: %s", load.replica, adapter, problem)
            return f"adapter {adapter}: the engine of replica {load.replica} did not load it: {problem}"
        self.residency.loaded(load.replica, adapter, trio.current_time())
        self.loads += 1
        log.info("replica %s: loaded adapter %s", load.replica, adapter)
        return None

    async def _path_on_node(self, node: str, profile: Profile, name: str) -> str:
        """Where the engine finds adapter ``name``'s files on ``node``: the profile's path, or
        for a stored adapter the node's copy, delivered first (the path a shard started with
        it takes); raises AdapterUnavailable or DeliveryFailed."""
        adapter = next((a for a in profile.adapters if a.name == name), None)
        if adapter is None:
            raise AdapterUnavailable(f"profile {profile.name} lists no adapter {name}")
        if not adapter.source:
            return adapter.path
        if self.delivery is None:
            raise DeliveryFailed(f"stored adapter {adapter.source}: this server delivers no adapters")
        stored = self.stored_adapters()
        files = served_files(profile.engine, profile.model, stored.get(adapter.source), adapter.source)
        try:
            with trio.fail_after(delivery_timeout(files)):
                directory = await self.delivery.ensure(node, adapter.source, files)
        except trio.TooSlowError:
            raise DeliveryFailed(
                f"stored adapter {adapter.source}: delivery to {node} took over {delivery_timeout(files):.0f} s"
            ) from None
        if not directory:
            raise DeliveryFailed(f"node {node}'s agent does not say where its copy of {adapter.source} is")
        return registry.ENGINES[profile.engine].adapter_path(directory, files)

    async def rank(self, profile_name: str) -> int | None:
        """The highest LoRA rank among the stored adapters of ``profile_name``, from their
        adapter_config.json as the server keeps it (the engine is started with room for it);
        None when none says (adapters with a path on the nodes are not read from here)."""
        profile = self.on_demand(profile_name)
        if profile is None or self.adapter_config is None:
            return None
        ranks = []
        for adapter in profile.adapters:
            if not adapter.source:
                continue
            try:
                text = await trio.to_thread.run_sync(self.adapter_config, adapter.source)
                ranks.append(lora_rank(json.loads(text)))
            except Exception as e:  # the store's NotFound too: the rank is then the default
                log.warning(
                    "profile %s: cannot read the rank of stored adapter %s: %s",
                    profile_name,
                    adapter.source,
                    e,
                )
        found = [r for r in ranks if r is not None]
        return max(found) if found else None

    async def _post(self, upstream: Upstream, path: str, body: dict) -> str | None:
        try:
            status, text = await http_post(
                upstream.host,
                upstream.port,
                path,
                json.dumps(body).encode(),
                headers=_auth(upstream),
                timeout=ENGINE_TIMEOUT,
            )
        except ProbeFailed as e:
            return str(e)
        if status != 200:
            return f"{status} {text.decode(errors='replace')[:500]}"
        return None

    def _engine(self, replica: str) -> tuple[Upstream, Profile] | None:
        record = self._replicas.get(replica)
        if record is None or not record.shards:
            return None
        profile = self.on_demand(record.profile)
        node = self._nodes.get(record.shards[0].node)
        if profile is None or node is None:
            return None
        host = node.inventory.reached_at
        key = self._replicas.key_of(record.id) or ""
        return Upstream(host=host, port=record.shards[0].port, engine_key=key, replica=record.id), profile

    def _changed(self) -> None:
        self._on_change()
        self.request_ended()


def record_node(replicas: ReplicaManager, replica: str) -> str:
    record = replicas.get(replica)
    return record.shards[0].node if record is not None and record.shards else ""


def _auth(upstream: Upstream) -> dict[str, str]:
    return {"Authorization": f"Bearer {upstream.engine_key}"} if upstream.engine_key else {}
