"""Quotas: requests per minute, tokens per minute and tokens per day, per tenant and per api key.

Reserve at admission, settle afterwards. Checking the counters and recording the request only
once it is done lets every request that arrives while the others run see the same room, so 64
concurrent requests against a quota with room for one all get in (a widely used gateway has this
bug). Here one step checks and counts: a request is counted, with its estimated tokens, the moment
it is admitted, and the next request's check already sees it. When the request ends its estimate
is replaced by what it really used (:meth:`QuotaBook.settle`), or the request and its tokens are
handed back when it failed before the engine did any work (:meth:`QuotaBook.release`). The
estimate is the caller's: max_tokens plus the prompt's tokens, or a configured figure.

Subjects are whatever the caller counts under, e.g. ``("tenant", id)`` and ``("key", id)``; a
request is counted under every subject it is reserved for and must fit every one's limits.

**Windows.** A sliding window made of fixed buckets: a request counts in the bucket of its
admission time, and a window holds the current bucket and the buckets of one whole span before
it: 5 s buckets, 13 of them for the minute; 1 h buckets, 25 for the day. The bucket beyond the
span is what makes the limit hold for every real interval: any 60 s interval lies within the 13
buckets a window holds at its last admission, so no 60 s interval (24 h for the day) admits more
than the limit. The price: a window reaches back between one span and one span plus a bucket, so a
client pacing itself exactly at its limit may get only 12/13 of it, and a refusal lasts until a
bucket boundary. Buckets rather than a token bucket (GCRA) because settlement must correct the
count where the reservation was made, which is one subtraction in its bucket, while a token
bucket keeps no record of when tokens were taken; and because a token bucket lets a full burst
plus a minute's refill through in one minute.

**Admission.** A request is admitted when, for each limit, what the window holds plus the
request's cost (1 request, or its estimated tokens) is within the limit, or the window holds
nothing. The exception is for a request larger than a whole limit (max_tokens above the tokens per
minute): it could never fit and would be refused for ever, so it may run alone in an empty window.

**The bound.** In any interval of one span, the tokens of the requests admitted in it (what they
used, their estimate while they run) are at most ``max(limit, e) + overrun``, where ``e`` is the
estimate of the interval's last admission and ``overrun`` the sum of ``actual - estimate`` over
the interval's requests that were still running at that admission and used more than estimated.
When no request uses more than its estimate, that is ``max(limit, e)``: never more than the limit
plus one request's reservation. Requests per minute never exceed their limit at all. A settlement above its estimate is allowed to push a window over
(the request has been served); it only holds back the requests after it.

**retry_after** is exact with the counters as they stand: absent any other reservation,
settlement or release, reserving ``retry_after`` seconds later succeeds and reserving any earlier
fails. The counts a window holds change only at bucket boundaries, so it is the first boundary at
which every limit admits the request.

**Settlement** adjusts the buckets the reservation was counted in, found from its admission time,
not the current ones. A bucket that has left its window is no longer counted by anyone, so
adjusting it would change nothing; once :meth:`QuotaBook.prune` has dropped it, nothing is done.

**Memory.** Pruning is part of every reservation, so the book stays bounded without anyone
calling :meth:`QuotaBook.prune`: a window drops the buckets that have left it whenever its current
bucket changes (at most once per bucket per subject, a walk of at most one window's buckets), and
each reservation drops the subjects whose last count has left even the day window (found from the
front of a least-recently-counted order, O(1) amortised). So a subject holds at most one window's
buckets (13 + 25), and the book holds only the subjects counted within the last day and hour.
Every window is counted for every
subject reserved, whether or not it has a limit set, so a limit set during the day counts what
came before it. The book lives in memory: a restart of the server starts every quota afresh;
the usage records are the durable account.

Pure: ``now`` is a parameter, read from one clock that never goes back (the shell passes
``trio.current_time()``): the sums a window caches, and what :meth:`QuotaBook.prune` drops, assume
no call comes with an earlier ``now`` than one before it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Literal

import attrs

frozen = attrs.frozen(kw_only=True)

LimitName = Literal["rpm", "tpm", "tpd"]


def _none_or_positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    # A limit of 0 would be a suspension; that belongs to the tenant or key, not to its quota.
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be at least 1 or None (unlimited), not {value}")


@frozen
class Limits:
    rpm: int | None = attrs.field(default=None, validator=_none_or_positive)  # requests per minute
    tpm: int | None = attrs.field(default=None, validator=_none_or_positive)  # tokens per minute
    tpd: int | None = attrs.field(default=None, validator=_none_or_positive)  # tokens per day


@frozen
class Usage:
    """What a subject's windows hold now: the figures its :class:`Limits` are compared with."""

    rpm: int
    tpm: int
    tpd: int


