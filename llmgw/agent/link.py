"""The agent's end of the link: dial, register, answer commands, and keep coming back.

One connection at a time. Each attempt dials the server (TLS when a CA file is configured), opens
the link stream with the join token, registers with a fresh inventory — discovered after dialling,
because the management interface is the one holding the address the connection left from — and
then serves the session until it ends. Between attempts it waits a capped, jittered, growing delay
that resets once a registration succeeds. A refused join token is final: retrying cannot fix it.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import attrs
import trio

from llmgw import __version__, tracing
from llmgw.agent.terms import TermBook
from llmgw.core.backoff import reconnect_delay
from llmgw.core.liveness import Liveness
from llmgw.core.shard import ShardSpec
from llmgw.core.training import FileDigest, TrainSpec
from llmgw.wire.h2link import H2Link, LinkClosed, LinkRefused
from llmgw.wire.messages import (
    AdapterDone,
    AdapterPiece,
    CancelJob,
    CommandResult,
    DrainShard,
    Goodbye,
    Heartbeat,
    Inventory,
    JobPiece,
    JobStatus,
    Message,
    Ping,
    Pong,
    PutAdapter,
    Register,
    Registered,
    RunningJob,
    RunningShard,
    ShardStatus,
    StartJob,
    StartShard,
    StopShard,
)
from llmgw.wire.pieces import UploadInterrupted

log = logging.getLogger(__name__)

# Inventory rides on every Nth heartbeat: free memory drifts, but not fast enough to be worth
# sending (and, on a GPU node, re-reading through NVML) every few seconds.
INVENTORY_EVERY = 6
# Dialling and registering must finish within this, or the attempt counts as failed.
HANDSHAKE_TIMEOUT = 10.0
# What Register says of an agent that runs no shards (engines.stop_grace's default).
DEFAULT_STOP_GRACE = 30.0


class ShardHost(Protocol):
    """What the link needs from the supervisor."""

    async def start(self, spec: ShardSpec, engine_key: str | None) -> tuple[bool, str]: ...

    stop_grace: float  # seconds between SIGTERM and SIGKILL when a stop names none

    async def stop(self, shard_id: str, grace: float | None) -> tuple[bool, str]: ...

    async def drain(self, shard_id: str, drain_timeout: float) -> tuple[bool, str]: ...

    def running(self) -> list[RunningShard]: ...


class JobHost(Protocol):
    """What the link needs from the trainer."""

    async def start(self, spec: TrainSpec) -> tuple[bool, str]: ...

    async def cancel(self, job_id: str, grace: float) -> tuple[bool, str]: ...

    def running(self) -> list[RunningJob]: ...


class AdapterHost(Protocol):
    """What the link needs from the node's adapter copies (llmgw.agent.adapters)."""

    async def put(self, name: str, files: tuple[FileDigest, ...]) -> tuple[bool, str]: ...

    async def piece(self, piece: AdapterPiece) -> None: ...

    async def done(self, name: str) -> tuple[bool, str]: ...

    async def abandon(self) -> None: ...


class JoinRefused(Exception):
    """The server will not take this agent (wrong join token, bad node name)."""


