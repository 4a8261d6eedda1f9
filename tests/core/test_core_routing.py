"""The pure choice of a replica: room, the three policies, and CHWBL's guarantees as properties."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.routing import (
    AFFINITY,
    LEAST_LOADED,
    NO_KEY,
    PREFIX,
    ROUND_ROBIN,
    SPILLED,
    Candidate,
    decide,
    has_room,
    load,
    load_bound,
    order,
    prefix_key,
    room,
)


def candidates(*in_flight: int, slots: int = 4) -> list[Candidate]:
    return [Candidate(id=f"r{i}", slots=slots, in_flight=n) for i, n in enumerate(in_flight)]


def keys(count: int) -> list[bytes]:
    return [f"system prompt number {i}".encode() for i in range(count)]


# --- room -----------------------------------------------------------------------------------


def test_room_is_slots_less_in_flight_and_a_full_engine_takes_no_more_than_it_runs():
    assert room(Candidate(id="a", slots=4, in_flight=1)) == 3
    assert room(Candidate(id="a", slots=4, in_flight=6)) == 0
    # Requests wait inside the engine: it runs 2, so with 1 of ours it takes 1 more at most.
    assert room(Candidate(id="a", slots=4, in_flight=1, running=2, waiting=3)) == 1
    assert room(Candidate(id="a", slots=4, in_flight=0, running=3, saturation=0.97)) == 3
    assert room(Candidate(id="a", slots=4, in_flight=3, running=3, saturation=0.97)) == 0
    # Not full: its slots stand, whatever it ran at the last scrape.
    assert room(Candidate(id="a", slots=4, in_flight=0, running=1, saturation=0.5)) == 4
    assert not has_room(candidates(4, 4)) and has_room(candidates(4, 3))


# --- round-robin and least-loaded -------------------------------------------------------------


def test_round_robin_turns_through_every_replica_with_room():
    firsts = [order(ROUND_ROBIN, candidates(0, 0, 0), turn=t).order[0] for t in range(6)]
    assert firsts == ["r0", "r1", "r2", "r0", "r1", "r2"]
    # A full one is passed over (it goes last, for a failed connect's sake).
    assert order(ROUND_ROBIN, candidates(0, 4, 0), turn=1).order == ("r2", "r0", "r1")


def test_least_loaded_takes_the_lowest_share_of_slots():
    replicas = [
        Candidate(id="a", slots=8, in_flight=4),  # half
        Candidate(id="b", slots=2, in_flight=1),  # half
        Candidate(id="c", slots=4, in_flight=1),  # a quarter
    ]
    assert order(LEAST_LOADED, replicas).order[0] == "c"


def test_least_loaded_passes_over_an_engine_that_says_it_is_full_while_another_has_room():
    replicas = [
        Candidate(id="busy", slots=4, in_flight=0, running=3, waiting=2),
        Candidate(id="free", slots=4, in_flight=2, running=2),
    ]
    assert order(LEAST_LOADED, replicas).order == ("free", "busy")


def test_least_loaded_breaks_ties_by_the_salt_not_by_position():
    firsts = collections.Counter(
        order(LEAST_LOADED, candidates(0, 0, 0), salt=s).order[0] for s in range(300)
    )
    assert set(firsts) == {"r0", "r1", "r2"}
    assert min(firsts.values()) > 60  # about a third each


# --- prefix (CHWBL) ---------------------------------------------------------------------------


def test_one_prefix_keeps_its_replica_and_different_prefixes_spread():
    replicas = candidates(0, 0, 0, 0)
    homes = {key: order(PREFIX, replicas, key=key).order[0] for key in keys(64)}
    assert all(order(PREFIX, replicas, key=k).order[0] == home for k, home in homes.items())
    assert set(homes.values()) == {"r0", "r1", "r2", "r3"}
    assert order(PREFIX, replicas, key=b"x").outcome == AFFINITY


def test_a_prefix_spills_over_once_its_replica_is_past_the_bound():
    key = keys(1)[0]
    home = order(PREFIX, candidates(0, 0), key=key).order[0]
    loaded = [Candidate(id=c.id, slots=8, in_flight=3 if c.id == home else 0) for c in candidates(0, 0)]
    # Bound: ceil(1.25 × (3 + 1) / 2) = 3, and the home replica would hold 4.
    spilled = order(PREFIX, loaded, key=key)
    assert spilled.outcome == SPILLED and spilled.order == (next(c.id for c in loaded if c.id != home), home)


def test_no_prompt_to_key_on_is_least_loaded():
    choice = order(PREFIX, candidates(2, 0, 1), key=None)
    assert choice.outcome == NO_KEY and choice.order[0] == "r1"


def test_an_unknown_policy_and_no_candidates_are_errors():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        order("fastest", candidates(0))
    with pytest.raises(ValueError):
        order(PREFIX, [], key=b"k")


loads = st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=8)


@settings(max_examples=300)
@given(loads, st.binary(min_size=1, max_size=32), st.floats(min_value=1.0, max_value=3.0))
def test_chwbl_never_puts_a_replica_past_the_bound(in_flight, key, factor):
    replicas = candidates(*in_flight, slots=1000)  # room everywhere: only the bound decides
    choice = order(PREFIX, replicas, key=key, load_factor=factor)
    chosen = next(c for c in replicas if c.id == choice.order[0])
    assert chosen.in_flight + 1 <= load_bound(replicas, factor)
    assert load_bound(replicas, factor) <= math.ceil(factor * (sum(in_flight) + 1) / len(in_flight))
    assert sorted(choice.order) == sorted(c.id for c in replicas)


@settings(max_examples=200)
@given(st.integers(min_value=1, max_value=8), st.integers(min_value=1, max_value=400), st.data())
def test_a_stream_of_requests_keeps_every_replica_within_the_bound(n, requests, data):
    """Requests arrive (and some finish) one at a time; the bound holds after every choice."""
    in_flight = dict.fromkeys((f"r{i}" for i in range(n)), 0)
    for i in range(requests):
        key = f"prefix {data.draw(st.integers(0, 5))}".encode()  # a few hot prefixes
        replicas = [Candidate(id=rid, slots=1000, in_flight=load) for rid, load in in_flight.items()]
        bound = load_bound(replicas, 1.25)
        chosen = order(PREFIX, replicas, key=key).order[0]
        in_flight[chosen] += 1
        assert in_flight[chosen] <= bound
        if i % 3 == 2:  # one finishes
            busiest = max(in_flight, key=in_flight.get)
            in_flight[busiest] -= 1


@settings(max_examples=100)
@given(st.integers(min_value=2, max_value=8), st.data())
def test_removing_a_replica_moves_only_its_own_keys(n, data):
    replicas = candidates(*([0] * n))
    gone = data.draw(st.sampled_from(replicas))
    left = [c for c in replicas if c is not gone]
    for key in keys(200):
        before = order(PREFIX, replicas, key=key).order[0]
        after = order(PREFIX, left, key=key).order[0]
        if before != gone.id:
            assert after == before


@settings(max_examples=100)
@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=6), st.binary(max_size=8))
def test_every_policy_puts_a_replica_with_room_first_whenever_one_has_room(in_flight, key):
    """Those that go where there is room; prefix waits for its replica instead (decide's test)."""
    replicas = candidates(*in_flight, slots=4)
    for policy in (LEAST_LOADED, ROUND_ROBIN):
        first = next(c for c in replicas if c.id == order(policy, replicas, key=key or None).order[0])
        assert room(first) > 0 or not has_room(replicas)


# --- decide: go now, or wait for one replica ----------------------------------------------------


def test_a_prefix_waits_for_its_full_replica_while_within_the_bound_then_spills():
    key = keys(1)[0]
    home = order(PREFIX, candidates(0, 0), key=key).order[0]
    other = "r1" if home == "r0" else "r0"

    def fleet(home_in_flight: int, home_queued: int = 0) -> list[Candidate]:
        return [
            Candidate(id=home, slots=1, in_flight=home_in_flight, queued=home_queued),
            Candidate(id=other, slots=1),
        ]

    now = decide(PREFIX, fleet(0), key=key)
    assert (now.choice.order[0], now.wait) == (home, False)
    # Its replica is busy, the other idle: with 1 in flight the bound is 2, so it waits for the
    # cache that holds its prompt rather than prefill it cold elsewhere.
    waits = decide(PREFIX, fleet(1), key=key)
    assert (waits.choice.order[0], waits.wait, waits.choice.outcome) == (home, True, AFFINITY)
    # One already waits there: past the bound, the next goes to the other replica at once.
    spills = decide(PREFIX, fleet(1, home_queued=1), key=key)
    assert (spills.choice.order[0], spills.wait, spills.choice.outcome) == (other, False, SPILLED)


def test_without_affinity_a_request_goes_where_there_is_room_or_stays_queued():
    for policy in (LEAST_LOADED, ROUND_ROBIN):
        assert decide(policy, candidates(4, 4)) is None
        assert decide(policy, candidates(4, 1)).choice.order[0] == "r1"
    assert decide(PREFIX, candidates(4, 4), key=None) is None  # nothing to key on: least-loaded
    assert decide(PREFIX, [], key=b"k") is None


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=6),
    st.binary(min_size=1, max_size=16),
)
def test_decide_keeps_the_bound_and_sends_only_where_there_is_room(loads, key):
    replicas = [Candidate(id=f"r{i}", slots=4, in_flight=f, queued=q) for i, (f, q) in enumerate(loads)]
    decision = decide(PREFIX, replicas, key=key)
    target = next(c for c in replicas if c.id == decision.choice.order[0])
    assert load(target) + 1 <= load_bound(replicas, 1.25)
    assert decision.wait == (room(target) == 0)


