"""Quotas: reserve at admission, settle afterwards, over bucketed minute and day windows."""

from __future__ import annotations

import copy

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from llmgw.core.quota import DAY, MINUTE, Limits, QuotaBook, Refused, Reservation, Usage

TENANT = ("tenant", "acme")
KEY = ("key", "acme-1")
OTHER_KEY = ("key", "acme-2")
HOUR = 3600


def reserved(result: Reservation | Refused) -> Reservation:
    assert isinstance(result, Reservation), result
    return result


# --- examples ------------------------------------------------------------------------------------


def test_requests_per_minute_refuses_the_fourth_until_the_first_bucket_leaves_the_window():
    book = QuotaBook()
    quota = {TENANT: Limits(rpm=3)}
    for at in (0, 1, 2):
        reserved(book.reserve(quota, 0, now=at))
    # The first three sit in bucket [0, 5); the window holds it until the one starting at 65.
    assert book.reserve(quota, 0, now=3) == Refused(subject=TENANT, limit="rpm", retry_after=62)
    assert isinstance(book.reserve(quota, 0, now=64.75), Refused)
    reserved(book.reserve(quota, 0, now=65))


def test_tokens_per_minute_counts_the_estimate_and_admits_what_still_fits():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100)}
    reserved(book.reserve(quota, 60, now=0))
    reserved(book.reserve(quota, 30, now=7))
    assert book.reserve(quota, 20, now=8) == Refused(subject=TENANT, limit="tpm", retry_after=57)
    reserved(book.reserve(quota, 10, now=8))  # exactly the limit
    assert book.usage(TENANT, now=8) == Usage(rpm=3, tpm=100, tpd=100)


def test_retry_after_waits_for_as_many_buckets_as_must_leave():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100)}
    for at, tokens in ((0, 40), (20, 40), (40, 20)):
        reserved(book.reserve(quota, tokens, now=at))
    # At 65 the first 40 leave: 60 + 50 is still too many. At 85 the second 40 leave too.
    assert book.reserve(quota, 50, now=50) == Refused(subject=TENANT, limit="tpm", retry_after=35)
    assert isinstance(book.reserve(quota, 50, now=84), Refused)
    reserved(book.reserve(quota, 50, now=85))


def test_tokens_per_day_over_hourly_buckets():
    book = QuotaBook()
    quota = {TENANT: Limits(tpd=1_000)}
    reserved(book.reserve(quota, 600, now=0))
    reserved(book.reserve(quota, 400, now=10 * HOUR))
    assert book.usage(TENANT, now=23 * HOUR) == Usage(rpm=0, tpm=0, tpd=1_000)
    # The first hour's 600 stay in the window until the hour starting at 25 h.
    assert book.reserve(quota, 1, now=23 * HOUR) == Refused(subject=TENANT, limit="tpd", retry_after=2 * HOUR)
    reserved(book.reserve(quota, 600, now=25 * HOUR))


def test_a_request_larger_than_the_limit_runs_alone_in_an_empty_window():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100)}
    small = reserved(book.reserve(quota, 10, now=0))
    # Not while anything else is held: it waits for the window to empty.
    assert book.reserve(quota, 500, now=1) == Refused(subject=TENANT, limit="tpm", retry_after=64)
    book.release(small)
    big = reserved(book.reserve(quota, 500, now=1))
    assert book.reserve(quota, 1, now=2) == Refused(subject=TENANT, limit="tpm", retry_after=63)
    book.settle(big, 50)  # it used far less than its max_tokens: the rest is room again
    reserved(book.reserve(quota, 50, now=2))


def test_settling_below_the_estimate_hands_the_difference_back_at_once():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100)}
    first = reserved(book.reserve(quota, 100, now=0))
    assert isinstance(book.reserve(quota, 30, now=1), Refused)
    book.settle(first, 70)
    reserved(book.reserve(quota, 30, now=2))


