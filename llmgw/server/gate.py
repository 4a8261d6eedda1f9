"""The control plane's gate for the data plane: API keys, quotas, the admission queue, usage.

For each request: the key is looked up in memory (no store read on the hot path); the model must
be one the key may use; the tenant's and the key's quotas are *reserved* for the request's
estimate before anything else (so concurrent requests cannot overshoot — see core.quota); then the
request waits its turn in its model's admission queue (priority band, then round-robin between
tenants — see core.admission) until a replica it may go to has room, and is sent to that
replica (core.routing orders them, by the model's policy). When the answer is out, the
reservation is settled with the real usage and a usage record is written.

Room is per replica: each takes its slots at once (fewer when its engine says it is full), and
the gate counts its own requests in flight on each. A model that has a profile but no Ready
replica — being started, re-adopted after a server restart, or scaled to zero — is no reason to
refuse: its requests wait in the queue like any other, up to the queue timeout.

Traced (beneath the relay's request span): ``gateway.quota`` (the reservation, failed when
refused) and ``gateway.admission`` (the wait for room, with the routing choice: policy, replica
and outcome); the request's span gets the tenant and the key's id, never the key.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import trio

from llmgw import tracing
from llmgw.core.admission import AdmissionLane, Arrival, Go, Rejected
from llmgw.core.quota import Limits, QuotaBook, Refused, Reservation, estimate_parts
from llmgw.core.routing import PREFIX, prefix_key
from llmgw.gateway import GatewayError, RequestRecord, Upstream
from llmgw.server.routing import Routes
from llmgw.server.store import UsageRecord

log = logging.getLogger(__name__)

# Waiters per model before new requests are refused with 429.
MAX_WAITING = 1024
# How long a request may wait for room before it is answered 503.
QUEUE_TIMEOUT = 60.0
# A queue timeout is logged with what the lane saw at most this often per model.
TIMEOUT_LOG_INTERVAL = 10.0
# How long a gateway worker's request refused only by its share of a quota (not by the limit)
# waits for grants that may bring the room before it is answered 429: moving a share takes the
# other worker's acknowledgement, a few lease ticks; a tenant truly over its limit is told 429
# this much later than by a lone gateway.
SHARE_WAIT = 2.0


class CallerKey(Protocol):
    id: str
    tenant: str
    models: tuple[str, ...]  # empty: every model
    band: int
    limits: Limits | None


class KeyDirectory(Protocol):
    """server.tenants.Tenants, as the gate uses it (in memory, no store read per request)."""

    def authenticate(self, secret: str) -> CallerKey | None: ...

    def tenant(self, name: str) -> Any: ...  # with .limits, or None


class UsageSink(Protocol):
    """server.usage_book.UsageRecorder: record() never waits (records are written in batches)."""

    def record(self, record: UsageRecord) -> None: ...


class RouteSource(Protocol):
    """server.routing.ReplicaRouter, as the gate uses it."""

    def routes(self, model: str) -> Routes | None: ...

    def parent(self, name: str) -> str | None: ...  # an adapter's base model


class QuotaCounter(Protocol):
    """core.quota.QuotaBook, or a worker's core.leases.WorkerLeases: reserve, then settle."""

    def reserve(
        self, quotas: Mapping[Hashable, Limits], estimate_tokens: int, now: float
    ) -> Reservation | Refused: ...

    def settle(self, reservation: Reservation, actual_tokens: int) -> None: ...

    def release(self, reservation: Reservation) -> None: ...


