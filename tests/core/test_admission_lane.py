"""One model's admission lane (core/admission.AdmissionLane): the queue with room per replica.

The gate only maps the lane's ids to wake-up events, so what a user relies on — a request goes
where there is room, waits while there is none, goes in its turn once there is, and a replica
never takes more than its slots — is decided and tested here, without trio.
"""

from __future__ import annotations

import math

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.core.admission import AdmissionLane, Arrival, Go, Queued, Rejected
from llmgw.core.routing import LEAST_LOADED, PREFIX, ROUND_ROBIN


@attrs.frozen
class Load:
    running: int | None = None
    waiting: int = 0
    saturation: float = 0.0


@attrs.frozen
class Replica:
    replica: str
    slots: int = 1
    load: Load | None = None
    adapters: frozenset[str] = frozenset()


@attrs.frozen
class Offer:
    policy: str = LEAST_LOADED
    load_factor: float = 1.25
    replicas: tuple[Replica, ...] = ()


def offer(*ids: str, slots: int = 1, policy: str = LEAST_LOADED) -> Offer:
    return Offer(policy=policy, replicas=tuple(Replica(replica=i, slots=slots) for i in ids))


def arrival(id: int, tenant: str = "a", band: int = 0, key: bytes | None = None) -> Arrival:
    return Arrival(id=id, tenant=tenant, band=band, deadline=math.inf, key=key)


def salt() -> int:
    return 7


def test_with_room_and_nobody_waiting_a_request_goes_at_once_and_takes_a_slot():
    lane = AdmissionLane(10)
    went = lane.arrive(arrival(1), offer("r1"), 0.0, salt)
    assert isinstance(went, Go) and went.replica == "r1" and went.order == ("r1",)
    assert lane.in_flight == {"r1": 1}


def test_without_room_it_queues_and_goes_when_a_request_finishes():
    lane = AdmissionLane(10)
    routes = offer("r1")
    lane.arrive(arrival(1), routes, 0.0, salt)
    queued = lane.arrive(arrival(2), routes, 0.0, salt)
    assert queued == Queued(wake=())
    assert lane.dispatch(routes, 1.0, salt) == ()  # still no room
    lane.release("r1")
    (went,) = lane.dispatch(routes, 1.0, salt)
    assert went.id == 2 and lane.in_flight == {"r1": 1} and lane.busy()


def test_a_model_with_no_ready_replica_queues_and_goes_once_one_is_ready():
    lane = AdmissionLane(10)
    assert lane.arrive(arrival(1), None, 0.0, salt) == Queued(wake=())
    assert lane.arrive(arrival(2), offer(), 0.0, salt) == Queued(wake=())
    (went,) = lane.dispatch(offer("r1"), 5.0, salt)
    assert went.id == 1


def test_two_replicas_share_the_load():
    lane = AdmissionLane(10)
    routes = offer("r1", "r2")
    first = lane.arrive(arrival(1), routes, 0.0, salt)
    second = lane.arrive(arrival(2), routes, 0.0, salt)
    assert {first.replica, second.replica} == {"r1", "r2"}


def test_a_full_queue_refuses():
    lane = AdmissionLane(1)
    routes = offer("r1")
    lane.arrive(arrival(1), routes, 0.0, salt)
    assert isinstance(lane.arrive(arrival(2), routes, 0.0, salt), Queued)
    assert isinstance(lane.arrive(arrival(3), routes, 0.0, salt), Rejected)


def test_a_waiter_that_leaves_is_never_let_through():
    lane = AdmissionLane(10)
    routes = offer("r1")
    lane.arrive(arrival(1), routes, 0.0, salt)
    lane.arrive(arrival(2), routes, 0.0, salt)
    lane.arrive(arrival(3), routes, 0.0, salt)
    lane.leave(2)
    lane.release("r1")
    assert [go.id for go in lane.dispatch(routes, 0.0, salt)] == [3]


def test_higher_bands_go_first_and_tenants_take_turns():
    lane = AdmissionLane(10)
    routes = offer("r1")
    lane.arrive(arrival(0), routes, 0.0, salt)  # holds the only slot
    for id, tenant, band in [(1, "a", 0), (2, "a", 0), (3, "b", 0), (4, "c", 5)]:
        lane.arrive(arrival(id, tenant, band), routes, 0.0, salt)
    order = []
    for _ in range(4):
        lane.release("r1")
        order += [go.id for go in lane.dispatch(routes, 0.0, salt)]
    assert order == [4, 1, 3, 2]


def test_a_prefix_request_waits_for_its_own_replica_counted_in_its_load():
    lane = AdmissionLane(10)
    routes = offer("r1", "r2", policy=PREFIX)
    key = b"the same system prompt"
    home = lane.arrive(arrival(1, key=key), routes, 0.0, salt).replica
    queued = lane.arrive(arrival(2, key=key), routes, 0.0, salt)
    # Its home is full, the other replica is free: within the load bound it waits for home.
    assert queued == Queued(wake=())
    assert lane.waiting_for() == {home: 1}
    assert lane.depth_by_band() == {0: 1}
    lane.release(home)
    (went,) = lane.dispatch(routes, 0.0, salt)
    assert (went.id, went.replica) == (2, home)


def test_round_robin_turns_through_the_replicas():
    lane = AdmissionLane(10)
    routes = offer("r1", "r2", "r3", slots=10, policy=ROUND_ROBIN)
    chosen = [lane.arrive(arrival(i), routes, 0.0, salt).replica for i in range(6)]
    assert sorted(chosen[:3]) == ["r1", "r2", "r3"] and chosen[3:] == chosen[:3]