def test_settling_above_the_estimate_may_go_over_and_holds_back_later_requests():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100)}
    first = reserved(book.reserve(quota, 50, now=0))
    book.settle(first, 130)  # allowed: the request has been served
    assert book.usage(TENANT, now=1).tpm == 130
    assert book.reserve(quota, 0, now=1) == Refused(subject=TENANT, limit="tpm", retry_after=64)


def test_settlement_adjusts_the_bucket_the_reservation_was_counted_in():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=1_000)}
    old = reserved(book.reserve(quota, 60, now=0))
    reserved(book.reserve(quota, 30, now=30))
    book.settle(
        old,
        10,
    )
    assert book.usage(TENANT, now=40).tpm == 40
    # When the old bucket leaves, it takes the settled 10 with it, not 60, and not from the
    # current bucket: the later 30 remain whole.
    assert book.usage(TENANT, now=65).tpm == 30


def test_settling_after_the_bucket_left_the_minute_adjusts_only_the_day():
    book = QuotaBook()
    quota = {TENANT: Limits(tpm=100, tpd=1_000)}
    old = reserved(book.reserve(quota, 60, now=0))
    reserved(book.reserve(quota, 20, now=100))
    book.settle(old, 10)
    assert book.usage(TENANT, now=100) == Usage(rpm=1, tpm=20, tpd=30)


def test_settling_after_prune_dropped_everything_changes_nothing():
    book = QuotaBook()
    old = reserved(book.reserve({TENANT: Limits(tpd=100)}, 60, now=0))
    book.prune(now=25 * HOUR)
    assert len(book) == 0
    book.settle(old, 500)
    assert len(book) == 0
    assert book.usage(TENANT, now=25 * HOUR) == Usage(rpm=0, tpm=0, tpd=0)


def test_release_hands_back_the_request_and_its_tokens():
    book = QuotaBook()
    quota = {TENANT: Limits(rpm=1, tpm=100)}
    failed = reserved(book.reserve(quota, 80, now=0))
    assert isinstance(book.reserve(quota, 10, now=1), Refused)
    book.release(failed)
    assert book.usage(TENANT, now=1) == Usage(rpm=0, tpm=0, tpd=0)
    reserved(book.reserve(quota, 100, now=1))


def test_a_reservation_is_settled_or_released_once():
    book = QuotaBook()
    quota = {TENANT: Limits()}
    settled = reserved(book.reserve(quota, 10, now=0))
    book.settle(settled, 5)
    with pytest.raises(ValueError, match="already"):
        book.settle(settled, 5)
    with pytest.raises(ValueError, match="already"):
        book.release(settled)
    released = reserved(book.reserve(quota, 10, now=0))
    book.release(released)
    with pytest.raises(ValueError, match="already"):
        book.settle(released, 5)
    assert book.usage(TENANT, now=0) == Usage(rpm=1, tpm=5, tpd=5)


def test_a_request_must_fit_both_its_key_and_its_tenant():
    book = QuotaBook()
    tenant = Limits(tpm=100)
    reserved(book.reserve({TENANT: tenant, KEY: Limits(tpm=50)}, 50, now=0))
    # The key is full while the tenant has room.
    assert book.reserve({TENANT: tenant, KEY: Limits(tpm=50)}, 1, now=1) == Refused(
        subject=KEY, limit="tpm", retry_after=64
    )
    # Another key of the tenant, without limits of its own, has the tenant's room.
    reserved(book.reserve({TENANT: tenant, OTHER_KEY: Limits()}, 50, now=2))
    assert book.reserve({TENANT: tenant, OTHER_KEY: Limits()}, 1, now=3) == Refused(
        subject=TENANT, limit="tpm", retry_after=62
    )
    # Refusals count nothing.
    assert book.usage(TENANT, now=3) == Usage(rpm=2, tpm=100, tpd=100)
    assert book.usage(KEY, now=3) == Usage(rpm=1, tpm=50, tpd=50)
    assert book.usage(OTHER_KEY, now=3) == Usage(rpm=1, tpm=50, tpd=50)


