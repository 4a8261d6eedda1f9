"""The control plane's gate: keys, model permissions, quotas under concurrency, the admission
queue's room, timeouts and cancellation. No sockets: the gate is driven directly."""

from __future__ import annotations

import json

import attrs
import pytest
import trio
import trio.testing

from llmgw.core.quota import (
    CHARS_PER_TOKEN,
    DEFAULT_COMPLETION_ESTIMATE,
    Limits,
    QuotaBook,
    Refused,
    estimate_tokens,
)
from llmgw.gateway import GatewayError, RequestRecord, Upstream, Usage
from llmgw.server.gate import SHARE_WAIT, ControlPlaneGate
from llmgw.server.routing import Route, Routes


@attrs.frozen
class Key:
    id: str
    tenant: str
    models: tuple[str, ...] = ()
    band: int = 0
    limits: Limits | None = None


class Keys:
    def __init__(self, *keys: tuple[str, Key], tenant_limits: dict[str, Limits] | None = None) -> None:
        self.by_secret = dict(keys)
        self.tenants = tenant_limits or {}

    def authenticate(self, secret: str):
        return self.by_secret.get(secret)

    def tenant(self, name: str):
        limits = self.tenants.get(name)
        return None if limits is None else Tenant(limits)


@attrs.frozen
class Tenant:
    limits: Limits


class Room:
    """The router's routes for model "m": Ready replicas with these slots, settable by the test."""

    def __init__(self, *slots: int, policy: str = "round-robin") -> None:
        self.policy = policy
        self.set(*slots)

    def set(self, *slots: int) -> None:
        self.replicas = tuple(
            Route(
                replica=f"r{i}", upstream=Upstream("127.0.0.1", 20000 + i, "k", f"r{i}"), slots=n, load=None
            )
            for i, n in enumerate(slots)
        )

    def routes(self, model: str) -> Routes | None:
        return Routes(policy=self.policy, replicas=self.replicas) if model == "m" else None

    def parent(self, name: str) -> str | None:
        return None


class Usages:
    def __init__(self) -> None:
        self.records: list = []

    def record(self, record) -> None:
        self.records.append(record)


def served(usage: Usage | None) -> RequestRecord:
    record = RequestRecord(path="/v1/chat/completions", started=0.0, model="m", status=200, completed=True)
    record.upstream = Upstream(host="10.0.0.1", port=20000, engine_key="k")
    record.usage = usage
    return record


def chat(max_tokens: int = 10) -> tuple[dict, int]:
    """A request's payload and its body's size, as the relay hands them to admit."""
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return payload, len(json.dumps(payload))


ALICE = Key(id="k-a", tenant="alice")


def gate(keys: Keys, slots: int = 8, usage: Usages | None = None, **options) -> ControlPlaneGate:
    return ControlPlaneGate(keys, Room(slots), usage=usage, **options)


def test_authentication_wants_a_bearer_key_it_knows():
    g = gate(Keys(("good", ALICE)))
    assert g.authenticate("Bearer good") == ALICE
    for header in (None, "", "Bearer bad", "Basic good", "good"):
        with pytest.raises(GatewayError) as refused:
            g.authenticate(header)
        assert refused.value.status == 401


async def test_a_key_may_use_only_its_models():
    key = Key(id="k", tenant="t", models=("m",))
    g = gate(Keys(("s", key)))
    assert g.models(key, ["m", "other"]) == ["m"]
    with pytest.raises(GatewayError) as refused:
        await g.admit(key, "other", *chat())
    assert refused.value.status == 403
    ticket = await g.admit(key, "m", *chat())
    g.finish(ticket, served(Usage(1, 1, 2)))