# The machine's replicas that serve adapter "a" (r2 serves the base model only).
SERVING_A = {"r1": frozenset({"a"}), "r3": frozenset({"a"})}


class LaneMachine(RuleBasedStateMachine):
    """Requests arrive, finish and leave at random against replicas that come and go: no
    replica ever holds more than its slots, every request goes at most once, and one that has
    left never goes."""

    def __init__(self) -> None:
        super().__init__()
        self.lane = AdmissionLane(8)
        self.replicas = {"r1": 2, "r2": 1}
        self.policy = LEAST_LOADED
        self.next_id = 0
        self.waiting: set[int] = set()
        self.running: dict[int, str] = {}
        self.gone: set[int] = set()
        self.adapter_of: dict[int, str | None] = {}

    def offer(self) -> Offer:
        return Offer(
            policy=self.policy,
            replicas=tuple(
                Replica(replica=r, slots=s, adapters=SERVING_A.get(r, frozenset()))
                for r, s in self.replicas.items()
            ),
        )

    def took(self, went) -> None:
        for go in went:
            assert go.id in self.waiting, go  # only a waiting request goes, and only once
            self.waiting.discard(go.id)
            assert go.replica in self.replicas
            adapter = self.adapter_of[go.id]
            # A request for an adapter goes only where it is served, and is sent nowhere else.
            assert adapter is None or all(adapter in SERVING_A.get(r, ()) for r in go.order), go
            self.running[go.id] = go.replica

    @rule(
        tenant=st.sampled_from("ab"),
        band=st.integers(0, 1),
        key=st.sampled_from([None, b"x", b"y"]),
        adapter=st.sampled_from([None, None, "a"]),
    )
    def arrive(self, tenant, band, key, adapter) -> None:
        id, self.next_id = self.next_id, self.next_id + 1
        self.waiting.add(id)
        self.adapter_of[id] = adapter
        result = self.lane.arrive(
            Arrival(id=id, tenant=tenant, band=band, deadline=math.inf, key=key, adapter=adapter),
            self.offer(),
            0.0,
            salt,
        )
        if isinstance(result, Go):
            self.took([result])
        elif isinstance(result, Rejected):
            self.waiting.discard(id)
        else:
            self.took(result.wake)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick) -> None:
        id = sorted(self.running)[pick % len(self.running)]
        self.lane.release(self.running.pop(id))
        self.took(self.lane.dispatch(self.offer(), 0.0, salt))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 100))
    def leave(self, pick) -> None:
        id = sorted(self.waiting)[pick % len(self.waiting)]
        self.waiting.discard(id)
        self.gone.add(id)
        self.lane.leave(id)

    @rule(policy=st.sampled_from([LEAST_LOADED, PREFIX, ROUND_ROBIN]), slots=st.integers(1, 3))
    def the_replicas_change(self, policy, slots) -> None:
        self.policy = policy
        self.replicas["r3"] = slots
        self.took(self.lane.dispatch(self.offer(), 0.0, salt))

    @invariant()
    def no_replica_holds_more_than_its_slots(self) -> None:
        for replica, count in self.lane.in_flight.items():
            assert count == sum(1 for r in self.running.values() if r == replica)
            # r3's slots change while requests run on it: never more than it ever offered.
            assert count <= (3 if replica == "r3" else self.replicas[replica])

    @invariant()
    def nothing_waits_while_a_replica_has_room_and_no_affinity_holds_it(self) -> None:
        if self.policy != LEAST_LOADED or not self.waiting:
            return
        self.took(self.lane.dispatch(self.offer(), 0.0, salt))
        free = {r: s - self.lane.in_flight.get(r, 0) for r, s in self.replicas.items()}
        for id in self.waiting:
            # What it waits for is full: any replica for the base, one serving its adapter else.
            adapter = self.adapter_of[id]
            usable = [f for r, f in free.items() if adapter is None or adapter in SERVING_A.get(r, ())]
            assert all(f <= 0 for f in usable), (free, id, adapter)


LaneMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLane = LaneMachine.TestCase


def test_a_request_for_an_adapter_goes_only_to_a_replica_serving_it_and_waits_for_one():
    lane = AdmissionLane(10)
    routes = Offer(
        replicas=(
            Replica(replica="base-only", slots=4),
            Replica(replica="with-a", slots=1, adapters=frozenset("a")),
        )
    )
    first = lane.arrive(Arrival(id=1, tenant="t", band=0, deadline=math.inf, adapter="a"), routes, 0.0, salt)
    assert isinstance(first, Go) and first.order == ("with-a",)
    # with-a is full: the next request for "a" waits, though base-only has room.
    queued = lane.arrive(Arrival(id=2, tenant="t", band=0, deadline=math.inf, adapter="a"), routes, 0.0, salt)
    assert queued == Queued(wake=())
    # ... and a base request behind it is not held up by it.
    behind = lane.arrive(arrival(3), routes, 0.0, salt)
    assert isinstance(behind, Queued) and [(g.id, g.replica) for g in behind.wake] == [(3, "base-only")]
    lane.release("with-a")
    (went,) = lane.dispatch(routes, 0.0, salt)
    assert (went.id, went.replica) == (2, "with-a")


def test_an_adapter_no_replica_serves_waits_rather_than_going_to_the_base():
    lane = AdmissionLane(10)
    routes = offer("r1", "r2", slots=4)
    queued = lane.arrive(Arrival(id=1, tenant="t", band=0, deadline=math.inf, adapter="x"), routes, 0.0, salt)
    assert queued == Queued(wake=())
    assert lane.dispatch(routes, 0.0, salt) == ()