def test_the_refusal_names_the_limit_that_holds_the_request_back_longest():
    book = QuotaBook()
    quotas = {TENANT: Limits(rpm=2), KEY: Limits(tpm=100, tpd=150)}
    reserved(book.reserve(quotas, 100, now=0))
    reserved(book.reserve(quotas, 0, now=20))
    # rpm: until 65; tpm: until 65 as well; tpd: until the hour at 25 h. The longest wins.
    assert book.reserve(quotas, 60, now=30) == Refused(subject=KEY, limit="tpd", retry_after=25 * HOUR - 30)
    # On a tie the first refusing limit is named: the tenant's, then rpm before tpm.
    assert book.reserve(quotas, 1, now=30) == Refused(subject=TENANT, limit="rpm", retry_after=35)


def test_prune_keeps_what_the_windows_hold_and_drops_idle_subjects():
    book = QuotaBook()
    reserved(book.reserve({TENANT: Limits(), KEY: Limits()}, 10, now=0))
    reserved(book.reserve({OTHER_KEY: Limits()}, 10, now=10 * HOUR))
    book.prune(now=20 * HOUR)
    assert len(book) == 3
    assert book.usage(TENANT, now=20 * HOUR) == Usage(rpm=0, tpm=0, tpd=10)
    book.prune(now=25 * HOUR)
    assert len(book) == 1  # the first hour has left the day window
    book.prune(now=35 * HOUR)
    assert len(book) == 0


@pytest.mark.parametrize("field", ["rpm", "tpm", "tpd"])
def test_a_limit_is_at_least_one_or_none(field):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: 0})


def test_token_counts_are_not_negative():
    book = QuotaBook()
    with pytest.raises(ValueError, match="estimate_tokens"):
        book.reserve({TENANT: Limits()}, -1, now=0)
    reservation = reserved(book.reserve({TENANT: Limits()}, 1, now=0))
    with pytest.raises(ValueError, match="actual_tokens"):
        book.settle(reservation, -1)


# --- 64 concurrent clients against a small token quota ---------------------------------------

CLIENTS = 64
SMALL = Limits(rpm=40, tpm=200)

# Times are multiples of 1/4 s, so sums of them and bucket boundaries are exact in floating point.
# None: the moment a refused client was told to come back (the earliest told), which is when
# refused clients crowd in as a window drops a bucket.
gaps = st.one_of(st.just(0.0), st.none(), st.integers(min_value=0, max_value=40).map(lambda q: q / 4))
# A step: one client acts after a gap. Idle, it asks to reserve `estimate`; holding a
# reservation, it releases it or settles it with its estimate plus `difference`.
steps = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=CLIENTS - 1),
        gaps,
        # The estimate: mostly small, so that many requests run at once; now and then above
        # SMALL.tpm, larger than the whole limit.
        st.one_of(st.integers(min_value=0, max_value=30), st.integers(min_value=0, max_value=300)),
        st.integers(min_value=-300, max_value=300),  # difference
        st.booleans(),  # release instead of settling
    ),
    max_size=600,
)


@attrs.define
class Admitted:
    at: float
    step: int  # when it was admitted
    estimate: int
    closed: float = float("inf")  # the step at which it was settled or released
    final: int = 0  # tokens it ends up counting: actual, 0 if released, the estimate while open
    requests: int = 1  # 0 once released
    overrun: int = 0  # actual - estimate, when that is positive

    def open_at(self, step: int) -> bool:
        return self.step <= step < self.closed