async def test_sixty_four_concurrent_clients_never_overshoot_a_token_quota(autojump_clock):
    """The gateway bug this exists to avoid: every request checks the quota before any has
    recorded its use. Reservations are taken at admission, so the admitted estimates stay within
    the limit (no request is larger than the limit here)."""
    limit = 1_000
    g = gate(Keys(("s", ALICE), tenant_limits={"alice": Limits(tpm=limit)}), slots=64)
    estimate = estimate_tokens(*chat(max_tokens=90))
    admitted: list[object] = []
    refused: list[GatewayError] = []
    release = trio.Event()

    async def client():
        try:
            ticket = await g.admit(ALICE, "m", *chat(max_tokens=90))
        except GatewayError as error:
            refused.append(error)
            return
        admitted.append(ticket)
        await release.wait()  # every admitted request is in flight at once
        g.finish(ticket, served(Usage(estimate - 8, 8, estimate)))

    async with trio.open_nursery() as nursery:
        for _ in range(64):
            nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert len(admitted) * estimate <= limit
    assert len(admitted) == limit // estimate  # and the quota is used, not wasted
    assert all(e.status == 429 and e.retry_after and e.retry_after > 0 for e in refused)
    assert len(admitted) + len(refused) == 64


class Shares:
    """A gateway worker's leases as the gate sees them: refuses by its share (or by the limit)
    until a grant lets it admit."""

    def __init__(self, short_of_share: bool) -> None:
        self.short_of_share = short_of_share
        self.admits = False
        self.book = QuotaBook()
        self.granted = trio.Event()
        self.tries = 0

    def reserve(self, quotas, estimate, now):
        self.tries += 1
        if not self.admits:
            return Refused(
                subject=("tenant", "alice"), limit="rpm", retry_after=1.0, short_of_share=self.short_of_share
            )
        return self.book.reserve(quotas, estimate, now)

    def settle(self, reservation, actual):
        self.book.settle(reservation, actual)

    def release(self, reservation):
        self.book.release(reservation)

    def grant(self, admits: bool) -> None:
        self.admits = admits
        self.granted.set()
        self.granted = trio.Event()

    async def next_grant(self) -> None:
        await self.granted.wait()


def shared_gate(shares: Shares) -> ControlPlaneGate:
    keys = Keys(("s", ALICE), tenant_limits={"alice": Limits(rpm=200)})
    return gate(keys, quotas=shares, next_grant=shares.next_grant)


