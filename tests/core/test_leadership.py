"""The leader lease and its fencing term (core/leadership.py, core/fencing.py)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.core import fencing
from llmgw.core.leadership import LeaseRow, decide, local_deadline, release, renew_interval

LEASE = 6.0


def test_a_free_lease_is_taken_with_the_first_term():
    d = decide(None, now=100.0, me="a", address="a:1", lease=LEASE)
    assert d.leader and d.term == 1 and d.write == LeaseRow("a", 1, 106.0, "a:1")
    assert d.reason == "acquired: free"


def test_the_holder_renews_under_the_same_term():
    d = decide(LeaseRow("a", 4, 106.0, "a:1"), now=104.0, me="a", address="a:1", lease=LEASE)
    assert d.leader and d.term == 4 and d.write == LeaseRow("a", 4, 110.0, "a:1")


def test_a_lease_held_by_another_is_followed_and_not_written():
    d = decide(LeaseRow("a", 4, 106.0, "a:1"), now=105.9, me="b", address="b:1", lease=LEASE)
    assert not d.leader and d.write is None and (d.holder, d.term, d.address) == ("a", 4, "a:1")


def test_an_expired_lease_is_taken_with_the_next_term_even_by_its_old_holder():
    for me in ("b", "a"):
        d = decide(LeaseRow("a", 4, 106.0, "a:1"), now=106.0, me=me, address=f"{me}:1", lease=LEASE)
        assert d.leader and d.term == 5 and d.write.holder == me
        assert d.reason == "acquired: expired (held by a)"


def test_force_takes_a_live_lease_with_the_next_term():
    d = decide(LeaseRow("old", 2, 999.0), now=1.0, me="new", address="", lease=LEASE, force=True)
    assert d.leader and d.term == 3


def test_release_frees_the_lease_at_once_and_only_for_its_holder():
    row = LeaseRow("a", 4, 106.0, "a:1")
    assert release(row, now=101.0, me="b") is None
    freed = release(row, now=101.0, me="a")
    assert freed == LeaseRow("", 4, 101.0, "")
    assert decide(freed, now=101.0, me="b", address="b:1", lease=LEASE).term == 5


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError):
        decide(None, now=0.0, me="a", address="", lease=0)


def test_the_local_deadline_is_before_the_stores_and_renewals_fit_three_times():
    assert local_deadline(10.0, LEASE) < 10.0 + LEASE
    assert renew_interval(LEASE) * 3 == LEASE


def test_fencing_refuses_only_an_older_term():
    assert fencing.admit(3, 3).ok and fencing.admit(3, 4) == fencing.Verdict(True, 4)
    refused = fencing.admit(3, 2)
    assert not refused.ok and refused.newest == 3 and "term 2" in refused.reason
    assert fencing.seen(3, 2) == 3 and fencing.seen(3, 5) == 5


SERVERS = ("a", "b", "c")


class LeaseMachine(RuleBasedStateMachine):
    """Three servers looking at one lease row at arbitrary times, with arbitrary delays between
    asking and the store answering (a paused process, a slow network), some pausing for long
    stretches. Whatever the interleaving: no two servers ever act as leader at the same moment,
    a term belongs to one server only, terms never go back, and an agent that hears every
    leader's commands runs only those of the newest term."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0  # one clock: the store's and every server's (same rate)
        self.row: LeaseRow | None = None
        self.deadline = dict.fromkeys(SERVERS, -1.0)  # until when each believes it leads
        self.term_of = dict.fromkeys(SERVERS, 0)
        self.holders: dict[int, str] = {}  # term -> the one server ever granted it
        self.last_term = 0
        self.agent_newest = 0

    @rule(dt=st.floats(0, 10))
    def time_passes(self, dt):
        self.now += dt

    @rule(server=st.sampled_from(SERVERS), delay=st.floats(0, 3))
    def look(self, server, delay):
        asked_at = self.now
        self.now += delay  # the store answers later than asked
        d = decide(self.row, now=self.now, me=server, address=server, lease=LEASE)
        if d.write is not None:
            self.row = d.write
        if d.leader:
            assert self.holders.setdefault(d.term, server) == server  # one server per term
        assert d.term >= self.last_term
        self.last_term = d.term
        if d.leader:
            self.deadline[server] = local_deadline(asked_at, LEASE)
            self.term_of[server] = d.term
        else:
            self.deadline[server] = -1.0

    @precondition(lambda self: self.row is not None)
    @rule(server=st.sampled_from(SERVERS))
    def shut_down(self, server):
        freed = release(self.row, now=self.now, me=server)
        if freed is not None:
            self.row = freed
            self.deadline[server] = -1.0

    @rule(server=st.sampled_from(SERVERS))
    def command(self, server):
        """A server sends a command under the term it last held (a stale one, maybe)."""
        term = self.term_of[server]
        if term == 0:
            return
        verdict = fencing.admit(self.agent_newest, term)
        acting = self.deadline[server] > self.now
        if acting:
            # A server within its own deadline is the newest leader: never refused.
            assert verdict.ok
        if verdict.ok:
            self.agent_newest = verdict.newest

    @invariant()
    def at_most_one_acts(self):
        acting = [s for s in SERVERS if self.deadline[s] > self.now]
        assert len(acting) <= 1, (acting, self.row, self.now)


LeaseMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_lease_machine = LeaseMachine.TestCase
