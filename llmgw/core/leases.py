"""Leases: each gateway worker's part of every quota and of every replica's slots.

The control plane (:class:`LeaseLedger`) splits each limit — a subject's requests per minute,
tokens per minute, tokens per day; a replica's slots — into **shares**, one per worker; a worker
(:class:`WorkerLeases`) admits against its own shares alone, as the one-process gate admits
against the whole limit, so no request waits on another process. Shares move by demand: a
worker reports (:class:`LeaseReport`, once per :data:`RENEW_INTERVAL`, or at once when it refused
a request for want of share) what its windows hold, what it was refused, its requests in flight
per replica and its waiters per tenant; the ledger answers (:class:`LeaseGrant`) with the shares
that changed and a renewal of the whole lease.

**The ledger's invariant.** For every limit, the *charges* of all workers sum to at most the limit.
A worker's charge is ``max(using, held)``: ``using`` the largest share it may still be admitting
against (a share the ledger lowered counts at its old size until the worker's report says it has
applied the grant that lowered it), ``held`` what it last reported its window to hold (requests in
flight, for slots). A share is raised only into room the charges leave. So a share taken back
from one worker is grantable to another only once the first has said that its window (or its
in-flight count) has come down below its reduced share.

**Why that bounds the sum.** A worker admits only while, with the request, its window holds at
most its share; without admissions its window only empties. So at any moment what it holds is at
most its charge as the ledger has it (the ledger's figure only lags behind a fall). Take any
interval of one window's span and its last admission, by any worker, at ``t``: every worker's
window at ``t`` covers the interval, so the interval's admissions are at most what all windows
hold at ``t``, at most the sum of charges, at most the limit. Hence:

- **Tokens**: in any interval of one span, the tokens of the requests admitted in it (across all
  workers) are at most ``max(limit, e) + overrun``, exactly the one-process bound of core.quota:
  ``e`` a request larger than the whole limit, admitted alone (only by a worker whose share is
  the whole limit, with an empty window — so every other worker's charge is 0), ``overrun`` what
  requests still running at the interval's last admission used beyond their estimate. Without
  overruns: never more than the limit plus one request's reservation (in fact never more than the
  limit, unless one request is larger than it). With 64 clients over two workers this is what
  tests/core/test_leases.py proves with hypothesis, grants and reports delayed in flight.
- **Requests per minute** never exceed the limit.
- **Slots**: a replica never has more requests in flight, over all workers, than its slots (as the
  ledger knew them when the requests started) — while a control plane answers. Past a lease
  without one, a worker that holds none of a replica's slots takes one anyway (see Silence).

**Silence.** A grant renews the worker's lease for :data:`LEASE_TTL`, counted from when the worker
*sent* the report it answers (its own clock; the ledger counts from the grant, which came later,
so the worker's count always ends first whatever the two clocks' offsets). A lease past its time
does not lapse: a worker cut off from the control plane — the server killed, restarting, or gone
for hours — keeps admitting on its last shares for as long as it runs, which is what lets the
data plane outlive the control plane. That is safe because shares are only ever taken back with
the holder's agreement: the ledger gives a silent worker no new share, but keeps charging it its
last one, and never gives that to anyone else while the worker may be admitting on it. The only
way a silent worker's shares come back is :meth:`LeaseLedger.gone`: its process is known to have
ended (the server's shell kills a worker it has not heard from for a lease's length, by pid and
start time, before it says so). Then its slots are free at once (its requests died with it), and
its quota charges stay until what it admitted has left every window, one window's reach later
(65 s for the minute limits, 25 h for the day's), under a name of their own: the worker the shell
starts in its place is a new process to the ledger, with an empty book.

Frozen shares are where demand left them when the control plane went, which can be all of a
replica's slots with one worker. Past its lease, a worker therefore fills at least one slot of
each replica it routes to (:meth:`WorkerLeases.slots`), whatever its share: the replica may run
up to one request more per such worker than its slots, which its engine queues — better than
that worker's clients all answered 503 until a control plane is back. Its reports still say the
share as granted, so a new ledger adopts nothing it did not give. Quotas get no such floor: a
quota holds exactly, control plane or not.

**Demand.** Each limit is split by max-min fairness over the workers' demands (a quota's demand:
what the worker's window holds plus what it was refused or is about to run short of; a slot's:
its requests in flight plus its waiters), and what nobody demands is split evenly, so that an
idle worker's first request goes at once. A request larger than a worker's share is refused with
``retry_after`` of one :data:`RENEW_INTERVAL` (its demand goes out with the next report); one that
would fit the share once the worker's own older requests leave the window is told exactly when
(core.quota's ``retry_after``, for the lease as it stands). The price of splitting: a single
client whose connections move between workers can be refused once by a worker whose share went
to the other, until the next grant (a second).

**Fairness inside a band across workers.** Slots go to workers in proportion to their weight in
the highest band anyone waits in: a worker's weight is the sum, over the band's tenants, of its
fraction of that tenant's waiters, so a tenant counts once however many workers hold its waiters.
Each worker's own lane rotates between its tenants, each weighted by that same fraction (the
grant carries it: :class:`TenantWeight`; core.admission serves a tenant of weight 1/2 every
other round). So a worker's slots go to its tenants in proportion to their fractions, and a
tenant's slots over all workers are the sum of its fractions' parts: an equal share of the
replica per tenant, however its waiters are spread — up to rounding to whole slots (with 6
slots and tenants 3:1 over two workers, 5:1 — the lone tenant has one slot, 1/6, not 1/4).
Moving slots between workers to even out the rounding over time was tried and lost more to the
drain than it gave.

**Restart.** A new ledger adopts each worker's shares from its first report (the old control
plane's invariant still holds for them). Built with ``awaiting`` (the workers it adopted), it
raises no share until each has reported or is gone, so nothing is handed out twice: the shell
kills an adopted worker that does not report within a lease's length. A worker that died while
no control plane ran is forgotten, as today's single process forgets every quota when it
restarts.

Call sequence, the worker's side (its shell, on trio's clock)::

    leases = WorkerLeases("w1")
    # every RENEW_INTERVAL, or at once when leases.wants_report():
    stream.send(leases.report(now, in_flight=lane.in_flight, waiting=waiting_per_tenant))
    # for each grant received:
    leases.apply(grant, now)
    # per request, as Gate.admit/finish do with QuotaBook today:
    reserved = leases.reserve({("tenant", t): tenant_limits, ("key", k): key_limits}, estimate, now)
    ... leases.settle(reserved, used) / leases.release(reserved)
    # the lane's offer: each replica with leases.slots(replica_id, now) slots

The control plane's side::

    ledger = LeaseLedger(now, awaiting=adopted_worker_ids)
    ledger.set_limits(("tenant", t), limits)            # for every subject, on every change
    ledger.set_replicas({replica_id: (model, slots)})   # on every routing change
    # for each report received from a worker:
    ledger.receive(report, now)
    stream_of(report.worker).send(ledger.grant(report.worker, now))

Pure: ``now`` is a parameter (the caller's own clock); nothing here does I/O. Messages are
frozen attrs with plain fields, for the link's codec.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Literal

import attrs

from llmgw.core.quota import DAY, MINUTE, Allowance, Limits, QuotaBook, Refused, Reservation, Window

frozen = attrs.frozen(kw_only=True)

# How long a lease lasts without renewal: longer than a control-plane restart takes, so a worker
# keeps serving limited tenants through one (the data plane survives the control plane), short
# enough that a dead worker's unused shares come back within a minute or so.
LEASE_TTL = 30.0
# How often a worker reports: how fast shares follow demand, and what a request refused for want
# of share is told to wait.
RENEW_INTERVAL = 1.0
# How long a worker keeps asking for what it was refused: a cut must reach another worker and be
# acknowledged (two of that worker's rounds) before the room is grantable, so one report's worth
# of demand would be forgotten before it could be met.
DEMAND_MEMORY = 5 * RENEW_INTERVAL

LIMIT_NAMES: tuple[Literal["rpm", "tpm", "tpd"], ...] = ("rpm", "tpm", "tpd")
_WINDOW_OF = {"rpm": MINUTE, "tpm": MINUTE, "tpd": DAY}

Subject = tuple[str, str]  # ("tenant", id) or ("key", id)


def reach(window: Window) -> float:
    """How long an admission stays counted in a window: its span plus one bucket."""
    return window.span_seconds + window.bucket_seconds


# --- messages ----------------------------------------------------------------------------------


@frozen
class QuotaShare:
    """A worker's share of one limit of one subject (0: none)."""

    kind: str  # "tenant" or "key"
    id: str
    limit: str  # "rpm", "tpm" or "tpd"
    share: int


