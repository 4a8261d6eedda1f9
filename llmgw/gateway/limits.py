"""What one gateway listener allows a client: deadlines, caps on connections, a budget of bodies.

A client on the same network can otherwise hold the process's file descriptors with silent
sockets (none is ever closed), or its memory with bodies it sends and never pays for. Every bound
here is a named default (llmgw.core.listener_limits) an operator can change in server.yaml's
``gateway:`` section.

Connections: the process has a cap, and each peer address one of its own. At the process cap, a
new connection displaces the oldest one that is waiting for a request head (a silent socket, a
slow head or an idle keep-alive: nginx drains idle keep-alives the same way when it runs out of
connections), so a flood of silent sockets cannot keep a probe of ``/health`` out. Only when every
connection is working (reading a body, or answering) is the new one refused, with a 503.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Callable

import trio

from llmgw.core.listener_limits import ListenerLimits

log = logging.getLogger(__name__)

# accept() failing for want of descriptors or kernel memory: trio's serve_listeners logs a
# traceback per attempt, ten a second. Here: connections waiting for a head are shed (each frees
# a descriptor), then a pause that doubles while it lasts, and one line per interval.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
SHED_ON_EMFILE = 16
ACCEPT_BACKOFF_MIN = 0.01
ACCEPT_BACKOFF_MAX = 1.0
ACCEPT_LOG_INTERVAL = 60.0


class BodyBudget:
    """Body bytes the process holds, shared by every connection: taken before a body is read,
    given back when its request ends."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._freed = trio.Event()

    async def take(self, size: int, patience: float) -> bool:
        """Takes `size` bytes, waiting up to `patience` seconds for room; False if none came."""
        if size > self.capacity:
            return False
        with trio.move_on_after(patience):
            while self.used + size > self.capacity:
                await self._freed.wait()
            self.used += size
            return True
        return False

    def give(self, size: int) -> None:
        if size:
            self.used -= size
            self._freed.set()
            self._freed = trio.Event()


class Connection:
    """One client connection, as the table sees it."""

    __slots__ = ("peer", "waiting", "displaced")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.displaced = False  # closed to make room: counted out already
        # The cancel scope of its wait for a request head, while it waits: what displacing it
        # cancels. None while it works (reads a body, or is answered).
        self.waiting: trio.CancelScope | None = None


class Connections:
    """The listener's connections: counts per process and per peer, and those waiting for a head,
    oldest first, to displace at the cap."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.cap = limits.connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.per_peer_cap = limits.max_connections_per_peer
        self.open = 0
        self.per_peer: dict[str, int] = {}
        self._waiting: dict[Connection, None] = {}  # insertion-ordered: the oldest first
        self.refused = 0
        self.displaced = 0

    def admit(self, peer: str) -> Connection | None:
        """A new connection from `peer`, or None to refuse it: its peer is at its cap, or the
        process is and no connection waits for a head to make room."""
        held = self.per_peer.get(peer, 0)
        if self.per_peer_cap is not None and held >= self.per_peer_cap:
            self.refused += 1
            return None
        if self.open >= self.cap and not self.displace(1):
            self.refused += 1
            return None
        self.open += 1
        self.per_peer[peer] = held + 1
        return Connection(peer)

    def displace(self, count: int) -> int:
        """Closes up to `count` connections that wait for a head, the oldest first; how many.
        They stop counting now: their tasks close their sockets at their next turn."""
        done = 0
        while done < count and self._waiting:
            connection = next(iter(self._waiting))
            del self._waiting[connection]
            scope = connection.waiting
            connection.waiting = None
            if scope is not None:
                scope.cancel()
            self._forget(connection)
            connection.displaced = True  # gone() has nothing more to count
            done += 1
        self.displaced += done
        return done

    def waiting(self, connection: Connection, scope: trio.CancelScope) -> None:
        connection.waiting = scope
        self._waiting[connection] = None

    def working(self, connection: Connection) -> None:
        connection.waiting = None
        self._release_wait(connection)

    def gone(self, connection: Connection) -> None:
        self._release_wait(connection)
        if not connection.displaced:
            self._forget(connection)

    def _release_wait(self, connection: Connection) -> None:
        self._waiting.pop(connection, None)

    def _forget(self, connection: Connection) -> None:
        self.open -= 1
        left = self.per_peer[connection.peer] - 1
        if left:
            self.per_peer[connection.peer] = left
        else:
            del self.per_peer[connection.peer]


async def accept_forever(
    listener: trio.abc.Listener,
    connections: Connections,
    take: Callable[[trio.abc.Stream], None],
    after_shed: Callable[[], None] = lambda: None,
) -> None:
    """Accepts connections for ``take`` (which admits each to ``connections`` or refuses it) until
    cancelled. Out of descriptors, it sheds the connections that wait (``after_shed`` is told),
    backs off and logs once per ACCEPT_LOG_INTERVAL."""
    backoff = ACCEPT_BACKOFF_MIN
    logged_at = -float("inf")
    failed = 0
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as error:
                if error.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                shed = connections.displace(SHED_ON_EMFILE)
                after_shed()
                failed += 1
                now = trio.current_time()
                if now - logged_at >= ACCEPT_LOG_INTERVAL:
                    log.warning(
                        "accept failed: %s (%s), %d time(s) since the last report; shedding connections"
                        " that wait (%d now) and retrying (limit of open files: %d)",
                        errno.errorcode.get(error.errno, error.errno),
                        os.strerror(error.errno),
                        failed,
                        shed,
                        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                    )
                    logged_at, failed = now, 0
                # The shed ones close their sockets at their next turn: let them run first.
                await trio.sleep(ACCEPT_BACKOFF_MIN if shed else backoff)
                backoff = min(ACCEPT_BACKOFF_MAX, backoff * 2)
                continue
            backoff = ACCEPT_BACKOFF_MIN
            take(stream)
