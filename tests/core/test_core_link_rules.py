"""The link's pure rules: reconnect delays and liveness."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.backoff import reconnect_delay
from llmgw.core.liveness import Liveness, NodeState, node_state


def test_backoff_doubles_from_initial_and_stops_at_the_cap():
    steps = [reconnect_delay(n, initial=0.5, maximum=30, draw=1.0) for n in range(10)]
    assert steps == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_backoff_jitter_spans_the_upper_half_of_the_step():
    assert reconnect_delay(3, initial=1, maximum=60, draw=0.0) == 4.0
    assert reconnect_delay(3, initial=1, maximum=60, draw=0.5) == 6.0


@given(
    attempt=st.integers(min_value=0, max_value=10_000),
    initial=st.floats(min_value=0.001, max_value=10),
    extra=st.floats(min_value=0, max_value=600),
    draw=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_backoff_is_never_above_the_cap_nor_below_half_the_step(attempt, initial, extra, draw):
    maximum = initial + extra
    delay = reconnect_delay(attempt, initial=initial, maximum=maximum, draw=draw)
    step = min(maximum, initial * 2.0 ** min(attempt, 62))
    assert step / 2 <= delay <= maximum
    # Growing the attempt never shrinks the fixed half of the delay.
    assert reconnect_delay(attempt + 1, initial=initial, maximum=maximum, draw=0) >= step / 2


def test_backoff_rejects_negative_attempts():
    with pytest.raises(ValueError):
        reconnect_delay(-1, initial=1, maximum=2, draw=0)


def test_node_is_lost_only_after_the_whole_window():
    rule = Liveness(interval=5, missed=3)
    assert node_state(rule, last_heard=100, now=115) is NodeState.ONLINE  # exactly the window
    assert node_state(rule, last_heard=100, now=115.01) is NodeState.LOST
    assert node_state(rule, last_heard=100, now=100) is NodeState.ONLINE


@given(
    interval=st.floats(min_value=0.01, max_value=60),
    missed=st.integers(min_value=1, max_value=20),
    last=st.floats(min_value=0, max_value=1e6),
    later=st.floats(min_value=0, max_value=1e4),
)
def test_being_heard_again_always_brings_a_node_back(interval, missed, last, later):
    rule = Liveness(interval=interval, missed=missed)
    now = last + later
    assert node_state(rule, last_heard=now, now=now) is NodeState.ONLINE
    # `now - last`, not `later`: the rule sees the two clock readings, and floats round.
    assert (node_state(rule, last_heard=last, now=now) is NodeState.LOST) == (now - last > interval * missed)