class AgentLink:
    def __init__(
        self,
        *,
        node: str,
        host: str,
        port: int,
        join_token: str,
        discover: Callable[[str], Inventory],
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
        initial_delay: float = 0.5,
        max_delay: float = 30.0,
        rng: random.Random | None = None,
        shards: ShardHost | None = None,
        jobs: JobHost | None = None,
        adapters: AdapterHost | None = None,
        terms: TermBook | None = None,
    ) -> None:
        self.node = node
        self._host, self._port = host, port
        self._token = join_token
        self._discover = discover
        self._ssl_context = ssl_context
        self._server_name = server_name or host
        self._initial_delay, self._max_delay = initial_delay, max_delay
        self._rng = rng or random.Random()
        self._shards = shards
        self._jobs = jobs
        self._adapters = adapters
        self._status_send, self._status_receive = trio.open_memory_channel[ShardStatus](math.inf)
        # The latest status of each job not yet sent, oldest first. Unlike shard statuses these
        # survive a reconnect (Register lists running jobs, but not how one ended), and only the
        # latest matters: progress superseded while the link was down is not worth sending.
        self._job_statuses: dict[str, JobStatus] = {}
        self._job_statuses_changed = trio.Event()
        # The registered session, for uploads: a job's pieces go on one session or not at all.
        self._session: H2Link | None = None
        self._session_up = trio.Event()
        self.registrations = 0  # how many times a session was established (tests, status)
        self.connected = False
        # The newest leader term seen on any link (shared by an agent's links); whether this
        # link's server said it leads, as of its last word.
        self.terms = terms or TermBook()
        self.server_leads = False
        self.server_term = 0
        self.fenced = 0  # commands refused as fenced on this link (tests, status)

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    @property
    def leading(self) -> bool:
        """Whether this link is up to the server that leads under the newest term seen."""
        return self.connected and self.server_leads and self.server_term >= self.terms.newest

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keeps a session up forever; raises JoinRefused when the server says no for good."""
        task_status.started()
        failures = 0
        while True:
            registered, why = await self._attempt()
            if registered:
                failures = 0
            delay = reconnect_delay(
                failures, initial=self._initial_delay, maximum=self._max_delay, draw=self._rng.random()
            )
            failures += 1
            log.warning("link to %s:%s down (%s); retrying in %.1fs", self._host, self._port, why, delay)
            await trio.sleep(delay)

    async def _attempt(self) -> tuple[bool, str]:
        """One connection, start to end: (whether it registered, why it ended)."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                tcp = await trio.open_tcp_stream(self._host, self._port)
        except (OSError, trio.TooSlowError) as exc:
            return False, f"cannot connect: {exc or 'timed out'}"
        local_address = tcp.socket.getsockname()[0]
        transport: trio.abc.Stream = tcp
        if self._ssl_context is not None:
            transport = trio.SSLStream(
                tcp, self._ssl_context, server_hostname=self._server_name, https_compatible=True
            )
        link = H2Link(transport, client_side=True, peer=f"{self._host}:{self._port}")
        outcome: tuple[bool, str] = (False, "")
        refused: JoinRefused | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            try:
                liveness = await self._register(link, local_address)
                self.registrations += 1
                self.connected = True
                self._session = link
                self._session_up.set()
                log.info("registered with %s:%s as node %s", self._host, self._port, self.node)
                outcome = (True, await self._serve(link, liveness, local_address))
            except LinkRefused as exc:
                if exc.status == 401:
                    refused = JoinRefused(f"the server refused this agent: {exc.message}")
                outcome = (False, f"refused: {exc.message}")
            except JoinRefused as exc:
                refused = exc
            except (LinkClosed, trio.TooSlowError, ssl.SSLError, OSError) as exc:
                outcome = (False, str(exc) or type(exc).__name__)
            finally:
                self.connected = False
                was_leading, self.server_leads = self.server_leads, False
                if self._session is link:
                    self._session = None
                    self._session_up = trio.Event()
                with trio.CancelScope(shield=True):
                    await link.aclose("agent closing the link")
                    if self._adapters is not None and was_leading:
                        # Pieces of another session would not continue this one's. Only the
                        # leader delivers adapters: a follower's link ending leaves them be.
                        await self._adapters.abandon()
                nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused
        return outcome

    async def _register(self, link: H2Link, local_address: str) -> Liveness:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            scheme = "https" if self._ssl_context is not None else "http"
            await link.open_stream(
                {"authorization": f"Bearer {self._token}", "x-llmgw-node": self.node},
                authority=f"{self._host}:{self._port}",
                scheme=scheme,
            )
            inventory = await trio.to_thread.run_sync(self._discover, local_address)
            # Register lists every shard as it is now, which supersedes any status reported
            # while the link was down: drop those first, then take the snapshot.
            self._drop_queued_statuses()
            shards = tuple(self._shards.running()) if self._shards is not None else ()
            jobs = tuple(self._jobs.running()) if self._jobs is not None else ()
            await link.send(
                Register(
                    node=self.node,
                    agent_version=__version__,
                    inventory=inventory,
                    shards=shards,
                    jobs=jobs,
                    stop_grace=self._shards.stop_grace if self._shards is not None else DEFAULT_STOP_GRACE,
                )
            )
            reply = await link.receive()
        if isinstance(reply, Goodbye):
            raise JoinRefused(f"the server refused this agent: {reply.reason}")
        if not isinstance(reply, Registered):
            raise LinkClosed(f"expected Registered, got {type(reply).__name__}")
        self._heard_leader(reply.term, reply.leader)
        return Liveness(interval=reply.heartbeat_interval, missed=reply.missed_heartbeats)

    # --- shard status reports -------------------------------------------------------------------

    def report(self, status: ShardStatus) -> None:
        """Queues a shard status for the server (the supervisor's ``on_status``). Never blocks:
        statuses are rare, and while the link is down the next Register supersedes them."""
        self._status_send.send_nowait(status)

    def _drop_queued_statuses(self) -> None:
        while True:
            try:
                self._status_receive.receive_nowait()
            except trio.WouldBlock:
                return

    async def _send_statuses(self, link: H2Link) -> None:
        async for status in self._status_receive:
            if status.spec is None and self._shards is not None:
                status = attrs.evolve(status, spec=self._spec_of(status.shard_id))
            await link.send(status)

    def _spec_of(self, shard_id: str) -> ShardSpec | None:
        assert self._shards is not None
        return next((s.spec for s in self._shards.running() if s.spec.shard_id == shard_id), None)

    # --- job status reports and uploads ---------------------------------------------------------

    def report_job(self, status: JobStatus) -> None:
        """Queues a job status for the server (the trainer's ``on_status``). Never blocks; a newer
        status of the same job replaces one not yet sent."""
        self._job_statuses.pop(status.job_id, None)
        self._job_statuses[status.job_id] = status
        self._job_statuses_changed.set()

    async def _send_job_statuses(self, link: H2Link) -> None:
        while True:
            while self._job_statuses:
                job_id = next(iter(self._job_statuses))
                status = self._job_statuses.pop(job_id)
                try:
                    await link.send(status)
                except LinkClosed:
                    # Kept for the next session, unless a newer one came meanwhile.
                    self._job_statuses.setdefault(job_id, status)
                    raise
            self._job_statuses_changed = trio.Event()
            await self._job_statuses_changed.wait()

    async def upload(self, status: JobStatus, pieces: AsyncIterator[JobPiece]) -> None:
        """Sends a job's Uploading status, then its pieces, on one session, each piece once the
        link has taken the one before (HTTP/2 flow control is the backpressure). Waits for a
        session when none is up; raises UploadInterrupted when it ends midway."""
        while self._session is None:
            await self._session_up.wait()
        link = self._session
        # This status supersedes any older one of the job, which must not arrive after it.
        self._job_statuses.pop(status.job_id, None)
        try:
            await link.send(status)
            async for piece in pieces:
                await link.send(piece)
        except LinkClosed as exc:
            raise UploadInterrupted(str(exc)) from None

    # --- a registered session -------------------------------------------------------------------

    async def _serve(self, link: H2Link, liveness: Liveness, local_address: str) -> str:
        """Runs a registered session until it ends; returns why."""

        async def send_heartbeats() -> None:
            for seq in itertools.count(1):
                await trio.sleep(liveness.interval)
                inventory = None
                if seq % INVENTORY_EVERY == 0:
                    inventory = await trio.to_thread.run_sync(self._discover, local_address)
                await link.send(Heartbeat(seq=seq, inventory=inventory))

        async def execute(command: Message) -> None:
            # Each command runs in its own task: a stop waits out a grace period, and the
            # receive loop (heartbeats, other commands) must not wait with it.
            reply = await self._execute(command)
            await link.send(reply)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_closed, send_heartbeats)
            nursery.start_soon(_until_closed, self._send_statuses, link)
            nursery.start_soon(_until_closed, self._send_job_statuses, link)
            nursery.start_soon(link.close_when_silent, liveness.window)
            try:
                while True:
                    message = await link.receive()
                    match message:
                        case Goodbye(reason=reason):
                            return f"the server said goodbye: {reason}"
                        case Heartbeat(term=term, leader=leader):
                            self._heard_leader(term, leader)
                        case Ping(id=command_id, payload=payload):
                            await link.send(Pong(reply_to=command_id, payload=payload, node=self.node))
                        case AdapterPiece():
                            # In the receive loop, in order: a piece is written before the next
                            # message is read (flow control holds the server back meanwhile),
                            # so every piece is in before the AdapterDone that follows them.
                            if self._adapters is not None:
                                await self._adapters.piece(message)
                        case (
                            StartShard()
                            | StopShard()
                            | DrainShard()
                            | StartJob()
                            | CancelJob()
                            | PutAdapter()
                            | AdapterDone()
                        ):
                            verdict = self.terms.admit(message.term)
                            if not verdict.ok:
                                # Decided by a server that lost the lease since: not acted on.
                                self.fenced += 1
                                log.warning(
                                    "refused a %s from %s: %s",
                                    type(message).__name__,
                                    self.address,
                                    verdict.reason,
                                )
                                reply = CommandResult(
                                    reply_to=message.id,
                                    ok=False,
                                    message=verdict.reason,
                                    fenced=verdict.newest,
                                )
                                await link.send(reply)
                                continue
                            nursery.start_soon(_until_closed, execute, message)
                        case _:
                            log.warning("ignoring a %s from the server: unknown here", type(message).__name__)
            except LinkClosed as exc:
                # Caught here, inside the nursery, so it leaves as itself rather than in a group.
                return str(exc)
            finally:
                nursery.cancel_scope.cancel()

    def _heard_leader(self, term: int, leader: bool) -> None:
        self.terms.heard(term)
        # A server that says it leads under an older term than one seen elsewhere is stale
        # (``leading`` compares again, as newer terms are heard on other links).
        self.server_leads, self.server_term = leader, term

    async def _execute(
        self, command: StartShard | StopShard | DrainShard | StartJob | CancelJob | PutAdapter | AdapterDone
    ) -> CommandResult:
        if isinstance(command, StartJob | CancelJob):
            return await self._execute_job(command)
        if isinstance(command, PutAdapter | AdapterDone):
            return await self._execute_adapter(command)
        if self._shards is None:
            return CommandResult(reply_to=command.id, ok=False, message="this agent runs no shards")
        # The server's trace goes on here (the command's W3C context); the supervisor's spans
        # for the shard's start (launch, leader wait, readiness) are children of this one.
        name = {
            StartShard: "agent.start_shard",
            StopShard: "agent.stop_shard",
            DrainShard: "agent.drain_shard",
        }
        shard_id = command.spec.shard_id if isinstance(command, StartShard) else command.shard_id
        attributes = {"llmgw.node": self.node, "llmgw.shard": shard_id}
        with tracing.span(
            name[type(command)], attributes, parent=command.trace or None, kind="server"
        ) as span:
            result = await self._execute_shard(command)
            if not result.ok:
                tracing.fail(span, result.message)
        return result

    async def _execute_shard(self, command: StartShard | StopShard | DrainShard) -> CommandResult:
        assert self._shards is not None
        match command:
            case StartShard(spec=spec, engine_key=key):
                log.info("start shard %s (replica %s, %s)", spec.shard_id, spec.replica_id, spec.engine)
                ok, message = await self._shards.start(spec, key)
            case StopShard(shard_id=shard_id, grace=grace):
                log.info("stop shard %s", shard_id)
                ok, message = await self._shards.stop(shard_id, grace)
            case DrainShard(shard_id=shard_id, timeout=timeout):
                log.info("drain shard %s", shard_id)
                ok, message = await self._shards.drain(shard_id, timeout)
        return CommandResult(reply_to=command.id, ok=ok, message=message)

    async def _execute_job(self, command: StartJob | CancelJob) -> CommandResult:
        if self._jobs is None:
            return CommandResult(reply_to=command.id, ok=False, message="this agent trains no adapters")
        # The server's trace of the job goes on here; the trainer's steps are beneath this span.
        name = "agent.start_job" if isinstance(command, StartJob) else "agent.cancel_job"
        job = command.spec.job_id if isinstance(command, StartJob) else command.job_id
        attributes = {"llmgw.node": self.node, "llmgw.job": job}
        with tracing.span(name, attributes, parent=command.trace or None, kind="server") as span:
            match command:
                case StartJob(spec=spec):
                    log.info("start job %s (adapter %s of %s)", spec.job_id, spec.adapter, spec.model)
                    ok, message = await self._jobs.start(spec)
                case CancelJob(job_id=job_id, grace=grace):
                    log.info("cancel job %s", job_id)
                    ok, message = await self._jobs.cancel(job_id, grace)
            if not ok:
                tracing.fail(span, message)
        return CommandResult(reply_to=command.id, ok=ok, message=message)

    async def _execute_adapter(self, command: PutAdapter | AdapterDone) -> CommandResult:
        if self._adapters is None:
            return CommandResult(reply_to=command.id, ok=False, message="this agent keeps no adapters")
        match command:
            case PutAdapter(name=name, files=files):
                ok, message = await self._adapters.put(name, files)
            case AdapterDone(name=name):
                ok, message = await self._adapters.done(name)
        if not ok:
            log.warning("adapter %s: %s", command.name, message)
        return CommandResult(reply_to=command.id, ok=ok, message=message)