# --- the key --------------------------------------------------------------------------------


def test_the_key_is_the_start_of_the_prompt():
    system = {"role": "system", "content": "You answer questions about invoices. " * 20}
    one = {"messages": [system, {"role": "user", "content": "What is VAT?"}]}
    two = {"messages": [system, {"role": "user", "content": "Who pays the freight?"}]}
    assert prefix_key(one) == prefix_key(two)  # a long system prompt: the key is all system
    assert prefix_key(one, chars=10_000) != prefix_key(two, chars=10_000)
    other = {"messages": [{"role": "system", "content": "You write poems. " * 40}]}
    assert prefix_key(other) != prefix_key(one)
    # Content parts count by their text; a completion's prompt by its start.
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": system["content"]}]}]}
    assert prefix_key(parts) == prefix_key(one)
    assert prefix_key({"prompt": "abc" * 200}, chars=5) == b"abcab"
    assert prefix_key({"prompt": ["first prompt", "second"]}) == b"first prompt"
    for nothing in ({"input": "embed me"}, {"prompt": ""}, {"messages": []}, {"messages": "x"}):
        assert prefix_key(nothing) is None


def test_an_adapter_starts_the_prefix_key_so_each_adapter_keys_its_own_cache():
    payload = {"messages": [{"role": "user", "content": "hello"}]}
    base = prefix_key(payload)
    assert prefix_key(payload, adapter="sql") == b"sql\x00" + base
    assert prefix_key(payload, adapter="sql") != prefix_key(payload, adapter="support")
    assert prefix_key({"input": "no prompt"}, adapter="sql") is None  # nothing to key on
