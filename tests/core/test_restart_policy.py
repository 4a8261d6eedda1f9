"""The restart policy: backoff after each failed start, a move every few, then giving up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.restart_policy import (
    GiveUp,
    MoveElsewhere,
    RestartAfter,
    RestartPolicy,
    decide,
    restart_delay,
)

POLICY = RestartPolicy(initial=5, maximum=300, move_after=3, give_up_after=10)

policies = st.builds(
    RestartPolicy,
    initial=st.floats(min_value=0.01, max_value=60),
    maximum=st.floats(min_value=0.01, max_value=3_600),
    move_after=st.integers(min_value=1, max_value=10),
    give_up_after=st.integers(min_value=1, max_value=30),
)


def test_the_delay_doubles_from_initial_and_stops_at_the_cap():
    assert [restart_delay(n, POLICY) for n in range(1, 10)] == [5, 10, 20, 40, 80, 160, 300, 300, 300]


def test_restarts_in_place_moves_every_third_failure_and_gives_up_at_the_tenth():
    decisions = {n: decide(n, last_failure=1_000, policy=POLICY) for n in range(1, 11)}
    assert decisions[1] == RestartAfter(at=1_005, delay=5)
    assert decisions[2] == RestartAfter(at=1_010, delay=10)
    assert decisions[3] == MoveElsewhere(at=1_020, delay=20)
    assert [type(decisions[n]) for n in (4, 5, 6, 7, 8, 9)] == [
        RestartAfter,
        RestartAfter,
        MoveElsewhere,
        RestartAfter,
        RestartAfter,
        MoveElsewhere,
    ]
    given_up = decisions[10]
    assert isinstance(given_up, GiveUp)
    assert given_up.reason.startswith("gave up after 10 failed starts in a row; an operator must act")


def test_a_restart_follows_a_failure():
    with pytest.raises(ValueError):
        restart_delay(0, POLICY)


@pytest.mark.parametrize("field", ["move_after", "give_up_after", "initial", "maximum", "reset_after"])
def test_the_policy_refuses_values_that_would_restart_without_limit(field):
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**{field: 0})


@given(policy=policies, failures=st.integers(min_value=1, max_value=10_000))
def test_delays_never_shrink_as_failures_grow_and_never_pass_the_cap(policy, failures):
    delay = restart_delay(failures, policy)
    assert min(policy.initial, policy.maximum) <= delay <= policy.maximum
    assert restart_delay(failures + 1, policy) >= delay


@given(policy=policies, failures=st.integers(min_value=1, max_value=100), last=st.floats(0, 1e9))
def test_every_decision_follows_the_counts(policy, failures, last):
    decision = decide(failures, last, policy)
    if failures >= policy.give_up_after:
        assert isinstance(decision, GiveUp)
        return
    assert not isinstance(decision, GiveUp)
    assert decision.at == last + restart_delay(failures, policy)
    assert isinstance(decision, MoveElsewhere) == (failures % policy.move_after == 0)
