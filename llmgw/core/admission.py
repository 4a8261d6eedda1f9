"""One model's admission queue: which waiting request is dispatched next when a replica has room.

Order: priority bands first (a higher band is always served before a lower one), then, inside a
band, round-robin between tenants, first come first served within each tenant. Round-robin rather
than one FIFO per band because a FIFO lets one tenant's burst of a thousand requests hold every
other tenant's single request behind all of it. With the rotation, a tenant that keeps waiting is
served before any other tenant of its band is served twice.

The rotation: the tenant at the front is served and goes to the back. A tenant whose last waiter
leaves (dispatched, cancelled or expired) leaves the rotation and the others keep their order.
When it has waiters again it joins at the back, like a newcomer: keeping its old place would let
a tenant that sends one request at a time jump ahead of tenants that have been waiting all along,
and would need a memory of tenants that have nothing queued.

Weights (a gateway worker's: its part of a tenant whose waiters other workers hold too, from
core.leases) make it a deficit round-robin: reaching the front adds the tenant's weight to its
credit, and it is served once its credit reaches 1, so a tenant of weight 1/2 is served every
other round. At weight 1, the default, that is exactly the plain rotation.

A waiter leaves by exactly one of three doors: :meth:`AdmissionQueue.pop` (dispatched),
:meth:`~AdmissionQueue.cancel` (its client went away) or :meth:`~AdmissionQueue.expire` (its
deadline came; the shell answers it with a timeout). ``pop`` expires first, so it never hands
out a waiter the shell owes a timeout. Expiry is the shell's to trigger: :meth:`push` expires
nothing, so an expired waiter holds its slot until ``pop`` or ``expire`` removes it (whoever
removes it must also answer it, and ``push`` has no one to tell).

Bounded: at most ``max_waiting`` waiters; a full queue refuses a newcomer whatever its band.
Letting a higher band displace a queued lower-band waiter was considered and left out: it turns
a quick 429 for the newcomer into a late failure for a client who has already waited, and among
the waiters that are queued the bands already decide who goes first.

The queue only decides order. :class:`AdmissionLane` puts it together with room: one model's
queue, the requests it has in flight on each replica, and the requests waiting for one replica in
particular (the prefix policy's affinity); it answers, for each arrival, go now (and where),
queued, or refused, and, whenever room may have changed, who goes now. The shell only maps the
lane's ids to its clients' wake-up events.

Pure: ``now`` is a parameter. A waiter is expired once ``now >= deadline``, the moment at which
``trio.move_on_at(deadline)`` would fire in the shell.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Sequence
from typing import Protocol

import attrs

from llmgw.core.routing import Candidate, Decision, decide, has_room

frozen = attrs.frozen(kw_only=True)

# Seconds a refused client is told to wait (Retry-After). The queue cannot know how fast the
# replicas drain it; a second is long enough not to be hammered by retries and short against
# any sensible wait timeout.
RETRY_AFTER = 1.0

# The least weight a tenant's turn counts for (see the weighted rotation), and what counts as a
# whole turn of credit (float sums of fractions land just below 1).
MIN_WEIGHT = 1 / 256
_FULL_TURN = 1.0 - 1e-9

# Stale deadline entries (of waiters dispatched or cancelled) tolerated beyond the live ones
# before the heap is rebuilt; without it a nearly empty queue would rebuild on every push.
_COMPACT_SLACK = 64


@frozen
class Waiter:
    id: Hashable  # the shell's handle for the request: unique among waiters in the queue
    tenant: str
    band: int  # priority: higher is served first
    enqueued_at: float  # for the shell's queue-time metrics; the order does not depend on it
    deadline: float  # expired once now >= deadline


@frozen
class Accepted:
    pass


@frozen
class Rejected:
    reason: str
    retry_after: float  # seconds, for the Retry-After header


@frozen
class Popped:
    waiter: Waiter | None  # the next to dispatch; None when nothing is waiting
    expired: tuple[Waiter, ...]  # removed on the way, earliest deadline first: answer them


class _Band:
    """One band's waiters: a rotation of tenants, each tenant with its own FIFO.

    OrderedDicts rather than deques because cancel removes from the middle, and rather than plain
    dicts because taking the first key of a dict that is always deleted from the front grows
    slower with every deletion until it resizes; an OrderedDict's front is a linked list.
    """

    def __init__(self) -> None:
        # Tenant → its waiters by id, oldest first. Holds only tenants with waiters.
        self.rotation: OrderedDict[str, OrderedDict[Hashable, Waiter]] = OrderedDict()
        self.size = 0
        # Tenant → credit toward its next turn, for weighted rotations only; kept while it waits.
        self.credit: dict[str, float] = {}

    def add(self, waiter: Waiter) -> None:
        fifo = self.rotation.get(waiter.tenant)
        if fifo is None:
            fifo = self.rotation[waiter.tenant] = OrderedDict()  # a newcomer joins at the back
        fifo[waiter.id] = waiter
        self.size += 1

    def remove(self, waiter: Waiter) -> None:
        fifo = self.rotation[waiter.tenant]
        del fifo[waiter.id]
        self.size -= 1
        if not fifo:
            del self.rotation[waiter.tenant]  # the others keep their order
            self.credit.pop(waiter.tenant, None)

    def take_next(self, weight: Callable[[str], float] | None = None) -> Waiter:
        if weight is None:
            tenant, fifo = next(iter(self.rotation.items()))
            return self._serve(tenant, fifo, done=True)
        while True:
            tenant, fifo = next(iter(self.rotation.items()))
            credit = self.credit.get(tenant, 0.0)
            if credit < _FULL_TURN:
                # Its turn comes round: the weight's worth of credit (never less than MIN_WEIGHT,
                # so that this loop ends within len(rotation) / MIN_WEIGHT steps).
                credit += min(1.0, max(MIN_WEIGHT, weight(tenant)))
                if credit < _FULL_TURN:
                    self.credit[tenant] = credit
                    self.rotation.move_to_end(tenant)
                    continue
            credit -= 1.0
            self.credit[tenant] = credit
            return self._serve(tenant, fifo, done=credit < _FULL_TURN)

    def _serve(self, tenant: str, fifo: OrderedDict[Hashable, Waiter], *, done: bool) -> Waiter:
        _, waiter = fifo.popitem(last=False)
        self.size -= 1
        if not fifo:
            del self.rotation[tenant]
            self.credit.pop(tenant, None)
        elif done:
            self.rotation.move_to_end(tenant)
        return waiter


class AdmissionQueue:
    """The waiting requests of one model, in dispatch order.

    Costs: push O(log n) (the deadline heap), cancel O(1), pop O(bands + log n) per waiter it
    returns or expires. Bands are the few priority levels of the API keys, so finding the highest
    non-empty one by looking at all of them is cheaper than keeping them sorted.
    """

    def __init__(
        self,
        max_waiting: int,
        *,
        retry_after: float = RETRY_AFTER,
        weight: Callable[[int, str], float] | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, not {max_waiting}")
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        # (band, tenant) → the tenant's weight in its band's rotation; None: every tenant 1.
        self._weight = weight
        # id → (push number, waiter) for every waiter in the queue. The push number tells a live
        # deadline entry from a stale one left by an earlier waiter with the same id.
        self._waiting: dict[Hashable, tuple[int, Waiter]] = {}
        self._bands: dict[int, _Band] = {}  # only bands with waiters
        # (deadline, push number, id), a min-heap. Dispatch and cancel leave their entry behind
        # (removing from inside a heap costs a scan); it is skipped when it reaches the top.
        self._deadlines: list[tuple[float, int, Hashable]] = []
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def depth(self) -> int:
        return len(self._waiting)

    def depth_by_band(self) -> dict[int, int]:
        """Waiters per band, for bands that have any."""
        return {band: queue.size for band, queue in self._bands.items()}

    def peek_band(self) -> int | None:
        """The band the next dispatch comes from (expiry aside), or None when nothing waits."""
        return max(self._bands, default=None)

    def next_deadline(self) -> float | None:
        """The earliest deadline among the waiters: when the shell should next call expire."""
        while self._deadlines and not self._is_live(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def push(self, waiter: Waiter) -> Accepted | Rejected:
        if waiter.id in self._waiting:
            # Cancel finds a waiter by id; two under one id would make that ambiguous.
            raise ValueError(f"waiter {waiter.id!r} is already queued")
        if len(self._waiting) >= self.max_waiting:
            return Rejected(reason="queue full", retry_after=self.retry_after)
        number = self._pushes
        self._pushes += 1
        self._waiting[waiter.id] = (number, waiter)
        band = self._bands.get(waiter.band)
        if band is None:
            band = self._bands[waiter.band] = _Band()
        band.add(waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, number, waiter.id))
        self._compact_deadlines()
        return Accepted()

    def cancel(self, waiter_id: Hashable) -> bool:
        """Remove a waiter whose client went away. False if it is not queued (any more)."""
        entry = self._waiting.get(waiter_id)
        if entry is None:
            return False
        self._remove(entry[1])
        return True

    def pop(self, now: float) -> Popped:
        """Expire what is due, then take the next waiter: highest band, next tenant in rotation."""
        expired = self.expire(now)
        band_number = self.peek_band()
        if band_number is None:
            return Popped(waiter=None, expired=expired)
        band = self._bands[band_number]
        weight = self._weight
        waiter = band.take_next(None if weight is None else lambda tenant: weight(band_number, tenant))
        if not band.size:
            del self._bands[band_number]
        del self._waiting[waiter.id]
        return Popped(waiter=waiter, expired=expired)

    def expire(self, now: float) -> tuple[Waiter, ...]:
        """Remove and return the waiters whose deadline has come: earliest first, ties as pushed."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            if self._is_live(entry):
                waiter = self._waiting[entry[2]][1]
                self._remove(waiter)
                expired.append(waiter)
        return tuple(expired)

    def _remove(self, waiter: Waiter) -> None:
        del self._waiting[waiter.id]
        band = self._bands[waiter.band]
        band.remove(waiter)
        if not band.size:
            del self._bands[waiter.band]

    def _is_live(self, entry: tuple[float, int, Hashable]) -> bool:
        _, number, waiter_id = entry
        waiting = self._waiting.get(waiter_id)
        return waiting is not None and waiting[0] == number

    def _compact_deadlines(self) -> None:
        # Rebuilt once stale entries outnumber live ones (plus slack): the heap stays under
        # 2 × max_waiting + slack, and each rebuild is paid for by the removals that made it due.
        if len(self._deadlines) > 2 * len(self._waiting) + _COMPACT_SLACK:
            self._deadlines = [entry for entry in self._deadlines if self._is_live(entry)]
            heapq.heapify(self._deadlines)


