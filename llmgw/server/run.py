"""`llmgw server`: one nursery holding the store, the agent link listener and the admin API.

The tenants (API keys) and the usage recorder are made here too, as local ``tenants`` and
``usage``: the gateway starts in this same nursery and takes them as arguments. The recorder runs
in the nursery, so its last batch is written before the store closes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import secrets
import socket
import ssl
import time
from pathlib import Path

import attrs
import trio

from llmgw.config import ServerConfig
from llmgw.core import keys, shared_load
from llmgw.core.catalog import Profile, StoredAdapter
from llmgw.core.liveness import Liveness
from llmgw.core.quota import Limits
from llmgw.core.reconcile import ReconcileConfig
from llmgw.core.replica import Replica, ReplicaState
from llmgw.core.restart_policy import RestartPolicy
from llmgw.core.scaling import LoadSignals
from llmgw.core.server_shares import share_of
from llmgw.core.shared_load import GatewayLoad
from llmgw.gateway import serve_gateway
from llmgw.gateway.metrics import GatewayMetrics, traffic_totals
from llmgw.server import tokens
from llmgw.server.adapter_loads import AdapterLoads
from llmgw.server.adapters import AdapterDelivery
from llmgw.server.api import serve_admin
from llmgw.server.catalog import Catalog
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.jobs import JobManager
from llmgw.server.journal import JournalShipper
from llmgw.server.leadership import Leadership
from llmgw.server.link import LinkListener
from llmgw.server.nodes import NodeRegistry
from llmgw.server.replicas import ReplicaManager
from llmgw.server.routing import ReplicaRouter
from llmgw.server.scrape import EngineScraper
from llmgw.server.store import Store, StoreError, open_store, read_password
from llmgw.server.tenants import Tenants
from llmgw.server.usage_book import UsageRecorder
from llmgw.server.workers import WorkerPool, keys_message, routes_message

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"
WORKERS_DIR = "workers"  # the gateway workers' specs, sockets, state files and journals


@attrs.frozen
class Endpoints:
    """Where a running server listens (ports resolved, so port 0 in the config is usable)."""

    link: str
    admin: str
    gateway: str


def raise_open_files_limit() -> int:
    """The soft limit of open files raised to the hard one (as Go's runtime does for every
    program): the listeners' connection caps come from it, and a soft 1024 (systemd's default)
    would cap the agents' links and the gateway's clients at a few hundred. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, exc)
    return soft


