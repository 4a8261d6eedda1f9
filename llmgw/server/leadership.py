"""The server's side of the leader lease: a task that claims or renews it every third of a lease,
and what the rest of the server asks of it (do I lead now, under which term).

The decisions are :mod:`llmgw.core.leadership`'s, made in the store's claim transaction; this
shell keeps the answer and its local deadline (the monotonic clock, counted from before the claim
was sent). :meth:`acting` is false as soon as the deadline passes, whatever the task is doing: a
server paused past its lease (SIGSTOP, a VM migrated) wakes up not leading, before its next look
at the store, and an agent that refuses one of its commands as fenced makes it step down at once.

On SQLite only this server can open the store, so it takes the lease by force at start and never
waits out one a crashed predecessor left.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from collections.abc import Callable, Mapping

import trio

from llmgw.core import leadership, shared_load
from llmgw.core.server_shares import ServerShare
from llmgw.core.shared_load import GatewayLoad
from llmgw.server.changes import Changes
from llmgw.server.store import Store, StoreError

log = logging.getLogger(__name__)


class Leadership:
    def __init__(self, store: Store, *, lease: float, exclusive: bool, server_id: str | None = None) -> None:
        self._store = store
        self.lease = lease
        self._exclusive = exclusive  # the store is this server's alone (SQLite)
        self.id = server_id or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        self.address = ""  # this server's agent-link address, once it listens
        self.leader = False  # as of the last claim; acting() also checks the deadline
        self.term = 0  # the lease's term as of the last look (this server's own, when leading)
        self.holder = ""
        self.holder_address = ""
        self.live_servers: tuple[str, ...] = ()
        # This server's part of every quota (core.server_shares); ``on_share`` is told when the
        # live servers change, so the gateway takes the new shares at once.
        self.share = ServerShare()
        self.on_share: Callable[[], None] | None = None
        # This server's gateway load, reported with every look (core.shared_load), and the other
        # live servers' as of this server's last look: what the leader's scaler adds to its own.
        self.gateway_load: Callable[[], Mapping[str, GatewayLoad]] = dict
        self.others_load: list[dict[str, GatewayLoad]] = []
        self._deadline = -1.0  # trio clock
        self.changes = Changes()  # bumped when this server starts or stops leading, or the term moves
        self._look_now = trio.Event()

    def acting(self) -> bool:
        """Whether this server leads right now: its last claim made it leader and its own
        deadline for that lease has not passed."""
        return self.leader and trio.current_time() < self._deadline

    def as_json(self) -> dict:
        return {
            "server": self.id,
            "leader": self.acting(),
            "term": self.term,
            "holder": self.holder,
            "holder_address": self.holder_address,
            "lease_s": self.lease,
            "live_servers": list(self.live_servers),
            "quota_share": {"servers": self.share.servers, "rank": self.share.rank},
        }

    def fenced(self, newest: int) -> None:
        """An agent refused a command of ours: it has seen a newer term, so another server leads."""
        if newest > self.term or self.leader:
            log.warning(
                "an agent refused a command of term %d: it has seen term %d; stepping down", self.term, newest
            )
            self._set(leader=False, term=max(self.term, newest))
            self._deadline = -1.0
            self._look_now.set()

    async def claim(self) -> None:
        """One look at the lease: acquire, renew or follow."""
        asked_at = trio.current_time()
        decision, live = await self._store.claim_leadership(
            self.id,
            self.address,
            self.lease,
            force=self._exclusive and not self.leader,
            load=json.dumps(shared_load.encode(self.gateway_load())),
        )
        self.live_servers = tuple(live)
        self.others_load = [
            shared_load.decode(_json(load)) for server, load in live.items() if server != self.id
        ]
        share = ServerShare.of(live, self.id) if not self._exclusive else ServerShare()
        if share != self.share:
            log.info("quotas: this server holds share %d of %d", share.rank + 1, share.servers)
            self.share = share
            if self.on_share is not None:
                self.on_share()
        self.holder, self.holder_address = decision.holder, decision.address
        if decision.leader:
            self._deadline = leadership.local_deadline(asked_at, self.lease)
        if decision.leader != self.leader or decision.term != self.term:
            if decision.leader:
                log.info("leading under term %d (%s)", decision.term, decision.reason)
            elif self.leader:
                log.warning("no longer leading: term %d is %s's", decision.term, decision.holder)
            else:
                log.info("following %s (%s), term %d", decision.holder, decision.address, decision.term)
        self._set(leader=decision.leader, term=decision.term)

    def _set(self, *, leader: bool, term: int) -> None:
        if (leader, term) != (self.leader, self.term):
            self.leader, self.term = leader, term
            self.changes.bump()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Looks every third of a lease (at once after a fencing refusal); the first look is made
        before ``started``, so the server knows whether it leads before it serves. On the way out
        a leader releases the lease, so a follower need not wait it out."""
        await self.claim()
        task_status.started()
        try:
            while True:
                with trio.move_on_after(leadership.renew_interval(self.lease)):
                    await self._look_now.wait()
                self._look_now = trio.Event()
                was_acting = self.acting()
                try:
                    await self.claim()
                except StoreError as exc:
                    # No answer is no lease: acting() runs out at the deadline on its own.
                    log.warning("cannot look at the leader lease: %s", exc)
                if was_acting and not self.acting():
                    self.changes.bump()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                if self.leader:
                    try:
                        await self._store.release_leadership(self.id)
                    except StoreError as exc:
                        log.warning("could not release the leader lease: %s", exc)

    async def wait_acting(self) -> None:
        """Returns once this server leads."""
        while not self.acting():
            seen = self.changes.version
            with trio.move_on_after(leadership.renew_interval(self.lease)):
                await self.changes.wait_past(seen)

    async def wait_not_acting(self) -> None:
        """Returns once this server no longer leads (its deadline passed, or it lost the lease)."""
        while self.acting():
            seen = self.changes.version
            with trio.move_on_at(self._deadline):
                await self.changes.wait_past(seen)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
