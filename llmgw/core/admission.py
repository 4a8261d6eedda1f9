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

The queue only decides order; whether a replica has room is the shell's question.

Pure: ``now`` is a parameter. A waiter is expired once ``now >= deadline``, the moment at which
``trio.move_on_at(deadline)`` would fire in the shell.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable

import attrs

frozen = attrs.frozen(kw_only=True)

# Seconds a refused client is told to wait (Retry-After). The queue cannot know how fast the
# replicas drain it; a second is long enough not to be hammered by retries and short against
# any sensible wait timeout.
RETRY_AFTER = 1.0

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

    def take_next(self) -> Waiter:
        tenant, fifo = next(iter(self.rotation.items()))
        _, waiter = fifo.popitem(last=False)
        self.size -= 1
        if fifo:
            self.rotation.move_to_end(tenant)
        else:
            del self.rotation[tenant]
        return waiter


class AdmissionQueue:
    """The waiting requests of one model, in dispatch order.

    Costs: push O(log n) (the deadline heap), cancel O(1), pop O(bands + log n) per waiter it
    returns or expires. Bands are the few priority levels of the API keys, so finding the highest
    non-empty one by looking at all of them is cheaper than keeping them sorted.
    """

    def __init__(self, max_waiting: int, *, retry_after: float = RETRY_AFTER) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, not {max_waiting}")
        self.max_waiting = max_waiting
        self.retry_after = retry_after
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
        waiter = band.take_next()
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
