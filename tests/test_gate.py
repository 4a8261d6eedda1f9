"""The control plane's gate: keys, model permissions, quotas under concurrency, the admission
queue's room, timeouts and cancellation. No sockets: the gate is driven directly."""

from __future__ import annotations

import json

import attrs
import pytest
import trio
import trio.testing

from llmgw.core.quota import Limits
from llmgw.gateway import GatewayError, RequestRecord, Upstream, Usage
from llmgw.server.gate import CHARS_PER_TOKEN, DEFAULT_COMPLETION_ESTIMATE, ControlPlaneGate, estimate_tokens


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
    """capacity(model), settable by the test."""

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def __call__(self, model: str) -> int:
        return self.slots


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
    return ControlPlaneGate(keys, router=None, capacity=Room(slots), usage=usage, **options)


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


async def test_requests_wait_for_room_and_are_let_through_as_slots_free(autojump_clock):
    room = Room(1)
    usage = Usages()
    g = ControlPlaneGate(Keys(("s", ALICE)), router=None, capacity=room, usage=usage)
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
    g = ControlPlaneGate(Keys(("s", ALICE)), router=None, capacity=room)
    held = await g.admit(ALICE, "m", *chat())
    through = trio.Event()

    async def waiter():
        await g.admit(ALICE, "m", *chat())
        through.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        room.slots = 2  # a second replica became Ready
        g.redispatch()
    assert through.is_set()
    g.finish(held, served(None))


async def test_no_ready_replica_is_503_at_once_and_a_long_wait_is_503_after_the_timeout(autojump_clock):
    g = gate(Keys(("s", ALICE)), slots=0)
    with pytest.raises(GatewayError) as none_ready:
        await g.admit(ALICE, "m", *chat())
    assert none_ready.value.code == "no_ready_replica"

    g = gate(Keys(("s", ALICE)), slots=1, queue_timeout=5)
    held = await g.admit(ALICE, "m", *chat())
    started = trio.current_time()
    with pytest.raises(GatewayError) as timed_out:
        await g.admit(ALICE, "m", *chat())
    assert timed_out.value.status == 503 and trio.current_time() - started == pytest.approx(5)
    assert g.queue_depths() == {"m": {}}
    g.finish(held, served(None))


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
