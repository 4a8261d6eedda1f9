"""The agent link, in one process over real loopback TCP: registration, heartbeats, commands,
liveness, reconnection, refusal and hostile input."""

from __future__ import annotations

import logging
import resource

import h2.config
import h2.connection
import h2.events
import pytest
import trio

from llmgw.agent.link import JoinRefused
from llmgw.core.inventory import Inventory
from llmgw.core.listener_limits import ListenerLimits
from llmgw.core.liveness import NodeState
from llmgw.server.run import raise_open_files_limit
from llmgw.wire.codec import encode
from llmgw.wire.h2link import LINK_PATH
from llmgw.wire.messages import Ping, Pong, Register
from tests.helpers import make_agent, start_link_server, wait_for


def online(server, names) -> bool:
    return all((n := server.registry.get(name)) is not None and n.connected for name in names)


async def test_fifty_agents_register_heartbeat_and_answer_commands(tmp_path):
    names = [f"node-{i:02d}" for i in range(50)]
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path, interval=0.3)
        agents = [make_agent(name, server.port, server.token) for name in names]
        for agent in agents:
            nursery.start_soon(agent.run)
        await wait_for(lambda: online(server, names), "50 agents to register")

        # Heartbeats keep arriving after registration: last_heard moves on for every node.
        registered_at = {name: server.registry.get(name).last_heard for name in names}
        await wait_for(
            lambda: all(server.registry.get(n).last_heard > registered_at[n] for n in names),
            "a heartbeat from every agent",
        )
        # The server can call every agent and gets each one's own answer.
        for name in names:
            with trio.fail_after(10):
                reply = await server.registry.call(name, Ping(id=0, payload=f"hi {name}"))
            assert reply == Pong(reply_to=reply.reply_to, payload=f"hi {name}", node=name)
        assert all(n.state is NodeState.ONLINE for n in server.registry.list())
        assert all(agent.registrations == 1 for agent in agents)
        nursery.cancel_scope.cancel()


async def test_silent_node_is_marked_lost_and_back_online_when_it_returns(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path, interval=0.2, missed=3)
        agent = make_agent("quiet", server.port, server.token)
        agent_scope = trio.CancelScope()

        async def run_agent():
            with agent_scope:
                await agent.run()

        nursery.start_soon(run_agent)
        await wait_for(lambda: online(server, ["quiet"]), "registration")

        agent_scope.cancel()
        lost_at_least_after = trio.current_time()
        node = server.registry.get("quiet")
        await wait_for(lambda: node.state is NodeState.LOST, "the node to be marked lost")
        # Not before the window (interval × missed) has passed since it was last heard.
        assert trio.current_time() - lost_at_least_after >= 0.0
        assert trio.current_time() - node.last_heard > server.registry.liveness.window

        again = make_agent("quiet", server.port, server.token)
        nursery.start_soon(again.run)
        await wait_for(lambda: node.state is NodeState.ONLINE and node.connected, "the node to come back")
        nursery.cancel_scope.cancel()


async def test_disconnect_alone_does_not_make_a_node_lost(tmp_path):
    """An agent restart inside the window must not flap the node: its engines kept running."""
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path, interval=0.5, missed=20)
        scope = trio.CancelScope()
        first = make_agent("steady", server.port, server.token)

        async def run_first():
            with scope:
                await first.run()

        nursery.start_soon(run_first)
        await wait_for(lambda: online(server, ["steady"]), "registration")
        scope.cancel()
        node = server.registry.get("steady")
        await wait_for(lambda: not node.connected, "the server to see the disconnect")
        assert node.state is NodeState.ONLINE
        second = make_agent("steady", server.port, server.token)
        nursery.start_soon(second.run)
        await wait_for(lambda: node.connected, "the agent to reconnect")
        assert node.state is NodeState.ONLINE
        nursery.cancel_scope.cancel()


