"""The control plane's gate for the data plane: API keys, quotas, the admission queue, usage.

For each request: the key is looked up in memory (no store read on the hot path); the model must
be one the key may use; the tenant's and the key's quotas are *reserved* for the request's
estimate before anything else (so concurrent requests cannot overshoot — see core.quota); then the
request waits its turn in its model's admission queue (priority band, then round-robin between
tenants — see core.admission) until a replica has room. When the answer is out, the reservation
is settled with the real usage and a usage record is written.

Room: ``capacity(model)``, the requests the model's Ready replicas serve at once (see
server.routing); the engines' own metrics refine this in a later step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import trio

from llmgw.core.admission import Accepted, AdmissionQueue, Waiter
from llmgw.core.quota import Limits, QuotaBook, Refused, Reservation
from llmgw.gateway import GatewayError, RequestRecord, Router
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


@attrs.define(eq=False)
class Ticket:
    key: CallerKey
    model: str
    reservation: Reservation
    wall_started: float


@attrs.define(eq=False)
class _Lane:
    """One model's queue and what it has in flight."""

    queue: AdmissionQueue
    in_flight: int = 0
    wakeups: dict[int, trio.Event] = attrs.field(factory=dict)


class ControlPlaneGate:
    def __init__(
        self,
        keys: KeyDirectory,
        router: Router,
        capacity,  # Callable[[str], int]: requests the model's Ready replicas serve at once
        usage: UsageSink | None = None,
        *,
        queue_timeout: float = QUEUE_TIMEOUT,
    ) -> None:
        self._keys = keys
        self._router = router
        self._capacity = capacity
        self._usage = usage
        self._queue_timeout = queue_timeout
        self._quotas = QuotaBook()
        self._lanes: dict[str, _Lane] = {}
        self._ids = itertools.count()

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
            await self._wait_for_room(caller, model, now)
        except BaseException:
            self._quotas.release(reserved)
            raise
        return ticket

    def finish(self, ticket: Ticket, record: RequestRecord) -> None:
        lane = self._lanes[ticket.model]
        lane.in_flight -= 1
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
        """Waiting requests per model and band, for the gateway's metrics."""
        return {model: lane.queue.depth_by_band() for model, lane in self._lanes.items()}

    def redispatch(self) -> None:
        """Capacity may have changed (a replica became Ready, or went): let waiters through."""
        now = trio.current_time()
        for model in self._lanes:
            self._dispatch(model, now)

    async def _wait_for_room(self, caller: CallerKey, model: str, now: float) -> None:
        capacity = self._capacity(model)
        if capacity == 0:
            raise GatewayError(503, f"No replica of '{model}' is ready", code="no_ready_replica")
        lane = self._lanes.get(model)
        if lane is None:
            lane = self._lanes[model] = _Lane(queue=AdmissionQueue(MAX_WAITING))
        if not lane.queue and lane.in_flight < capacity:
            # Nobody waits and there is room: the queue would hand this very request the slot.
            # Taking it directly spares an event, a cancel scope and a queue round trip.
            lane.in_flight += 1
            return
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
        woken = lane.wakeups[waiter.id] = trio.Event()
        self._dispatch(model, now)
        try:
            with trio.move_on_at(waiter.deadline):
                await woken.wait()
        except BaseException:
            if woken.is_set():  # let through, then cancelled before it could use its slot
                lane.in_flight -= 1
                self._dispatch(model, trio.current_time())
            raise
        finally:
            del lane.wakeups[waiter.id]
            if not woken.is_set():
                lane.queue.cancel(waiter.id)  # the client left, or the deadline passed
        if not woken.is_set():
            raise GatewayError(
                503,
                f"No replica of '{model}' had room within {self._queue_timeout:g} s",
                code="queue_timeout",
            )

    def _dispatch(self, model: str, now: float) -> None:
        """Lets waiters through while the model's replicas have room."""
        lane = self._lanes[model]
        capacity = self._capacity(model)
        while lane.in_flight < capacity:
            popped = lane.queue.pop(now)
            if popped.waiter is None:
                return
            lane.in_flight += 1
            lane.wakeups[popped.waiter.id].set()


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
