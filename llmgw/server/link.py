"""The server's end of the agent link: an h2c (or TLS) listener and one session per agent.

A connection goes through three steps, each bounded by the handshake timeout: the HTTP/2 request
(path and join token checked), the agent's Register, then the session proper, which lasts until
either side goes quiet for longer than the liveness window or closes. Every failure ends only the
connection it happened on.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs
import trio

from llmgw import __version__
from llmgw.config import NODE_NAME
from llmgw.core.listener_limits import ListenerLimits
from llmgw.core.liveness import Liveness
from llmgw.gateway.limits import Connection, Connections, accept_forever
from llmgw.server import tokens
from llmgw.server.changes import Changes
from llmgw.server.nodes import NodeRegistry
from llmgw.wire.h2link import LINK_PATH, H2Link, LinkClosed
from llmgw.wire.messages import (
    CommandResult,
    Goodbye,
    Heartbeat,
    JobPiece,
    JobStatus,
    Message,
    Register,
    Registered,
    ShardStatus,
)

log = logging.getLogger(__name__)

# The link's caps: the gateway's defaults for connections, none per peer (a fleet's nodes may
# reach the server from one address, behind NAT). Its deadlines are its own: the handshake's
# (link.handshake_timeout), then the agents' heartbeats (liveness).
LINK_LIMITS = ListenerLimits(max_connections_per_peer=None)

# How long a closing session tries to deliver its Goodbye before dropping the connection.
GOODBYE_GRACE = 1.0


class LeaderView(Protocol):
    """The leader lease as this server sees it (:class:`llmgw.server.leadership.Leadership`)."""

    term: int
    changes: Changes

    def acting(self) -> bool: ...

    def fenced(self, newest: int) -> None: ...


class _AlwaysLeading:
    """A server with no lease to share (tests that build a listener alone): leads, term 0."""

    term = 0

    def __init__(self) -> None:
        self.changes = Changes()

    def acting(self) -> bool:
        return True

    def fenced(self, newest: int) -> None:
        log.warning("an agent refused a command as fenced (it has seen term %d)", newest)


class JobReports(Protocol):
    """Where a node's job reports go (the job manager)."""

    async def on_message(self, node: str, message: Message) -> None: ...


@attrs.define
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: Message | None = None