async def test_agents_reconnect_by_themselves_after_a_server_restart(tmp_path):
    names = [f"r{i}" for i in range(10)]
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path)
        agents = [make_agent(name, server.port, server.token) for name in names]
        for agent in agents:
            nursery.start_soon(agent.run)
        await wait_for(lambda: online(server, names), "registration")
        # The agent counts a registration when Registered arrives, a moment after the server.
        await wait_for(lambda: all(agent.registrations == 1 for agent in agents), "agents to see Registered")

        server.cancel.cancel()
        await wait_for(lambda: not any(a.connected for a in agents), "agents to notice the server is gone")

        restarted = await start_link_server(nursery, tmp_path, port=server.port)
        # The restarted server knows the nodes from its store before they come back.
        assert {n.name for n in restarted.registry.list()} == set(names)
        await wait_for(lambda: online(restarted, names), "every agent to reconnect")
        # Each agent came back exactly once (the agent counts when it receives Registered).
        await wait_for(lambda: all(agent.registrations >= 2 for agent in agents), "agents to see Registered")
        assert [agent.registrations for agent in agents] == [2] * len(agents)
        nursery.cancel_scope.cancel()


async def test_wrong_join_token_is_refused_and_others_are_unaffected(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path)
        good = make_agent("good", server.port, server.token)
        nursery.start_soon(good.run)
        await wait_for(lambda: online(server, ["good"]), "the good agent")

        intruder = make_agent("intruder", server.port, "not-the-token")
        with pytest.raises(JoinRefused, match="join token rejected"), trio.fail_after(10):
            await intruder.run()
        assert server.registry.get("intruder") is None
        assert any(
            "wrong join token" in r.getMessage() and "intruder" in r.getMessage() for r in caplog.records
        )

        with trio.fail_after(10):
            reply = await server.registry.call("good", Ping(id=0, payload="still there?"))
        assert reply.payload == "still there?"
        assert good.registrations == 1
        nursery.cancel_scope.cancel()


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    """Reads until the server closes the connection (EOF or reset)."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    return True


async def test_garbage_and_half_open_connections_are_dropped_server_keeps_serving(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path, handshake_timeout=1.0)
        good = make_agent("good", server.port, server.token)
        nursery.start_soon(good.run)
        await wait_for(lambda: online(server, ["good"]), "the good agent")

        garbage = await trio.open_tcp_stream("127.0.0.1", server.port)
        await garbage.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 8)
        half_open = await trio.open_tcp_stream("127.0.0.1", server.port)  # says nothing at all
        # A valid HTTP/2 preface followed by junk frames: h2 itself must reject it.
        bad_h2 = await trio.open_tcp_stream("127.0.0.1", server.port)
        await bad_h2.send_all(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x99\x00\x00\x00\x00\x00junk"
        )

        with trio.fail_after(10):
            assert await _closed_by_server(garbage)
            assert await _closed_by_server(bad_h2)
            assert await _closed_by_server(half_open)  # after the handshake timeout

        with trio.fail_after(10):
            reply = await server.registry.call("good", Ping(id=0, payload="ok"))
        assert reply.payload == "ok"
        # A newcomer still gets in.
        late = make_agent("late", server.port, server.token)
        nursery.start_soon(late.run)
        await wait_for(lambda: online(server, ["late"]), "a new agent after the junk")
        for stream in (garbage, half_open, bad_h2):
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_new_link_from_the_same_node_replaces_the_old_one(tmp_path):
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path)
        first = make_agent("twin", server.port, server.token, max_delay=30)
        nursery.start_soon(first.run)
        await wait_for(lambda: online(server, ["twin"]), "the first link")
        old_session = server.registry.get("twin").session
        second = make_agent("twin", server.port, server.token, max_delay=30)
        nursery.start_soon(second.run)
        await wait_for(lambda: server.registry.get("twin").session is not old_session, "the second link")
        # The old link closes in its own task, after its Goodbye.
        await wait_for(lambda: old_session.link.closed, "the old link closed")
        nursery.cancel_scope.cancel()


# --- training jobs on the link (a bare server end, so only the agent's side is under test) -------


async def test_jobs_are_registered_commanded_reported_and_uploaded_in_order():
    import random

    from llmgw.agent.link import AgentLink
    from llmgw.core.training import QaPair, TrainSpec
    from llmgw.wire.h2link import H2Link
    from llmgw.wire.messages import (
        CancelJob,
        CommandResult,
        JobPiece,
        JobStatus,
        Register,
        Registered,
        RunningJob,
        StartJob,
    )
    from tests.helpers import fake_inventory

    class Jobs:
        def __init__(self) -> None:
            self.started: list[str] = []

        async def start(self, spec: TrainSpec) -> tuple[bool, str]:
            self.started.append(spec.job_id)
            return True, "starting on cpu"

        async def cancel(self, job_id: str, grace: float) -> tuple[bool, str]:
            return True, f"cancelled {job_id} within {grace:g}s"

        def running(self) -> list[RunningJob]:
            return [RunningJob(job_id="job-0", state="Training")]

    received: list[object] = []
    sessions: list[H2Link] = []

    async def serve(stream: trio.SocketStream) -> None:
        link = H2Link(stream, client_side=False, peer="agent")
        async with trio.open_nursery() as inner:
            await inner.start(link.run)
            await link.accept_stream()
            await link.respond(200)
            sessions.append(link)
            try:
                while True:
                    message = await link.receive()
                    received.append(message)
                    if isinstance(message, Register):
                        await link.send(
                            Registered(
                                node="n1", server_version="t", heartbeat_interval=5, missed_heartbeats=3
                            )
                        )
            except Exception:
                inner.cancel_scope.cancel()

    jobs = Jobs()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        port = listeners[0].socket.getsockname()[1]
        agent = AgentLink(
            node="n1",
            host="127.0.0.1",
            port=port,
            join_token="t",
            discover=lambda _a: fake_inventory("n1"),
            initial_delay=0.05,
            max_delay=0.1,
            rng=random.Random(1),
            jobs=jobs,
        )
        # Reported before any session: kept, and only the latest of a job goes.
        agent.report_job(JobStatus(job_id="job-0", state="Training", step=1))
        agent.report_job(JobStatus(job_id="job-0", state="Training", step=2))
        nursery.start_soon(agent.run)
        await wait_for(lambda: agent.connected, "the agent to register")
        [register] = [m for m in received if isinstance(m, Register)]
        assert register.jobs == (RunningJob(job_id="job-0", state="Training"),)
        await wait_for(lambda: any(isinstance(m, JobStatus) for m in received), "the queued status")
        assert [m.step for m in received if isinstance(m, JobStatus)] == [2]

        server = sessions[-1]
        spec = TrainSpec(
            job_id="job-1", model="m", adapter="a", base_dir="/b", pairs=(QaPair(question="q", answer="a"),)
        )
        await server.send(StartJob(id=7, spec=spec))
        await server.send(CancelJob(id=8, job_id="job-1", grace=2))
        await wait_for(lambda: sum(isinstance(m, CommandResult) for m in received) == 2, "both replies")
        replies = {m.reply_to: m for m in received if isinstance(m, CommandResult)}
        assert replies[7] == CommandResult(reply_to=7, ok=True, message="starting on cpu")
        assert replies[8] == CommandResult(reply_to=8, ok=True, message="cancelled job-1 within 2s")
        assert jobs.started == ["job-1"]

        # An upload: a stale progress status queued just before must not arrive after Uploading.
        agent.report_job(JobStatus(job_id="job-1", state="Training", step=9))
        before = len(received)

        async def pieces():
            for index in range(3):
                yield JobPiece(job_id="job-1", file="f", index=index, count=3, data="", sha256="x")

        await agent.upload(JobStatus(job_id="job-1", state="Uploading"), pieces())
        await wait_for(lambda: len(received) >= before + 4, "the upload")
        sent = [(type(m).__name__, getattr(m, "state", getattr(m, "index", None))) for m in received[before:]]
        assert sent == [("JobStatus", "Uploading"), ("JobPiece", 0), ("JobPiece", 1), ("JobPiece", 2)]
        nursery.cancel_scope.cancel()


async def _link_request(port: int, token: str, early: bytes, until=None) -> tuple[int | None, bool]:
    """A raw HTTP/2 link request whose body starts before the server answers: (its status, or None
    if the connection ended first; whether the server closed the connection). Accepted, it is held
    open until ``until()`` is true."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    headers = [
        (":method", "POST"),
        (":path", LINK_PATH),
        (":scheme", "http"),
        (":authority", "llmgw"),
        ("authorization", f"Bearer {token}"),
    ]
    conn.send_headers(1, headers)
    for start in range(0, len(early), 16384):  # the largest frame a peer must accept
        conn.send_data(1, early[start : start + 16384])
    await stream.send_all(conn.data_to_send())
    status = None
    try:
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[":status"])
            await stream.send_all(conn.data_to_send())
            if status == 200:
                if until is not None:
                    await wait_for(until, "the server to take the early messages")
                await stream.aclose()
                return status, False
    except trio.BrokenResourceError:
        pass
    await stream.aclose()
    return status, True


