"""Training jobs through the server: the admin API on one side, a scripted agent speaking the real
link on the other (so the agent's own code is not needed to test the server's)."""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.core.catalog import Model, Profile
from llmgw.core.liveness import Liveness, NodeState
from llmgw.core.training import FileDigest, JobState
from llmgw.server import tokens
from llmgw.server.api import serve_admin
from llmgw.server.catalog import Catalog
from llmgw.server.jobs import COMMAND_TIMEOUT, JobManager
from llmgw.server.link import LinkListener
from llmgw.server.nodes import NodeRegistry
from llmgw.server.store import JobRow, open_store
from llmgw.wire.h2link import H2Link, LinkClosed
from llmgw.wire.messages import (
    CancelJob,
    CommandResult,
    Gpu,
    Heartbeat,
    Inventory,
    JobPiece,
    JobStatus,
    Message,
    Register,
    Registered,
    RunningJob,
    StartJob,
)
from tests.helpers import admin_call, fake_inventory, wait_for

ADMIN_TOKEN = "admin-secret"
JOIN_TOKEN = "join-secret"
MODEL = Model(name="tiny", path="/models/tiny.gguf", format="gguf")
PROFILE = Profile(name="tiny-cpu", model="tiny", engine="llamacpp", gpu_class=None, memory_mib=1024)
PAIRS = '{"question": "What is 2+2?", "answer": "4"}\n{"question": "Capital of France?", "answer": "Paris"}\n'
# Heartbeats every 0.25 s, lost after 2 s of silence: quick, yet calm on a loaded 2-core machine.
LIVENESS = Liveness(interval=0.25, missed=8)


@attrs.define
class Server:
    link_port: int
    admin_url: str
    jobs: JobManager
    registry: NodeRegistry
    data_dir: Path
    cancel: trio.CancelScope

    async def api(self, method: str, path: str, body: object = None) -> tuple[int, dict]:
        return await trio.to_thread.run_sync(admin_call, method, self.admin_url + path, ADMIN_TOKEN, body)

    async def job(self, job_id: str) -> dict:
        status, body = await self.api("GET", f"/admin/v1/jobs/{job_id}")
        assert status == 200, body
        return body

    async def create(self, **changes) -> dict:
        body = {"model": "tiny", "node": "n1", "adapter": "tiny-qa", "base_dir": "/w/tiny", "pairs": PAIRS}
        status, answer = await self.api("POST", "/admin/v1/jobs", {**body, **changes})
        assert status == 201, answer
        return answer


