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
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

from llmgw.core.admission import Accepted, AdmissionQueue, Waiter
from llmgw.core.quota import Limits, QuotaBook, Refused, Reservation
from llmgw.core.routing import PREFIX, Candidate, Decision, decide, has_room, prefix_key
from llmgw.gateway import GatewayError, RequestRecord, Upstream
from llmgw.server.routing import Routes
from llmgw.server.store import UsageRecord

# Waiters per model before new requests are refused with 429.
MAX_WAITING = 1024
# How long a request may wait for room before it is answered 503.
QUEUE_TIMEOUT = 60.0
# Tokens reserved for a request that names no max_tokens: a typical answer's length.
DEFAULT_COMPLETION_ESTIMATE = 256
# Characters per token when estimating a prompt from its text (English-ish, a rough upper bound).
CHARS_PER_TOKEN = 3


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
    """server.usage.UsageRecorder: record() never waits (records are written in batches)."""

    def record(self, record: UsageRecord) -> None: ...


class RouteSource(Protocol):
    """server.routing.ReplicaRouter, as the gate uses it."""

    def routes(self, model: str) -> Routes | None: ...


class GateObserver(Protocol):
    """gateway.metrics.GatewayMetrics, as the gate tells it of its choices."""

    def on_route(self, model: str, policy: str, outcome: str) -> None: ...

    def on_queue_wait(self, model: str, seconds: float) -> None: ...


@attrs.define(eq=False)
class Ticket:
    key: CallerKey
    model: str
    reservation: Reservation
    wall_started: float
    replica: str = ""  # the replica charged with the request's slot
    upstreams: tuple[Upstream, ...] = ()  # where to send it, best first


@attrs.define(eq=False)
class _Waiting:
    """A queued request, as the shell keeps it: what its choice needs, and how to wake it."""

    prefix: bytes | None
    band: int
    woken: trio.Event = attrs.field(factory=trio.Event)
    choice: tuple[str, tuple[Upstream, ...]] | None = None  # (replica charged, upstreams)