async def test_nothing_an_agent_sends_is_decoded_before_its_join_token_is_checked(tmp_path, caplog):
    """Bytes sent with the link request wait, undecoded, for the token check: a wrong token with a
    body that would break the decoder (brackets nested past Python's recursion limit) is a 401,
    not a protocol error; the right token with its Register sent at once registers."""
    caplog.set_level(logging.INFO)
    nested = b"[" * 3_000 + b"]" * 3_000 + b"\n"  # past the recursion limit, in one read
    inventory = Inventory(hostname="eager", cpu_count=1, memory_total_mib=1, memory_available_mib=1)
    register = encode(Register(node="eager", agent_version="0", inventory=inventory))
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path)
        with trio.fail_after(10):
            # The 401 itself may be lost: closing with the unread body resets the connection.
            assert (await _link_request(server.port, "not-the-token", nested))[0] in (401, None)
        assert "wrong join token" in caplog.text
        # Before, the bytes were decoded first: a RecursionError and its traceback per connection.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        with trio.fail_after(10):
            status, _ = await _link_request(
                server.port, server.token, register, until=lambda: server.registry.get("eager") is not None
            )
        assert status == 200
        nursery.cancel_scope.cancel()


async def test_silent_sockets_at_the_cap_make_room_for_an_agent_and_never_close_a_registered_link(tmp_path):
    """Connections are capped (here 4): a flood of silent sockets is displaced oldest first by
    newcomers, a new agent still registers, and a registered agent's link is never closed."""
    limits = ListenerLimits(max_connections=4, max_connections_per_peer=None)
    async with trio.open_nursery() as nursery:
        server = await start_link_server(nursery, tmp_path, handshake_timeout=60.0, limits=limits)
        good = make_agent("good", server.port, server.token)
        nursery.start_soon(good.run)
        await wait_for(lambda: online(server, ["good"]), "the good agent")
        silent = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(20)]
        await wait_for(lambda: server.listener.connections.displaced >= 16, "the flood to displace itself")
        assert server.listener.connections.open <= 4
        late = make_agent("late", server.port, server.token)
        nursery.start_soon(late.run)
        await wait_for(lambda: online(server, ["late"]), "an agent past the flood")
        with trio.fail_after(10):
            reply = await server.registry.call("good", Ping(id=0, payload="still there?"))
        assert reply.payload == "still there?" and good.registrations == 1
        for stream in silent:
            await stream.aclose()
        nursery.cancel_scope.cancel()


def test_the_server_raises_its_open_files_limit_to_the_hard_one():
    """The connection caps come from the soft limit: a soft 1024 (systemd's default) would cap
    the agents' links at a few hundred."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        assert raise_open_files_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