class AgentSession:
    """One registered agent's link, as the rest of the server sees it."""

    def __init__(
        self, link: H2Link, node: str, liveness: Liveness, leadership: LeaderView | None = None
    ) -> None:
        self.link = link
        self.node = node
        self._liveness = liveness
        self._leadership = leadership or _AlwaysLeading()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._cancel = trio.CancelScope()
        self._close_reason: str | None = None
        # Set once Registered is sent (or the session ended): a command sent before it would
        # reach an agent still waiting for Registered as its first answer.
        self.registered = trio.Event()

    async def call(self, command: Message) -> Message:
        """Sends a command with a fresh id and this server's leader term, and waits for the reply
        that names it. Callers bound the wait with ``trio.fail_after``; a link that ends first
        raises LinkClosed. A reply refusing it as fenced makes this server step down."""
        await self.registered.wait()
        changes = {"id": next(self._ids)}
        if "term" in attrs.fields_dict(type(command)):
            changes["term"] = self._leadership.term
        command = attrs.evolve(command, **changes)
        pending = self._pending[command.id] = _Pending()
        try:
            await self.link.send(command)
            await pending.done.wait()
        finally:
            del self._pending[command.id]
        if pending.reply is None:
            raise LinkClosed(self.link.closed_reason or "the link ended")
        if isinstance(pending.reply, CommandResult) and pending.reply.fenced:
            log.warning("node %s refused %s: %s", self.node, type(command).__name__, pending.reply.message)
            self._leadership.fenced(pending.reply.fenced)
        return pending.reply

    async def send(self, message: Message) -> None:
        """Sends a message that is not a command (no reply is awaited: an adapter's pieces, whose
        command after them is answered once all arrived). A link that ends raises LinkClosed."""
        await self.registered.wait()
        await self.link.send(message)

    def close(self, reason: str) -> None:
        """Ends the session without waiting: its own task says goodbye and closes the link."""
        self._close_reason = reason
        self._cancel.cancel()

    async def run(
        self,
        on_message: Callable[[Message], None],
        on_job_message: Callable[[Message], Awaitable[None]] | None = None,
    ) -> str:
        """Runs until the link ends; returns why. Job reports also go to ``on_job_message``,
        awaited before the next message is taken: an upload's pieces are written as they come,
        and a slow disk slows the agent down through the stream's flow control instead of
        filling the server's memory."""
        reason = "closed by the server"
        with self._cancel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_heartbeats)
                nursery.start_soon(self.link.close_when_silent, self._liveness.window)
                reason = await self._receive(on_message, on_job_message)
                nursery.cancel_scope.cancel()
        for pending in self._pending.values():
            pending.done.set()  # callers see LinkClosed
        if self._close_reason is not None:
            reason = self._close_reason
            with trio.CancelScope(shield=True), trio.move_on_after(GOODBYE_GRACE):
                try:
                    await self.link.send(Goodbye(reason=reason))
                except LinkClosed:
                    pass
        return reason

    async def _receive(
        self,
        on_message: Callable[[Message], None],
        on_job_message: Callable[[Message], Awaitable[None]] | None,
    ) -> str:
        try:
            while True:
                message = await self.link.receive()
                if isinstance(message, Goodbye):
                    return f"the agent said goodbye: {message.reason}"
                reply_to = getattr(message, "reply_to", None)
                if reply_to is not None and reply_to in self._pending:
                    pending = self._pending[reply_to]
                    pending.reply = message
                    pending.done.set()
                on_message(message)
                if on_job_message is not None and isinstance(message, JobStatus | JobPiece):
                    await on_job_message(message)
        except LinkClosed as exc:
            return str(exc)

    async def _send_heartbeats(self) -> None:
        """Every interval, and at once when this server starts or stops leading: the agent learns
        a new leader's term from its first heartbeat, and refuses the old leader from then on."""
        leadership = self._leadership
        try:
            for seq in itertools.count():
                seen = leadership.changes.version
                await self.link.send(Heartbeat(seq=seq, term=leadership.term, leader=leadership.acting()))
                with trio.move_on_after(self._liveness.interval):
                    await leadership.changes.wait_past(seen)
        except LinkClosed:
            return  # the receive side reports why


