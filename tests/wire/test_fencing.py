"""Fencing over the real link, in one process on loopback: one agent linked to two servers.

The agent learns a new leader's term from its first heartbeat, and from then on refuses the old
leader's commands — answering why, with the newer term — and the old leader steps down; the
term survives the agent's restart (its file)."""

from __future__ import annotations

import random
import stat

import trio

from llmgw.agent.link import AgentLink, ServerLinks
from llmgw.agent.terms import TERM_FILE, TermBook
from llmgw.core.shard import ShardSpec
from llmgw.server.changes import Changes
from llmgw.wire.messages import CommandResult, RunningShard, ShardState, ShardStatus, StartShard, StopShard
from tests.helpers import fake_inventory, start_link_server, wait_for


class FakeLease:
    """A server's view of the lease, set by the test."""

    def __init__(self, term: int, leader: bool) -> None:
        self.term, self.leader = term, leader
        self.changes = Changes()
        self.fenced_by: list[int] = []

    def acting(self) -> bool:
        return self.leader

    def fenced(self, newest: int) -> None:
        self.fenced_by.append(newest)
        self.leader = False
        self.changes.bump()

    def lead(self, term: int) -> None:
        self.term, self.leader = term, True
        self.changes.bump()


class Shards:
    stop_grace = 1.0

    def __init__(self) -> None:
        self.specs: dict[str, ShardSpec] = {}
        self.stopped: list[str] = []

    async def start(self, spec, engine_key):
        self.specs[spec.shard_id] = spec
        return True, "started"

    async def stop(self, shard_id, grace):
        self.stopped.append(shard_id)
        self.specs.pop(shard_id, None)
        return True, "stopped"

    async def drain(self, shard_id, drain_timeout):
        return await self.stop(shard_id, None)

    def running(self):
        return [RunningShard(spec=spec, state=ShardState.READY, pid=1) for spec in self.specs.values()]


def spec(shard_id: str) -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id,
        replica_id=f"r-{shard_id}",
        model="m",
        model_path="/m",
        engine="llamacpp",
        port=9000,
    )


def agent(ports: list[int], shards: Shards, terms: TermBook) -> ServerLinks:
    return ServerLinks(
        [
            AgentLink(
                node="n1",
                host="127.0.0.1",
                port=port,
                join_token="join-secret",
                discover=lambda _address: fake_inventory("n1"),
                initial_delay=0.05,
                max_delay=0.2,
                rng=random.Random(port),
                shards=shards,
                terms=terms,
            )
            for port in ports
        ]
    )


async def test_the_old_leaders_commands_are_refused_once_a_newer_term_is_heard(tmp_path):
    a_lease, b_lease = FakeLease(1, True), FakeLease(1, False)
    shards = Shards()
    term_file = tmp_path / "agent" / TERM_FILE
    term_file.parent.mkdir()
    async with trio.open_nursery() as nursery:
        a = await start_link_server(nursery, tmp_path / "a", leadership=a_lease, interval=5.0)
        b = await start_link_server(nursery, tmp_path / "b", leadership=b_lease, interval=5.0)
        links = agent([a.port, b.port], shards, TermBook(term_file))
        await nursery.start(links.run)
        await wait_for(lambda: all(link.registrations for link in links.links), "both links to register")
        assert links.terms.newest == 1
        # Only the leader's link leads: job reports and uploads go to it.
        assert [link.leading for link in links.links] == [True, False]

        with trio.fail_after(10):
            reply = await a.registry.call("n1", StartShard(id=0, spec=spec("s1")))
        assert reply.ok and "s1" in shards.specs
        # The follower learns of the shard from its status, spec and all (it can route to it).
        links.report(ShardStatus(shard_id="s1", replica_id="r-s1", state=ShardState.READY))
        await wait_for(
            lambda: (s := b.registry.get("n1").shards.get("s1")) is not None and s.spec == spec("s1"),
            "the follower to know shard s1 with its spec",
        )

        # B takes the lease under term 2: its next heartbeat goes out at once (not in 5 s).
        b_lease.lead(2)
        await wait_for(lambda: links.terms.newest == 2, "the agent to hear term 2")
        assert term_file.read_text().strip() == "2" and stat.S_IMODE(term_file.stat().st_mode) == 0o600
        await wait_for(lambda: [link.leading for link in links.links] == [False, True], "B's link to lead")

        # A still believes it leads under term 1: its stop is refused and not carried out.
        with trio.fail_after(10):
            refused = await a.registry.call("n1", StopShard(id=0, shard_id="s1"))
        assert isinstance(refused, CommandResult) and not refused.ok and refused.fenced == 2
        assert "term 1" in refused.message and "term 2" in refused.message
        assert shards.stopped == [] and a_lease.fenced_by == [2] and not a_lease.leader
        assert links.links[0].fenced == 1

        # The new leader's commands are obeyed.
        with trio.fail_after(10):
            obeyed = await b.registry.call("n1", StopShard(id=0, shard_id="s1"))
        assert obeyed.ok and shards.stopped == ["s1"]
        nursery.cancel_scope.cancel()

    # A restarted agent still refuses term 1.
    again = TermBook(term_file)
    assert again.newest == 2 and not again.admit(1).ok and again.admit(2).ok
