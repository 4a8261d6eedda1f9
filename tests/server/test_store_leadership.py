"""The leader lease in the store: one compare-and-set transaction per claim, on both backends,
by the store's clock; PostgreSQL alone for servers racing on one database."""

from __future__ import annotations

import pytest
import trio

from llmgw.server.store.copy import copy_store


@pytest.fixture
async def store(open_test_store):
    s = await open_test_store()
    yield s
    await s.aclose()


async def test_the_first_claim_leads_with_term_one_and_another_follows(store):
    first, live = await store.claim_leadership("a", "a:7070", 5.0)
    assert (first.leader, first.term, list(live)) == (True, 1, ["a"])
    second, live = await store.claim_leadership("b", "b:7070", 5.0)
    assert (second.leader, second.term, second.holder, second.address) == (False, 1, "a", "a:7070")
    assert list(live) == ["a", "b"]
    renewed, live = await store.claim_leadership("a", "a:7070", 5.0, load='{"m": {"queued": 2}}')
    assert renewed.leader and renewed.term == 1 and await store.lease_term() == 1
    assert live == {"a": '{"m": {"queued": 2}}', "b": "{}"}  # each server's gateway load


async def test_an_expired_lease_goes_to_the_next_claimant_with_the_next_term(store):
    await store.claim_leadership("a", "a:7070", 0.2)
    with trio.fail_after(10):
        while True:  # the store's clock, not ours, decides when it expired
            taken, live = await store.claim_leadership("b", "b:7070", 0.2)
            if taken.leader:
                break
            await trio.sleep(0.05)
    assert taken.term == 2 and taken.reason == "acquired: expired (held by a)"
    back, _ = await store.claim_leadership("a", "a:7070", 0.2)
    assert not back.leader or back.term == 3  # a lapse is a new term even for its old holder


async def test_release_hands_over_at_once_and_force_takes_a_live_lease(store):
    await store.claim_leadership("a", "a:7070", 60.0)
    assert not await store.release_leadership("b")
    assert await store.release_leadership("a")
    taken, live = await store.claim_leadership("b", "b:7070", 60.0)
    assert taken.leader and taken.term == 2 and list(live) == ["b"]  # a left the live servers
    forced, _ = await store.claim_leadership("c", "c:7070", 60.0, force=True)
    assert forced.leader and forced.term == 3


async def test_a_copy_carries_the_term_up_but_not_the_holder(store, tmp_path):
    from llmgw.server.store import open_store

    for _ in range(3):
        await store.claim_leadership("a", "a:1", 60.0, force=True)
    target = await open_store(tmp_path / "target")
    try:
        await copy_store(store, target)
        assert await target.lease_term() == 3
        after, _ = await target.claim_leadership("b", "b:1", 60.0)
        assert after.leader and after.term == 4
    finally:
        await target.aclose()


@pytest.mark.parametrize("open_test_store", ["postgresql"], indirect=True)
async def test_servers_racing_for_a_free_lease_get_one_leader(open_test_store):
    """Five servers on one PostgreSQL claim a free lease at once, round after round (the leader
    releasing it in between): each round has exactly one leader, and all agree on who and on the
    term."""
    stores = [await open_test_store() for _ in range(5)]
    try:
        for round_ in range(5):
            decisions = {}

            async def claim(i, s, decisions=decisions):
                decisions[i] = (await s.claim_leadership(f"s{i}", f"s{i}:1", 60.0))[0]

            async with trio.open_nursery() as nursery:
                for i, s in enumerate(stores):
                    nursery.start_soon(claim, i, s)
            leaders = [i for i, d in decisions.items() if d.leader]
            assert len(leaders) == 1, decisions
            assert {d.term for d in decisions.values()} == {round_ + 1}
            assert {d.holder for d in decisions.values()} == {f"s{leaders[0]}"}
            assert await stores[leaders[0]].release_leadership(f"s{leaders[0]}")  # next: a new term
    finally:
        for s in stores:
            await s.aclose()
