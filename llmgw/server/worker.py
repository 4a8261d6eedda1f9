"""A gateway worker: the data plane in a process of its own (``llmgw server --gateway-worker SPEC``).

The server starts its workers (see :mod:`llmgw.server.workers`); each binds the gateway's port with
SO_REUSEPORT beside its siblings, so the kernel spreads connections over them and each uses a core
of its own. A worker holds everything a request needs — API keys as digests, tenants and their
limits, every served model's Ready replicas with their endpoints and engine keys — as the control
plane last pushed it (:mod:`llmgw.server.worker_link`), and runs the same gate and relay as an
in-process gateway on it. Nothing per request asks the control plane, so when the server dies or
restarts the worker goes on serving with what it has, and the next server adopts it.

Usage records go to the worker's own journal (:mod:`llmgw.server.journal`) as each request ends.

Files, in the workers' directory (0700): ``<id>.json`` (the worker's spec, from the server),
``<id>.state.json`` (pid and start time, for adoption), ``<id>.sock`` (the control stream), the
journal's segments and ``<id>.log``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import cattrs
import trio

from llmgw.config import TracingConfig
from llmgw.core.leases import RENEW_INTERVAL, LeaseGrant, LeaseReport, WorkerLeases
from llmgw.core.leases import Waiting as LeaseWaiting
from llmgw.core.listener_limits import ListenerLimits
from llmgw.core.scaling import EngineLoad
from llmgw.gateway import serve_gateway
from llmgw.gateway.contract import RequestRecord, Upstream
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.metrics import GatewayMetrics, traffic_totals
from llmgw.procfs import start_time_of
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.journal import JournalWriter
from llmgw.server.routing import Route
from llmgw.server.routing import Routes as ModelRoutes
from llmgw.server.scrape import SCRAPE_INTERVAL, EngineSample
from llmgw.server.tenants import KeyRecord, Tenant, key_id_of
from llmgw.server.tokens import matches
from llmgw.server.worker_link import (
    LEASE_TICK,
    LINK_ERRORS,
    REPORT_INTERVAL,
    AdapterAnswer,
    Keys,
    LineStream,
    NeedAdapter,
    Report,
    Routes,
    Waiting,
)
from llmgw.server.worker_metrics import WRITE_INTERVAL, SharedExposition, WorkerInfo

log = logging.getLogger(__name__)

# The engines' loads come with the routes, which the control plane pushes after every scrape
# round. Past three missed rounds (the server killed, stopped or cut off) a load is no evidence of
# anything: a replica last seen full would stay full to this worker for good, and every request
# would wait for room it has. Then the worker routes by its slots alone, as before the first scrape.
LOADS_STALE_AFTER = 3 * SCRAPE_INTERVAL
LOADS_CHECK = 1.0

# How long a request waits for the control plane to have its adapter loaded: the server's own
# bound (server.adapter_loads.LOAD_TIMEOUT), and a little for the answer to travel.
ADAPTER_ANSWER_TIMEOUT = 65.0


@attrs.frozen
class WorkerSpec:
    """What the server tells a worker it starts (a JSON file beside the worker's other files)."""

    id: str
    host: str
    port: int
    directory: str
    queue_timeout: float
    ttft_target: float
    # Several workers: each admits against its leased shares of quotas and slots (core.leases).
    leased: bool = False
    # The server's tracing: block; the worker exports its own spans (service llmgw-gateway-worker,
    # or <service_name>-gateway-worker, its id as service.instance.id). The file is 0600: the
    # collector's headers are secrets.
    tracing: TracingConfig = attrs.field(factory=TracingConfig)
    tenant_metrics: bool = False  # gateway.tenant_metrics
    # The gateway section's deadlines and caps on client connections (GatewayConfig.listener_limits).
    listener: ListenerLimits = attrs.field(factory=ListenerLimits)

    @property
    def dir(self) -> Path:
        return Path(self.directory)

    @property
    def socket_path(self) -> Path:
        return self.dir / f"{self.id}.sock"

    @property
    def state_path(self) -> Path:
        return self.dir / f"{self.id}.state.json"


def spec_path(directory: Path, worker: str) -> Path:
    return directory / f"{worker}.json"


def load_spec(path: Path) -> WorkerSpec:
    return cattrs.structure(json.loads(path.read_text()), WorkerSpec)


def worker_tracing(spec: WorkerSpec) -> TracingConfig:
    """The tracing a worker sets up: the server's, named as a worker's, with its id."""
    config = spec.tracing
    name = f"{config.service_name}-gateway-worker" if config.service_name else None
    resource = {**config.resource_attributes, "service.instance.id": spec.id}
    return attrs.evolve(config, service_name=name, resource_attributes=resource)


class PushedState:
    """What the control plane last pushed, as the gate, the relay and the metrics read it."""

    def __init__(
        self, slots: Callable[[str], int] | None = None, live: Callable[[], bool] | None = None
    ) -> None:
        # Several workers: a replica's slots for this one (its leased share), and whether it has
        # had its first grant. None: a lone worker holds every slot.
        self._slots_of = slots
        self._live = live
        self._pushed: Routes | None = None
        self._pushed_at = -math.inf  # trio time of the last routes (and loads) pushed
        self._keys: dict[str, tuple[KeyRecord, bytes]] = {}
        self._tenants: dict[str, Tenant] = {}
        self._routes: dict[str, ModelRoutes] = {}
        self._models: list[str] = []
        self._parents: dict[str, str] = {}  # adapter name -> its base model
        self._samples: dict[str, EngineSample] = {}
        self._ttft: dict[str, float] = {}
        self.have_keys = False
        self.have_routes = False
        self.routes_version = 0  # the pushed Routes' version
        self.routes_taken = trio.Event()  # set (and replaced) as each Routes is taken

    def loads_stale(self, now: float) -> bool:
        """The pushed engine loads are too old to route by (see LOADS_STALE_AFTER)."""
        return now - self._pushed_at > LOADS_STALE_AFTER

    def has_loads(self) -> bool:
        return bool(self._samples)

    def fresh(self) -> bool:
        """Ready to serve: it has had both halves of the state at least once (and its shares,
        when it shares the quotas with other workers). A worker whose control plane has gone stays
        fresh: serving with the last state (and shares) is the point."""
        return self.have_keys and self.have_routes and (self._live is None or self._live())

    # --- from the control plane ------------------------------------------------------------------

    def take_keys(self, keys: Keys) -> None:
        self._keys = {
            k.id: (
                KeyRecord(
                    k.id, k.tenant, tuple(k.models), k.band, k.limits and k.limits.limits(), created=0.0
                ),
                bytes.fromhex(k.digest),
            )
            for k in keys.keys
        }
        self._tenants = {t.name: Tenant(t.name, t.limits.limits(), 0.0) for t in keys.tenants}
        self.have_keys = True

    def take_routes(self, routes: Routes) -> None:
        self._pushed = routes
        self._pushed_at = trio.current_time()
        self.rebuild()
        self.routes_version = routes.version
        self.routes_taken.set()
        self.routes_taken = trio.Event()

    def rebuild(self) -> None:
        """The routes again, with each replica's slots as this worker holds them now."""
        routes = self._pushed
        if routes is None:
            return
        loads_known = not self.loads_stale(trio.current_time())
        built: dict[str, ModelRoutes] = {}
        samples: dict[str, EngineSample] = {}
        for model in routes.models:
            replicas = []
            for r in model.replicas:
                known = loads_known and r.running is not None
                load = (
                    EngineLoad(running=r.running, waiting=r.waiting, saturation=r.saturation)
                    if known
                    else None
                )
                upstream = Upstream(
                    host=r.host,
                    port=r.port,
                    engine_key=r.engine_key,
                    replica=r.replica,
                    body_members=r.body_members.encode(),
                )
                slots = r.slots if self._slots_of is None else self._slots_of(r.replica)
                adapters = {
                    name: attrs.evolve(upstream, body_members=members.encode()) if members else upstream
                    for name, members in r.adapters
                }
                replicas.append(
                    Route(replica=r.replica, upstream=upstream, slots=slots, load=load, adapters=adapters)
                )
                if known:
                    samples[r.replica] = EngineSample(model.model, "", r.running, r.waiting, r.saturation)
            built[model.model] = ModelRoutes(
                policy=model.policy,
                load_factor=model.load_factor,
                prefix_chars=model.prefix_chars,
                replicas=tuple(replicas),
                loads_adapters=model.loads_adapters,
            )
        self._routes = built
        self._parents = {name: model.model for model in routes.models for name in model.adapters}
        self._models = sorted({*built, *self._parents})
        self._samples = samples
        self._ttft = dict(routes.ttft_targets)
        self.have_routes = True

    # --- the gate's key directory ------------------------------------------------------------------

    def authenticate(self, secret: str) -> KeyRecord | None:
        key_id = key_id_of(secret)
        entry = self._keys.get(key_id) if key_id is not None else None
        if entry is None or not matches(secret, entry[1]):
            return None
        return entry[0]

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    # --- the router ----------------------------------------------------------------------------------

    def routes(self, model: str) -> ModelRoutes | None:
        return self._routes.get(model)

    def models(self) -> Sequence[str]:
        return self._models

    def parent(self, name: str) -> str | None:
        return self._parents.get(name)

    def base_models(self) -> list[str]:
        """The served models without their adapters: what lanes, reports and the scaler count."""
        return sorted(self._routes)

    def ready_upstreams(self, model: str) -> Sequence[Upstream] | None:
        routes = self._routes.get(model)
        return None if routes is None else [route.upstream for route in routes.replicas]

    # --- the metrics' engine loads ----------------------------------------------------------------

    def snapshot(self) -> Mapping[str, EngineSample]:
        return self._samples

    def ttft_target(self, model: str) -> float | None:
        return self._ttft.get(model)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.leases = leases = WorkerLeases(spec.id) if spec.leased else None
        self.state = PushedState(
            slots=None if leases is None else lambda replica: leases.slots(replica, trio.current_time()),
            live=None if leases is None else lambda: leases.live(trio.current_time()),
        )
        self.journal = JournalWriter(spec.dir, spec.id)
        self.requests = 0
        self._waiting_send, self._waiting_receive = trio.open_memory_channel[str](256)
        self.gate = ControlPlaneGate(
            self.state,
            self.state,
            self.journal,
            queue_timeout=spec.queue_timeout,
            on_waiting=self._note_waiting,
            quotas=self.leases,
            tenant_weight=None if leases is None else leases.tenant_weight,
            next_grant=None if leases is None else self._next_grant,
        )
        self.metrics = GatewayMetrics(
            gate=self.gate,
            engines=self.state,
            ttft_target=spec.ttft_target,
            ttft_targets=self.state.ttft_target,
            tenants=spec.tenant_metrics,
        )
        self.gate.observer = self.metrics
        self.shared_metrics = SharedExposition(self.metrics, spec.dir, spec.id, self._info)
        self.metrics.answer_with(self.shared_metrics.exposition)
        self.gate.adapter_loader = self._need_adapter
        self._control: trio.CancelScope | None = None
        self._serveable = trio.Event()  # set once the state is fresh: it then takes connections
        self._reported_waiting: Mapping[tuple[str, int, str], int] = {}  # as the last lease report said
        self._link: LineStream | None = None  # the control plane's, while one is connected
        self._asks = itertools.count(1)
        self._answers: dict[int, tuple[trio.Event, list[AdapterAnswer]]] = {}
        self._report_now = trio.Event()
        self._granted = trio.Event()  # set (and replaced) as each lease grant is applied

    async def _next_grant(self) -> None:
        await self._granted.wait()

    def _info(self) -> WorkerInfo:
        now = trio.current_time()
        if self.leases is None:
            return WorkerInfo(pid=os.getpid(), serving=self.state.fresh(), lease_left=None)
        return WorkerInfo(
            pid=os.getpid(),
            serving=self.state.fresh(),
            lease_left=max(0.0, self.leases.expires_at - now),
            slots=tuple(sorted(self.leases.slot_shares().items())),
        )

    async def _watch_staleness(self) -> None:
        """Routes again when what the control plane last said goes stale with time: the engines'
        loads once no control plane has refreshed them for a while, and the slots once the
        lease is past its length (core.leases: then at least one slot of every replica)."""
        lapsed = False
        while True:
            await trio.sleep(LOADS_CHECK)
            now = trio.current_time()
            rebuild = False
            if self.state.has_loads() and self.state.loads_stale(now):
                log.info("engine loads not refreshed for %.0f s: routing by slots alone", LOADS_STALE_AFTER)
                rebuild = True
            if self.leases is not None and self.leases.lapsed(now) != lapsed:
                lapsed = not lapsed
                if lapsed:
                    log.warning(
                        "lease past its length with no renewal: serving on the last shares, and on "
                        "at least one slot of every replica"
                    )
                rebuild = True
            if rebuild:
                self.state.rebuild()
                self.gate.redispatch()

    async def _write_metrics(self) -> None:
        while True:
            try:
                self.shared_metrics.write()
            except OSError as exc:
                log.warning("cannot write %s: %s", self.shared_metrics.path, exc)
            await trio.sleep(WRITE_INTERVAL)

    def _note_waiting(self, model: str) -> None:
        try:
            self._waiting_send.send_nowait(model)
        except trio.WouldBlock:
            pass  # the control plane is told of this model on the next one, or not there now

    def _count(self, record: RequestRecord) -> None:
        self.requests += 1

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = await _reuse_port_socket(self.spec.host, self.spec.port)
        control = await _unix_listener(self.spec.socket_path)
        _write_state(self.spec)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._serve_control, [control])
                nursery.start_soon(self._write_metrics)
                nursery.start_soon(self._watch_staleness)
                log.info(
                    "gateway worker %s (pid %d) on %s:%d",
                    self.spec.id,
                    os.getpid(),
                    self.spec.host,
                    self.spec.port,
                )
                task_status.started()
                # No connection before it has what a request needs (it would answer 401 to
                # every key, or refuse every limited tenant): the kernel hands connections only
                # to listening sockets, so until then its siblings take them all.
                await self._serveable.wait()
                sock.listen(1024)
                await nursery.start(
                    lambda task_status: serve_gateway(
                        self.state,
                        self.spec.host,
                        self.spec.port,
                        gate=self.gate,
                        on_done=self._count,
                        metrics=self.metrics,
                        fresh=self.state.fresh,
                        listeners=[trio.SocketListener(sock)],
                        limits=self.spec.listener,
                        task_status=task_status,
                    )
                )
                log.info("gateway worker %s has the control plane's state: taking connections", self.spec.id)
        finally:
            self.journal.close()

    async def _serve_control(self, stream: trio.SocketStream) -> None:
        """One control plane at a time: a new connection (a restarted server) replaces the old."""
        if self._control is not None:
            self._control.cancel()
        with trio.CancelScope() as scope:
            self._control = scope
            link = self._link = LineStream(stream)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._report, link)
                    while True:
                        message = await link.receive()
                        if isinstance(message, Keys):
                            self.state.take_keys(message)
                        elif isinstance(message, Routes):
                            self.state.take_routes(message)
                            self.gate.redispatch()
                            # At once: the control plane may wait to hear this version taken
                            # before it unloads an adapter these routes no longer offer.
                            self._report_now.set()
                        elif isinstance(message, AdapterAnswer):
                            waiting = self._answers.get(message.ask)
                            if waiting is not None:
                                waiting[1].append(message)
                                waiting[0].set()
                        elif isinstance(message, LeaseGrant) and self.leases is not None:
                            self.leases.apply(message, trio.current_time())
                            self.state.rebuild()  # slots may have moved
                            self.gate.redispatch()
                            self._granted.set()  # requests waiting for a share try again
                            self._granted = trio.Event()
                        if self.state.fresh():
                            self._serveable.set()
            except* LINK_ERRORS as group:
                log.info("control plane link closed: %s", group.exceptions[0])
            except* Exception:
                # A message this worker could not apply: it serves on with what it had, and the
                # next control plane connection pushes the state afresh.
                log.exception("control plane message not applied; link closed")
            finally:
                if self._link is link:
                    self._link = None
                with trio.CancelScope(shield=True):
                    await link.aclose()

    async def _need_adapter(self, model: str, adapter: str) -> None:
        """The gate's adapter loader: the control plane decides and loads (once, for every
        worker); this waits for its answer, then for routes that show the adapter."""
        link = self._link
        if link is None:
            raise GatewayError(
                503,
                f"Adapter '{adapter}' is not loaded, and the control plane that loads it is not connected",
                code="adapter_unavailable",
            )
        ask = next(self._asks)
        answered = self._answers[ask] = (trio.Event(), [])
        try:
            with trio.move_on_after(ADAPTER_ANSWER_TIMEOUT) as waited:
                await link.send(NeedAdapter(ask=ask, model=model, adapter=adapter))
                await answered[0].wait()
                answer = answered[1][0]
                if answer.status != 200:
                    raise GatewayError(
                        answer.status, answer.message, code=answer.code or "adapter_load_failed"
                    )
                while self.state.routes_version < answer.routes_version:
                    await self.state.routes_taken.wait()
        finally:
            del self._answers[ask]
        if waited.cancelled_caught:
            raise GatewayError(
                503,
                f"Adapter '{adapter}' was not loaded within {ADAPTER_ANSWER_TIMEOUT:g} s",
                code="adapter_load_timeout",
            )

    async def _report(self, link: LineStream) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._forward_waiting, link)
            next_report = next_lease = trio.current_time()
            while True:
                now = trio.current_time()
                if now >= next_report:
                    await link.send(self._snapshot())
                    next_report = now + REPORT_INTERVAL
                if self.leases is not None:
                    waiting = self.gate.waiting_by_tenant()
                    # More waiters than the last report said: slots may have to move here, and
                    # the ledger moves them on reports.
                    grew = any(n > self._reported_waiting.get(key, 0) for key, n in waiting.items())
                    if now >= next_lease or grew or self.leases.wants_report():
                        await link.send(self._lease_report(now, waiting))
                        self._reported_waiting = waiting
                        next_lease = now + RENEW_INTERVAL
                with trio.move_on_after(LEASE_TICK if self.leases is not None else REPORT_INTERVAL):
                    await self._report_now.wait()
                if self._report_now.is_set():
                    self._report_now = trio.Event()
                    next_report = trio.current_time()

    def _lease_report(self, now: float, waiting: Mapping[tuple[str, int, str], int]) -> LeaseReport:
        assert self.leases is not None
        in_flight: dict[str, int] = {}
        for model in self.state.base_models():
            for replica, n in self.gate.in_flight(model).items():
                in_flight[replica] = in_flight.get(replica, 0) + n
        waiters = [
            LeaseWaiting(model=model, band=band, tenant=tenant, count=n)
            for (model, band, tenant), n in sorted(waiting.items())
        ]
        return self.leases.report(now, in_flight=in_flight, waiting=waiters)

    async def _forward_waiting(self, link: LineStream) -> None:
        async for model in self._waiting_receive:
            await link.send(Waiting(model=model))

    def _snapshot(self) -> Report:
        models = self.state.base_models()
        return Report(
            worker=self.spec.id,
            pid=os.getpid(),
            fresh=self.state.fresh(),
            traffic=traffic_totals(self.metrics.registry),
            lease_left=self._info().lease_left,
            requests=self.requests,
            connections=self.metrics.connections_open,
            in_flight=tuple(
                (model, replica, n) for model in models for replica, n in self.gate.in_flight(model).items()
            ),
            queued=tuple(
                (model, band, n)
                for model, bands in self.gate.queue_depths().items()
                for band, n in bands.items()
            ),
            idle_for=tuple((model, self.gate.idle_for(model)) for model in models),
            routes_version=self.state.routes_version,
            adapters_in_flight=tuple(
                (r, a, n) for (r, a), n in sorted(self.gate.adapters_in_flight().items())
            ),
            adapters_waiting=tuple(sorted(self.gate.adapters_waiting().items())),
            quota_shares=() if self.leases is None else self.leases.quota_shares(),
        )


async def _reuse_port_socket(host: str, port: int) -> trio.socket.SocketType:
    """The gateway port, bound beside the other workers' (not listening yet)."""
    family, kind, proto, _, address = (await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = trio.socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Every worker of a server binds the same port: the kernel hashes connections across them.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    await sock.bind(address)
    return sock


async def _unix_listener(path: Path) -> trio.SocketListener:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket an earlier life of this worker left
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is the server's user's alone
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(4)
    return trio.SocketListener(sock)


def _write_state(spec: WorkerSpec) -> None:
    state = {
        "id": spec.id,
        "pid": os.getpid(),
        "start_time": start_time_of(os.getpid()),
        "port": spec.port,
    }
    tmp = spec.state_path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(state, file)
    os.replace(tmp, spec.state_path)


async def run_worker(spec: WorkerSpec, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await Worker(spec).run(task_status=task_status)