@frozen
class SlotShare:
    """A worker's share of one replica's slots (0: none)."""

    replica: str
    share: int


@frozen
class LeaseGrant:
    """The ledger's answer to a report: the shares that changed, and the whole lease renewed."""

    worker: str
    seq: int  # this grant's number, for the worker's acknowledgement
    answers: int  # the report it answers: the lease runs from when that report was sent
    ttl: float
    quotas: tuple[QuotaShare, ...] = ()
    slots: tuple[SlotShare, ...] = ()
    full: bool = False  # the complete lease: shares not named here are 0
    # The worker's part of each tenant it holds waiters of, where other workers hold some too
    # (1 where it holds them all, which is not sent): always the whole list, replacing the last.
    weights: tuple[TenantWeight, ...] = ()


@frozen
class TenantWeight:
    """A worker's part (0 to 1) of a tenant's waiters for a model in a band, over all workers."""

    model: str
    band: int
    tenant: str
    weight: float


@frozen
class QuotaDemand:
    kind: str
    id: str
    limit: str
    share: int  # what the worker admits against now
    held: int  # what its window holds
    wanted: int  # refused, or about to run short of, since its last report


@frozen
class SlotDemand:
    replica: str
    share: int
    in_flight: int


@frozen
class Waiting:
    """A worker's requests waiting for a model, per band and tenant."""

    model: str
    band: int
    tenant: str
    count: int