# --- one model's lane: the queue, with room per replica ------------------------------------------


class EngineLoadView(Protocol):
    running: int | None
    waiting: int
    saturation: float


class OfferedReplica(Protocol):
    """A Ready replica as the lane needs it (the shell's route)."""

    replica: str
    slots: int
    load: EngineLoadView | None  # the engine's last scraped load; None when unknown
    adapters: Container[str]  # the adapters it serves, by name


class Offer(Protocol):
    """A model's Ready replicas, and how its profile wants them chosen (the shell's routes)."""

    policy: str
    load_factor: float
    replicas: Sequence[OfferedReplica]


@frozen
class Arrival:
    id: Hashable  # unique among the lane's requests that wait
    tenant: str
    band: int
    deadline: float  # when the shell answers it with a timeout
    key: bytes | None = None  # the prefix policy's key; None for the others or without a prompt
    # The adapter the request names; None for the base model. Only replicas that serve it are
    # its candidates (routing.serving).
    adapter: str | None = None


@frozen
class Go:
    """A request let through: charged to ``replica``, to be sent along ``order`` (best first)."""

    id: Hashable
    replica: str
    order: tuple[str, ...]
    outcome: str  # the routing outcome, for the metrics


@frozen
class Queued:
    """The arrival waits; ``wake`` are those let through by the dispatch that followed (the
    arrival itself among them, when it waited for nothing after all)."""

    wake: tuple[Go, ...]