async def test_a_request_refused_by_its_workers_share_alone_waits_for_the_grant_that_brings_room(
    autojump_clock,
):
    shares = Shares(short_of_share=True)
    g = shared_gate(shares)
    admitted = []

    async def client():
        admitted.append(await g.admit(ALICE, "m", *chat()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        shares.grant(admits=False)  # a grant that moved nothing: still waiting
        await trio.testing.wait_all_tasks_blocked()
        assert not admitted
        await trio.sleep(0.3)
        shares.grant(admits=True)
    assert len(admitted) == 1 and shares.tries == 3


async def test_a_worker_whose_share_never_grows_answers_429_after_the_share_wait(autojump_clock):
    shares = Shares(short_of_share=True)
    g = shared_gate(shares)
    started = trio.current_time()
    with pytest.raises(GatewayError) as refused:
        await g.admit(ALICE, "m", *chat())
    assert refused.value.status == 429
    assert trio.current_time() - started == pytest.approx(SHARE_WAIT)


async def test_a_refusal_by_the_limit_itself_is_answered_at_once(autojump_clock):
    shares = Shares(short_of_share=False)
    g = shared_gate(shares)
    started = trio.current_time()
    with pytest.raises(GatewayError) as refused:
        await g.admit(ALICE, "m", *chat())
    assert refused.value.status == 429 and trio.current_time() == started and shares.tries == 1


async def test_requests_wait_for_room_and_are_let_through_as_slots_free(autojump_clock):
    usage = Usages()
    g = ControlPlaneGate(Keys(("s", ALICE)), Room(1), usage=usage)
    first = await g.admit(ALICE, "m", *chat())
    second_in = trio.Event()

    async def second():
        ticket = await g.admit(ALICE, "m", *chat())
        second_in.set()
        g.finish(ticket, served(Usage(1, 1, 2)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not second_in.is_set()  # one slot, taken
        assert g.queue_depths() == {"m": {0: 1}}
        g.finish(first, served(Usage(1, 2, 3)))
    assert second_in.is_set()
    assert [(r.key_id, r.tenant, r.prompt_tokens, r.completion_tokens) for r in usage.records] == [
        ("k-a", "alice", 1, 2),
        ("k-a", "alice", 1, 1),
    ]


async def test_more_room_lets_waiters_through(autojump_clock):
    room = Room(1)
    g = ControlPlaneGate(Keys(("s", ALICE)), room)
    held = await g.admit(ALICE, "m", *chat())
    through = trio.Event()

    async def waiter():
        await g.admit(ALICE, "m", *chat())
        through.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        room.set(1, 1)  # a second replica became Ready
        g.redispatch()
    assert through.is_set()
    g.finish(held, served(None))


async def test_with_no_ready_replica_a_request_waits_for_one_and_is_503_after_the_timeout(autojump_clock):
    room = Room()
    woke: list[str] = []
    g = ControlPlaneGate(Keys(("s", ALICE)), room, queue_timeout=30, on_waiting=woke.append)
    started = trio.current_time()
    with pytest.raises(GatewayError) as timed_out:
        await g.admit(ALICE, "m", *chat())
    assert (timed_out.value.status, timed_out.value.code) == (503, "queue_timeout")
    assert "'m' became ready within 30 s" in timed_out.value.message
    assert trio.current_time() - started == pytest.approx(30) and woke == ["m"]

    tickets = []

    async def client():
        tickets.append(await g.admit(ALICE, "m", *chat()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        await trio.sleep(5)  # the replica starts meanwhile
        assert not tickets and g.queue_depths() == {"m": {0: 1}}
        room.set(4)
        g.redispatch()
    assert [t.replica for t in tickets] == ["r0"] and tickets[0].upstreams[0].port == 20000


async def test_a_long_wait_for_room_is_503_after_the_timeout(autojump_clock, caplog):
    g = gate(Keys(("s", ALICE)), slots=1, queue_timeout=5)
    held = await g.admit(ALICE, "m", *chat())
    started = trio.current_time()
    with pytest.raises(GatewayError) as timed_out:
        await g.admit(ALICE, "m", *chat())
    assert timed_out.value.status == 503 and trio.current_time() - started == pytest.approx(5)
    assert "had room within 5 s" in timed_out.value.message
    # The operator's log says why: the replicas' slots as this process fills them.
    assert "replicas: r0 slots 1 in flight 1" in caplog.text
    assert g.queue_depths() == {"m": {}}
    g.finish(held, served(None))


async def test_room_is_per_replica_and_a_waiter_goes_to_the_one_that_frees(autojump_clock):
    g = ControlPlaneGate(Keys(("s", ALICE)), Room(1, 2))
    tickets = [await g.admit(ALICE, "m", *chat()) for _ in range(3)]
    assert sorted(t.replica for t in tickets) == ["r0", "r1", "r1"]
    assert g.in_flight("m") == {"r0": 1, "r1": 2}
    through = []

    async def waiter():
        through.append(await g.admit(ALICE, "m", *chat()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not through  # three slots, three in flight
        g.finish(next(t for t in tickets if t.replica == "r0"), served(None))
    assert [t.replica for t in through] == ["r0"]
    assert [u.replica for u in through[0].upstreams] == ["r0", "r1"]  # the full one as fallback


async def test_a_prefix_waits_for_its_replica_then_goes_when_it_frees(autojump_clock):
    """Two one-slot replicas, one prompt: the second request waits for the first's replica (its
    cache holds the prompt) though the other is idle; the third is past the bound and goes to
    the other at once; the waiter goes to its replica when that frees."""
    g = ControlPlaneGate(Keys(("s", ALICE)), Room(1, 1, policy="prefix"))
    first = await g.admit(ALICE, "m", *chat())
    through = []

    async def second():
        through.append(await g.admit(ALICE, "m", *chat()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not through and g.waiting_for("m") == {first.replica: 1}
        assert g.queue_depths() == {"m": {0: 1}}  # waiting for a replica is waiting all the same
        third = await g.admit(ALICE, "m", *chat())
        assert third.replica != first.replica
        g.finish(first, served(None))
    assert [t.replica for t in through] == [first.replica]
    assert g.waiting_for("m") == {} and g.idle_for("m") == 0


async def test_idle_time_counts_from_the_last_request(autojump_clock):
    g = gate(Keys(("s", ALICE)))
    assert g.idle_for("m") == 0
    await trio.sleep(10)
    assert g.idle_for("m") == pytest.approx(10)
    ticket = await g.admit(ALICE, "m", *chat())
    await trio.sleep(3)
    assert g.idle_for("m") == 0  # busy
    g.finish(ticket, served(None))
    await trio.sleep(4)
    assert g.idle_for("m") == pytest.approx(4)


async def test_a_waiter_that_leaves_holds_nothing(autojump_clock):
    limit = 3 * estimate_tokens(*chat())
    g = gate(Keys(("s", ALICE), tenant_limits={"alice": Limits(tpm=limit)}), slots=1)
    held = await g.admit(ALICE, "m", *chat())
    with trio.move_on_after(1):
        await g.admit(ALICE, "m", *chat())  # the client goes away while queued
    # Its reservation and its place are gone: two more fit in the quota, once the slot frees.
    g.finish(held, served(None))
    first = await g.admit(ALICE, "m", *chat())
    g.finish(first, served(None))
    await g.admit(ALICE, "m", *chat())


async def test_settlement_uses_the_real_usage_and_a_request_that_reached_no_engine_costs_nothing():
    limit = 100
    g = gate(Keys(("s", ALICE), tenant_limits={"alice": Limits(tpm=limit)}))
    big = chat(max_tokens=60)
    ticket = await g.admit(ALICE, "m", *big)
    never_sent = RequestRecord(path="/v1/chat/completions", started=0.0, model="m", status=503)
    g.finish(ticket, never_sent)  # released: the whole quota is back
    ticket = await g.admit(ALICE, "m", *big)
    g.finish(ticket, served(Usage(5, 5, 10)))  # settled at 10, not 60+
    ticket = await g.admit(ALICE, "m", *big)  # fits only because the first settled low
    g.finish(ticket, served(Usage(5, 5, 10)))


def test_estimates_count_the_prompt_and_the_most_it_may_write():
    assert estimate_tokens({"messages": [], "max_tokens": 100}, 30) > 100
    assert estimate_tokens({"prompt": "x" * 300, "max_tokens": 10}, 330) >= 10 + 300 // CHARS_PER_TOKEN
    # Either limit on the answer counts; without one, a typical answer's length.
    assert estimate_tokens({"max_completion_tokens": 7}, 0) == 7 + 1
    assert estimate_tokens({"messages": []}, 20) >= DEFAULT_COMPLETION_ESTIMATE
    # The whole body counts as prompt: tool definitions are prompt to an engine too.
    assert (
        estimate_tokens({"max_tokens": 1}, 4_000) - estimate_tokens({"max_tokens": 1}, 0)
        == 4_000 // CHARS_PER_TOKEN
    )


def test_estimates_count_every_completion_asked_for():
    one = estimate_tokens({"max_tokens": 100}, 0)
    assert estimate_tokens({"max_tokens": 100, "n": 4}, 0) == 4 * 100 + 1 == 4 * (one - 1) + 1
    # Without a limit, n typical answers; an n the relay would refuse counts as one.
    assert estimate_tokens({"n": 3}, 0) == 3 * DEFAULT_COMPLETION_ESTIMATE + 1
    assert estimate_tokens({"n": "3"}, 0) == estimate_tokens({}, 0)
    # A string limit (refused by the relay) is never taken as a number, nor as no limit at all.
    assert estimate_tokens({"max_tokens": "100000"}, 0) == DEFAULT_COMPLETION_ESTIMATE + 1


async def test_an_answer_without_usage_is_recorded_at_the_estimate_and_flagged_never_as_zero():
    usage = Usages()
    g = gate(Keys(("s", ALICE)), usage=usage)
    payload, size = chat(max_tokens=50)
    ticket = await g.admit(ALICE, "m", payload, size)
    g.finish(ticket, served(None))  # the engine said nothing of its usage
    ticket = await g.admit(ALICE, "m", payload, size)
    g.finish(ticket, served(Usage(4, 6, 10)))
    estimated, measured = usage.records
    assert (estimated.prompt_tokens, estimated.completion_tokens) == (size // CHARS_PER_TOKEN + 1, 50)
    assert estimated.prompt_tokens + estimated.completion_tokens == estimate_tokens(payload, size)
    assert estimated.estimated == 1
    assert (measured.prompt_tokens, measured.completion_tokens, measured.estimated) == (4, 6, 0)


# --- adapters ---------------------------------------------------------------------------------


class AdapterRoom(Room):
    """Model "m" on r0 (the base only) and r1, which also serves adapter "sql" through an
    upstream of its own (as server.routing builds for an engine that selects per request)."""

    def set(self, *slots: int) -> None:
        base = [Upstream("127.0.0.1", 20000 + i, "k", f"r{i}") for i in range(2)]
        sql = attrs.evolve(base[1], body_members=b'{"lora":[{"id":0,"scale":1.0}]}')
        self.replicas = (
            Route(replica="r0", upstream=base[0], slots=slots[0], load=None),
            Route(replica="r1", upstream=base[1], slots=slots[1], load=None, adapters={"sql": sql}),
        )

    def parent(self, name: str) -> str | None:
        return "m" if name == "sql" else None


async def test_a_request_for_an_adapter_goes_to_a_replica_serving_it_and_is_accounted_to_it():
    usages = Usages()
    g = ControlPlaneGate(Keys(("s", ALICE)), AdapterRoom(4, 1), usage=usages)
    for _ in range(3):  # round-robin would have sent one of them to r0
        ticket = await g.admit(ALICE, "sql", *chat())
        assert ticket.model == "m" and ticket.adapter == "sql" and ticket.replica == "r1"
        (upstream,) = ticket.upstreams
        assert upstream.replica == "r1" and upstream.body_members == b'{"lora":[{"id":0,"scale":1.0}]}'
        g.finish(ticket, served(Usage(1, 1, 2)))
    base = await g.admit(ALICE, "m", *chat())
    assert all(u.body_members == b"" for u in base.upstreams)
    g.finish(base, served(Usage(1, 1, 2)))
    assert [(r.model, r.adapter) for r in usages.records] == [("m", "sql")] * 3 + [("m", "")]


async def test_adapter_requests_share_the_base_models_slots(autojump_clock):
    """One lane per base model: r1's one slot taken by a base request leaves none for "sql"."""
    g = ControlPlaneGate(Keys(("s", ALICE)), AdapterRoom(0, 1), queue_timeout=5.0)
    held = await g.admit(ALICE, "m", *chat())
    assert held.replica == "r1"
    with pytest.raises(GatewayError) as waited:
        await g.admit(ALICE, "sql", *chat())
    assert waited.value.status == 503
    g.finish(held, served(Usage(1, 1, 2)))
    ticket = await g.admit(ALICE, "sql", *chat())
    assert ticket.replica == "r1"


async def test_a_key_may_be_limited_to_an_adapter():
    only_sql = Key(id="k-sql", tenant="t", models=("sql",))
    g = ControlPlaneGate(Keys(("s", only_sql)), AdapterRoom(4, 4))
    assert g.models(only_sql, ["m", "sql"]) == ["sql"]
    with pytest.raises(GatewayError) as refused:
        await g.admit(only_sql, "m", *chat())
    assert refused.value.status == 403 and "'m'" in refused.value.message
    ticket = await g.admit(only_sql, "sql", *chat())
    assert ticket.adapter == "sql"
    # ... and one allowed the base model is not thereby allowed its adapters.
    only_base = Key(id="k-m", tenant="t", models=("m",))
    with pytest.raises(GatewayError) as refused:
        await ControlPlaneGate(Keys(("s", only_base)), AdapterRoom(4, 4)).admit(only_base, "sql", *chat())
    assert refused.value.status == 403