async def _until_closed(fn: Callable, *args) -> None:
    try:
        await fn(*args)
    except LinkClosed:
        pass  # the receive loop reports why


class ServerLinks:
    """An agent's links to every server sharing one store (server.addresses), one AgentLink each.

    Each link registers with its server and reports every shard status to it, so each server
    routes to this node's engines and a new leader already knows what runs here. Commands are
    obeyed from whichever link they come, if their term is not older than the newest seen on any
    (one TermBook for all). Training jobs' statuses and uploads go to the server that leads.
    """

    def __init__(self, links: list[AgentLink]) -> None:
        if not links:
            raise ValueError("an agent needs at least one server address")
        self.links = links
        self.node = links[0].node

    @property
    def registrations(self) -> int:
        return sum(link.registrations for link in self.links)

    @property
    def connected(self) -> bool:
        return any(link.connected for link in self.links)

    @property
    def terms(self) -> TermBook:
        return self.links[0].terms

    def _leader_link(self) -> AgentLink:
        return next((link for link in self.links if link.leading), self.links[0])

    def report(self, status: ShardStatus) -> None:
        for link in self.links:
            link.report(status)

    def report_job(self, status: JobStatus) -> None:
        self._leader_link().report_job(status)

    async def upload(self, status: JobStatus, pieces: AsyncIterator[JobPiece]) -> None:
        await self._leader_link().upload(status, pieces)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for link in self.links:
                await nursery.start(link.run)
            task_status.started()