async def run_server(config: ServerConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    raise_open_files_limit()
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = await open_store(config.data_dir, config.store, read_password(config.store_password_file))
    # A store only this server opens (SQLite in its data_dir) makes it the leader at once.
    shared = config.store is not None
    # The lease holder is this process, not just this server: a restarted server (or a second
    # process on the same data_dir by mistake) never takes over the lease its predecessor holds.
    server_id = _server_id(config.data_dir)
    leadership = Leadership(
        store, lease=config.ha.lease, exclusive=not shared, server_id=f"{server_id}.{secrets.token_hex(2)}"
    )
    try:
        join_digest = await _token_digest(store, "join_token_sha256", config.join_token_path)
        admin_digest = await _token_digest(store, "admin_token_sha256", config.admin_token_path)
        engine_secret = await store.ensure_secret(keys.SECRET_NAME, keys.new_secret, time.time())
        registry = NodeRegistry(
            store, Liveness(interval=config.link.heartbeat_interval, missed=config.link.missed_heartbeats)
        )
        await registry.load()
        catalog = await Catalog.load(store, config.models, config.profiles)
        log.info(
            "catalog: %d models, %d profiles (%d entries declared in server.yaml)",
            len(catalog.models()),
            len(catalog.profiles()),
            len(config.models) + len(config.profiles),
        )
        # Training jobs: loaded after the nodes, since a job whose node is gone fails at once.
        jobs = JobManager(store, registry, catalog, config.data_dir)
        await jobs.load(shared=shared)
        if shared:
            # Training jobs stay with one server for now (docs/ha.md): with several, a job's
            # reports and upload would need to follow the lease from server to server.
            jobs.refuse_new = (
                "training jobs need a server of its own store (not one shared by several servers)"
            )
            registry.watchers.remove(jobs)

        def stored_adapters() -> dict[str, StoredAdapter]:
            return {
                a.name: StoredAdapter(name=a.name, model=a.model, files=a.files) for a in jobs.list_adapters()
            }

        # Profiles may name the adapters jobs made; a node gets one's files before serving it.
        catalog.stored_adapters = stored_adapters
        catalog.warn_about_unservable_adapters()
        delivery = AdapterDelivery(registry.session, lambda name, file: jobs.adapter_file(name, file)[0])
        listener = LinkListener(
            registry,
            join_digest,
            handshake_timeout=config.link.handshake_timeout,
            ssl_context=_server_ssl_context(config),
            jobs=None if shared else jobs,
            leadership=leadership,
        )
        tenants = await Tenants.load(store)

        def quota_share(limits: Limits) -> Limits:
            return share_of(limits, leadership.share)

        # New shares reach the workers as new limits would (their keys are pushed anew).
        leadership.on_share = tenants.changes.bump
        usage = UsageRecorder(store)
        # The gateway's router and gate read the replicas; after each reconcile pass (a replica
        # became Ready, or went) and each scrape round (the engines' loads) the router builds
        # its routes anew and the gate lets through the waiters that now have room. The
        # replicas scale on the load the gate and the scraper see (made just below).
        gate: ControlPlaneGate | None = None
        pool: WorkerPool | None = None
        front: WorkerPool | ControlPlaneGate | None = None
        scraper: EngineScraper | None = None
        router: ReplicaRouter | None = None

        loads: AdapterLoads | None = None

        def routes_changed() -> None:
            if loads is not None:
                loads.sync()
            if router is not None:
                router.refresh()
            if pool is not None:
                pool.routes_changed.bump()
            elif gate is not None:
                gate.redispatch()

        def routes_changed_only() -> None:
            # What a replica holds changed (not the replicas): the routes again, no resync.
            if router is not None:
                router.refresh()
            if pool is not None:
                pool.routes_changed.bump()
            elif gate is not None:
                gate.redispatch()

        def load_of(profile: Profile, records: list[Replica]) -> LoadSignals:
            queued = sum((front.queue_depths().get(profile.model) or {}).values()) if front else 0
            loads = [scraper.load(r.id) for r in records if r.state == ReplicaState.READY] if scraper else []
            own = LoadSignals(
                queue_depth=queued,
                replicas=tuple(load for load in loads if load is not None),
                idle_for=front.idle_for(profile.model) if front else 0.0,
            )
            # The other servers' gateways too (none on a store of this server's own).
            return shared_load.combine(own, profile.model, leadership.others_load)

        def gateway_load() -> dict[str, GatewayLoad]:
            if front is None:
                return {}
            depths = front.queue_depths()
            return {
                model: GatewayLoad(
                    queued=sum((depths.get(model) or {}).values()), idle_for=front.idle_for(model)
                )
                for model in catalog.models()
            }

        leadership.gateway_load = gateway_load

        replicas = ReplicaManager(
            registry,
            catalog,
            engine_secret,
            reconcile_config(config),
            on_pass=routes_changed,
            signals=load_of,
            stored_adapters=stored_adapters,
            delivery=delivery,
            leadership=leadership,
        )
        router = ReplicaRouter(
            catalog, replicas, registry, load=lambda rid: scraper.load(rid) if scraper else None
        )
        gate = ControlPlaneGate(
            tenants,
            router,
            usage,
            queue_timeout=config.gateway.queue_timeout,
            on_waiting=lambda _model: replicas.kick(),
            share=quota_share,
        )
        # Adapters loaded on demand: decided and carried out here, for every gateway.
        loads = AdapterLoads(
            catalog,
            replicas,
            registry,
            # With workers, theirs as they last reported them; else this process's gate's.
            in_flight=lambda: (pool or gate).adapters_in_flight(),
            waiting=lambda: (pool or gate).adapters_waiting(),
            replica_in_flight=lambda model: (pool or gate).in_flight(model),
            on_change=routes_changed_only,
        )
        loads.delivery = delivery
        loads.stored_adapters = stored_adapters
        loads.adapter_config = lambda name: jobs.adapter_file(name, "adapter_config.json")[0].read_text()
        replicas.adapter_rank = loads.rank
        router.held = loads.held
        gate.adapter_loader = loads.need
        gate.on_adapter_done = loads.request_ended
        # llama.cpp has no KV gauge: its saturation is running / the profile's slots, when set.
        scraper = EngineScraper(
            replicas,
            registry,
            slots=lambda record: _parallel(catalog, record.profile),
            on_round=routes_changed,
        )
        metrics = GatewayMetrics(
            gate=gate,
            engines=scraper,
            ttft_target=config.gateway.ttft_target,
            ttft_targets=lambda model: _ttft_target(catalog, model),
            tenants=config.gateway.tenant_metrics,
        )
        gate.observer = metrics
        # The gateway in worker processes of its own (see server/workers.py), or in this one.
        if config.gateway.workers:
            pool = WorkerPool(
                config.data_dir / WORKERS_DIR,
                count=config.gateway.workers,
                host=config.gateway.listen.host,
                port=config.gateway.listen.port,
                queue_timeout=config.gateway.queue_timeout,
                ttft_target=config.gateway.ttft_target,
                keys=lambda: keys_message(tenants, quota_share),
                routes=lambda: routes_message(router, lambda model: _ttft_target(catalog, model)),
                on_waiting=lambda _model: replicas.kick(),
                keys_changed=tenants.changes,
                stop_on_exit=config.gateway.stop_workers_on_exit,
                tracing=config.tracing,
                lease_ttl=config.gateway.lease_ttl,
                tenant_metrics=config.gateway.tenant_metrics,
                listener=config.gateway.listener_limits(),
            )
            pool.need_adapter = loads.need
            loads.quiesce = pool.quiesce
        front = pool or gate  # who holds the queues the scaler and the admin API read
        async with trio.open_nursery() as nursery:
            loads.attach(nursery)
            # Before the link listens: a registering agent's jobs are re-attached by it.
            if not shared:
                await nursery.start(jobs.run)
            link_listeners = await nursery.start(
                listener.serve, config.link.listen.host, config.link.listen.port
            )
            # The first look at the lease, before the reconciler starts: whether this server
            # leads. Its address is what the lease shows agents' operators.
            leadership.address = _address(config.link.listen.host, link_listeners[0])
            await nursery.start(leadership.run)
            if shared:
                nursery.start_soon(_follow_store, catalog, tenants)
            admin_port = await nursery.start(
                functools.partial(
                    serve_admin,
                    replicas=replicas,
                    tenants=tenants,
                    usage=usage,
                    jobs=jobs,
                    queued=lambda model: sum(front.queue_depths().get(model, {}).values()),
                    queue_depths=lambda: front.queue_depths(),
                    # With workers, the counters are theirs, as their last reports summed them.
                    traffic=(lambda: traffic_totals(metrics.registry))
                    if pool is None
                    else pool.traffic_totals,
                    engine_load=lambda replica_id: scraper.load(replica_id),
                    workers=pool.as_json if pool is not None else None,
                    leadership=leadership.as_json,
                    tls=config.admin.tls,
                ),
                registry,
                catalog,
                admin_digest,
                engine_secret,
                config.admin.listen.host,
                config.admin.listen.port,
            )
            nursery.start_soon(registry.run)
            nursery.start_soon(replicas.run)
            nursery.start_soon(scraper.run)
            await nursery.start(usage.run)
            if pool is not None:
                shipper = JournalShipper(
                    store, config.data_dir / WORKERS_DIR, owner=server_id if shared else ""
                )
                nursery.start_soon(shipper.run)
                gateway_port = await nursery.start(pool.run)
            else:
                gateway_port = await nursery.start(
                    functools.partial(
                        serve_gateway,
                        router,
                        gate=gate,
                        metrics=metrics,
                        limits=config.gateway.listener_limits(),
                    ),
                    config.gateway.listen.host,
                    config.gateway.listen.port,
                )
            endpoints = Endpoints(
                link=_address(config.link.listen.host, link_listeners[0]),
                admin=_address(config.admin.listen.host, admin_port),
                gateway=_address(config.gateway.listen.host, gateway_port),
            )
            _write_endpoints(config.data_dir / ENDPOINTS_FILE, endpoints)
            log.info(
                "llmgw server up: gateway on http://%s, agent link on %s%s, admin API on %s://%s"
                " (data in %s, store %s; %s under term %d)",
                endpoints.gateway,
                endpoints.link,
                " (TLS)" if config.link.tls else "",
                "https" if config.admin.tls else "http",
                endpoints.admin,
                config.data_dir,
                store.where,
                "leading" if leadership.acting() else f"following {leadership.holder}",
                leadership.term,
            )
            task_status.started(endpoints)
    finally:
        await store.aclose()


# How often a server sharing its store looks for what other servers changed there (the catalog,
# tenants and keys made through their admin APIs): two small reads a second, and a key made on
# one server works on the others within about a second.
SHARED_STORE_POLL = 1.0


async def _follow_store(catalog: Catalog, tenants: Tenants) -> None:
    while True:
        await trio.sleep(SHARED_STORE_POLL)
        for source in (catalog, tenants):
            try:
                await source.reload()
            except StoreError as exc:
                log.warning("cannot read the shared store: %s", exc)


SERVER_ID_FILE = "server-id"


def _server_id(data_dir: Path) -> str:
    """This server's name among those sharing a store: made once (the host's name and a random
    part) and kept in its data_dir, so a restarted server finds its own journal offsets again."""
    path = data_dir / SERVER_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    name = f"{socket.gethostname()}-{secrets.token_hex(3)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    return name


def _parallel(catalog: Catalog, profile_name: str) -> int | None:
    profile = catalog.profiles().get(profile_name)
    return profile.parallel if profile is not None else None


def _ttft_target(catalog: Catalog, model: str) -> float | None:
    """The strictest time-to-first-token target among the profiles serving ``model``."""
    targets = [p.ttft_target for p in catalog.profiles().values() if p.model == model and p.ttft_target]
    return min(targets) if targets else None


def reconcile_config(config: ServerConfig) -> ReconcileConfig:
    section = config.reconcile
    restart = section.restart
    return ReconcileConfig(
        port_range=(section.engine_port_min, section.engine_port_max),
        drain_timeout=section.drain_timeout,
        restart=RestartPolicy(
            initial=restart.initial_delay,
            maximum=restart.max_delay,
            move_after=restart.move_after,
            give_up_after=restart.give_up_after,
            reset_after=restart.reset_after,
        ),
    )


async def _token_digest(store: Store, secret_name: str, path: Path) -> bytes:
    """Makes the token file on first start and records its digest; the file is the source of
    truth, so an operator rotates a token by replacing the file and restarting."""
    token = await trio.to_thread.run_sync(tokens.ensure_token_file, path)
    digest = tokens.digest(token)
    await store.put_secret(secret_name, digest, time.time())
    return digest


def _server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    tls = config.link.tls
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    context.set_alpn_protocols(["h2"])
    return context


def _address(host: str, listener_or_port) -> str:
    port = listener_or_port if isinstance(listener_or_port, int) else _listener_port(listener_or_port)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listener_port(listener) -> int:
    inner = listener.transport_listener if isinstance(listener, trio.SSLListener) else listener
    return inner.socket.getsockname()[1]


def _write_endpoints(path: Path, endpoints: Endpoints) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(attrs.asdict(endpoints), f)
    os.replace(tmp, path)