def _download(url: str) -> tuple[bytes, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as response:
        return response.read(), response.headers["X-Llmgw-Sha256"]


async def start_server(nursery: trio.Nursery, data_dir: Path, link_port: int = 0) -> Server:
    """Store, registry, catalog, job manager, link listener and admin API, as run.py wires them."""
    cancel = trio.CancelScope()

    async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
        store = await open_store(data_dir)
        try:
            with cancel:
                registry = NodeRegistry(store, LIVENESS)
                await registry.load()
                catalog = await Catalog.load(store, [MODEL], [PROFILE])
                jobs = JobManager(store, registry, catalog, data_dir)
                await jobs.load()
                listener = LinkListener(registry, tokens.digest(JOIN_TOKEN), handshake_timeout=5.0, jobs=jobs)
                async with trio.open_nursery() as inner:
                    await inner.start(jobs.run)
                    listeners = await inner.start(listener.serve, "127.0.0.1", link_port)
                    admin_port = await inner.start(
                        functools.partial(serve_admin, jobs=jobs),
                        registry,
                        catalog,
                        tokens.digest(ADMIN_TOKEN),
                        None,
                        "127.0.0.1",
                        0,
                    )
                    inner.start_soon(registry.run)
                    task_status.started(
                        Server(
                            link_port=listeners[0].socket.getsockname()[1],
                            admin_url=f"http://127.0.0.1:{admin_port}",
                            jobs=jobs,
                            registry=registry,
                            data_dir=data_dir,
                            cancel=cancel,
                        )
                    )
        finally:
            await store.aclose()

    return await nursery.start(serve)


class FakeAgent:
    """A node's agent reduced to its link: it registers (listing the jobs it claims to run),
    sends heartbeats, queues every command for the test and sends what the test tells it to."""

    def __init__(self, name: str, port: int, inventory: Inventory | None = None) -> None:
        self.name = name
        self.port = port
        self.inventory = inventory or fake_inventory(name)
        self.link: H2Link | None = None
        self._scope = trio.CancelScope()
        self._send_commands, self.commands = trio.open_memory_channel[Message](100)

    async def connect(self, nursery: trio.Nursery, jobs: tuple[RunningJob, ...] = ()) -> None:
        await nursery.start(self._run, jobs)

    async def _run(self, jobs: tuple[RunningJob, ...], task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._scope:
            tcp = await trio.open_tcp_stream("127.0.0.1", self.port)
            link = self.link = H2Link(tcp, client_side=True, peer="server")
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(link.run)
                    await link.open_stream(
                        {"authorization": f"Bearer {JOIN_TOKEN}", "x-llmgw-node": self.name},
                        authority=f"127.0.0.1:{self.port}",
                    )
                    await link.send(
                        Register(
                            node=self.name,
                            agent_version="0.1.0",
                            inventory=self.inventory,
                            jobs=jobs,
                        )
                    )
                    assert isinstance(await link.receive(), Registered)
                    nursery.start_soon(self._heartbeats, link)
                    task_status.started()
                    while True:
                        message = await link.receive()
                        if not isinstance(message, Heartbeat):
                            self._send_commands.send_nowait(message)
            except LinkClosed:
                pass
            finally:
                with trio.CancelScope(shield=True):
                    await link.aclose("agent gone")

    async def _heartbeats(self, link: H2Link) -> None:
        seq = 0
        while True:
            await link.send(Heartbeat(seq=seq))
            seq += 1
            await trio.sleep(LIVENESS.interval)

    def disconnect(self) -> None:
        """Drops the connection (an agent killed, a cable pulled)."""
        self._scope.cancel()

    async def command(self, kind: type) -> Message:
        with trio.fail_after(20):
            while True:
                message = await self.commands.receive()
                if isinstance(message, kind):
                    return message

    async def answer(self, kind: type, ok: bool = True, message: str = "") -> Message:
        command = await self.command(kind)
        await self.send(CommandResult(reply_to=command.id, ok=ok, message=message))
        return command

    async def send(self, message: Message) -> None:
        assert self.link is not None
        await self.link.send(message)

    async def upload(self, job_id: str, files: dict[str, bytes], piece_size: int = 7) -> None:
        manifest = tuple(
            FileDigest(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
            for name, data in files.items()
        )
        await self.send(JobStatus(job_id=job_id, state=JobState.UPLOADING, files=manifest))
        for piece in file_pieces(job_id, files, piece_size):
            await self.send(piece)


def file_pieces(job_id: str, files: dict[str, bytes], piece_size: int) -> list[JobPiece]:
    out = []
    for name, data in files.items():
        chunks = [data[i : i + piece_size] for i in range(0, len(data), piece_size)] or [b""]
        out += [
            JobPiece(
                job_id=job_id,
                file=name,
                index=i,
                count=len(chunks),
                data=base64.b64encode(chunk).decode(),
                sha256=hashlib.sha256(chunk).hexdigest(),
            )
            for i, chunk in enumerate(chunks)
        ]
    return out


ADAPTER_FILES = {
    "adapter_model.safetensors": os.urandom(1000),
    "adapter_config.json": b'{"r": 8, "lora_alpha": 16}',
    "adapter.gguf": os.urandom(300),
}


async def state_is(server: Server, job_id: str, state: str) -> dict:
    await wait_for(lambda: server.jobs.get(job_id).state == state, f"job {job_id} {state}")
    return await server.job(job_id)


async def train_to_uploading(agent: FakeAgent, job_id: str) -> None:
    start = await agent.answer(StartJob)
    assert start.spec.job_id == job_id
    await agent.send(JobStatus(job_id=job_id, state=JobState.TRAINING, step=0, total_steps=3, device="cpu"))
    for step in (1, 2, 3):
        await agent.send(
            JobStatus(
                job_id=job_id,
                state=JobState.TRAINING,
                step=step,
                total_steps=3,
                loss=3.0 / step,
                peak_mib=400 + step,
                device="cpu",
            )
        )
    await agent.send(JobStatus(job_id=job_id, state=JobState.CONVERTING, step=3, total_steps=3))


# --- the tests --------------------------------------------------------------------------------


async def test_a_job_is_sent_only_to_a_connected_idle_node_and_succeeds(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    # The node must be known to take a job: it registers once, then its link drops.
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    agent.disconnect()
    await wait_for(lambda: not server.registry.get("n1").connected, "n1 disconnected")

    job = await server.create()
    assert (job["state"], job["gguf"], job["pairs"], job["params"]["rank"]) == (JobState.PENDING, True, 2, 8)
    second = await server.create(adapter="tiny-qa-2")
    await trio.sleep(0.3)  # nothing can happen without a link; this only gives it the chance
    assert server.jobs.get(job["id"]).state == JobState.PENDING

    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    await train_to_uploading(agent, job["id"])
    shown = await state_is(server, job["id"], JobState.CONVERTING)
    assert (shown["step"], shown["total_steps"], shown["loss"], shown["peak_mib"], shown["device"]) == (
        3,
        3,
        1.0,
        403,
        "cpu",
    )
    assert server.jobs.get(second["id"]).state == JobState.PENDING  # one job per node at a time

    await agent.upload(job["id"], ADAPTER_FILES)
    done = await state_is(server, job["id"], JobState.SUCCEEDED)
    assert set(done["timings"]) == {"queue", "train", "convert", "upload", "total"}
    assert all(value is not None for value in done["timings"].values())

    status, listing = await server.api("GET", "/admin/v1/adapters")
    assert status == 200
    [adapter] = listing["adapters"]
    assert (adapter["name"], adapter["model"], adapter["job_id"], adapter["gguf"]) == (
        "tiny-qa",
        "tiny",
        job["id"],
        True,
    )
    for entry in adapter["files"]:
        url = f"{server.admin_url}/admin/v1/adapters/tiny-qa/files/{entry['name']}"
        data, header = await trio.to_thread.run_sync(_download, url)
        assert data == ADAPTER_FILES[entry["name"]]
        assert header == entry["sha256"] == hashlib.sha256(data).hexdigest()
        kept = server.data_dir / "adapters" / "tiny-qa" / entry["name"]
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE((server.data_dir / "adapters" / "tiny-qa").stat().st_mode) == 0o700
    assert list((server.data_dir / "adapters" / ".incoming").iterdir()) == []
    # The bytes are in the store too, under the adapter's name (nothing left staged): what a copy
    # of the store moves and a server with an empty data_dir rebuilds the files from.
    sizes = await server.jobs._store.stored_file_sizes()
    assert {key: size for key, (_, size) in sizes.items()} == {
        ("tiny-qa", name): len(data) for name, data in ADAPTER_FILES.items()
    }

    # The node is free again: the second job goes.
    start = await agent.answer(StartJob)
    assert start.spec.job_id == second["id"]


async def connected_job(server: Server, nursery, **changes) -> tuple[FakeAgent, str]:
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    job = await server.create(**changes)
    return agent, job["id"]


async def test_a_corrupt_piece_fails_the_job_and_keeps_nothing(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await train_to_uploading(agent, job_id)
    manifest = tuple(
        FileDigest(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for name, data in ADAPTER_FILES.items()
    )
    await agent.send(JobStatus(job_id=job_id, state=JobState.UPLOADING, files=manifest))
    pieces = file_pieces(job_id, ADAPTER_FILES, 100)
    await agent.send(pieces[0])
    await agent.send(attrs.evolve(pieces[1], data=base64.b64encode(b"x" * 100).decode()))
    failed = await state_is(server, job_id, JobState.FAILED)
    assert failed["reason"] == (
        "upload failed: piece 1 of adapter_model.safetensors: sha256 of the piece does not match"
    )
    cancel = await agent.command(CancelJob)  # so the agent stops sending pieces nobody keeps
    assert cancel.job_id == job_id
    for piece in pieces[2:]:
        await agent.send(piece)  # still in flight: dropped
    assert (await server.api("GET", "/admin/v1/adapters"))[1] == {"adapters": []}
    assert sorted(p.name for p in (server.data_dir / "adapters").iterdir()) == [".incoming"]
    assert list((server.data_dir / "adapters" / ".incoming").iterdir()) == []


async def test_a_disconnect_mid_upload_fails_the_transfer_and_cleans_up(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await train_to_uploading(agent, job_id)
    manifest = tuple(
        FileDigest(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for name, data in ADAPTER_FILES.items()
    )
    await agent.send(JobStatus(job_id=job_id, state=JobState.UPLOADING, files=manifest))
    for piece in file_pieces(job_id, ADAPTER_FILES, 100)[:3]:
        await agent.send(piece)
    incoming = server.data_dir / "adapters" / ".incoming" / job_id
    await wait_for(lambda: (incoming / "adapter_model.safetensors").exists(), "pieces written")
    progress = (await server.job(job_id))["upload"]
    assert progress["total"] == sum(map(len, ADAPTER_FILES.values()))
    agent.disconnect()
    failed = await state_is(server, job_id, JobState.FAILED)
    assert failed["reason"] == "transfer interrupted: the link broke during the upload"
    assert not incoming.exists()
    assert (await server.api("GET", "/admin/v1/adapters"))[1] == {"adapters": []}


async def test_a_node_that_goes_away_fails_its_job_with_that_reason(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await train_to_uploading(agent, job_id)
    await state_is(server, job_id, JobState.CONVERTING)
    agent.disconnect()
    await wait_for(lambda: not server.registry.get("n1").connected, "n1 disconnected")
    assert server.jobs.get(job_id).state == JobState.CONVERTING  # a disconnect alone is not a loss
    failed = await state_is(server, job_id, JobState.FAILED)
    assert failed["reason"] == "node n1 lost"
    assert failed["log_tail"] == []


async def restart(server: Server, nursery) -> Server:
    server.cancel.cancel()
    with trio.fail_after(20):
        while True:  # the old listener's port is free once its task has ended
            try:
                return await start_server(nursery, server.data_dir, server.link_port)
            except OSError:
                await trio.sleep(0.05)


async def test_a_restarted_server_reattaches_a_job_the_agent_still_runs(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await agent.answer(StartJob)
    await agent.send(JobStatus(job_id=job_id, state=JobState.TRAINING, step=1, total_steps=3))
    await state_is(server, job_id, JobState.TRAINING)
    agent.disconnect()
    server = await restart(server, nursery)
    assert server.jobs.get(job_id).state == JobState.TRAINING  # kept across the restart

    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery, jobs=(RunningJob(job_id=job_id, state=JobState.CONVERTING),))
    await state_is(server, job_id, JobState.CONVERTING)
    await agent.upload(job_id, ADAPTER_FILES)
    await state_is(server, job_id, JobState.SUCCEEDED)


async def test_a_restarted_server_fails_a_job_the_agent_no_longer_runs(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await agent.answer(StartJob)
    await state_is(server, job_id, JobState.SENT)
    agent.disconnect()
    server = await restart(server, nursery)
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery, jobs=(RunningJob(job_id="j-unknown", state=JobState.TRAINING),))
    failed = await state_is(server, job_id, JobState.FAILED)
    assert failed["reason"] == "agent no longer runs it"
    cancel = await agent.command(CancelJob)  # a job it runs that the server never heard of
    assert cancel.job_id == "j-unknown"


async def test_cancel_a_running_job_through_its_agent(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await agent.answer(StartJob)
    await agent.send(JobStatus(job_id=job_id, state=JobState.TRAINING, step=1, total_steps=3))
    await state_is(server, job_id, JobState.TRAINING)
    status, answer = await server.api("POST", f"/admin/v1/jobs/{job_id}/cancel")
    assert (status, answer["state"], answer["cancel_requested"]) == (200, JobState.TRAINING, True)
    cancel = await agent.answer(CancelJob)
    assert cancel.job_id == job_id
    await agent.send(JobStatus(job_id=job_id, state=JobState.CANCELLED, reason="cancelled by the operator"))
    done = await state_is(server, job_id, JobState.CANCELLED)
    assert done["reason"] == "cancelled by the operator"
    status, again = await server.api("POST", f"/admin/v1/jobs/{job_id}/cancel")
    assert (status, again["error"]["message"]) == (409, f"job {job_id} already ended: Cancelled")


async def test_cancel_a_pending_job_at_once(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, first = await connected_job(server, nursery)
    await agent.answer(StartJob)
    second = (await server.create(adapter="other"))["id"]
    status, answer = await server.api("POST", f"/admin/v1/jobs/{second}/cancel")
    assert (status, answer["state"], answer["reason"]) == (
        200,
        JobState.CANCELLED,
        "cancelled before it was sent",
    )
    # Its name is free again.
    assert (await server.create(adapter="other"))["state"] == JobState.PENDING
    status, listing = await server.api("GET", "/admin/v1/jobs")
    assert [j["id"] for j in listing["jobs"]][:2] == [first, second]
    assert "log_tail" not in listing["jobs"][0]


async def test_the_agent_refusing_a_job_fails_it(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent, job_id = await connected_job(server, nursery)
    await agent.answer(StartJob, ok=False, message="no card has 9000 MiB free")
    failed = await state_is(server, job_id, JobState.FAILED)
    assert failed["reason"] == "node n1 refused the job: no card has 9000 MiB free"


async def test_a_bad_request_names_every_field(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    body = {
        "model": "tiny",
        "node": "n1",
        "adapter": "Bad Name",
        "base_dir": "relative/dir",
        "need_mib": -1,
        "params": {"rank": 0, "lr": 1},
        "pairs": '{"question": "q", "answer": "a"}\nnot json\n',
        "extra": 1,
    }
    status, answer = await server.api("POST", "/admin/v1/jobs", body)
    assert status == 400
    assert answer["error"]["problems"] == [
        "extra: unknown field (expected one of: model, node, adapter, base_dir, need_mib, params, gguf, pairs)",
        "adapter: 'Bad Name' must be 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit",
        "base_dir: must be an absolute path on the node, got 'relative/dir'",
        "need_mib: expected a whole number of MiB, 0 or more, got -1",
        "params.lr: unknown (expected one of: rank, alpha, dropout, target_modules, steps, epochs, "
        "learning_rate, batch_size, max_seq_len, seed)",
        "params.rank: must be 1..1024, got 0",
        "pairs: line 2: not JSON (Expecting value)",
    ]
    status, answer = await server.api("POST", "/admin/v1/jobs", {"model": "nope", "node": "n9", **_ok()})
    assert (status, answer["error"]["problems"]) == (
        400,
        ['model: no model "nope" in the catalog', 'node: no node "n9" has registered'],
    )
    await server.create()
    status, answer = await server.api("POST", "/admin/v1/jobs", {"model": "tiny", "node": "n1", **_ok()})
    first = server.jobs.list()[0]
    assert (status, answer["error"]["message"]) == (
        409,
        f'adapter: job {first.id} ({first.state}) is already making "tiny-qa"',
    )
    assert server.jobs.list()[0].spec.gguf is True


async def test_a_gpu_node_needs_a_memory_figure_its_cards_can_hold(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")
    card = Gpu(
        index=0, uuid="GPU-0", name="NVIDIA L40S", gpu_class="l40s-45g",
        memory_total_mib=46068, memory_used_mib=0, compute_capability="8.9",
    )  # fmt: skip
    agent = FakeAgent("g1", server.link_port, attrs.evolve(fake_inventory("g1"), gpus=(card,)))
    await agent.connect(nursery)
    for need, problem in (
        (
            0,
            "need_mib: node g1 has 1 GPU(s); give the MiB of one card the job needs (its largest card has 46,068 MiB)",
        ),
        (50000, "need_mib: 50,000 MiB is more than any card of node g1 has (46,068 MiB)"),
    ):
        status, answer = await server.api(
            "POST", "/admin/v1/jobs", {"model": "tiny", "node": "g1", **_ok(), "need_mib": need}
        )
        assert (status, answer["error"]["problems"]) == (400, [problem])
    status, _ = await server.api(
        "POST", "/admin/v1/jobs", {"model": "tiny", "node": "g1", **_ok(), "need_mib": 20000}
    )
    assert status == 201


def _ok() -> dict:
    return {
        "adapter": "tiny-qa",
        "base_dir": "/w",
        "need_mib": 0,
        "params": {},
        "pairs": [{"question": "q", "answer": "a"}],
    }


async def test_job_and_adapter_endpoints_need_the_admin_token(tmp_path: Path, nursery):
    server = await start_server(nursery, tmp_path / "data")

    def without_token(method: str, path: str) -> int:
        req = urllib.request.Request(server.admin_url + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    for method, path in (
        ("GET", "/admin/v1/jobs"),
        ("POST", "/admin/v1/jobs"),
        ("GET", "/admin/v1/jobs/j-1"),
        ("POST", "/admin/v1/jobs/j-1/cancel"),
        ("GET", "/admin/v1/adapters"),
        ("GET", "/admin/v1/adapters/a/files/adapter_config.json"),
    ):
        assert await trio.to_thread.run_sync(without_token, method, path) == 401, path
    assert await server.api("GET", "/admin/v1/adapters/nope/files/x") == (
        404,
        {
            "error": {
                "message": 'adapter: no adapter "nope"',
                "type": "not_found",
                "problems": ['adapter: no adapter "nope"'],
            }
        },
    )


# --- the injected clock -------------------------------------------------------------------------


@attrs.define
class SilentNode:
    name: str
    inventory: Inventory
    connected: bool = True
    state: NodeState = NodeState.ONLINE


class SilentAgentRegistry:
    """One connected node whose agent never answers a command: only the timeout ends the wait."""

    def __init__(self, node: str) -> None:
        self.node = SilentNode(name=node, inventory=fake_inventory(node))
        self.watchers: list[object] = []
        self.calls: list[Message] = []

    def get(self, name: str) -> SilentNode | None:
        return self.node if name == self.node.name else None

    def list(self) -> list[SilentNode]:
        return [self.node]

    async def call(self, node: str, message: Message) -> Message:
        self.calls.append(message)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


class MemoryStore:
    """The store without its worker threads: the autojump clock would otherwise jump to the next
    deadline while a task waits for a write, and time out what is merely being written."""

    def __init__(self) -> None:
        self.job_rows: list[JobRow] = []

    async def list_jobs(self):
        return []

    async def list_adapters(self):
        return []

    async def delete_unlisted_chunks(self):
        return 0

    async def stored_file_sizes(self):
        return {}

    async def save_jobs(self, rows):
        self.job_rows += rows


class FixedCatalog:
    def models(self) -> dict[str, Model]:
        return {MODEL.name: MODEL}

    def profiles(self) -> dict[str, Profile]:
        return {PROFILE.name: PROFILE}


async def test_an_unanswered_start_fails_the_job_at_the_timeout_with_the_injected_clocks_times(
    tmp_path: Path, autojump_clock
):
    """The manager's clock is the test's: every time the job records is on it, and the command
    timeout passes in virtual time, with no real waiting."""
    t0 = 1_700_000_000.0
    registry, store = SilentAgentRegistry("n1"), MemoryStore()
    clock = lambda: t0 + trio.current_time()  # noqa: E731
    jobs = JobManager(store, registry, FixedCatalog(), tmp_path, clock=clock)  # type: ignore[arg-type]
    await jobs.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(jobs.run)
        begun = trio.current_time()
        body = {"model": "tiny", "node": "n1", "adapter": "tiny-qa", "base_dir": "/w/tiny", "pairs": PAIRS}
        created = await jobs.create(body)
        assert created.created == t0 + begun
        with trio.fail_after(4 * COMMAND_TIMEOUT):
            seen = -1
            while jobs.get(created.id).state != JobState.FAILED:
                seen = await jobs.changes.wait_past(seen)
        nursery.cancel_scope.cancel()
    failed = jobs.get(created.id)
    assert [type(m).__name__ for m in registry.calls] == ["StartJob"]
    assert failed.reason == f"the agent did not answer StartJob within {COMMAND_TIMEOUT:g} s"
    assert failed.sent == t0 + begun
    assert failed.finished - failed.sent == pytest.approx(COMMAND_TIMEOUT)
    # The rows keep the states' plain strings, each written as the job moved.
    assert [(row.state, type(row.state)) for row in store.job_rows] == [
        ("Pending", str),
        ("Sent", str),
        ("Failed", str),
    ]