class GateObserver(Protocol):
    """gateway.metrics.GatewayMetrics, as the gate tells it of its choices."""

    def on_route(self, model: str, policy: str, outcome: str) -> None: ...

    def on_queue_wait(self, model: str, seconds: float) -> None: ...

    def on_usage(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None: ...


@attrs.define(eq=False)
class Ticket:
    key: CallerKey
    model: str  # the base model: its lane, routes and replicas
    reservation: Reservation
    wall_started: float
    adapter: str | None = None  # the adapter the request named, if it named one
    replica: str = ""  # the replica charged with the request's slot
    upstreams: tuple[Upstream, ...] = ()  # where to send it, best first
    # The estimate reserved, as (prompt, completion) tokens: what the request is recorded at
    # when its engine answered without saying what it used.
    estimate: tuple[int, int] = (0, 0)


@attrs.define(eq=False)
class _Lane:
    """One model's lane (core.admission), and the shell's side of its waiters."""

    admission: AdmissionLane
    # Per waiting request: its wake-up, and where it goes once let through.
    woken: dict[int, trio.Event] = attrs.field(factory=dict)
    chosen: dict[int, tuple[str, tuple[Upstream, ...], str]] = attrs.field(factory=dict)
    adapter_of: dict[int, str] = attrs.field(factory=dict)  # waiting requests that name one
    last_busy: float = -math.inf  # when it last had a request in flight or waiting (trio time)


class ControlPlaneGate:
    def __init__(
        self,
        keys: KeyDirectory,
        router: RouteSource,
        usage: UsageSink | None = None,
        *,
        queue_timeout: float = QUEUE_TIMEOUT,
        on_waiting: Callable[[str], None] | None = None,
        observer: GateObserver | None = None,
        salt: Callable[[], int] | None = None,
        quotas: QuotaCounter | None = None,
        tenant_weight: Callable[[str, int, str], float] | None = None,
        share: Callable[[Limits], Limits] | None = None,
        adapter_loader: Callable[[str, str], Awaitable[None]] | None = None,
        next_grant: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._keys = keys
        # A gateway worker's: returns once its next lease grant is applied (None: no leases).
        self._next_grant = next_grant
        # This server's part of each limit, when servers sharing a store split the quotas
        # (core.server_shares); None: the whole limit.
        self._share = share
        self._router = router
        self._usage = usage
        self._queue_timeout = queue_timeout
        self._timeout_logged: dict[str, float] = {}  # model -> when its last timeout was logged
        # Told when a request of a model with no Ready replica starts to wait: the scaler's cue.
        self._on_waiting = on_waiting
        self.observer = observer
        self._salt = salt or _random_salt  # the least-loaded policy's tie-break
        # The whole quotas (one process), or a gateway worker's leased shares of them.
        self._quotas: QuotaCounter = quotas if quotas is not None else QuotaBook()
        # A gateway worker's weight for (model, band, tenant) in its lanes' rotations: its part of
        # the tenant's waiters over all workers (core.leases). None: every tenant weighs 1.
        self._tenant_weight = tenant_weight
        self._lanes: dict[str, _Lane] = {}
        # (model, adapter) -> returns once a replica holds the adapter (adapters loaded on
        # demand), raising GatewayError when it cannot be loaded; None: nothing loads them.
        self.adapter_loader = adapter_loader
        self._adapter_in_flight: dict[tuple[str, str], int] = {}  # (replica, adapter) -> requests
        self.on_adapter_done: Callable[[], None] | None = None  # a request naming an adapter ended
        self._adapter_waiting: dict[str, int] = {}  # adapter -> requests waiting in its lane
        self._watched: dict[tuple[str, str], set[trio.CancelScope]] = {}  # see _admission
        self._ids = itertools.count()
        self._started: float | None = None  # when the scaler first asked (idle since then at most)

    def _weight_in(self, model: str) -> Callable[[int, str], float] | None:
        weigh = self._tenant_weight
        return None if weigh is None else lambda band, tenant: weigh(model, band, tenant)

    # --- the Gate protocol ---------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> CallerKey:
        scheme, _, secret = (authorization or "").partition(" ")
        key = self._keys.authenticate(secret.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise GatewayError(
                401, "Incorrect API key provided (Authorization: Bearer <llmgw key>)", code="invalid_api_key"
            )
        return key

    def models(self, caller: CallerKey, served: Sequence[str]) -> Sequence[str]:
        return [m for m in served if not caller.models or m in caller.models]

    async def _reserve(
        self, quotas: Mapping[Hashable, Limits], estimate: int, now: float
    ) -> Reservation | Refused:
        reserved = self._quotas.reserve(quotas, estimate, now)
        if self._next_grant is None:
            return reserved
        # Refused by this worker's share alone (a worker just started holds none): the room may
        # be another's, moving here with the next grants. Only the limit itself answers 429.
        with trio.move_on_after(SHARE_WAIT):
            while isinstance(reserved, Refused) and reserved.short_of_share:
                await self._next_grant()
                reserved = self._quotas.reserve(quotas, estimate, trio.current_time())
        return reserved

    async def admit(self, caller: CallerKey, model: str, payload: dict, body_size: int) -> Ticket:
        # A key's models are names as clients send them: a key may be limited to an adapter,
        # and one allowed the base model is not thereby allowed its adapters.
        if caller.models and model not in caller.models:
            raise GatewayError(403, f"This API key may not use the model '{model}'", code="model_not_allowed")
        parent = self._router.parent(model)
        adapter = model if parent is not None else None
        model = parent if parent is not None else model
        now = trio.current_time()
        tenant = self._keys.tenant(caller.tenant)
        quotas = {("tenant", caller.tenant): (tenant.limits if tenant is not None else None) or Limits()}
        if caller.limits is not None:
            quotas[("key", caller.id)] = caller.limits
        if self._share is not None:
            quotas = {subject: self._share(limits) for subject, limits in quotas.items()}
        traced = tracing.enabled()  # off: one check, nothing else
        if traced:
            request_span = tracing.current()
            request_span.set_attribute("llmgw.tenant", caller.tenant)
            request_span.set_attribute("llmgw.key_id", caller.id)
            if adapter is not None:
                request_span.set_attribute("llmgw.adapter", adapter)
            quota_span = tracing.start("gateway.quota")
        estimate = estimate_parts(payload, body_size)
        reserved = await self._reserve(quotas, sum(estimate), now)
        now = trio.current_time()
        if isinstance(reserved, Refused):
            who = "this API key" if reserved.subject[0] == "key" else f"tenant '{caller.tenant}'"
            refusal = GatewayError(
                429,
                f"{who} is over its {_LIMIT_NAMES[reserved.limit]} quota; retry after {reserved.retry_after:.0f} s",
                code="rate_limit_exceeded",
                retry_after=reserved.retry_after,
            )
            if traced:
                tracing.end(quota_span, error=str(refusal))
            raise refusal
        if traced:
            tracing.end(quota_span)
        ticket = Ticket(
            key=caller,
            model=model,
            reservation=reserved,
            wall_started=time.time(),
            adapter=adapter,
            estimate=estimate,
        )
        if traced:
            waited = tracing.start("gateway.admission", {"llmgw.model": model, "llmgw.band": caller.band})
        try:
            ticket.replica, ticket.upstreams, outcome = await self._admission(
                caller, model, payload, now, adapter
            )
        except BaseException as error:
            self._quotas.release(reserved)
            if traced:  # a refusal (a full queue, a timeout) fails it; a client gone does not
                tracing.end(waited, error=str(error) if isinstance(error, Exception) else None)
            raise
        if traced:
            routes = self._router.routes(model)
            waited.set_attribute("llmgw.route.policy", routes.policy if routes is not None else "")
            waited.set_attribute("llmgw.route.replica", ticket.replica)
            waited.set_attribute("llmgw.route.outcome", outcome)
            tracing.end(waited)
        if adapter is not None:
            key = (ticket.replica, adapter)
            self._adapter_in_flight[key] = self._adapter_in_flight.get(key, 0) + 1
        return ticket

    async def _admission(
        self, caller: CallerKey, model: str, payload: dict, now: float, adapter: str | None
    ) -> tuple[str, tuple[Upstream, ...], str]:
        """The request's place in its lane, as _wait_for_room; for an adapter loaded on demand,
        first its load when no holder has room, and again should it leave every replica while
        the request waits (made room for another: a waiter it was not told of yet)."""
        while True:
            routes = self._router.routes(model)
            on_demand = adapter is not None and routes is not None and routes.loads_adapters
            if not on_demand or self.adapter_loader is None:
                return await self._wait_for_room(caller, model, payload, now, adapter)
            assert adapter is not None
            if not self._holder_has_room(model, routes, adapter):
                await self.adapter_loader(model, adapter)
            self._adapter_waiting[adapter] = self._adapter_waiting.get(adapter, 0) + 1
            watch = trio.CancelScope()
            watched = self._watched.setdefault((model, adapter), set())
            watched.add(watch)
            try:
                with watch:
                    return await self._wait_for_room(caller, model, payload, trio.current_time(), adapter)
            finally:
                watched.discard(watch)
                if not watched:
                    del self._watched[(model, adapter)]
                self._adapter_waiting[adapter] -= 1
                if not self._adapter_waiting[adapter]:
                    del self._adapter_waiting[adapter]
            # Only here when the watch was cancelled: no replica holds the adapter now.

    def _unheld_adapters(self) -> None:
        """Waiters whose adapter no replica holds any more (see _admission) go back to ask."""
        for (model, adapter), watches in list(self._watched.items()):
            routes = self._router.routes(model)
            if routes is None or not any(adapter in route.adapters for route in routes.replicas):
                for watch in watches:
                    watch.cancel()

    def _holder_has_room(self, model: str, routes: Routes, adapter: str) -> bool:
        lane = self._lanes.get(model)
        in_flight = lane.admission.in_flight if lane is not None else {}
        return any(
            adapter in route.adapters and in_flight.get(route.replica, 0) < route.slots
            for route in routes.replicas
        )

    def adapters_in_flight(self) -> dict[tuple[str, str], int]:
        """Requests in flight per (replica, adapter), those with any: no adapter in use is unloaded."""
        return dict(self._adapter_in_flight)

    def adapters_waiting(self) -> dict[str, int]:
        """Requests naming an adapter that wait for a replica, per adapter (those with any)."""
        return dict(self._adapter_waiting)

    def finish(self, ticket: Ticket, record: RequestRecord) -> None:
        lane = self._lanes[ticket.model]
        lane.admission.release(ticket.replica)
        if ticket.adapter is not None:
            key = (ticket.replica, ticket.adapter)
            left = self._adapter_in_flight.get(key, 0) - 1
            if left > 0:
                self._adapter_in_flight[key] = left
            else:
                self._adapter_in_flight.pop(key, None)
            if self.on_adapter_done is not None:
                self.on_adapter_done()
        lane.last_busy = trio.current_time()
        if record.usage is not None:
            self._quotas.settle(ticket.reservation, record.usage.total_tokens)
            if self.observer is not None:
                self.observer.on_usage(
                    ticket.key.tenant, record.usage.prompt_tokens, record.usage.completion_tokens
                )
        elif record.upstream is None:
            self._quotas.release(ticket.reservation)  # never reached an engine: nothing was spent
        else:
            # An engine may have worked on it but said nothing of its usage: keep the estimate.
            self._quotas.settle(ticket.reservation, ticket.reservation.estimate_tokens)
        if self._usage is not None:
            usage = record.usage
            if usage is not None:
                prompt, completion, estimated = usage.prompt_tokens, usage.completion_tokens, 0
            elif record.usage_missing:
                # Served, but the engine never said what it used (a stream cut short, an engine
                # that ignores include_usage): the estimate, flagged as one, rather than 0.
                (prompt, completion), estimated = ticket.estimate, 1
            else:
                prompt, completion, estimated = 0, 0, 0
            self._usage.record(
                UsageRecord(
                    time=ticket.wall_started,
                    tenant=ticket.key.tenant,
                    key_id=ticket.key.id,
                    model=ticket.model,
                    adapter=ticket.adapter or "",
                    replica=f"{record.upstream.host}:{record.upstream.port}" if record.upstream else "",
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    latency_ms=(record.finished - record.started) * 1000,
                    status=record.status,
                    estimated=estimated,
                )
            )
        self._dispatch(ticket.model, trio.current_time())

    # --- admission -----------------------------------------------------------------------------

    def queue_depths(self) -> dict[str, dict[int, int]]:
        """Waiting requests per model and band, for the gateway's metrics and the scaler."""
        return {model: lane.admission.depth_by_band() for model, lane in self._lanes.items()}

    def in_flight(self, model: str) -> dict[str, int]:
        """The model's requests in flight, per replica id (those with any)."""
        lane = self._lanes.get(model)
        return dict(lane.admission.in_flight) if lane is not None else {}

    def waiting_for(self, model: str) -> dict[str, int]:
        """The model's requests waiting for one replica in particular, per replica id."""
        lane = self._lanes.get(model)
        return lane.admission.waiting_for() if lane is not None else {}

    def waiting_by_tenant(self) -> dict[tuple[str, int, str], int]:
        """Waiting requests per (model, band, tenant): a gateway worker's demand for slots."""
        return {
            (model, band, tenant): n
            for model, lane in self._lanes.items()
            for (band, tenant), n in lane.admission.waiting_by_tenant().items()
        }

    def idle_for(self, model: str) -> float:
        """Seconds the model has had nothing in flight and nothing waiting (0 while it has)."""
        lane = self._lanes.get(model)
        now = trio.current_time()
        if self._started is None:
            self._started = now
        if lane is not None and lane.admission.busy():
            return 0.0
        return now - max(lane.last_busy if lane is not None else -math.inf, self._started)

    def redispatch(self) -> None:
        """Room may have changed (a replica became Ready, or went): let waiters through."""
        if self._watched:
            self._unheld_adapters()
        now = trio.current_time()
        for model in self._lanes:
            self._dispatch(model, now)

    async def _wait_for_room(
        self, caller: CallerKey, model: str, payload: dict, now: float, adapter: str | None = None
    ) -> tuple[str, tuple[Upstream, ...], str]:
        lane = self._lanes.get(model)
        if lane is None:
            lane = self._lanes[model] = _Lane(
                admission=AdmissionLane(MAX_WAITING, weight=self._weight_in(model))
            )
        lane.last_busy = now
        routes = self._router.routes(model)
        arrival = Arrival(
            id=next(self._ids),
            tenant=caller.tenant,
            band=caller.band,
            deadline=now + self._queue_timeout,
            key=_prefix(routes, payload, adapter),
            adapter=adapter,
        )
        arrived = lane.admission.arrive(arrival, routes, now, self._salt)
        if isinstance(arrived, Go):
            return self._went(model, routes, arrived, adapter)
        if isinstance(arrived, Rejected):
            raise GatewayError(
                429,
                f"Too many requests are waiting for '{model}'",
                code="queue_full",
                retry_after=arrived.retry_after,
            )
        woken = lane.woken[arrival.id] = trio.Event()
        if adapter is not None:
            lane.adapter_of[arrival.id] = adapter
        ready = routes is not None and bool(routes.replicas)
        if not ready and self._on_waiting is not None:
            self._on_waiting(model)
        self._wake(model, lane, routes, arrived.wake)
        try:
            with trio.move_on_at(arrival.deadline):
                await woken.wait()
        except BaseException:
            chosen = lane.chosen.pop(arrival.id, None)
            if chosen is not None:  # let through, then cancelled before it could go
                lane.admission.release(chosen[0])
                self._dispatch(model, trio.current_time())
            raise
        finally:
            del lane.woken[arrival.id]
            lane.adapter_of.pop(arrival.id, None)
            if arrival.id not in lane.chosen:
                lane.admission.leave(arrival.id)  # the client left, or the deadline passed
            if self.observer is not None:
                self.observer.on_queue_wait(model, trio.current_time() - now)
        chosen = lane.chosen.pop(arrival.id, None)
        if chosen is None:
            if ready:
                message = f"No replica of '{model}' had room within {self._queue_timeout:g} s"
            else:
                message = f"No replica of '{model}' became ready within {self._queue_timeout:g} s"
            self._log_timeout(model, message)
            raise GatewayError(503, message, code="queue_timeout")
        return chosen

    def _log_timeout(self, model: str, message: str) -> None:
        """What the lane sees, for the operator (not the client): each replica's slots as this
        process may fill them, what it has in flight there, and the engine's last load. At most
        once per TIMEOUT_LOG_INTERVAL per model: an overload times out many at once."""
        now = trio.current_time()
        if now < self._timeout_logged.get(model, -math.inf) + TIMEOUT_LOG_INTERVAL:
            return
        self._timeout_logged[model] = now
        lane = self._lanes[model]
        now_routes = self._router.routes(model)
        log.warning(
            "%s; replicas: %s",
            message,
            ", ".join(
                f"{r.replica} slots {r.slots} in flight {lane.admission.in_flight.get(r.replica, 0)}"
                + (f" engine running {r.load.running} waiting {r.load.waiting}" if r.load else "")
                for r in (now_routes.replicas if now_routes is not None else ())
            )
            or "none",
        )

    def _dispatch(self, model: str, now: float) -> None:
        lane = self._lanes[model]
        if lane.woken:
            routes = self._router.routes(model)
            self._wake(model, lane, routes, lane.admission.dispatch(routes, now, self._salt))

    def _wake(self, model: str, lane: _Lane, routes: Routes | None, went: Sequence[Go]) -> None:
        for go in went:
            assert routes is not None  # nobody goes without routes
            lane.chosen[go.id] = self._went(model, routes, go, lane.adapter_of.get(go.id))
            lane.woken[go.id].set()

    def _went(
        self, model: str, routes: Routes, go: Go, adapter: str | None = None
    ) -> tuple[str, tuple[Upstream, ...], str]:
        """The replica charged with a request let through, the upstreams in the order to try
        them (for an adapter, those that select it: the lane chose among its servers only), and
        the routing outcome (why that replica)."""
        if self.observer is not None:
            self.observer.on_route(model, routes.policy, go.outcome)
        if adapter is not None:
            by_adapter = {
                route.replica: route.adapters[adapter]
                for route in routes.replicas
                if adapter in route.adapters
            }
            return go.replica, tuple(by_adapter[rid] for rid in go.order), go.outcome
        if len(routes.replicas) == 1:
            return go.replica, (routes.replicas[0].upstream,), go.outcome
        by_id = {route.replica: route.upstream for route in routes.replicas}
        return go.replica, tuple(by_id[rid] for rid in go.order), go.outcome


def _random_salt() -> int:
    return random.getrandbits(32)


def _prefix(routes: Routes | None, payload: dict, adapter: str | None = None) -> bytes | None:
    if routes is None or routes.policy != PREFIX:
        return None
    return prefix_key(payload, routes.prefix_chars, adapter)


_LIMIT_NAMES = {"rpm": "requests-per-minute", "tpm": "tokens-per-minute", "tpd": "tokens-per-day"}
