"""Adapters loaded on demand (core/adapter_residency): single flight, LRU without in-flight
victims, spill, failed loads, relearning — decided here, without trio or engines."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.core.adapter_residency import Await, Load, NoRoom, Queue, ReplicaView, Residency, Use

ADAPTERS = [f"a{i}" for i in range(10)]


def residency(capacities: dict[str, int], held: dict[str, list[str]] | None = None) -> Residency:
    r = Residency()
    r.sync(capacities)
    for replica in capacities:
        r.relearn(replica, (held or {}).get(replica, []), 0.0)
    return r


def views(*ids: str, busy: tuple[str, ...] = (), loads: dict[str, float] | None = None) -> list[ReplicaView]:
    return [ReplicaView(id=i, load=(loads or {}).get(i, 0.0), has_room=i not in busy) for i in ids]


def test_fifty_concurrent_first_requests_for_one_cold_adapter_load_it_once():
    r = residency({"r1": 3, "r2": 3})
    answers = [r.want("a0", views("r1", "r2"), {}, 1.0) for _ in range(50)]
    loads = [a for a in answers if isinstance(a, Load)]
    assert len(loads) == 1
    assert all(a == Await(replica=loads[0].replica) for a in answers if not isinstance(a, Load))
    r.loaded(loads[0].replica, "a0", 2.0)
    assert r.want("a0", views("r1", "r2"), {}, 3.0) == Use(replica=loads[0].replica)


def test_a_cold_adapter_goes_to_the_least_loaded_replica_with_a_free_slot_before_evicting():
    r = residency({"r1": 3, "r2": 3}, {"r1": ["a1"], "r2": ["a2", "a3", "a4"]})
    # r2 is the less loaded but its slots are full: a free slot on r1 wins over an eviction...
    assert r.want("a0", views("r1", "r2", loads={"r1": 0.5, "r2": 0.1}), {}, 1.0) == Load(replica="r1")
    # ...and between two free slots the least loaded wins.
    r = residency({"r1": 3, "r2": 3})
    assert r.want("a0", views("r1", "r2", loads={"r1": 0.5, "r2": 0.1}), {}, 1.0) == Load(replica="r2")


def test_to_make_room_the_least_recently_used_idle_adapter_is_unloaded_in_lru_order():
    r = residency({"r1": 3})
    for t, name in enumerate(["a1", "a2", "a3"]):
        load = r.want(name, views("r1"), {}, float(t))
        assert load == Load(replica="r1")
        r.loaded("r1", name, float(t))
    r.want("a1", views("r1"), {}, 10.0)  # a1 used again: a2 is now the oldest
    evicted = []
    for t, name in enumerate(["a4", "a5", "a6"], start=20):
        load = r.want(name, views("r1"), {}, float(t))
        assert isinstance(load, Load) and load.evict is not None
        evicted.append(load.evict)
        r.unloaded("r1", load.evict)
        r.loaded("r1", name, float(t))
    assert evicted == ["a2", "a3", "a1"]
    assert r.held("r1") == ["a4", "a5", "a6"]


def test_an_adapter_with_a_request_in_flight_is_never_unloaded():
    r = residency({"r1": 2}, {"r1": ["a1", "a2"]})
    r.used("r1", "a2", 5.0)  # a1 is the least recently used, but it has a request in flight
    load = r.want("a0", views("r1"), {("r1", "a1"): 1}, 6.0)
    assert load == Load(replica="r1", evict="a2")
    r.unloaded("r1", "a2")
    r.loaded("r1", "a0", 7.0)
    # Now both held adapters are in use: a third waits, nothing is unloaded.
    answer = r.want("a3", views("r1"), {("r1", "a1"): 1, ("r1", "a0"): 2}, 8.0)
    assert isinstance(answer, NoRoom) and "requests in flight" in answer.reason
    assert r.held("r1") == ["a0", "a1"]


def test_spill_to_another_replica_when_the_affine_one_is_saturated():
    r = residency({"r1": 3, "r2": 3}, {"r1": ["a0"]})
    assert r.want("a0", views("r1", "r2"), {}, 1.0) == Use(replica="r1")
    spill = r.want("a0", views("r1", "r2", busy=("r1",)), {("r1", "a0"): 4}, 2.0)
    assert spill == Load(replica="r2")
    r.loaded("r2", "a0", 3.0)
    assert r.holders("a0") == ["r1", "r2"]
    # With both holding it, the one with room takes the request, and no third copy is loaded.
    assert r.want("a0", views("r1", "r2", busy=("r2",)), {}, 4.0) == Use(replica="r1")


def test_a_busy_holder_is_waited_for_when_no_replica_with_room_can_load_it():
    r = residency({"r1": 1, "r2": 1}, {"r1": ["a0"], "r2": ["a1"]})
    # r2 has room for requests, but its one slot holds a1, in use: a0's requests wait for r1.
    answer = r.want("a0", views("r1", "r2", busy=("r1",)), {("r2", "a1"): 1}, 1.0)
    assert answer == Queue(holders=("r1",))
    # Nor is a second copy opened on a replica that is as busy.
    r = residency({"r1": 3, "r2": 3}, {"r1": ["a0"]})
    assert r.want("a0", views("r1", "r2", busy=("r1", "r2")), {}, 1.0) == Queue(holders=("r1",))


def test_a_failed_load_is_retried_by_the_next_request_not_by_itself():
    r = residency({"r1": 3})
    assert r.want("a0", views("r1"), {}, 1.0) == Load(replica="r1")
    assert r.want("a0", views("r1"), {}, 1.5) == Await(replica="r1")
    r.load_failed("r1", "a0")
    assert r.held("r1") == [] and r.loading("r1") == []
    assert r.want("a0", views("r1"), {}, 2.0) == Load(replica="r1")


def test_a_failed_unload_keeps_the_victim_held():
    r = residency({"r1": 1}, {"r1": ["a1"]})
    assert r.want("a0", views("r1"), {}, 1.0) == Load(replica="r1", evict="a1")
    r.unload_failed("r1", "a1", 2.0)
    r.load_failed("r1", "a0")
    assert r.held("r1") == ["a1"]


def test_after_a_server_restart_what_the_engines_hold_is_relearned_and_not_loaded_again():
    before = residency({"r1": 3, "r2": 3})
    load = before.want("a0", views("r1", "r2"), {}, 1.0)
    before.loaded(load.replica, "a0", 1.0)
    engines = {"r1": before.held("r1"), "r2": before.held("r2")}

    after = Residency()  # the restarted server's
    assert after.sync({"r1": 3, "r2": 3}) == ["r1", "r2"]
    waiting = after.want("a0", views("r1", "r2"), {}, 5.0)
    assert isinstance(waiting, NoRoom) and "not yet said" in waiting.reason  # no blind load
    for replica, held in engines.items():
        after.relearn(replica, held, 5.0)
    assert after.sync({"r1": 3, "r2": 3}) == []
    assert after.want("a0", views("r1", "r2"), {}, 6.0) == Use(replica=load.replica)


def test_a_replica_that_went_is_forgotten_and_one_that_came_is_learned():
    r = residency({"r1": 3}, {"r1": ["a0"]})
    assert r.sync({"r2": 3}) == ["r2"]
    assert r.holders("a0") == []
    r.relearn("r2", ["a0"], 1.0)
    assert r.holders("a0") == ["r2"]


class ResidencyMachine(RuleBasedStateMachine):
    """Any sequence of wants, loads that succeed or fail, unloads and requests starting and
    ending: never more adapters than slots, one load per adapter at a time, no victim in use."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = {"r1": 3, "r2": 3}
        self.r = residency(self.capacity)
        self.in_flight: dict[tuple[str, str], int] = {}
        self.pending_loads: list[tuple[str, str]] = []
        self.pending_unloads: list[tuple[str, str]] = []
        self.now = 0.0

    @rule(
        adapter=st.sampled_from(ADAPTERS),
        busy=st.sets(st.sampled_from(["r1", "r2"])),
        load1=st.floats(0, 2),
        load2=st.floats(0, 2),
    )
    def want(self, adapter, busy, load1, load2):
        self.now += 1
        loading_before = [(r, a) for r, a in self.pending_loads if a == adapter]
        held_before = {r: self.r.held(r) for r in self.capacity}
        answer = self.r.want(
            adapter,
            views("r1", "r2", busy=tuple(busy), loads={"r1": load1, "r2": load2}),
            self.in_flight,
            self.now,
        )
        if isinstance(answer, Use):
            assert answer.replica not in busy and adapter in held_before[answer.replica]
            key = (answer.replica, adapter)
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
        elif isinstance(answer, Load):
            assert not loading_before, "single flight: a second load of one adapter"
            assert adapter not in held_before[answer.replica]
            self.pending_loads.append((answer.replica, adapter))
            if answer.evict is not None:
                assert self.in_flight.get((answer.replica, answer.evict), 0) == 0
                assert answer.evict in held_before[answer.replica]
                self.pending_unloads.append((answer.replica, answer.evict))
        elif isinstance(answer, Await):
            assert (answer.replica, adapter) in loading_before
        elif isinstance(answer, Queue):
            assert all(adapter in held_before[h] for h in answer.holders)

    @precondition(lambda self: self.pending_loads)
    @rule(data=st.data(), ok=st.booleans())
    def finish_load(self, data, ok):
        replica, adapter = data.draw(st.sampled_from(self.pending_loads))
        if any(r == replica for r, _ in self.pending_unloads):
            return  # the shell unloads the victim first
        self.pending_loads.remove((replica, adapter))
        if ok:
            self.r.loaded(replica, adapter, self.now)
        else:
            self.r.load_failed(replica, adapter)

    @precondition(lambda self: self.pending_unloads)
    @rule(data=st.data())
    def finish_unload(self, data):
        replica, adapter = data.draw(st.sampled_from(self.pending_unloads))
        self.pending_unloads.remove((replica, adapter))
        self.r.unloaded(replica, adapter)

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def request_ends(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.in_flight.items() if n)))
        self.in_flight[key] -= 1

    @invariant()
    def never_more_adapters_than_slots(self):
        for replica, capacity in self.capacity.items():
            held = self.r.held(replica)
            loading = self.r.loading(replica)
            assert len(held) + len(loading) <= capacity
            assert not set(held) & set(loading)

    @invariant()
    def an_adapter_in_use_stays_held(self):
        for (replica, adapter), n in self.in_flight.items():
            if n:
                assert adapter in self.r.held(replica)

    @invariant()
    def one_load_per_adapter_at_a_time(self):
        adapters = [a for _, a in self.pending_loads]
        assert len(adapters) == len(set(adapters))


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