@frozen
class LeaseReport:
    worker: str
    seq: int
    acked: int  # the last grant applied (0: none)
    quotas: tuple[QuotaDemand, ...] = ()
    slots: tuple[SlotDemand, ...] = ()
    waiting: tuple[Waiting, ...] = ()


# --- splitting a limit ---------------------------------------------------------------------------


def share_out(
    capacity: int, demands: Mapping[str, int], weights: Mapping[str, float] | None = None, turn: int = 0
) -> dict[str, int]:
    """``capacity`` split among the workers of ``demands``, whole units summing to ``capacity``.

    Weighted max-min fairness: workers with demand (and, given ``weights``, positive weight) get
    shares in proportion to their weights (1 each without ``weights``), none more than it
    demands; what is left once every demand is met is split evenly among all. Rounding by largest
    remainder; ties go to the workers in id order rotated by ``turn``, so that a caller that
    counts its rounds in ``turn`` hands a unit both could claim to each in turn (a replica's 6
    slots at weights 3:1 are 5:1 and 4:2 by turns: 4.5:1.5 over time).
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, not {capacity}")
    workers = sorted(demands)
    out = dict.fromkeys(workers, 0)
    if not workers:
        return out
    weight = {w: (1.0 if weights is None else float(weights.get(w, 0.0))) for w in workers}
    active = [w for w in workers if demands[w] > 0 and weight[w] > 0]
    exact: dict[str, float] = {}
    rest = float(capacity)
    total_weight = sum(weight[w] for w in active)
    # Fill the least demanding (per weight) first; once one's demand exceeds the level, every
    # later one does too, and the rest is shared at that level.
    for i, w in enumerate(sorted(active, key=lambda w: (demands[w] / weight[w], w))):
        level = rest / total_weight
        if demands[w] <= level * weight[w]:
            exact[w] = demands[w]
            rest -= demands[w]
            total_weight -= weight[w]
            continue
        for v in sorted(active, key=lambda w: (demands[w] / weight[w], w))[i:]:
            exact[v] = level * weight[v]
        rest = 0.0
        break
    rank = {w: (i - turn) % len(workers) for i, w in enumerate(workers)}
    _round_into(out, exact, round(capacity - rest), rank)
    leftover = capacity - sum(out.values())
    if leftover:
        _round_into(out, {w: leftover / len(workers) for w in workers}, leftover, rank)
    return out


def _round_into(out: dict[str, int], exact: Mapping[str, float], total: int, rank: Mapping[str, int]) -> None:
    """Add to ``out`` whole parts of ``exact`` summing to ``total`` (largest remainder)."""
    floors = {w: math.floor(x + 1e-9) for w, x in exact.items()}
    for w, x in floors.items():
        out[w] += x
    left = total - sum(floors.values())
    for w in sorted(exact, key=lambda w: (-round(exact[w] - floors[w], 9), rank[w]))[: max(0, left)]:
        out[w] += 1


# --- the worker's side ------------------------------------------------------------------------


class WorkerLeases:
    """One worker's leases and its quota book: admits locally, reports demand, applies grants."""

    def __init__(self, worker: str, *, renew_interval: float = RENEW_INTERVAL) -> None:
        self.worker = worker
        self.renew_interval = renew_interval
        self.book = QuotaBook()
        self._quota: dict[tuple[Subject, str], int] = {}  # (subject, limit) → share
        self._slots: dict[str, int] = {}  # replica → share
        self._weights: dict[tuple[str, int, str], float] = {}  # (model, band, tenant) → its part
        self._wanted: dict[tuple[Subject, str], int] = {}  # since the last report
        self._kept: dict[tuple[Subject, str], tuple[int, float]] = {}  # demand still asked: until
        self._held_seen: set[tuple[Subject, str]] = set()  # pools reported with something held
        self._sent: dict[int, float] = {}  # unanswered report → when it was sent
        self._seq = 0
        self._acked = 0
        self._refused_for_share = False
        self._granted = False
        # When the control plane will count this worker silent unless it hears from it again
        # (on this worker's clock): shown as the lease's time left; the shares do not lapse.
        self.expires_at = -math.inf

    def live(self, now: float) -> bool:
        """It holds shares: from its first grant on, for as long as it runs (see Silence)."""
        return self._granted

    def share(self, subject: Subject, limit: str, now: float) -> int:
        return self._quota.get((subject, limit), 0) if self.live(now) else 0

    def lapsed(self, now: float) -> bool:
        """No control plane has renewed the lease for its length (the server killed, restarting
        or cut off): one that runs counts this worker silent, and moves no share to it."""
        return self._granted and now >= self.expires_at

    def slots(self, replica: str, now: float) -> int:
        """The replica's slots this worker may fill now: its share (0 before its first grant).
        Past its lease, at least one (see Silence): shares frozen as they were when the control
        plane went would leave a worker that then held none of a replica's slots answering 503
        to every client the kernel gives it, for as long as the control plane is away."""
        share = self._slot_share(replica)
        return max(share, 1) if self.lapsed(now) else share

    def _slot_share(self, replica: str) -> int:
        return self._slots.get(replica, 0) if self._granted else 0

    def tenant_weight(self, model: str, band: int, tenant: str) -> float:
        """The tenant's weight in this worker's rotation for ``model`` (see the module's fairness
        note): its part of the tenant's waiters over all workers, 1 where this one holds all."""
        return self._weights.get((model, band, tenant), 1.0)

    def slot_shares(self) -> dict[str, int]:
        """Each replica's slots this worker holds (for its /metrics)."""
        return dict(self._slots)

    def quota_shares(self) -> tuple[tuple[str, str, str, int], ...]:
        """Each quota this worker holds a share of: (kind, id, limit, share), for its reports."""
        return tuple(sorted((kind, id_, limit, share) for ((kind, id_), limit), share in self._quota.items()))

    def wants_report(self) -> bool:
        """A request was refused for want of share, or a share was cut: report now rather than
        at the next tick."""
        return self._refused_for_share

    def reserve(
        self, quotas: Mapping[Subject, Limits], estimate_tokens: int, now: float
    ) -> Reservation | Refused:
        """Count a request against this worker's shares of every limit of ``quotas`` (the whole
        limits, as the control plane pushed them), as QuotaBook.reserve does against a limit."""
        allowances: dict[Hashable, dict] = {}
        for subject, limits in quotas.items():
            per = allowances[subject] = {}
            for name in LIMIT_NAMES:
                limit = getattr(limits, name)
                if limit is not None:
                    share = min(self.share(subject, name, now), limit)
                    per[name] = Allowance(amount=share, alone=share >= limit)
        result = self.book.reserve_within(allowances, estimate_tokens, now)
        short_of_share = True  # every pool that refused it is a share smaller than its limit
        for subject, per in allowances.items():
            usage = self.book.usage(subject, now)
            for name, allowance in per.items():
                cost = 1 if name == "rpm" else estimate_tokens
                held = getattr(usage, name)
                pool = (subject, name)
                if isinstance(result, Refused):
                    if held + cost > allowance.amount:
                        self._wanted[pool] = self._wanted.get(pool, 0) + cost
                        short_of_share = short_of_share and not allowance.alone
                else:
                    self._kept.pop(pool, None)  # what it was refused for is in now (or went)
                    if held + cost > allowance.amount:
                        # Admitted, but the next one like it would not fit: ask ahead.
                        self._wanted[pool] = max(self._wanted.get(pool, 0), cost)
        if not isinstance(result, Refused):
            return result
        if short_of_share:
            # The room may be another worker's: ask for it now, not at the next tick, since the
            # request waits for the grant that brings it (the gate's SHARE_WAIT).
            self._refused_for_share = True
        retry_after = self.renew_interval if math.isinf(result.retry_after) else result.retry_after
        return Refused(
            subject=result.subject, limit=result.limit, retry_after=retry_after, short_of_share=short_of_share
        )

    def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        self.book.settle(reservation, actual_tokens)

    def release(self, reservation: Reservation) -> None:
        self.book.release(reservation)

    def report(
        self, now: float, *, in_flight: Mapping[str, int] | None = None, waiting: Iterable[Waiting] = ()
    ) -> LeaseReport:
        """What this worker holds and wants; send it to the control plane."""
        self._seq += 1
        self._sent[self._seq] = now
        quotas = []
        for pool, wanted in self._wanted.items():
            self._kept[pool] = (wanted, now + DEMAND_MEMORY)
        for pool in [p for p, (_, until) in self._kept.items() if until <= now]:
            del self._kept[pool]
        pools = set(self._quota) | set(self._kept) | self._held_seen
        held_now = set()
        for subject, name in sorted(pools):
            held = getattr(self.book.usage(subject, now), name)
            if held:
                held_now.add((subject, name))
            quotas.append(
                QuotaDemand(
                    kind=subject[0],
                    id=subject[1],
                    limit=name,
                    share=self.share(subject, name, now),
                    held=held,
                    wanted=self._kept.get((subject, name), (0, 0.0))[0],
                )
            )
        self._held_seen = held_now
        self._wanted.clear()
        self._refused_for_share = False
        in_flight = in_flight or {}
        slots = tuple(
            # The share as granted, never the lapsed floor: a new ledger adopts what this says.
            SlotDemand(replica=r, share=self._slot_share(r), in_flight=in_flight.get(r, 0))
            for r in sorted(set(self._slots) | {r for r, n in in_flight.items() if n})
        )
        return LeaseReport(
            worker=self.worker,
            seq=self._seq,
            acked=self._acked,
            quotas=tuple(quotas),
            slots=slots,
            waiting=tuple(waiting),
        )

    def apply(self, grant: LeaseGrant, now: float) -> None:
        """Take the grant's shares; the lease runs ``ttl`` from when the answered report left."""
        if grant.worker != self.worker:
            raise ValueError(f"grant for worker {grant.worker!r} applied to worker {self.worker!r}")
        if grant.seq <= self._acked:
            return  # an old grant: the shares it would set were already replaced
        before = (dict(self._quota), dict(self._slots))
        if grant.full:
            self._quota.clear()
            self._slots.clear()
        for q in grant.quotas:
            pool = ((q.kind, q.id), q.limit)
            if q.share > 0:
                self._quota[pool] = q.share
            else:
                self._quota.pop(pool, None)
        for s in grant.slots:
            if s.share > 0:
                self._slots[s.replica] = s.share
            else:
                self._slots.pop(s.replica, None)
        # A cut is only in force for the ledger once this worker says it applied it: saying so at
        # once (not at the next tick) is what lets the share move on to whoever waits for it.
        for old, new in zip(before, (self._quota, self._slots), strict=True):
            if any(new.get(pool, 0) < share for pool, share in old.items()):
                self._refused_for_share = True
        self._weights = {(w.model, w.band, w.tenant): w.weight for w in grant.weights}
        self._granted = True
        sent = self._sent.get(grant.answers)
        if sent is not None:
            self.expires_at = max(self.expires_at, sent + grant.ttl)
        for seq in [seq for seq in self._sent if seq <= grant.answers]:
            del self._sent[seq]
        self._acked = grant.seq