@attrs.define(eq=False)
class _Lane:
    """One model's queue and what it has in flight on each replica."""

    queue: AdmissionQueue
    in_flight: dict[str, int] = attrs.field(factory=dict)  # per replica id, only those above 0
    waiting: dict[int, _Waiting] = attrs.field(factory=dict)
    # Waiters taken from the queue to wait for one replica in particular (the prefix policy's
    # affinity): waiter id → replica id, oldest first. They go before the queue when it frees.
    parked: dict[int, str] = attrs.field(factory=dict)
    turn: int = 0  # the round-robin policy's counter
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
    ) -> None:
        self._keys = keys
        self._router = router
        self._usage = usage
        self._queue_timeout = queue_timeout
        # Told when a request of a model with no Ready replica starts to wait: the scaler's cue.
        self._on_waiting = on_waiting
        self.observer = observer
        self._salt = salt or _random_salt  # the least-loaded policy's tie-break
        self._quotas = QuotaBook()
        self._lanes: dict[str, _Lane] = {}
        self._ids = itertools.count()
        self._started: float | None = None  # when the scaler first asked (idle since then at most)

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

    async def admit(self, caller: CallerKey, model: str, payload: dict, body_size: int) -> Ticket:
        if caller.models and model not in caller.models:
            raise GatewayError(403, f"This API key may not use the model '{model}'", code="model_not_allowed")
        now = trio.current_time()
        tenant = self._keys.tenant(caller.tenant)
        quotas = {("tenant", caller.tenant): (tenant.limits if tenant is not None else None) or Limits()}
        if caller.limits is not None:
            quotas[("key", caller.id)] = caller.limits
        reserved = self._quotas.reserve(quotas, estimate_tokens(payload, body_size), now)
        if isinstance(reserved, Refused):
            who = "this API key" if reserved.subject[0] == "key" else f"tenant '{caller.tenant}'"
            raise GatewayError(
                429,
                f"{who} is over its {_LIMIT_NAMES[reserved.limit]} quota; retry after {reserved.retry_after:.0f} s",
                code="rate_limit_exceeded",
                retry_after=reserved.retry_after,
            )
        ticket = Ticket(key=caller, model=model, reservation=reserved, wall_started=time.time())
        try:
            ticket.replica, ticket.upstreams = await self._wait_for_room(caller, model, payload, now)
        except BaseException:
            self._quotas.release(reserved)
            raise
        return ticket

    def finish(self, ticket: Ticket, record: RequestRecord) -> None:
        lane = self._lanes[ticket.model]
        self._release_slot(lane, ticket.replica)
        lane.last_busy = trio.current_time()
        if record.usage is not None:
            self._quotas.settle(ticket.reservation, record.usage.total_tokens)
        elif record.upstream is None:
            self._quotas.release(ticket.reservation)  # never reached an engine: nothing was spent
        else:
            # An engine may have worked on it but said nothing of its usage: keep the estimate.
            self._quotas.settle(ticket.reservation, ticket.reservation.estimate_tokens)
        if self._usage is not None:
            usage = record.usage
            self._usage.record(
                UsageRecord(
                    time=ticket.wall_started,
                    tenant=ticket.key.tenant,
                    key_id=ticket.key.id,
                    model=ticket.model,
                    replica=f"{record.upstream.host}:{record.upstream.port}" if record.upstream else "",
                    prompt_tokens=usage.prompt_tokens if usage else 0,
                    completion_tokens=usage.completion_tokens if usage else 0,
                    latency_ms=(record.finished - record.started) * 1000,
                    status=record.status,
                )
            )
        self._dispatch(ticket.model, trio.current_time())

    # --- admission -----------------------------------------------------------------------------

    def queue_depths(self) -> dict[str, dict[int, int]]:
        """Waiting requests per model and band, for the gateway's metrics and the scaler."""
        depths = {}
        for model, lane in self._lanes.items():
            bands = lane.queue.depth_by_band()
            for waiter_id in lane.parked:
                band = lane.waiting[waiter_id].band
                bands[band] = bands.get(band, 0) + 1
            depths[model] = bands
        return depths

    def in_flight(self, model: str) -> dict[str, int]:
        """The model's requests in flight, per replica id (those with any)."""
        lane = self._lanes.get(model)
        return dict(lane.in_flight) if lane is not None else {}

    def waiting_for(self, model: str) -> dict[str, int]:
        """The model's requests waiting for one replica in particular, per replica id."""
        lane = self._lanes.get(model)
        counts: dict[str, int] = {}
        for replica in lane.parked.values() if lane is not None else ():
            counts[replica] = counts.get(replica, 0) + 1
        return counts

    def idle_for(self, model: str) -> float:
        """Seconds the model has had nothing in flight and nothing waiting (0 while it has)."""
        lane = self._lanes.get(model)
        now = trio.current_time()
        if self._started is None:
            self._started = now
        if lane is not None and (lane.in_flight or lane.queue or lane.parked):
            return 0.0
        return now - max(lane.last_busy if lane is not None else -math.inf, self._started)

    def redispatch(self) -> None:
        """Room may have changed (a replica became Ready, or went): let waiters through."""
        now = trio.current_time()
        for model in self._lanes:
            self._dispatch(model, now)

    async def _wait_for_room(
        self, caller: CallerKey, model: str, payload: dict, now: float
    ) -> tuple[str, tuple[Upstream, ...]]:
        lane = self._lanes.get(model)
        if lane is None:
            lane = self._lanes[model] = _Lane(queue=AdmissionQueue(MAX_WAITING))
        lane.last_busy = now
        routes = self._router.routes(model)
        prefix = _prefix(routes, payload)
        if not lane.queue and not lane.parked and routes is not None:
            # Nobody waits: if the request may go now, the queue would hand it the slot at once.
            # Going directly spares an event, a cancel scope and a queue round trip.
            decision = self._decide(lane, routes, prefix)
            if decision is not None and not decision.wait:
                return self._go(model, lane, routes, decision)
        waiter = Waiter(
            id=next(self._ids),
            tenant=caller.tenant,
            band=caller.band,
            enqueued_at=now,
            deadline=now + self._queue_timeout,
        )
        pushed = lane.queue.push(waiter)
        if not isinstance(pushed, Accepted):
            raise GatewayError(
                429,
                f"Too many requests are waiting for '{model}'",
                code="queue_full",
                retry_after=pushed.retry_after,
            )
        waiting = lane.waiting[waiter.id] = _Waiting(prefix=prefix, band=caller.band)
        ready = routes is not None and bool(routes.replicas)
        if not ready and self._on_waiting is not None:
            self._on_waiting(model)
        self._dispatch(model, now)
        try:
            with trio.move_on_at(waiter.deadline):
                await waiting.woken.wait()
        except BaseException:
            if waiting.choice is not None:  # let through, then cancelled before it could go
                self._release_slot(lane, waiting.choice[0])
                self._dispatch(model, trio.current_time())
            raise
        finally:
            del lane.waiting[waiter.id]
            if waiting.choice is None:
                # The client left, or the deadline passed: out of the queue, or of its replica's
                # wait.
                lane.queue.cancel(waiter.id)
                lane.parked.pop(waiter.id, None)
            if self.observer is not None:
                self.observer.on_queue_wait(model, trio.current_time() - now)
        if waiting.choice is None:
            if ready:
                message = f"No replica of '{model}' had room within {self._queue_timeout:g} s"
            else:
                message = f"No replica of '{model}' became ready within {self._queue_timeout:g} s"
            raise GatewayError(503, message, code="queue_timeout")
        return waiting.choice

    def _dispatch(self, model: str, now: float) -> None:
        """Lets waiters through while a replica they may go to has room: first those waiting
        for one replica, oldest first, each decided again as loads are now; then the queue."""
        lane = self._lanes[model]
        if not lane.queue and not lane.parked:
            return
        routes = self._router.routes(model)
        if routes is None:
            return  # no profile serves it any more: the waiters' deadlines answer them
        for waiter_id in list(lane.parked):
            waiting = lane.waiting[waiter_id]
            decision = self._decide(lane, routes, waiting.prefix, parked=waiter_id)
            if decision is None:
                continue  # no replica at all now: it keeps waiting where it was
            if decision.wait:
                lane.parked[waiter_id] = decision.choice.order[0]  # keeps its place in line
            else:
                del lane.parked[waiter_id]
                waiting.choice = self._go(model, lane, routes, decision)
                waiting.woken.set()
        while lane.queue:
            candidates = _candidates(routes, lane)
            if not has_room(candidates):
                return
            popped = lane.queue.pop(now)
            if popped.waiter is None:
                return
            waiting = lane.waiting[popped.waiter.id]
            decision = self._decide(lane, routes, waiting.prefix, candidates=candidates)
            if decision is None:  # cannot happen while a replica has room; kept waiting if so
                lane.parked[popped.waiter.id] = ""
            elif decision.wait:
                lane.parked[popped.waiter.id] = decision.choice.order[0]
            else:
                waiting.choice = self._go(model, lane, routes, decision)
                waiting.woken.set()

    def _decide(
        self,
        lane: _Lane,
        routes: Routes,
        prefix: bytes | None,
        parked: int | None = None,
        candidates: list[Candidate] | None = None,
    ) -> Decision | None:
        """core.routing.decide for one request, with the lane's loads (``parked``: the waiter
        being decided again, whose own wait is not counted; ``candidates``: already built)."""
        return decide(
            routes.policy,
            candidates if candidates is not None else _candidates(routes, lane, leaving=parked),
            key=prefix,
            salt=self._salt(),
            turn=lane.turn,
            load_factor=routes.load_factor,
        )

    def _go(
        self, model: str, lane: _Lane, routes: Routes, decision: Decision
    ) -> tuple[str, tuple[Upstream, ...]]:
        """Charges the chosen replica with the request's slot: the replica, and the upstreams in
        the order to try them."""
        choice = decision.choice
        lane.turn += 1
        first = choice.order[0]
        lane.in_flight[first] = lane.in_flight.get(first, 0) + 1
        if self.observer is not None:
            self.observer.on_route(model, routes.policy, choice.outcome)
        if len(routes.replicas) == 1:
            return first, (routes.replicas[0].upstream,)
        by_id = {route.replica: route.upstream for route in routes.replicas}
        return first, tuple(by_id[rid] for rid in choice.order)

    def _release_slot(self, lane: _Lane, replica: str) -> None:
        # Only busy replicas are kept: replicas come and go over the process's life.
        left = lane.in_flight[replica] - 1
        if left:
            lane.in_flight[replica] = left
        else:
            del lane.in_flight[replica]


