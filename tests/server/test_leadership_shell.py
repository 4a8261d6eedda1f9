"""The server's lease shell (server/leadership.py) on trio's clock, over a store stand-in that
decides as the real claim transaction does (core.leadership.decide, by one shared clock)."""

from __future__ import annotations

import trio

from llmgw.core import leadership as core
from llmgw.core.shared_load import GatewayLoad
from llmgw.server.leadership import Leadership
from llmgw.server.store import StoreError

LEASE = 6.0


class Store:
    """One lease row; ``down`` makes every call fail as an unreachable database does."""

    def __init__(self) -> None:
        self.row: core.LeaseRow | None = None
        self.seen: dict[str, float] = {}
        self.loads: dict[str, str] = {}
        self.down: set[str] = set()

    async def claim_leadership(self, me, address, lease, force=False, load="{}"):
        if me in self.down:
            raise StoreError("unreachable")
        await trio.sleep(0.05)  # a round trip
        now = trio.current_time()
        decision = core.decide(self.row, now=now, me=me, address=address, lease=lease, force=force)
        if decision.write is not None:
            self.row = decision.write
        self.seen[me] = now
        self.loads[me] = load
        return decision, {s: self.loads[s] for s, t in sorted(self.seen.items()) if t > now - lease}

    async def release_leadership(self, me):
        freed = core.release(self.row, now=trio.current_time(), me=me)
        if freed is not None:
            self.row = freed
        self.seen.pop(me, None)
        return freed is not None


async def watch(servers: list[Leadership], until: float, acting_log: list) -> None:
    """Samples who acts, every 10 ms: never two at once."""
    while trio.current_time() < until:
        acting = [s.id for s in servers if s.acting()]
        assert len(acting) <= 1, acting
        acting_log.append((trio.current_time(), tuple(acting)))
        await trio.sleep(0.01)


async def test_one_leads_another_takes_over_when_it_cannot_reach_the_store(autojump_clock):
    store = Store()
    a = Leadership(store, lease=LEASE, exclusive=False, server_id="a")
    b = Leadership(store, lease=LEASE, exclusive=False, server_id="b")
    log: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        assert a.acting() and not b.acting() and (a.term, b.term) == (1, 1)
        assert a.share.servers == 2 or b.share.servers == 2
        a.gateway_load = lambda: {"m": GatewayLoad(queued=4, idle_for=0.0)}
        await trio.sleep(core.renew_interval(LEASE) * 2)  # both looked again: b has a's figures
        assert b.others_load == [{"m": GatewayLoad(queued=4, idle_for=0.0)}] and a.others_load == [{}]
        nursery.start_soon(watch, [a, b], trio.current_time() + 40, log)
        await trio.sleep(10)
        assert a.acting() and not b.acting()

        store.down.add("a")  # a is cut off from the store (or paused): it stops on its own
        cut = trio.current_time()
        await b.wait_acting()
        taken = trio.current_time() - cut
        assert not a.acting() and b.term == 2
        assert taken <= LEASE + core.renew_interval(LEASE) + 0.5
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    # Someone acted almost all the time: a until just before b.
    idle = sum(0.01 for _, acting in log if not acting)
    assert idle < LEASE + core.renew_interval(LEASE)


async def test_fenced_steps_down_at_once_and_a_clean_stop_hands_over(autojump_clock):
    store = Store()
    a = Leadership(store, lease=LEASE, exclusive=False, server_id="a")
    b = Leadership(store, lease=LEASE, exclusive=False, server_id="b")
    async with trio.open_nursery() as nursery:
        a_scope = trio.CancelScope()

        async def run_a(task_status=trio.TASK_STATUS_IGNORED):
            with a_scope:
                await a.run(task_status=task_status)

        await nursery.start(run_a)
        await nursery.start(b.run)
        a.fenced(5)  # an agent has seen term 5: another server leads
        assert not a.acting() and a.term == 5

        # a stops cleanly: it releases the lease, and b takes it at its next look, not a lease later.
        await trio.sleep(1)
        a_scope.cancel()
        stopped = trio.current_time()
        await b.wait_acting()
        assert trio.current_time() - stopped <= core.renew_interval(LEASE) + 0.5
        nursery.cancel_scope.cancel()


async def test_a_store_of_its_own_is_led_at_once_even_over_a_live_lease(autojump_clock):
    store = Store()
    store.row = core.LeaseRow("crashed-predecessor", 7, trio.current_time() + 60)
    me = Leadership(store, lease=LEASE, exclusive=True, server_id="me")
    async with trio.open_nursery() as nursery:
        await nursery.start(me.run)
        assert me.acting() and me.term == 8 and me.share.servers == 1
        nursery.cancel_scope.cancel()