# --- the control plane's side -----------------------------------------------------------------


@attrs.define
class _Hold:
    """One worker's part of one pool, as the ledger sees it."""

    share: int = 0  # the latest share decided
    sent: int = 0  # the share the latest grant sent carried
    using: int = 0  # the most it may still admit against (until it acknowledges the latest change)
    held: int = 0  # its window's count, or its requests in flight, as last reported
    demand: int = 0
    weight: float = 0.0  # slots: its weight in the band being served

    @property
    def charge(self) -> int:
        return max(self.using, self.held)


@attrs.define
class _Pool:
    capacity: int
    linger: float  # how long after a worker is gone its charge stays (its windows' reach)
    holds: dict[str, _Hold] = attrs.field(factory=dict)

    def charged(self) -> int:
        return sum(h.charge for h in self.holds.values())


@attrs.define
class _Worker:
    expires: float = -math.inf  # on the ledger's clock
    gone_at: float | None = None
    seq: int = 0  # grants sent
    answered: int = 0  # the last report received
    acked: int = 0
    reported: bool = False
    granted: bool = False  # a full grant has been sent
    pending: set = attrs.field(factory=set)  # pools whose share changed since the last grant
    unacked: dict = attrs.field(factory=dict)  # pool → the grant that last changed its share
    in_report: set = attrs.field(factory=set)  # pools named in the last report


