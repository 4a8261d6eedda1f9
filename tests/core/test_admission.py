"""The admission queue: bands in strict order, tenants in rotation, cancel, expiry and the bound.

Fairness is tested here, on the pure queue, where the order is the queue's decision and nothing
else's; a test of the gateway can only see the order in which trio woke the waiting tasks.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from llmgw.core.admission import RETRY_AFTER, Accepted, AdmissionQueue, Popped, Rejected, Waiter


def waiter(id, tenant="a", band=0, enqueued_at=0.0, deadline=math.inf) -> Waiter:
    return Waiter(id=id, tenant=tenant, band=band, enqueued_at=enqueued_at, deadline=deadline)


def queue_of(*waiters: Waiter, max_waiting: int = 100) -> AdmissionQueue:
    queue = AdmissionQueue(max_waiting=max_waiting)
    for w in waiters:
        assert queue.push(w) == Accepted()
    return queue


def drain(queue: AdmissionQueue, now: float = 0.0) -> list:
    """Ids in dispatch order until the queue is empty."""
    order = []
    while (popped := queue.pop(now)).waiter is not None:
        order.append(popped.waiter.id)
    return order


# --- bands ---------------------------------------------------------------------------------------


def test_a_higher_band_is_served_first_however_late_it_came():
    queue = queue_of(waiter("low1", band=0), waiter("mid", band=5), waiter("low2", band=0))
    assert queue.peek_band() == 5
    assert queue.pop(0.0).waiter.id == "mid"
    queue.push(waiter("high", band=9))
    queue.push(waiter("negative", band=-1))
    assert drain(queue) == ["high", "low1", "low2", "negative"]
    assert queue.peek_band() is None


def test_bands_do_not_share_a_rotation():
    # Tenant a is served in band 1; that does not move it back in band 0's rotation.
    queue = queue_of(waiter(1, "a", band=0), waiter(2, "b", band=0), waiter(3, "a", band=1))
    assert drain(queue) == [3, 1, 2]


# --- the rotation --------------------------------------------------------------------------------


def test_three_tenants_with_unequal_queues_take_turns():
    queue = queue_of(
        *(waiter(f"a{i}", "a") for i in range(4)),
        *(waiter(f"b{i}", "b") for i in range(2)),
        *(waiter(f"c{i}", "c") for i in range(2)),
    )
    assert drain(queue) == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "a3"]


def test_a_tenant_that_runs_out_mid_rotation_leaves_without_disturbing_the_others():
    queue = queue_of(
        waiter("a0", "a"),
        waiter("b0", "b"),
        waiter("b1", "b"),
        waiter("c0", "c"),
        waiter("c1", "c"),
    )
    assert queue.pop(0.0).waiter.id == "a0"  # a has nothing left: the rotation is b, c
    assert drain(queue) == ["b0", "c0", "b1", "c1"]


def test_a_tenant_that_comes_back_joins_at_the_back():
    queue = queue_of(waiter("a0", "a"), waiter("b0", "b"), waiter("b1", "b"), waiter("c0", "c"))
    assert queue.pop(0.0).waiter.id == "a0"  # a leaves; the rotation is b, c
    queue.push(waiter("a1", "a"))  # b, c, a: not back in front of b and c
    assert drain(queue) == ["b0", "c0", "a1", "b1"]


def test_a_tenant_cancelled_out_of_the_rotation_leaves_the_others_in_order():
    queue = queue_of(waiter("a0", "a"), waiter("a1", "a"), waiter("b0", "b"), waiter("c0", "c"))
    assert queue.pop(0.0).waiter.id == "a0"  # the rotation is b, c, a
    assert queue.cancel("b0")  # b had only that one: c, a
    assert drain(queue) == ["c0", "a1"]


# --- the weighted rotation (a gateway worker's, core.leases) ------------------------------------


def weighted_queue(weights: dict[str, float], *waiters: Waiter) -> AdmissionQueue:
    queue = AdmissionQueue(max_waiting=100, weight=lambda band, tenant: weights[tenant])
    for w in waiters:
        assert queue.push(w) == Accepted()
    return queue


def test_a_tenant_of_weight_half_is_served_every_other_round():
    queue = weighted_queue(
        {"a": 0.5, "b": 1.0},
        *(waiter(f"a{i}", "a") for i in range(10)),
        *(waiter(f"b{i}", "b") for i in range(20)),
    )
    order = drain(queue)
    assert order[:8] == ["b0", "a0", "b1", "b2", "a1", "b3", "b4", "a2"]
    assert sum(1 for i in order[:30] if i.startswith("a")) == 10  # 1 : 2


def test_weights_of_one_are_the_plain_rotation():
    waiters = [waiter(f"{t}{i}", t) for t, n in (("a", 4), ("b", 2), ("c", 3)) for i in range(n)]
    assert drain(weighted_queue(dict.fromkeys("abc", 1.0), *waiters)) == drain(queue_of(*waiters))


def test_a_weight_of_zero_still_gets_turns_and_the_queue_drains():
    queue = weighted_queue({"a": 0.0, "b": 0.0}, waiter("a0", "a"), waiter("b0", "b"), waiter("a1", "a"))
    assert drain(queue) == ["a0", "b0", "a1"]


def test_a_tenant_that_leaves_takes_no_credit_with_it():
    # a, at weight 0.5, has half a turn of credit when its only waiter is cancelled; back again,
    # it starts from nothing like any newcomer: b goes twice before it.
    queue = weighted_queue({"a": 0.5, "b": 1.0}, waiter("a0", "a"), *(waiter(f"b{i}", "b") for i in range(4)))
    assert queue.pop(0.0).waiter.id == "b0"  # a took half a turn and went to the back
    assert queue.cancel("a0")
    queue.push(waiter("a1", "a"))
    assert drain(queue) == ["b1", "b2", "a1", "b3"]


# --- cancel --------------------------------------------------------------------------------------


def test_a_cancelled_waiter_is_never_popped():
    queue = queue_of(waiter(1, "a"), waiter(2, "a"), waiter(3, "b"))
    assert queue.cancel(2)
    assert drain(queue) == [1, 3]


def test_cancel_frees_the_slot_of_a_full_queue():
    queue = queue_of(waiter(1), waiter(2), max_waiting=2)
    assert queue.push(waiter(3)) == Rejected(reason="queue full", retry_after=RETRY_AFTER)
    assert queue.cancel(1)
    assert queue.push(waiter(3)) == Accepted()
    assert drain(queue) == [2, 3]


def test_cancel_says_whether_the_waiter_was_still_queued():
    queue = queue_of(waiter(1), waiter(2, deadline=5.0))
    assert queue.pop(0.0).waiter.id == 1
    assert queue.expire(5.0) == (waiter(2, deadline=5.0),)
    assert not queue.cancel(1)  # dispatched
    assert not queue.cancel(2)  # expired
    assert not queue.cancel("never pushed")


def test_an_id_can_be_queued_again_once_it_has_left():
    # The deadline the first waiter left behind in the heap must not expire the second.
    queue = queue_of(waiter(1, deadline=5.0))
    assert queue.cancel(1)
    queue.push(waiter(1, deadline=10.0))
    assert queue.expire(7.0) == ()
    assert queue.next_deadline() == 10.0
    assert queue.expire(10.0) == (waiter(1, deadline=10.0),)


def test_one_id_cannot_be_queued_twice():
    queue = queue_of(waiter(1))
    with pytest.raises(ValueError, match="already queued"):
        queue.push(waiter(1, tenant="b"))


# --- expiry --------------------------------------------------------------------------------------


def test_expire_removes_waiters_whose_deadline_has_come_earliest_first():
    queue = queue_of(
        waiter(1, "a", deadline=30.0),
        waiter(2, "b", deadline=10.0),
        waiter(3, "a", deadline=20.0),
        waiter(4, "c", deadline=10.0),
    )
    assert queue.next_deadline() == 10.0
    assert queue.expire(9.9) == ()
    expired = queue.expire(20.0)  # a deadline is due at its own instant
    assert [w.id for w in expired] == [2, 4, 3]
    assert len(queue) == 1
    assert queue.next_deadline() == 30.0


def test_pop_skips_expired_waiters_and_reports_them():
    queue = queue_of(waiter(1, "a", deadline=5.0), waiter(2, "b", deadline=50.0))
    popped = queue.pop(6.0)
    assert popped == Popped(waiter=waiter(2, "b", deadline=50.0), expired=(waiter(1, "a", deadline=5.0),))
    assert queue.pop(6.0) == Popped(waiter=None, expired=())


def test_an_expired_waiter_holds_its_slot_until_it_is_removed():
    queue = queue_of(waiter(1, deadline=5.0), max_waiting=1)
    assert isinstance(queue.push(waiter(2, enqueued_at=6.0)), Rejected)  # push expires nothing
    assert [w.id for w in queue.expire(6.0)] == [1]
    assert queue.push(waiter(2, enqueued_at=6.0)) == Accepted()


def test_next_deadline_skips_waiters_that_have_left():
    queue = queue_of(waiter(1, deadline=5.0), waiter(2, deadline=8.0))
    assert queue.pop(0.0).waiter.id == 1
    assert queue.next_deadline() == 8.0
    assert queue.cancel(2)
    assert queue.next_deadline() is None


def test_deadlines_left_behind_do_not_pile_up():
    # Each dispatched waiter leaves a far deadline in the heap; rebuilding keeps it bounded.
    queue = AdmissionQueue(max_waiting=4)
    for i in range(10_000):
        queue.push(waiter(i, deadline=1e9))
        assert queue.pop(0.0).waiter.id == i
        assert len(queue._deadlines) <= 2 * queue.max_waiting + 64


# --- the bound and the metrics -------------------------------------------------------------------


def test_a_full_queue_refuses_any_band_and_keeps_what_it_has():
    queue = queue_of(waiter(1, band=0), waiter(2, band=0), max_waiting=2)
    refused = queue.push(waiter(3, band=9))
    assert refused == Rejected(reason="queue full", retry_after=RETRY_AFTER)
    assert not queue.cancel(3)  # it was never queued
    assert drain(queue) == [1, 2]


def test_the_retry_hint_is_configurable():
    queue = AdmissionQueue(max_waiting=1, retry_after=2.5)
    queue.push(waiter(1))
    assert queue.push(waiter(2)) == Rejected(reason="queue full", retry_after=2.5)


def test_a_queue_holds_at_least_one_waiter():
    with pytest.raises(ValueError, match="max_waiting"):
        AdmissionQueue(max_waiting=0)


def test_depth_counts_waiters_per_band():
    queue = queue_of(waiter(1, band=0), waiter(2, "b", band=0), waiter(3, band=2))
    assert (len(queue), queue.depth(), queue.depth_by_band()) == (3, 3, {0: 2, 2: 1})
    queue.pop(0.0)
    assert queue.depth_by_band() == {0: 2}
    queue.cancel(1)
    queue.cancel(2)
    assert (len(queue), queue.depth_by_band()) == (0, {})


# --- against a reference model -------------------------------------------------------------------

MAX_WAITING = 6
TENANTS = ("a", "b", "c")
BANDS = (0, 1, 2)


class Reference:
    """The same order written the plain way: lists, scanned."""

    def __init__(self) -> None:
        self.fifos: dict[tuple[int, str], list[Waiter]] = {}  # (band, tenant) → oldest first
        self.rotations: dict[int, list[str]] = {}  # band → tenants with waiters, next first
        self.by_id: dict[object, Waiter] = {}  # every waiter in the queue

    def waiting(self) -> list[Waiter]:
        return list(self.by_id.values())

    def add(self, w: Waiter) -> None:
        if (w.band, w.tenant) not in self.fifos:
            self.fifos[(w.band, w.tenant)] = []
            self.rotations.setdefault(w.band, []).append(w.tenant)
        self.fifos[(w.band, w.tenant)].append(w)
        self.by_id[w.id] = w

    def remove(self, w: Waiter) -> None:
        fifo = self.fifos[(w.band, w.tenant)]
        fifo.remove(w)
        del self.by_id[w.id]
        if not fifo:
            del self.fifos[(w.band, w.tenant)]
            self.rotations[w.band].remove(w.tenant)
            if not self.rotations[w.band]:
                del self.rotations[w.band]

    def expire(self, now: float) -> tuple[Waiter, ...]:
        # Ids are numbered in push order: equal deadlines leave in the order they came.
        due = sorted((w for w in self.waiting() if w.deadline <= now), key=lambda w: (w.deadline, w.id))
        for w in due:
            self.remove(w)
        return tuple(due)

    def next(self) -> Waiter | None:
        if not self.rotations:
            return None
        band = max(self.rotations)
        w = self.fifos[(band, self.rotations[band][0])][0]
        self.remove(w)
        if (band, w.tenant) in self.fifos:  # still has waiters: to the back
            self.rotations[band].remove(w.tenant)
            self.rotations[band].append(w.tenant)
        return w


class AdmissionMachine(RuleBasedStateMachine):
    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.queue = AdmissionQueue(max_waiting=MAX_WAITING)
        self.model = Reference()
        self.now = 0.0
        self.pushes = 0
        self.accepted: set[object] = set()
        self.left_by: dict[object, str] = {}  # id → the door it left by: popped, cancelled, expired
        # (band, tenant) of each waiting tenant → how often each other tenant of its band has been
        # served since it was last served or started waiting.
        self.served_meanwhile: dict[tuple[int, str], Counter] = {}

    def left(self, w: Waiter, door: str) -> None:
        assert w.id in self.accepted
        assert w.id not in self.left_by, f"{w.id} left by {self.left_by.get(w.id)} and by {door}"
        self.left_by[w.id] = door

    def forget_idle_tenants(self) -> None:
        for key in list(self.served_meanwhile):
            if key not in self.model.fifos:
                del self.served_meanwhile[key]

    @rule(
        target=ids,
        tenant=st.sampled_from(TENANTS),
        band=st.sampled_from(BANDS),
        wait=st.sampled_from([0.0, 1.0, 2.5, 4.0, math.inf]),
    )
    def push(self, tenant, band, wait):
        w = Waiter(id=self.pushes, tenant=tenant, band=band, enqueued_at=self.now, deadline=self.now + wait)
        self.pushes += 1
        result = self.queue.push(w)
        if len(self.model.by_id) >= MAX_WAITING:
            assert result == Rejected(reason="queue full", retry_after=RETRY_AFTER)
        else:
            assert result == Accepted()
            self.model.add(w)
            self.accepted.add(w.id)
            self.served_meanwhile.setdefault((band, tenant), Counter())
        return w.id

    @rule(waiter_id=ids)
    def cancel(self, waiter_id):
        w = self.model.by_id.get(waiter_id)
        assert self.queue.cancel(waiter_id) == (w is not None)
        if w is not None:
            self.model.remove(w)
            self.left(w, "cancelled")
            self.forget_idle_tenants()

    @rule(step=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, step):
        self.now += step

    @rule()
    def expire(self):
        expired = self.queue.expire(self.now)
        assert expired == self.model.expire(self.now)
        for w in expired:
            self.left(w, "expired")
        self.forget_idle_tenants()

    @rule()
    def pop(self):
        popped = self.queue.pop(self.now)
        assert popped.expired == self.model.expire(self.now)
        for w in popped.expired:
            self.left(w, "expired")
        self.forget_idle_tenants()
        still_waiting = self.model.waiting()
        assert popped.waiter == self.model.next()
        w = popped.waiter
        if w is None:
            assert still_waiting == []
            return
        self.left(w, "popped")
        assert all(other.band <= w.band for other in still_waiting), "a higher band was waiting"
        # Fairness: every other tenant waiting in this band sees this tenant served once at most
        # before its own turn comes.
        for (band, tenant), meanwhile in self.served_meanwhile.items():
            if band == w.band and tenant != w.tenant:
                meanwhile[w.tenant] += 1
                assert meanwhile[w.tenant] <= 1, f"{tenant} was skipped twice by {w.tenant} in band {band}"
        self.served_meanwhile[(w.band, w.tenant)] = Counter()
        self.forget_idle_tenants()

    @invariant()
    def counts_agree(self):
        waiting = self.model.waiting()
        assert len(self.queue) == self.queue.depth() == len(waiting)
        assert self.queue.depth_by_band() == Counter(w.band for w in waiting)
        assert self.queue.peek_band() == max(self.model.rotations, default=None)
        assert self.queue.next_deadline() == min((w.deadline for w in waiting), default=None)

    @invariant()
    def every_accepted_waiter_is_queued_or_left_once(self):
        assert set(self.model.by_id) | set(self.left_by) == self.accepted
        assert not set(self.model.by_id) & set(self.left_by)

    def teardown(self):
        # Whatever is still queued leaves too, by the one door it is due.
        for _ in range(MAX_WAITING):
            self.pop()
        assert set(self.left_by) == self.accepted


AdmissionMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


class WeightsOfOneMachine(AdmissionMachine):
    """Every tenant at weight 1: the weighted rotation follows the plain one step for step."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = AdmissionQueue(max_waiting=MAX_WAITING, weight=lambda band, tenant: 1.0)


WeightsOfOneMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestWeightsOfOneMachine = WeightsOfOneMachine.TestCase