def run_clients(schedule, actual_may_exceed: bool) -> list[Admitted]:
    book = QuotaBook()
    holding: dict[int, tuple[Reservation, Admitted]] = {}
    admitted: list[Admitted] = []
    told: list[float] = []  # when refused clients were told to come back
    now = 0.0
    for step, (client, gap, estimate, difference, release) in enumerate(schedule):
        if gap is not None:
            now += gap
        elif told:
            now = max(now, min(told))
            told.remove(min(told))
        if client in holding:
            reservation, record = holding.pop(client)
            record.closed = step
            if release:
                book.release(reservation)
                record.final = record.requests = 0
            else:
                change = difference if actual_may_exceed else -abs(difference)
                used = max(0, record.estimate + change)
                book.settle(reservation, used)
                record.final = used
                record.overrun = max(0, used - record.estimate)
            continue
        result = book.reserve({TENANT: SMALL}, estimate, now)
        if isinstance(result, Refused):
            assert result.retry_after > 0
            told.append(now + result.retry_after)
            continue
        record = Admitted(at=now, step=step, estimate=estimate, final=estimate)
        holding[client] = (result, record)
        admitted.append(record)
    return admitted


def intervals(admitted: list[Admitted]):
    """The admissions of every 60 s interval that starts at an admission: the most crowded ones."""
    for first in admitted:
        inside = [r for r in admitted if first.at <= r.at < first.at + MINUTE.span_seconds]
        yield inside, max(inside, key=lambda r: r.step)


@settings(max_examples=300)
@given(steps)
def test_64_clients_never_exceed_the_limit_by_more_than_one_reservation(schedule):
    admitted = run_clients(schedule, actual_may_exceed=False)
    for inside, last in intervals(admitted):
        tokens = sum(r.final for r in inside)
        # The precise bound: the limit, or a single reservation larger than it alone.
        assert tokens <= max(SMALL.tpm, last.estimate)
        # The wording: never more than the limit plus one request's reservation.
        assert tokens <= SMALL.tpm + max(r.estimate for r in inside)
        assert sum(r.requests for r in inside) <= SMALL.rpm


@settings(max_examples=300)
@given(steps)
def test_64_clients_using_more_than_estimated_exceed_it_only_by_the_running_requests_overrun(schedule):
    admitted = run_clients(schedule, actual_may_exceed=True)
    for inside, last in intervals(admitted):
        tokens = sum(r.final for r in inside)
        # Requests settled before the interval's last admission were counted as they used, so
        # only those still running then can add what they used beyond their estimate.
        running = [r for r in inside if r.open_at(last.step)]
        assert tokens <= max(SMALL.tpm, last.estimate) + sum(r.overrun for r in running)
        # Each client runs one request at a time, so at most 64 overruns.
        assert len(running) <= CLIENTS
        assert sum(r.requests for r in inside) <= SMALL.rpm


# --- the book against a naive reference -------------------------------------------------------

T1, K1, K2 = ("tenant", "t1"), ("key", "k1"), ("key", "k2")
T2, K3 = ("tenant", "t2"), ("key", "k3")
LIMITS = {
    T1: Limits(rpm=4, tpm=120, tpd=500),
    K1: Limits(tpm=60),
    K2: Limits(),  # counted, never limiting
    T2: Limits(rpm=2, tpd=300),
    K3: Limits(rpm=3, tpm=80, tpd=200),
}
CALLERS = [(T1, K1), (T1, K2), (T1,), (T2, K3)]
CHECKS = [("rpm", MINUTE, False), ("tpm", MINUTE, True), ("tpd", DAY, True)]


@attrs.define
class Event:
    subjects: tuple
    estimate: int
    at: float
    actual: int | None = None
    released: bool = False

    def count(self, of_tokens: bool) -> int:
        if self.released:
            return 0
        if not of_tokens:
            return 1
        return self.estimate if self.actual is None else self.actual