@frozen
class Window:
    bucket_seconds: int  # whole seconds, so bucket boundaries are exact in floating point
    span_seconds: int  # a multiple of bucket_seconds

    @property
    def full_buckets(self) -> int:
        """Buckets held before the current one."""
        return self.span_seconds // self.bucket_seconds

    def bucket(self, at: float) -> int:
        return int(at // self.bucket_seconds)


# 5 s: a refused client waits at most 5 s longer than an exact record of every request would make
# it, and one pacing itself at its limit still gets 12/13 of it. Finer buckets cost memory per
# subject and a longer walk when a request is refused.
MINUTE = Window(bucket_seconds=5, span_seconds=60)
# 1 h: a day's budget is rarely paced to the minute; 25 buckets per subject.
DAY = Window(bucket_seconds=3600, span_seconds=86_400)
_WINDOWS = (MINUTE, DAY)

# Each limit: the window it is counted over and whether it counts requests or tokens.
_CHECKS: tuple[tuple[LimitName, Window, bool], ...] = (
    ("rpm", MINUTE, False),
    ("tpm", MINUTE, True),
    ("tpd", DAY, True),
)


@attrs.define
class _Bucket:
    requests: int = 0
    tokens: int = 0


class _WindowCounts:
    """One subject's counts over one window: its buckets, and the sums of those the window holds."""

    def __init__(self, window: Window, now: float) -> None:
        self.window = window
        self.buckets: dict[int, _Bucket] = {}  # by bucket number; only where something was counted
        # The sums while `now` is in bucket `_at`. Recomputed only when the bucket changes (every
        # 5 s or 1 h at most), so an admission adds to them instead of summing 13 or 25 buckets.
        self._at = window.bucket(now)
        self._held = _Bucket()

    def held(self, now: float) -> _Bucket:
        current = self.window.bucket(now)
        if current != self._at:
            self._at = current
            self._held = _Bucket()
            self.prune(now)  # once per bucket: the window's buckets and a few that just left
            for number in range(current - self.window.full_buckets, current + 1):
                bucket = self.buckets.get(number)
                if bucket is not None:
                    self._held.requests += bucket.requests
                    self._held.tokens += bucket.tokens
        return self._held

    def count(self, tokens: int, now: float) -> None:
        held = self.held(now)
        bucket = self.buckets.get(self._at)
        if bucket is None:
            bucket = self.buckets[self._at] = _Bucket()
        bucket.requests += 1
        bucket.tokens += tokens
        held.requests += 1
        held.tokens += tokens

    def adjust(self, number: int, requests: int, tokens: int) -> None:
        bucket = self.buckets.get(number)
        if bucket is None:
            return  # pruned: it has left the window, and nobody counts it any more
        bucket.requests += requests
        bucket.tokens += tokens
        if self._at - self.window.full_buckets <= number <= self._at:
            self._held.requests += requests
            self._held.tokens += tokens

    def wait(self, of_tokens: bool, limit: int, cost: int, now: float, alone: bool = True) -> float:
        """Seconds until the window admits ``cost`` more: the first boundary at which it does
        (``math.inf`` when it never will: ``cost`` above ``limit`` and not ``alone``)."""
        if cost > limit and not alone:
            return math.inf
        current = self.window.bucket(now)
        counts = []  # oldest first
        for number in range(current - self.window.full_buckets, current + 1):
            bucket = self.buckets.get(number)
            counts.append(0 if bucket is None else bucket.tokens if of_tokens else bucket.requests)
        held = sum(counts)
        # Boundary by boundary, the oldest bucket leaves the window. After the last one the
        # window is empty, and an empty window admits anything.
        for leaving, count in enumerate(counts):
            if _admits(held, cost, limit, alone):
                return 0.0 if leaving == 0 else (current + leaving) * self.window.bucket_seconds - now
            held -= count
        return (current + len(counts)) * self.window.bucket_seconds - now

    def prune(self, now: float) -> None:
        oldest = self.window.bucket(now) - self.window.full_buckets
        for number in [number for number in self.buckets if number < oldest]:
            del self.buckets[number]


def _admits(held: int, cost: int, limit: int, alone: bool = True) -> bool:
    return held + cost <= limit or (alone and held == 0)


@frozen
class Allowance:
    """What one limit of one subject lets a book admit: ``amount`` (requests or tokens over the
    limit's window; 0 admits nothing), and whether a request larger than it may run ``alone`` in
    an empty window. A process's own limit is ``Allowance(amount=limit, alone=True)``; a gateway
    worker's lease is its share, alone only when the share is the whole limit (core.leases)."""

    amount: int
    alone: bool = True


@attrs.define(kw_only=True, eq=False)
class Reservation:
    """A request counted against its subjects' quotas, until it is settled or released."""

    subjects: tuple[Hashable, ...]
    estimate_tokens: int
    reserved_at: float  # finds the buckets it was counted in
    # Settling or releasing twice would count the request's tokens twice over: only once.
    _open: bool = attrs.field(default=True, init=False)

    def _close(self) -> None:
        if not self._open:
            raise ValueError("this reservation was already settled or released")
        self._open = False


@frozen
class Refused:
    """Not admitted: the limit that holds the request back longest, and for how long."""

    subject: Hashable
    limit: LimitName
    retry_after: float  # seconds from now; > 0
    # Refused only by shares smaller than their limits (a gateway worker's leases, core.leases):
    # the room may be another worker's, and can move here with the control plane's next grants.
    short_of_share: bool = False


class QuotaBook:
    """The counters of every subject with recent requests.

    Costs: reserve, settle and release are O(subjects); a refusal also walks the refusing
    windows' buckets (13 for the minute, 25 for the day) to find when it would fit.
    """

    def __init__(self) -> None:
        self._subjects: dict[Hashable, dict[Window, _WindowCounts]] = {}
        # Subject → when it was last counted, least recent first: the front is the next to leave.
        self._last_counted: OrderedDict[Hashable, float] = OrderedDict()

    def __len__(self) -> int:
        """Subjects held."""
        return len(self._subjects)

    def reserve(
        self, quotas: Mapping[Hashable, Limits], estimate_tokens: int, now: float
    ) -> Reservation | Refused:
        """Count a request under every subject of ``quotas`` if it fits all their limits.

        Nothing is counted when it is refused. On a tie between limits the first refusing one
        is named, subjects in ``quotas``' order and each subject's limits as rpm, tpm, tpd.
        """
        allowances = {
            subject: {
                name: Allowance(amount=limit)
                for name in ("rpm", "tpm", "tpd")
                if (limit := getattr(limits, name)) is not None
            }
            for subject, limits in quotas.items()
        }
        return self.reserve_within(allowances, estimate_tokens, now)

    def reserve_within(
        self,
        allowances: Mapping[Hashable, Mapping[LimitName, Allowance]],
        estimate_tokens: int,
        now: float,
    ) -> Reservation | Refused:
        """:meth:`reserve` against explicit allowances: a limit a subject's mapping leaves out is
        unlimited. ``retry_after`` is ``math.inf`` when a limit never admits the request (larger
        than an allowance that may not run alone)."""
        if estimate_tokens < 0:
            raise ValueError(f"estimate_tokens must be >= 0, not {estimate_tokens}")
        self._drop_idle(now)
        refused: Refused | None = None
        for subject, limits in allowances.items():
            windows = self._subjects.get(subject)
            for name, window, of_tokens in _CHECKS:
                allowance = limits.get(name)
                if allowance is None:
                    continue
                cost = estimate_tokens if of_tokens else 1
                if windows is None:
                    # Nothing counted: an empty window admits anything its allowance lets alone.
                    if _admits(0, cost, allowance.amount, allowance.alone):
                        continue
                    wait = math.inf
                else:
                    counts = windows[window]
                    held = counts.held(now)
                    if _admits(
                        held.tokens if of_tokens else held.requests, cost, allowance.amount, allowance.alone
                    ):
                        continue
                    wait = counts.wait(of_tokens, allowance.amount, cost, now, allowance.alone)
                if refused is None or wait > refused.retry_after:
                    refused = Refused(subject=subject, limit=name, retry_after=wait)
        if refused is not None:
            return refused
        for subject in allowances:
            windows = self._subjects.get(subject)
            if windows is None:
                windows = self._subjects[subject] = {
                    window: _WindowCounts(window, now) for window in _WINDOWS
                }
            for counts in windows.values():
                counts.count(estimate_tokens, now)
            self._last_counted[subject] = now
            self._last_counted.move_to_end(subject)
        return Reservation(subjects=tuple(allowances), estimate_tokens=estimate_tokens, reserved_at=now)

    def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Replace the reservation's estimate with the tokens the request really used."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, not {actual_tokens}")
        reservation._close()
        self._adjust(reservation, 0, actual_tokens - reservation.estimate_tokens)

    def release(self, reservation: Reservation) -> None:
        """Hand back the request and its tokens: it failed before the engine did any work."""
        reservation._close()
        self._adjust(reservation, -1, -reservation.estimate_tokens)

    def usage(self, subject: Hashable, now: float) -> Usage:
        """What the subject's windows hold: against its limits, what remains (rate-limit headers)."""
        windows = self._subjects.get(subject)
        if windows is None:
            return Usage(rpm=0, tpm=0, tpd=0)
        minute = windows[MINUTE].held(now)
        return Usage(rpm=minute.requests, tpm=minute.tokens, tpd=windows[DAY].held(now).tokens)

    def buckets(self) -> int:
        """Buckets held over every subject and window: what the book's memory grows with."""
        return sum(len(counts.buckets) for windows in self._subjects.values() for counts in windows.values())

    def prune(self, now: float) -> None:
        """Drop the buckets that have left their window, and the subjects left with none (all of
        them at once; reservations do the same a little at a time)."""
        for subject, windows in list(self._subjects.items()):
            for counts in windows.values():
                counts.prune(now)
            if not any(counts.buckets for counts in windows.values()):
                del self._subjects[subject]
                del self._last_counted[subject]

    def _drop_idle(self, now: float) -> None:
        # A subject last counted in a day bucket the day window no longer holds has nothing left
        # in any window (the day's reaches furthest back): drop it whole.
        oldest = DAY.bucket(now) - DAY.full_buckets
        last = self._last_counted
        while last:
            subject, at = next(iter(last.items()))
            if DAY.bucket(at) >= oldest:
                break
            del last[subject]
            del self._subjects[subject]

    def _adjust(self, reservation: Reservation, requests: int, tokens: int) -> None:
        for subject in reservation.subjects:
            windows = self._subjects.get(subject)
            if windows is None:
                continue  # pruned: every bucket it was counted in has left its window
            for window, counts in windows.items():
                counts.adjust(window.bucket(reservation.reserved_at), requests, tokens)


# Tokens reserved for a request that names no max_tokens: a typical answer's length.
DEFAULT_COMPLETION_ESTIMATE = 256
# Characters per token when estimating a prompt from its text (English-ish, a rough upper bound).
CHARS_PER_TOKEN = 3


def estimate_tokens(payload: Mapping, body_size: int) -> int:
    """What to reserve before the answer is known: the prompt's size plus the most it may write.

    The prompt's size is taken from the body's: its bytes are nearly all prompt (tool definitions
    and the like are prompt to the engine too), and encoding the messages again only to measure
    them would cost more than the rest of the request's path for a long conversation."""
    prompt, completion = estimate_parts(payload, body_size)
    return prompt + completion


def estimate_parts(payload: Mapping, body_size: int) -> tuple[int, int]:
    """The estimate as (prompt tokens, completion tokens): what a request is recorded at when its
    engine never said what it used. ``n`` answers may each write up to the limit. Only JSON
    integers count (a bool or a string is not one: the relay refuses those before this)."""
    limit = payload.get("max_completion_tokens")
    if limit is None:
        limit = payload.get("max_tokens")
    if type(limit) is not int or limit <= 0:
        limit = DEFAULT_COMPLETION_ESTIMATE
    n = payload.get("n")
    if type(n) is not int or n <= 0:
        n = 1
    return body_size // CHARS_PER_TOKEN + 1, n * limit