PoolKey = tuple  # ("quota", kind, id, limit) or ("slot", replica)


class LeaseLedger:
    """The control plane's record of every worker's shares; see the module docstring."""

    def __init__(
        self,
        now: float,
        *,
        ttl: float = LEASE_TTL,
        awaiting: Iterable[str] = (),
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, not {ttl}")
        self.ttl = ttl
        self._pools: dict[PoolKey, _Pool] = {}
        self._workers: dict[str, _Worker] = {}
        self._models: dict[str, str] = {}  # replica → model
        self._waiting: dict[str, tuple[Waiting, ...]] = {}  # worker → its last report's waiters
        self._dirty: set[PoolKey] = set()
        self._awaiting = set(awaiting)

    # --- what is split ---------------------------------------------------------------------------

    def set_limits(self, subject: Subject, limits: Limits | None) -> None:
        """A subject's limits (None: it has none any more). Unlimited limits have no pool."""
        for name in LIMIT_NAMES:
            limit = None if limits is None else getattr(limits, name)
            self._set_pool(("quota", subject[0], subject[1], name), limit, reach(_WINDOW_OF[name]))

    def set_replicas(self, replicas: Mapping[str, tuple[str, int]]) -> None:
        """Every Ready replica: id → (model, slots). Replicas left out have no slots to lease."""
        for key in [k for k in self._pools if k[0] == "slot" and k[1] not in replicas]:
            self._set_pool(key, None, 0.0)
        self._models = {replica: model for replica, (model, _) in replicas.items()}
        for replica, (_, slots) in replicas.items():
            # A gone worker's slots are free at once (gone() drops them): its requests died with it.
            self._set_pool(("slot", replica), slots, 0.0)

    def _set_pool(self, key: PoolKey, capacity: int | None, linger: float) -> None:
        pool = self._pools.get(key)
        if capacity is None:
            if pool is not None:
                del self._pools[key]
                for worker, hold in pool.holds.items():
                    if hold.share and worker in self._workers:
                        self._workers[worker].pending.add(key)
            return
        if capacity < 0:
            raise ValueError(f"capacity of {key!r} must be >= 0, not {capacity}")
        if pool is None:
            pool = self._pools[key] = _Pool(capacity=capacity, linger=linger)
            for name, worker in self._workers.items():
                if worker.granted:
                    pool.holds[name] = _Hold()
        pool.capacity = capacity
        pool.linger = linger
        self._dirty.add(key)

    # --- reports and grants ------------------------------------------------------------------

    def receive(self, report: LeaseReport, now: float) -> None:
        worker = self._workers.get(report.worker)
        if worker is None:
            # Any lease it holds (a previous control plane's) answered a report sent before now,
            # so it ends within one ttl from now: charge it until then at least.
            worker = self._workers[report.worker] = _Worker(expires=now + self.ttl)
            # A worker that outlived an earlier control plane has applied that one's grants up
            # to report.acked: this ledger's numbers go on from there, or the worker would take
            # its grants for old ones and drop them (for as many grants as the old one sent).
            worker.seq = worker.acked = report.acked
        if report.seq <= worker.answered:
            return  # older than one already taken in
        worker.answered = report.seq
        worker.reported = True
        worker.gone_at = None
        self._awaiting.discard(report.worker)
        worker.acked = max(worker.acked, report.acked)
        for key, seq in list(worker.unacked.items()):
            if seq <= worker.acked:
                del worker.unacked[key]
                hold = self._pools[key].holds.get(report.worker) if key in self._pools else None
                if hold is not None:
                    # The grant is in force; a change decided since then and not yet sent counts
                    # if it is a raise (a cut is not in force until it too is acknowledged).
                    hold.using = max(hold.sent, hold.share)
                    self._dirty.add(key)
        named = set()
        for q in report.quotas:
            key = ("quota", q.kind, q.id, q.limit)
            named.add(key)
            self._take(report.worker, worker, key, q.share, q.held, q.held + q.wanted)
        waiting_by_model: dict[str, int] = {}
        for w in report.waiting:
            waiting_by_model[w.model] = waiting_by_model.get(w.model, 0) + w.count
        # Every replica of a model it has waiters for is in its demand, leased to it or not.
        slot_reports = {s.replica: s for s in report.slots}
        for replica, model in self._models.items():
            s = slot_reports.get(replica)
            if s is None and not waiting_by_model.get(model):
                continue
            key = ("slot", replica)
            named.add(key)
            in_flight = s.in_flight if s is not None else 0
            share = s.share if s is not None else 0
            self._take(
                report.worker, worker, key, share, in_flight, in_flight + waiting_by_model.get(model, 0)
            )
        for key in worker.in_report - named:
            hold = self._pools[key].holds.get(report.worker) if key in self._pools else None
            if hold is not None:
                hold.held = hold.demand = 0
                self._dirty.add(key)
        worker.in_report = named
        self._waiting[report.worker] = report.waiting
        for key in self._pools:
            if key[0] == "slot":
                self._dirty.add(key)  # waiters moved: the weights of every replica's split

    def _take(self, name: str, worker: _Worker, key: PoolKey, share: int, held: int, demand: int) -> None:
        pool = self._pools.get(key)
        if pool is None:
            return  # a limit that is gone, or a replica the ledger does not know (yet)
        hold = pool.holds.get(name)
        if hold is None:
            # A share this ledger did not grant: the previous control plane's, adopted.
            hold = pool.holds[name] = _Hold(share=share, sent=share, using=share)
        hold.held = held
        hold.demand = demand
        self._dirty.add(key)

    def gone(self, worker: str, now: float) -> None:
        """The worker's process is known to have ended: its requests ended with it, and it
        admits nothing more. The only way a silent worker's shares come back (see Silence)."""
        self._awaiting.discard(worker)
        w = self._workers.pop(worker, None)
        self._waiting.pop(worker, None)
        if w is None:
            return
        w.expires = min(w.expires, now)
        w.gone_at = now
        # Its quota charges stay under a name of their own until its windows drain: the worker
        # started again under its name is a new process, with an empty book and no shares.
        tomb = f"{worker}\0{now!r}"
        self._workers[tomb] = w
        for key, pool in self._pools.items():
            hold = pool.holds.pop(worker, None)
            if hold is not None:
                if key[0] == "quota":
                    pool.holds[tomb] = hold
                self._dirty.add(key)

    def grant(self, worker: str, now: float) -> LeaseGrant:
        """The answer to the worker's last report: changed shares, the lease renewed."""
        w = self._workers.get(worker)
        if w is None or not w.reported:
            raise ValueError(f"worker {worker!r} has not reported: a grant answers a report")
        w.expires = now + self.ttl
        w.gone_at = None
        if not w.granted:
            for key, pool in self._pools.items():
                pool.holds.setdefault(worker, _Hold())
                self._dirty.add(key)
        self._sweep(now)
        can_raise = not self._awaiting
        for key in sorted(self._dirty, key=repr):
            if key in self._pools:
                self._rebalance(key, self._pools[key], now, can_raise)
        self._dirty.clear()
        w.seq += 1
        full = not w.granted
        keys = (
            [k for k, p in self._pools.items() if worker in p.holds] if full else sorted(w.pending, key=repr)
        )
        quotas, slots = [], []
        for key in keys:
            pool = self._pools.get(key)
            hold = pool.holds.get(worker) if pool is not None else None
            share = hold.share if hold is not None else 0
            if full and share == 0:
                continue
            if hold is not None:
                w.unacked[key] = w.seq
                hold.sent = share
            if key[0] == "quota":
                quotas.append(QuotaShare(kind=key[1], id=key[2], limit=key[3], share=share))
            else:
                slots.append(SlotShare(replica=key[1], share=share))
        w.pending.clear()
        w.granted = True
        return LeaseGrant(
            worker=worker,
            seq=w.seq,
            answers=w.answered,
            ttl=self.ttl,
            quotas=tuple(quotas),
            slots=tuple(slots),
            full=full,
            weights=self._tenant_weights(worker, now),
        )

    def due(self) -> list[str]:
        """Workers with changed shares not yet sent: a grant for each now (rather than with the
        answer to its next report) moves a share in one round trip."""
        return sorted(
            name for name, w in self._workers.items() if w.pending and w.reported and w.gone_at is None
        )

    # --- what the ledger holds, for metrics and tests ----------------------------------------

    def shares(self, key: PoolKey) -> dict[str, int]:
        pool = self._pools.get(key)
        return {} if pool is None else {w: h.share for w, h in pool.holds.items()}

    def charged(self, key: PoolKey) -> int:
        pool = self._pools.get(key)
        return 0 if pool is None else pool.charged()

    def capacity(self, key: PoolKey) -> int | None:
        pool = self._pools.get(key)
        return None if pool is None else pool.capacity

    def pools(self) -> int:
        return len(self._pools)

    # --- inside ------------------------------------------------------------------------------

    def _live(self, worker: str, now: float) -> bool:
        w = self._workers.get(worker)
        return w is not None and now < w.expires

    def _sweep(self, now: float) -> None:
        """Silent workers get no new shares; a gone one's charges go once its windows drained."""
        dead = {name: w for name, w in self._workers.items() if now >= w.expires}
        if not dead:
            return
        for key, pool in self._pools.items():
            for name in [n for n in pool.holds if n in dead]:
                hold = pool.holds[name]
                if hold.share or hold.demand:
                    hold.share = hold.demand = 0  # its target: nothing; its charge stays
                    self._dirty.add(key)
                gone_at = dead[name].gone_at
                if gone_at is not None and now >= gone_at + pool.linger:
                    del pool.holds[name]
                    self._dirty.add(key)
        for name in dead:
            if not any(name in pool.holds for pool in self._pools.values()):
                del self._workers[name]
                self._waiting.pop(name, None)

    def _rebalance(self, key: PoolKey, pool: _Pool, now: float, can_raise: bool) -> None:
        live = [name for name in pool.holds if self._live(name, now)]
        weights = self._slot_weights(key[1], live) if key[0] == "slot" else None
        # What silent and gone workers are still charged is not there to split: the live ones
        # share the rest, so that one waiting is not left behind another's even half.
        kept = sum(hold.charge for name, hold in pool.holds.items() if name not in live)
        targets = share_out(
            max(0, pool.capacity - kept), {name: pool.holds[name].demand for name in live}, weights
        )
        for name, hold in pool.holds.items():
            target = targets.get(name, 0)
            if target < hold.share:
                self._set_share(key, name, hold, target)
        if not can_raise:
            return
        free = pool.capacity - pool.charged()
        for name in sorted(live, key=lambda n: (-(targets[n] - pool.holds[n].share), n)):
            hold = pool.holds[name]
            new = min(targets[name], hold.charge + max(free, 0))
            if new > hold.share:
                before = hold.charge
                self._set_share(key, name, hold, new)
                free -= hold.charge - before

    def _set_share(self, key: PoolKey, name: str, hold: _Hold, share: int) -> None:
        hold.share = share
        hold.using = max(hold.using, share)
        w = self._workers.get(name)
        if w is not None:
            w.pending.add(key)

    def _tenant_weights(self, worker: str, now: float) -> tuple[TenantWeight, ...]:
        """The worker's part of each tenant's waiters it holds, where live others hold some too."""
        totals: dict[tuple[str, int, str], int] = {}
        for name, waits in self._waiting.items():
            if name == worker or self._live(name, now):
                for w in waits:
                    if w.count > 0:
                        key = (w.model, w.band, w.tenant)
                        totals[key] = totals.get(key, 0) + w.count
        return tuple(
            TenantWeight(model=w.model, band=w.band, tenant=w.tenant, weight=w.count / total)
            for w in self._waiting.get(worker, ())
            if w.count > 0 and (total := totals[(w.model, w.band, w.tenant)]) > w.count
        )

    def _slot_weights(self, replica: str, live: list[str]) -> dict[str, float] | None:
        """Each live worker's weight for the replica's model: its part of each tenant waiting in
        the highest band anyone waits in; None (even, by demand) when nobody waits."""
        model = self._models.get(replica)
        waits = [w for name in live for w in self._waiting.get(name, ()) if w.model == model and w.count > 0]
        if not waits:
            return None
        top = max(w.band for w in waits)
        totals: dict[str, int] = {}
        for w in waits:
            if w.band == top:
                totals[w.tenant] = totals.get(w.tenant, 0) + w.count
        weights = dict.fromkeys(live, 0.0)
        for name in live:
            for w in self._waiting.get(name, ()):
                if w.model == model and w.band == top and w.count > 0:
                    weights[name] += w.count / totals[w.tenant]
        # A worker with requests in flight but none waiting keeps what it runs (its demand), no
        # more: weight for it would only matter once its demand exceeds what is in flight.
        return {name: weight for name, weight in weights.items() if weight > 0} | {
            name: 1e-9 for name in live if weights[name] == 0
        }