def _random_salt() -> int:
    return random.getrandbits(32)


def _candidates(routes: Routes, lane: _Lane, leaving: int | None = None) -> list[Candidate]:
    in_flight = lane.in_flight
    queued: dict[str, int] = {}
    for waiter_id, replica in lane.parked.items():
        if waiter_id != leaving:
            queued[replica] = queued.get(replica, 0) + 1
    return [
        Candidate(
            id=route.replica,
            slots=route.slots,
            in_flight=in_flight.get(route.replica, 0),
            queued=queued.get(route.replica, 0),
            running=route.load.running if route.load is not None else None,
            waiting=route.load.waiting if route.load is not None else 0,
            saturation=route.load.saturation if route.load is not None else 0.0,
        )
        for route in routes.replicas
    ]


def _prefix(routes: Routes | None, payload: dict) -> bytes | None:
    if routes is None or routes.policy != PREFIX:
        return None
    return prefix_key(payload, routes.prefix_chars)


_LIMIT_NAMES = {"rpm": "requests-per-minute", "tpm": "tokens-per-minute", "tpd": "tokens-per-day"}


def estimate_tokens(payload: dict, body_size: int) -> int:
    """What to reserve before the answer is known: the prompt's size plus the most it may write.

    The prompt's size is taken from the body's: its bytes are nearly all prompt (tool definitions
    and the like are prompt to the engine too). Encoding the messages again to measure them cost
    700 µs for 200 KB of conversation."""
    completion = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if not isinstance(completion, int) or completion <= 0:
        completion = DEFAULT_COMPLETION_ESTIMATE
    return completion + body_size // CHARS_PER_TOKEN + 1