class Reference:
    """Every reservation ever made; each window summed from scratch when asked."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def held(self, subject, window, of_tokens: bool, now: float) -> int:
        span = window.span_seconds // window.bucket_seconds
        current = int(now // window.bucket_seconds)
        return sum(
            event.count(of_tokens)
            for event in self.events
            if subject in event.subjects
            and current - span <= int(event.at // window.bucket_seconds) <= current
        )

    def admits(self, subject, name, window, of_tokens, estimate, now) -> bool:
        limit = getattr(LIMITS[subject], name)
        if limit is None:
            return True
        held = self.held(subject, window, of_tokens, now)
        return held + (estimate if of_tokens else 1) <= limit or held == 0

    def wait(self, subject, name, window, of_tokens, estimate, now) -> float:
        """Seconds until this one limit admits: tried at every moment a bucket leaves a window."""
        if self.admits(subject, name, window, of_tokens, estimate, now):
            return 0.0
        leaving = sorted(
            (int(event.at // w.bucket_seconds) + w.span_seconds // w.bucket_seconds + 1) * w.bucket_seconds
            for event in self.events
            for w in (MINUTE, DAY)
        )
        return next(
            at - now
            for at in leaving
            if at > now and self.admits(subject, name, window, of_tokens, estimate, at)
        )


class QuotaMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.book = QuotaBook()
        self.reference = Reference()
        self.now = 0.0

    @rule(
        gap=st.one_of(
            st.integers(min_value=0, max_value=40).map(lambda q: q / 4),
            st.sampled_from([30, 300, HOUR, 5 * HOUR, 20 * HOUR]),
        )
    )
    def advance(self, gap):
        self.now += gap

    @rule(target=reservations, caller=st.sampled_from(CALLERS), estimate=st.integers(0, 150))
    def reserve(self, caller, estimate):
        quotas = {subject: LIMITS[subject] for subject in caller}
        result = self.book.reserve(quotas, estimate, self.now)
        waits = {
            (subject, name): self.reference.wait(subject, name, window, of_tokens, estimate, self.now)
            for subject in caller
            for name, window, of_tokens in CHECKS
        }
        if isinstance(result, Refused):
            assert result.retry_after == max(waits.values()) > 0
            assert waits[(result.subject, result.limit)] == result.retry_after
            # Exact: nothing else happening, it fits at now + retry_after and not a moment
            # sooner (what windows hold changes only at 5 s boundaries).
            then = self.now + result.retry_after
            assert isinstance(copy.deepcopy(self.book).reserve(quotas, estimate, then), Reservation)
            sooner = max(self.now, then - MINUTE.bucket_seconds)
            assert isinstance(copy.deepcopy(self.book).reserve(quotas, estimate, sooner), Refused)
            return multiple()
        assert set(waits.values()) == {0.0}
        event = Event(subjects=caller, estimate=estimate, at=self.now)
        self.reference.events.append(event)
        return (result, event)

    @rule(held=consumes(reservations), actual=st.integers(0, 200))
    def settle(self, held, actual):
        reservation, event = held
        self.book.settle(reservation, actual)
        event.actual = actual

    @rule(held=consumes(reservations))
    def release(self, held):
        reservation, event = held
        self.book.release(reservation)
        event.released = True

    @rule()
    def prune(self):
        self.book.prune(self.now)
        # Kept: exactly the subjects with a bucket in the day window (which spans the minute's).
        oldest = (int(self.now // DAY.bucket_seconds) - DAY.full_buckets) * DAY.bucket_seconds
        recent = {s for event in self.reference.events if event.at >= oldest for s in event.subjects}
        assert len(self.book) == len(recent)

    @invariant()
    def counters_match_the_reference(self):
        for subject in LIMITS:
            expected = Usage(
                rpm=self.reference.held(subject, MINUTE, False, self.now),
                tpm=self.reference.held(subject, MINUTE, True, self.now),
                tpd=self.reference.held(subject, DAY, True, self.now),
            )
            assert self.book.usage(subject, self.now) == expected


QuotaMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestQuotaMachine = QuotaMachine.TestCase
