"""Scaling between min and max replicas from load, with sustain windows and cooldowns."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.catalog import Profile
from llmgw.core.scaling import (
    FINE,
    HIGH,
    LOW,
    EngineLoad,
    LoadSignals,
    ScalePolicy,
    ScaleState,
    desired_replicas,
    load_level,
)

POLICY = ScalePolicy(up_after=60, down_after=300, up_cooldown=120, down_cooldown=600)
PROFILE = Profile(
    name="chat",
    model="llama",
    engine="vllm",
    gpu_class="l40s-45g",
    gpus_per_node=1,
    memory_mib=20_000,
    min_replicas=1,
    max_replicas=4,
)

BUSY = EngineLoad(running=8, waiting=3, saturation=0.95)
IDLE = EngineLoad(running=0, waiting=0, saturation=0.05)
HALF = EngineLoad(running=4, waiting=0, saturation=0.5)


def signals(*engines: EngineLoad, queue: int = 0) -> LoadSignals:
    return LoadSignals(queue_depth=queue, replicas=engines)


def run(
    loads: list[tuple[float, LoadSignals]],
    current: int = 2,
    profile: Profile = PROFILE,
    policy: ScalePolicy = POLICY,
) -> list[tuple[float, int, str]]:
    """Feeds ``(time, signals)`` in order; returns (time, count, reason) after each."""
    state = ScaleState()
    out = []
    for now, load in loads:
        decision = desired_replicas(profile, current, load, state, now, policy)
        current, state = decision.count, decision.state
        out.append((now, current, decision.reason))
    return out


@pytest.mark.parametrize(
    ("load", "level", "why"),
    [
        (signals(queue=3), HIGH, "3 requests queued and no replica is Ready"),
        (signals(), LOW, "no requests and no replica is Ready"),
        (signals(HALF, HALF, queue=17), HIGH, "17 requests queued at the gateway for 2 replicas"),
        (signals(BUSY, HALF), HIGH, "requests wait in the engines of 1 of 2 replicas"),
        (
            signals(*[attrs.evolve(BUSY, waiting=0)] * 3),
            HIGH,
            "average saturation 0.95 above 0.80",
        ),
        (signals(IDLE, IDLE), LOW, "average saturation 0.05 below 0.30, nothing waits"),
        (signals(IDLE, HALF), LOW, "average saturation 0.28 below 0.30, nothing waits"),
        (signals(HALF, HALF), FINE, "load fits 2 replicas (average saturation 0.50)"),
        (signals(IDLE, IDLE, queue=1), FINE, "load fits 2 replicas (average saturation 0.05)"),
    ],
)
def test_load_levels_and_their_words(load, level, why):
    assert load_level(load, POLICY) == (level, why)


def test_the_count_is_brought_into_the_profile_bounds_at_once():
    below = desired_replicas(PROFILE, 0, signals(), ScaleState(), 0, POLICY)
    assert (below.count, below.reason) == (1, "up to the profile's min_replicas 1")
    above = desired_replicas(PROFILE, 9, signals(BUSY), ScaleState(), 0, POLICY)
    assert (above.count, above.reason) == (4, "down to the profile's max_replicas 4")


def test_load_must_last_before_a_replica_is_added():
    steps = run([(t, signals(BUSY, BUSY)) for t in (0, 30, 59, 60, 61)])
    assert [count for _, count, _ in steps] == [2, 2, 2, 3, 3]
    assert steps[1][2] == (
        "holding at 2: requests wait in the engines of 2 of 2 replicas, for 30 s of the 60 s before scaling up"
    )
    assert steps[3][2] == "up to 3: requests wait in the engines of 2 of 2 replicas"


def test_a_burst_shorter_than_the_window_changes_nothing():
    loads = [
        (0, signals(BUSY, BUSY)),
        (50, signals(HALF, HALF)),
        (55, signals(BUSY, BUSY)),
        (100, signals(BUSY, BUSY)),
    ]
    assert [count for _, count, _ in run(loads)] == [2, 2, 2, 2]


def test_each_further_step_waits_out_the_cooldown_and_the_window_again():
    steps = run([(t, signals(BUSY, BUSY, BUSY)) for t in range(0, 400, 10)], current=1)
    ups = [t for (t, count, _), (_, before, _) in zip(steps[1:], steps, strict=False) if count > before]
    # The first after 60 s of load; then each after both the 120 s cooldown and a fresh 60 s.
    assert ups == [60, 180, 300]
    assert steps[-1][1] == 4  # max_replicas
    assert (
        steps[-1][2]
        == "holding at 4: at max_replicas 4 though requests wait in the engines of 3 of 3 replicas"
    )


def test_scaling_down_waits_for_its_own_window_and_cooldown_and_stops_at_min():
    busy = [(t, signals(BUSY, BUSY)) for t in range(0, 70, 10)]
    idle = [(t, signals(IDLE, IDLE)) for t in range(70, 2_000, 10)]
    steps = run(busy + idle)
    changes = [
        (t, count) for (t, count, _), (_, before, _) in zip(steps[1:], steps, strict=False) if count != before
    ]
    # Up at 60; idle from 70, but a step down needs 300 s of it and 600 s since the last change:
    # 660. The next needs both again: 1260, where it reaches min_replicas.
    assert changes == [(60, 3), (660, 2), (1260, 1)]
    assert steps[-1][2] == "holding at 1: at min_replicas 1"


def test_the_reason_says_when_the_cooldown_holds_the_count():
    state = ScaleState(high_since=0, last_change=100)
    decision = desired_replicas(PROFILE, 2, signals(BUSY, BUSY), state, 160, POLICY)
    assert decision.count == 2
    assert decision.reason == (
        "holding at 2: requests wait in the engines of 2 of 2 replicas, "
        "but the count changed 60 s too recently to scale up"
    )


def test_from_zero_queued_requests_start_a_replica_without_waiting_for_the_window():
    profile = attrs.evolve(PROFILE, min_replicas=0)
    decision = desired_replicas(profile, 0, signals(queue=1), ScaleState(), 5, POLICY)
    assert (decision.count, decision.reason) == (1, "up to 1: 1 requests queued and no replica is Ready")
    # ... nor for the cooldown: a client waits, and nothing else can serve it.
    cold = desired_replicas(profile, 0, signals(queue=1), ScaleState(last_change=0), 5, POLICY)
    assert cold.count == 1
    idle = desired_replicas(profile, 0, signals(), ScaleState(), 5, POLICY)
    assert (idle.count, idle.reason) == (0, "holding at 0: no request waits (min_replicas 0)")


def test_the_last_replica_goes_only_after_scale_to_zero_after_without_a_request():
    profile = attrs.evolve(PROFILE, min_replicas=0, scale_to_zero_after=900)
    quiet = LoadSignals(replicas=(IDLE,), idle_for=899)
    # Low load for long enough to step down, but the last replica stays: a start is slow.
    held = desired_replicas(profile, 1, quiet, ScaleState(low_since=0), 1_000, POLICY)
    assert held.count == 1 and "until 900 s without a request (idle 899 s)" in held.reason
    gone = desired_replicas(profile, 1, attrs.evolve(quiet, idle_for=900), ScaleState(), 1_000, POLICY)
    assert (gone.count, gone.reason) == (0, "down to 0: no request for 900 s (scale_to_zero_after 900 s)")
    # The down cooldown does not hold it: the idle time already counts from the last request.
    recent = desired_replicas(
        profile, 1, attrs.evolve(quiet, idle_for=900), ScaleState(last_change=500), 1_000, POLICY
    )
    assert recent.count == 0
    # A profile that keeps a replica keeps it, however long nothing comes.
    kept = desired_replicas(PROFILE, 1, attrs.evolve(quiet, idle_for=10**6), ScaleState(), 1_000, POLICY)
    assert kept.count == 1


# --- properties ------------------------------------------------------------------------------------

engine_loads = st.builds(
    EngineLoad,
    running=st.integers(0, 16),
    waiting=st.integers(0, 4),
    saturation=st.floats(0, 1),
)
load_signals = st.builds(
    LoadSignals,
    queue_depth=st.integers(0, 40),
    replicas=st.lists(engine_loads, max_size=5).map(tuple),
    idle_for=st.floats(0, 2_000),
)
scale_policies = st.builds(
    ScalePolicy,
    up_after=st.floats(0, 300),
    down_after=st.floats(0, 900),
    up_cooldown=st.floats(1, 600),
    down_cooldown=st.floats(1, 1_200),
)


@given(
    low=st.integers(0, 4),
    extra=st.integers(0, 4),
    current=st.integers(0, 12),
    load=load_signals,
    now=st.floats(0, 1e6),
    state=st.builds(
        ScaleState,
        high_since=st.none() | st.floats(0, 1e6),
        low_since=st.none() | st.floats(0, 1e6),
        last_change=st.none() | st.floats(0, 1e6),
    ),
)
def test_the_count_stays_within_bounds_and_moves_one_step_at_a_time(low, extra, current, load, now, state):
    profile = attrs.evolve(PROFILE, min_replicas=low, max_replicas=low + extra)
    decision = desired_replicas(profile, current, load, state, now, POLICY)
    assert low <= decision.count <= low + extra
    if low <= current <= low + extra:
        assert abs(decision.count - current) <= 1
    assert decision.reason.startswith(("holding at", "up to", "down to"))


@given(
    policy=scale_policies,
    steps=st.lists(st.tuples(st.floats(0.5, 400), load_signals), min_size=1, max_size=60),
)
def test_opposite_changes_are_never_closer_than_the_cooldown(policy, steps):
    profile = attrs.evolve(PROFILE, min_replicas=0, max_replicas=6)
    now, current, state = 0.0, 3, ScaleState()
    changes = []
    for dt, load in steps:
        now += dt
        decision = desired_replicas(profile, current, load, state, now, policy)
        if decision.count != current:
            changes.append((now, decision.count - current, current))
        current, state = decision.count, decision.state
    for (t1, d1, _), (t2, d2, before) in zip(changes, changes[1:], strict=False):
        if before == 0 or before + d2 == 0:
            continue  # to and from zero go by requests, not by cooldowns (tested above)
        cooldown = policy.down_cooldown if d2 < 0 else policy.up_cooldown
        assert t2 - t1 >= cooldown, (d1, d2)


@given(run_length=st.integers(1, 5), ticks=st.integers(4, 200), tick=st.floats(0.5, 10))
def test_load_oscillating_faster_than_the_windows_never_moves_the_count(run_length, ticks, tick):
    # ``run_length`` samples high, as many low, and so on: neither lasts 40 s, and the windows are
    # 60 s (up) and 300 s (down).
    loads = [
        (n * tick, signals(BUSY, BUSY) if (n // run_length) % 2 == 0 else signals(IDLE, IDLE))
        for n in range(ticks)
    ]
    assert {count for _, count, _ in run(loads)} == {2}
