"""Shared test helpers: waiting for conditions with a deadline, and a small in-process fleet."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw.agent.link import AgentLink
from llmgw.core.liveness import Liveness
from llmgw.server import tokens
from llmgw.server.link import LinkListener
from llmgw.server.nodes import NodeRegistry
from llmgw.server.store import open_store
from llmgw.wire.messages import Inventory

TESTS = Path(__file__).resolve().parent  # fixtures, goldens and the fakes' scripts live here
PROJECT_ROOT = TESTS.parent

# Generous: the suite must pass on a loaded 2-core machine. A condition that holds returns at once.
DEADLINE = 20.0


async def wait_for(condition: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Polls ``condition`` until it holds; fails the test naming ``what`` after ``deadline`` s."""
    with trio.move_on_after(deadline):
        while not condition():  # noqa: ASYNC110 (conditions on plain attributes have no event)
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {deadline}s waiting for {what}")


def fake_inventory(hostname: str = "test") -> Inventory:
    return Inventory(hostname=hostname, cpu_count=2, memory_total_mib=4096, memory_available_mib=2048)


@attrs.define
class LinkServer:
    registry: NodeRegistry
    port: int
    token: str
    cancel: trio.CancelScope
    listener: LinkListener


async def start_link_server(
    nursery: trio.Nursery,
    data_dir: Path,
    *,
    port: int = 0,
    interval: float = 0.5,
    missed: int = 4,
    handshake_timeout: float = 2.0,
    token: str = "join-secret",
    leadership=None,
    **options,
) -> LinkServer:
    """A store, a registry and the link listener, in ``nursery``; cancel ``.cancel`` to stop it.
    ``leadership``: what the listener tells agents of the leader lease (None: it leads, term 0)."""
    store = await open_store(data_dir)
    registry = NodeRegistry(store, Liveness(interval=interval, missed=missed))
    await registry.load()
    listener = LinkListener(
        registry, tokens.digest(token), handshake_timeout=handshake_timeout, leadership=leadership, **options
    )
    cancel = trio.CancelScope()

    async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with cancel:
                async with trio.open_nursery() as inner:
                    listeners = await inner.start(listener.serve, "127.0.0.1", port)
                    inner.start_soon(registry.run)
                    task_status.started(listeners[0].socket.getsockname()[1])
        finally:
            await store.aclose()

    bound = await nursery.start(serve)
    return LinkServer(registry=registry, port=bound, token=token, cancel=cancel, listener=listener)


def make_agent(name: str, port: int, token: str, *, max_delay: float = 0.5) -> AgentLink:
    return AgentLink(
        node=name,
        host="127.0.0.1",
        port=port,
        join_token=token,
        discover=lambda _address: fake_inventory(name),
        initial_delay=0.05,
        max_delay=max_delay,
        rng=random.Random(name),
    )


async def kill_9_after(script: Path, args: list[str], marker: bytes) -> bytes:
    """Runs a Python script as a child in its own session, reads its output until ``marker``
    appears, SIGKILLs it (by pid) and returns what it printed. The child is killed even if the
    test fails on the way."""
    import os
    import signal
    import subprocess
    import sys

    root = str(PROJECT_ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        output = b""
        with trio.fail_after(30):
            while marker not in output:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    raise AssertionError(
                        f"child exited before {marker!r} (rc={await proc.wait()}): {output!r}"
                    )
                output += chunk
        os.kill(proc.pid, signal.SIGKILL)
        with trio.fail_after(10):
            assert await proc.wait() == -signal.SIGKILL
        return output
    finally:
        if proc.returncode is None:
            with trio.CancelScope(shield=True):
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
        await proc.stdout.aclose()


def admin_call(method: str, url: str, token: str | None, body: object = None) -> tuple[int, dict]:
    """One admin API request (blocking: run it in a thread); its status and JSON answer, errors
    included."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