class LinkListener:
    def __init__(
        self,
        registry: NodeRegistry,
        join_token_digest: bytes,
        *,
        handshake_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        jobs: JobReports | None = None,
        leadership: LeaderView | None = None,
        limits: ListenerLimits = LINK_LIMITS,
    ) -> None:
        # A cap on connections (from the file descriptor limit): at the cap a new one displaces
        # the oldest that has not registered, so silent sockets cannot keep an agent out, and
        # a registered agent's link is never the one closed.
        self.connections = Connections(limits)
        self._registry = registry
        self._leadership = leadership or _AlwaysLeading()
        self._jobs = jobs
        self._join_digest = join_token_digest
        self._handshake_timeout = handshake_timeout
        self._ssl_context = ssl_context

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners: list[trio.abc.Listener] = list(await trio.open_tcp_listeners(port, host=host))
        if self._ssl_context is not None:
            listeners = [trio.SSLListener(lst, self._ssl_context, https_compatible=True) for lst in listeners]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(
                    accept_forever, listener, self.connections, lambda s: self._take(s, nursery)
                )
            task_status.started(listeners)

    def _take(self, transport: trio.abc.Stream, nursery: trio.Nursery) -> None:
        peer = _peer_name(transport)
        connection = self.connections.admit(peer.rpartition(":")[0])
        if connection is None:
            # Refused at once, without a task: every connection at the cap is a registered agent.
            _close_now(transport)
            return
        nursery.start_soon(self._handle, transport, peer, connection)

    async def _handle(self, transport: trio.abc.Stream, peer: str, connection: Connection) -> None:
        link = H2Link(transport, client_side=False, peer=peer)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await self._converse(link, peer, connection)
                nursery.cancel_scope.cancel()
        except* LinkClosed as group:
            log.debug("link from %s ended: %s", peer, group.exceptions[0])
        except* Exception:
            # Isolation: a bug on one connection must not take the listener (and every other
            # agent's link) down with it.
            log.exception("link from %s failed", peer)
        finally:
            self.connections.gone(connection)
            with trio.CancelScope(shield=True):
                await link.aclose("done")

    async def _converse(self, link: H2Link, peer: str, connection: Connection) -> None:
        with trio.CancelScope() as waiting:
            self.connections.waiting(connection, waiting)  # displaceable until registered
            register = await self._handshake(link, peer)
        self.connections.working(connection)
        if waiting.cancelled_caught:
            # Debug: a flood displaces thousands; the table's counts say how many.
            log.debug("dropped link from %s before it registered: connections at their cap", peer)
            return
        if register is None:
            return
        if not NODE_NAME.fullmatch(register.node):
            log.warning("refused agent at %s: invalid node name %r", peer, register.node)
            await link.send(Goodbye(reason=f"invalid node name {register.node!r}"))
            return
        session = AgentSession(link, register.node, self._registry.liveness, self._leadership)
        await self._registry.attach(session, register)
        try:
            await link.send(
                Registered(
                    node=register.node,
                    server_version=__version__,
                    heartbeat_interval=self._registry.liveness.interval,
                    missed_heartbeats=self._registry.liveness.missed,
                    term=self._leadership.term,
                    leader=self._leadership.acting(),
                )
            )
            session.registered.set()
            jobs = self._jobs
            reason = await session.run(
                lambda message: self._on_message(register.node, message),
                None if jobs is None else lambda message: jobs.on_message(register.node, message),
            )
        finally:
            session.registered.set()  # commands waiting for it now see the link closed
            self._registry.detach(session, link.closed_reason or "ended")
        log.debug("session of node %s ended: %s", register.node, reason)

    async def _handshake(self, link: H2Link, peer: str) -> Register | None:
        with trio.move_on_after(self._handshake_timeout):
            headers = await link.accept_stream()
            if headers.get(":path") != LINK_PATH or headers.get(":method") != "POST":
                await link.respond(404, f"this port speaks only the llmgw agent link (POST {LINK_PATH})")
                return None
            token = headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not tokens.matches(token, self._join_digest):
                log.warning(
                    "refused agent at %s (node %s): wrong join token", peer, headers.get("x-llmgw-node", "?")
                )
                await link.respond(
                    401, "join token rejected: the agent's join_token_file does not match the server's"
                )
                return None
            await link.respond(200)
            first = await link.receive()
            if isinstance(first, Register):
                return first
            log.warning("dropped link from %s: expected Register, got %s", peer, type(first).__name__)
            return None
        log.info("dropped link from %s: not registered within %.1fs", peer, self._handshake_timeout)
        return None

    def _on_message(self, node: str, message: Message) -> None:
        # Any message is a sign of life; a heartbeat may bring a fresher inventory.
        self._registry.heard(node, message.inventory if isinstance(message, Heartbeat) else None)
        if isinstance(message, ShardStatus):
            self._registry.shard_status(node, message)


def _close_now(transport: trio.abc.Stream) -> None:
    stream = transport.transport_stream if isinstance(transport, trio.SSLStream) else transport
    if isinstance(stream, trio.SocketStream):
        stream.socket.close()


def _peer_name(transport: trio.abc.Stream) -> str:
    stream = transport.transport_stream if isinstance(transport, trio.SSLStream) else transport
    try:
        host, port, *_ = stream.socket.getpeername()
        return f"{host}:{port}"
    except (AttributeError, OSError):
        return "?"