Salt = Callable[[], int]


class AdmissionLane:
    """One model's requests between arrival and their answer's end.

    A request arrives (:meth:`arrive`): it goes at once when nobody waits and a replica may take
    it, else it is queued (or refused when the queue is full). It leaves the lane by going (a
    :class:`Go` from ``arrive`` or :meth:`dispatch`), or by :meth:`leave` (its client went away or
    its deadline came). A request that went holds its replica's slot until :meth:`release`.
    Whenever room may have changed — a request finished, replicas came or went, an engine's load
    was scraped — :meth:`dispatch` says who goes now: first those waiting for one replica, oldest
    first, each decided again as loads are now; then the queue, while a replica has room.
    """

    def __init__(self, max_waiting: int, *, weight: Callable[[int, str], float] | None = None) -> None:
        self.queue = AdmissionQueue(max_waiting, weight=weight)
        self.in_flight: dict[str, int] = {}  # per replica id, only those above 0
        # Waiters taken from the queue to wait for one replica in particular: waiter id → replica
        # id, oldest first. They go before the queue when it frees.
        self.parked: dict[Hashable, str] = {}
        self._waiting: dict[Hashable, Arrival] = {}  # queued or parked
        self.turn = 0  # the round-robin policy's counter

    def busy(self) -> bool:
        return bool(self.in_flight or self._waiting)

    def depth_by_band(self) -> dict[int, int]:
        """Waiting requests per band, those waiting for one replica included."""
        bands = self.queue.depth_by_band()
        for waiter_id in self.parked:
            band = self._waiting[waiter_id].band
            bands[band] = bands.get(band, 0) + 1
        return bands

    def waiting_by_tenant(self) -> dict[tuple[int, str], int]:
        """Waiting requests per (band, tenant), those waiting for one replica included."""
        counts: dict[tuple[int, str], int] = {}
        for arrival in self._waiting.values():
            key = (arrival.band, arrival.tenant)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def waiting_for(self) -> dict[str, int]:
        """Requests waiting for one replica in particular, per replica id."""
        counts: dict[str, int] = {}
        for replica in self.parked.values():
            counts[replica] = counts.get(replica, 0) + 1
        return counts

    def arrive(self, arrival: Arrival, offer: Offer | None, now: float, salt: Salt) -> Go | Queued | Rejected:
        if not self._waiting and offer is not None:
            # Nobody waits: if the request may go now, the queue would hand it the slot at once.
            decision = self._decide(offer, arrival.key, salt, adapter=arrival.adapter)
            if decision is not None and not decision.wait:
                return self._go(arrival.id, decision)
        waiter = Waiter(
            id=arrival.id,
            tenant=arrival.tenant,
            band=arrival.band,
            enqueued_at=now,
            deadline=arrival.deadline,
        )
        pushed = self.queue.push(waiter)
        if isinstance(pushed, Rejected):
            return pushed
        self._waiting[arrival.id] = arrival
        return Queued(wake=self.dispatch(offer, now, salt))

    def dispatch(self, offer: Offer | None, now: float, salt: Salt) -> tuple[Go, ...]:
        """Who goes now. ``offer`` None (no profile serves the model any more): nobody; the
        waiters' deadlines answer them."""
        if not self._waiting or offer is None:
            return ()
        went = []
        for waiter_id in list(self.parked):
            waiter = self._waiting[waiter_id]
            decision = self._decide(offer, waiter.key, salt, parked=waiter_id, adapter=waiter.adapter)
            if decision is None:
                continue  # no replica at all now: it keeps waiting where it was
            if decision.wait:
                self.parked[waiter_id] = decision.choice.order[0]  # keeps its place in line
            else:
                del self.parked[waiter_id]
                went.append(self._go(waiter_id, decision))
        while self.queue:
            candidates = self._candidates(offer)
            if not has_room(candidates):
                break
            popped = self.queue.pop(now)
            if popped.waiter is None:
                break
            waiter_id = popped.waiter.id
            arrival = self._waiting[waiter_id]
            if arrival.adapter is not None:
                decision = self._decide(offer, arrival.key, salt, adapter=arrival.adapter)
            else:
                decision = self._decide(offer, arrival.key, salt, candidates=candidates)
            if decision is None:
                # No replica serving its adapter has room (for the base model, this cannot
                # happen while one has): it waits, decided again at each dispatch.
                self.parked[waiter_id] = ""
            elif decision.wait:
                self.parked[waiter_id] = decision.choice.order[0]
            else:
                went.append(self._go(waiter_id, decision))
        return tuple(went)

    def leave(self, waiter_id: Hashable) -> None:
        """A waiter that will not go: its client went away, or its deadline came."""
        if self._waiting.pop(waiter_id, None) is not None:
            self.queue.cancel(waiter_id)
            self.parked.pop(waiter_id, None)

    def release(self, replica: str) -> None:
        """A request that went is over (answered, failed, or cancelled before it was sent)."""
        # Only busy replicas are kept: replicas come and go over the process's life.
        left = self.in_flight[replica] - 1
        if left:
            self.in_flight[replica] = left
        else:
            del self.in_flight[replica]

    def _go(self, waiter_id: Hashable, decision: Decision) -> Go:
        self._waiting.pop(waiter_id, None)
        choice = decision.choice
        self.turn += 1
        first = choice.order[0]
        self.in_flight[first] = self.in_flight.get(first, 0) + 1
        return Go(id=waiter_id, replica=first, order=choice.order, outcome=choice.outcome)

    def _decide(
        self,
        offer: Offer,
        key: bytes | None,
        salt: Salt,
        parked: Hashable | None = None,
        candidates: list[Candidate] | None = None,
        adapter: str | None = None,
    ) -> Decision | None:
        """core.routing.decide for one request, with the lane's loads (``parked``: the waiter
        being decided again, whose own wait is not counted; ``candidates``: already built;
        ``adapter``: the one it names, which only some replicas may serve)."""
        if candidates is None:
            candidates = self._candidates(offer, leaving=parked, adapter=adapter)
        return decide(
            offer.policy,
            candidates,
            key=key,
            salt=salt(),
            turn=self.turn,
            load_factor=offer.load_factor,
        )

    def _candidates(
        self, offer: Offer, leaving: Hashable | None = None, adapter: str | None = None
    ) -> list[Candidate]:
        in_flight = self.in_flight
        queued: dict[str, int] = {}
        for waiter_id, replica in self.parked.items():
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
            for route in offer.replicas
            if adapter is None or adapter in route.adapters
        ]
