"""The shard supervisor with real processes.

The engine is tests/fake_engine.py, started through the real command builders: as llama-server,
as `vllm serve` and as `ray start`, each through a small wrapper script that sets its behaviour
knobs (the supervisor gives engines a minimal environment, so knobs cannot come from the test's).
Everything lives in a 0755 directory under /tmp so that an unprivileged engine user can run it.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.agent import processes, shard_state
from llmgw.agent.processes import ProcessRecord, members, process_table, read_cmdline, read_stat
from llmgw.agent.shard_state import ShardRecord
from llmgw.agent.supervisor import Supervisor
from llmgw.core.engines import EngineBinaries
from llmgw.core.engines.load_metrics import busy_requests
from llmgw.core.shard import GpuRef, ShardSpec
from llmgw.http_probe import http_get
from llmgw.wire.messages import Compute, GpuUse, ShardState, ShardStatus
from tests.agent.test_discovery import FakeNvml
from tests.conftest import group_exists
from tests.helpers import DEADLINE, TESTS, wait_for
from tests.procs import kill_recorded_shards

pytestmark = pytest.mark.slow

# The engine user cannot run the virtualenv's interpreter (it lives under /root); the fake
# engine needs only the standard library.
ENGINE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
FAKE_ENGINE = TESTS / "fake_engine.py"

KEY = "engine-key-0123456789"
HEALTH_INTERVAL = 0.1
MIB = 2**20

STARTING, LOADING, READY = ShardState.STARTING, ShardState.LOADING, ShardState.READY
DRAINING, STOPPED, FAILED = ShardState.DRAINING, ShardState.STOPPED, ShardState.FAILED


# --- the lab: wrappers, specs, and a supervisor that can be "restarted" -----------------------


@attrs.define
class Lab:
    root: Path

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    def shard_dir(self, shard_id: str) -> Path:
        return self.work_dir / "shards" / shard_id

    def state(self, shard_id: str) -> ShardRecord:
        return shard_state.read(self.shard_dir(shard_id))

    def wrapper(self, name: str, knobs: dict[str, str]) -> str:
        path = self.root / name
        exports = [f"export {key}={shlex.quote(value)}" for key, value in knobs.items()]
        path.write_text(
            "\n".join(
                ["#!/bin/sh", *exports, f'exec {ENGINE_PYTHON} {self.root / "fake_engine.py"} "$@"', ""]
            )
        )
        path.chmod(0o755)
        return str(path)

    def binaries(self, ray: dict[str, str] | None = None, **engine: str) -> EngineBinaries:
        """Wrappers for every engine binary; keyword arguments are the engine's knobs."""
        return EngineBinaries(
            llama_server=self.wrapper("llama-server", engine),
            vllm=self.wrapper("vllm", engine),
            ray=self.wrapper("ray", ray or {}),
        )

    def kill_leftovers(self) -> None:
        kill_recorded_shards(self.work_dir)


@pytest.fixture
def lab() -> Iterator[Lab]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-test-"))
    root.chmod(0o755)
    shutil.copyfile(FAKE_ENGINE, root / "fake_engine.py")
    (root / "fake_engine.py").chmod(0o644)
    lab = Lab(root)
    try:
        yield lab
    finally:
        lab.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)


def no_nvml() -> FakeNvml:
    # Never the real NVML: on a GPU machine the foreign-process sweep would kill its processes.
    return FakeNvml({"init_error": "LibraryNotFound"})


@attrs.define
class Agent:
    supervisor: Supervisor
    statuses: list[ShardStatus]
    scope: trio.CancelScope
    exited: trio.Event

    def of(self, shard_id: str) -> list[ShardStatus]:
        return [s for s in self.statuses if s.shard_id == shard_id]

    def states(self, shard_id: str) -> list[str]:
        """The shard's states in order, a repeat (a compute-only status) counted once."""
        states: list[str] = []
        for status in self.of(shard_id):
            if not states or states[-1] != status.state:
                states.append(status.state)
        return states

    async def wait_state(self, shard_id: str, state: str, deadline: float = DEADLINE) -> ShardStatus:
        def reached() -> bool:
            return any(s.state == state for s in self.of(shard_id))

        try:
            await wait_for(reached, f"shard {shard_id} to be {state}", deadline)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; statuses: {self.of(shard_id)}") from None
        return next(s for s in self.of(shard_id) if s.state == state)

    async def wait_compute(self, shard_id: str) -> Compute:
        await wait_for(lambda: any(s.compute is not None for s in self.of(shard_id)), "compute to be known")
        compute = next(s.compute for s in self.of(shard_id) if s.compute is not None)
        assert compute is not None
        return compute

    async def cut(self) -> None:
        """What an agent restart does to the supervisor: run() is cancelled."""
        self.scope.cancel()
        await self.exited.wait()


async def start_agent(nursery: trio.Nursery, lab: Lab, **options: object) -> Agent:
    statuses: list[ShardStatus] = []
    settings = {
        "run_as": None,
        "nvml": no_nvml(),
        "health_interval": HEALTH_INTERVAL,
        "leader_wait": 10.0,
        **options,
    }
    if "binaries" not in settings:
        settings["binaries"] = lab.binaries()
    supervisor = Supervisor(lab.work_dir, on_status=statuses.append, **settings)
    scope = trio.CancelScope()
    exited = trio.Event()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await supervisor.run(task_status=task_status)
        finally:
            exited.set()

    await nursery.start(run)
    return Agent(supervisor=supervisor, statuses=statuses, scope=scope, exited=exited)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_spec(shard_id: str = "shard-1", **changes: object) -> ShardSpec:
    fields = {
        "shard_id": shard_id,
        "replica_id": "replica-1",
        "model": "tiny",
        "model_path": "/models/tiny.gguf",
        "engine": "llamacpp",
        "port": free_port(),
        **changes,
    }
    return ShardSpec(**fields)


def ray_spec(shard_id: str, *, rendezvous_port: int, rank: int = 0, nodes: int = 1) -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id,
        replica_id="replica-ray",
        model="big",
        model_path="/models/big",
        engine="vllm",
        launcher="ray",
        gpus=(GpuRef(index=0, uuid="GPU-0", gpu_class="h100-80g", compute_capability="9.0"),),
        tensor_parallel=nodes,
        nodes=nodes,
        rank=rank,
        leader_address="127.0.0.1",
        node_address="127.0.0.1",
        mgmt_interface="lo",
        port=free_port(),
        rendezvous_port=rendezvous_port,
    )


def is_alive(pid: int) -> bool:
    """Exists and is not a zombie (which kill(pid, 0) would call alive)."""
    stat = read_stat(pid)
    return stat is not None and stat.alive


def group_of(record: ProcessRecord) -> set[int]:
    return members([record.pgid], process_table())


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


# --- starting, readiness, stopping ---------------------------------------------------------------


async def test_a_shard_goes_starting_loading_ready_and_a_repeated_start_changes_nothing(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_LOAD_DELAY="1.5"))
    spec = llama_spec()
    assert await agent.supervisor.start(spec, KEY) == (True, "starting")
    await agent.wait_state(spec.shard_id, READY)
    assert agent.states(spec.shard_id) == [STARTING, LOADING, READY]

    [running] = agent.supervisor.running()
    assert (running.spec, running.state, running.adopted) == (spec, READY, False)
    assert running.pid == lab.state(spec.shard_id).processes[-1].pid
    assert await agent.supervisor.start(spec, KEY) == (True, "already running")
    assert [r.pid for r in agent.supervisor.running()] == [running.pid]

    # No GPUs to be found: the shard computes on the CPU, and the state file says so.
    assert await agent.wait_compute(spec.shard_id) == Compute()
    assert lab.state(spec.shard_id).compute == Compute()

    assert await agent.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")
    assert agent.states(spec.shard_id)[-1] == STOPPED
    assert not is_alive(running.pid)
    assert not lab.shard_dir(spec.shard_id).exists()
    assert agent.supervisor.running() == []
    assert await agent.supervisor.stop(spec.shard_id) == (True, "not running")


async def test_stop_leaves_nothing_of_the_group_alive(nursery: trio.Nursery, lab: Lab) -> None:
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_FORK_WORKER="1"))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes
    assert engine.pgid == engine.pid  # a session, and so a group, of its own
    await wait_for(lambda: len(group_of(engine)) == 2, "the engine's forked worker")
    group = group_of(engine)

    assert await agent.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")
    assert [pid for pid in group if is_alive(pid)] == []
    assert group_of(engine) == set()


async def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace(
    nursery: trio.Nursery, lab: Lab
) -> None:
    knobs = {"FAKE_ENGINE_FORK_WORKER": "1", "FAKE_ENGINE_IGNORE_SIGTERM": "1"}
    agent = await start_agent(nursery, lab, binaries=lab.binaries(**knobs))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes
    await wait_for(lambda: len(group_of(engine)) == 2, "the engine's forked worker")
    group = group_of(engine)

    began = trio.current_time()
    assert await agent.supervisor.stop(spec.shard_id, grace=0.5) == (True, "stopped")
    assert trio.current_time() - began >= 0.5
    assert [pid for pid in group if is_alive(pid)] == []


async def test_a_stop_that_names_no_grace_takes_the_agents_stop_grace(
    nursery: trio.Nursery, lab: Lab
) -> None:
    """What the server sends: the agent's engines.stop_grace decides, not a grace of the wire's."""
    agent = await start_agent(
        nursery, lab, binaries=lab.binaries(FAKE_ENGINE_IGNORE_SIGTERM="1"), stop_grace=0.5
    )
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    began = trio.current_time()
    # Far below the 30 s a grace of the wire's own would take to run out.
    with trio.fail_after(20):
        assert await agent.supervisor.stop(spec.shard_id) == (True, "stopped")
    assert trio.current_time() - began >= 0.5


async def test_an_engine_that_exits_fails_the_shard_with_its_code_and_output(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_EXIT_AFTER="1"))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    failed = await agent.wait_state(spec.shard_id, FAILED)
    assert failed.reason == "the engine exited with code 3"
    assert any(line.startswith("fake engine pid") for line in failed.log_tail)
    assert "exiting with code 3 as told (FAKE_ENGINE_EXIT_AFTER)" in failed.log_tail
    assert not lab.shard_dir(spec.shard_id).exists()
    assert agent.supervisor.running() == []


async def test_an_invalid_shard_fails_with_its_reasons_and_starts_nothing(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab)
    ok, message = await agent.supervisor.start(llama_spec(model_path="/models/tiny.bin"), KEY)
    assert not ok and "is not one" in message and ".gguf" in message
    [failed] = agent.of("shard-1")
    assert failed.state == FAILED and failed.reason == message
    ok, message = await agent.supervisor.start(llama_spec(shard_id="../escape"), KEY)
    assert not ok and "shard id" in message
    assert agent.supervisor.running() == []
    assert not (lab.work_dir / "shards").exists() or list((lab.work_dir / "shards").iterdir()) == []


# --- sidecars and the leader -----------------------------------------------------------------------


async def test_the_ray_head_runs_first_and_vllm_waits_for_it(nursery: trio.Nursery, lab: Lab) -> None:
    # The head listens only after a second: vLLM must not have started before that.
    binaries = lab.binaries(ray={"FAKE_ENGINE_LOAD_DELAY": "1"})
    agent = await start_agent(nursery, lab, binaries=binaries)
    spec = ray_spec("ray-leader", rendezvous_port=free_port())
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)

    head, engine = lab.state(spec.shard_id).processes
    assert (head.name, engine.name) == ("ray-head", "engine")
    assert head.argv[:3] == (binaries.ray, "start", "--head")
    waited = (engine.start_time - head.start_time) / os.sysconf("SC_CLK_TCK")
    assert waited >= 0.9, f"vLLM started {waited:.2f}s after the head, before it listened"
    assert proc_environ(engine.pid)["RAY_ADDRESS"] == f"127.0.0.1:{spec.rendezvous_port}"
    # One tail, each line telling whose it is.
    for line, whose in (
        (f"[ray-head] ray head listening on {spec.rendezvous_port}", "the head's"),
        (f"listening on 127.0.0.1:{spec.port}, model big, key set", "vLLM's"),  # its node's address
    ):
        await wait_for(
            lambda line=line: line in agent.supervisor.log_tail(spec.shard_id), f"{whose} output in the tail"
        )

    assert await agent.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")
    assert not is_alive(head.pid) and not is_alive(engine.pid)


async def test_a_sidecar_that_exits_fails_the_shard_and_stops_the_engine(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab)
    spec = ray_spec("ray-leader", rendezvous_port=free_port())
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    head, engine = lab.state(spec.shard_id).processes

    os.kill(head.pid, signal.SIGKILL)
    failed = await agent.wait_state(spec.shard_id, FAILED)
    assert failed.reason == "sidecar ray-head was killed by SIGKILL"
    assert not is_alive(engine.pid)
    assert not lab.shard_dir(spec.shard_id).exists()


async def test_a_worker_waits_for_the_leader_and_fails_when_it_never_listens(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab, leader_wait=0.5)
    port = free_port()  # nothing listens here
    lonely = ray_spec("ray-worker-1", rendezvous_port=port, rank=1, nodes=2)
    await agent.supervisor.start(lonely, KEY)
    failed = await agent.wait_state(lonely.shard_id, FAILED)
    assert failed.reason == (
        f"ray-worker waits for the leader's rendezvous point 127.0.0.1:{port}, "
        "which did not accept connections within 0.5s"
    )
    assert agent.states(lonely.shard_id) == [STARTING, FAILED]

    # With a leader listening, the worker starts; serving no HTTP, it is Ready by staying up.
    leader = socket.create_server(("127.0.0.1", 0))
    try:
        joined = ray_spec("ray-worker-2", rendezvous_port=leader.getsockname()[1], rank=1, nodes=2)
        await agent.supervisor.start(joined, KEY)
        await agent.wait_state(joined.shard_id, READY)
        assert agent.states(joined.shard_id) == [STARTING, READY]
        [worker] = lab.state(joined.shard_id).processes
        assert worker.name == "ray-worker" and is_alive(worker.pid)
        assert await agent.supervisor.stop(joined.shard_id, grace=5) == (True, "stopped")
    finally:
        leader.close()


# --- who engines run as, and what they are given ---------------------------------------------------


async def test_engines_run_as_the_unprivileged_user(
    nursery: trio.Nursery, lab: Lab, engine_user: str
) -> None:
    agent = await start_agent(nursery, lab, run_as=engine_user)
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes
    entry = pwd.getpwnam(engine_user)

    status = proc_status(engine.pid)
    assert status["Uid"].split() == [str(entry.pw_uid)] * 4
    assert status["Gid"].split() == [str(entry.pw_gid)] * 4
    expected_groups = set(os.getgrouplist(engine_user, entry.pw_gid)) - {entry.pw_gid}
    assert {int(g) for g in status["Groups"].split()} == expected_groups
    if group_exists("video") and entry.pw_gid != _gid("video"):
        assert _gid("video") in expected_groups

    home = lab.work_dir / "home" / engine_user
    assert os.readlink(f"/proc/{engine.pid}/cwd") == str(home)
    environ = proc_environ(engine.pid)
    assert (environ["HOME"], environ["XDG_CACHE_HOME"]) == (str(home), str(home / ".cache"))
    assert (environ["USER"], environ["LOGNAME"]) == (engine_user, engine_user)
    info = home.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (entry.pw_uid, 0o700)

    # Its output file is root's and private; the engine writes to it through the descriptor.
    output = lab.shard_dir(spec.shard_id) / "engine.out"
    info = output.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
    await wait_for(
        lambda: any(
            f"uid {entry.pw_uid} cwd {home}" in line for line in agent.supervisor.log_tail(spec.shard_id)
        ),
        "the engine's own account of who it is",
    )
    assert await agent.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")


def _gid(name: str) -> int:
    import grp

    return grp.getgrnam(name).gr_gid


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule for an agent running as root")
async def test_a_missing_engine_user_fails_the_shard_and_root_is_said_at_every_start(
    nursery: trio.Nursery, lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    """No silent fall back to root: a run_as the node lacks fails the shard, naming the fix; root
    runs only where asked for (run_as null or root), with a warning at every start."""
    caplog.set_level(logging.WARNING, logger="llmgw.agent.supervisor")
    missing = await start_agent(nursery, lab, run_as="llmgw-no-such-user")
    await missing.supervisor.start(llama_spec("shard-0"), KEY)
    failed = await missing.wait_state("shard-0", FAILED)
    assert "no user 'llmgw-no-such-user' on this node" in failed.reason and "useradd" in failed.reason
    await missing.cut()

    agent = await start_agent(nursery, lab, run_as=None)
    first, second = llama_spec("shard-1"), llama_spec("shard-2")
    for spec in (first, second):
        await agent.supervisor.start(spec, KEY)
        await agent.wait_state(spec.shard_id, READY)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engines run as root")]
    assert len(notes) == 2, notes
    engine = lab.state("shard-1").processes[-1]
    assert proc_status(engine.pid)["Uid"].split()[0] == "0"
    await agent.supervisor.stop_all(grace=5)
    assert agent.supervisor.running() == []
    assert [agent.states(s)[-1] for s in ("shard-1", "shard-2")] == [STOPPED, STOPPED]


async def test_stop_all_after_run_has_ended_stops_every_engine(nursery: trio.Nursery, lab: Lab) -> None:
    """The agent's own shutdown with stop_shards_on_exit: run() is cancelled first, so no shard
    task is left, and stop_all must still leave nothing behind."""
    agent = await start_agent(nursery, lab)
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    engine = lab.state(spec.shard_id).processes[-1]
    await agent.cut()
    assert read_stat(engine.pid).alive  # cancelling run() alone leaves engines running
    with trio.fail_after(DEADLINE):
        await agent.supervisor.stop_all(grace=5)
    stat = read_stat(engine.pid)
    assert stat is None or not stat.alive
    assert agent.supervisor.running() == []
    assert agent.states(spec.shard_id)[-1] == STOPPED


async def test_engines_get_a_minimal_environment_and_the_key_only_there(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", "join-secret-4242")
    monkeypatch.setenv("SOMETHING_OF_THE_AGENTS", "1")
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_LOAD_DELAY="0"))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes

    environ = proc_environ(engine.pid)
    assert "join-secret-4242" not in "".join(environ.values())
    assert environ["LLAMA_API_KEY"] == KEY
    base = {"PATH", "LANG", "HOME", "XDG_CACHE_HOME", "USER", "LOGNAME"}
    plan = {"CUDA_VISIBLE_DEVICES", "LLAMA_API_KEY"}
    # What the wrapper (sh: PWD) and the fake's Python add on their way.
    on_the_way = {"FAKE_ENGINE_LOAD_DELAY", "PWD", "LC_CTYPE"}
    assert set(environ) <= base | plan | on_the_way, set(environ) - base - plan - on_the_way
    assert KEY not in " ".join(read_cmdline(engine.pid) or ())
    assert KEY not in " ".join(engine.argv)
    await agent.supervisor.stop(spec.shard_id, grace=5)


# --- output files ----------------------------------------------------------------------------------


async def test_output_is_followed_and_its_file_emptied_past_the_limit(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "MAX_OUTPUT_BYTES", 4096)
    agent = await start_agent(nursery, lab)
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    output = lab.shard_dir(spec.shard_id) / "engine.out"
    assert stat.S_IMODE(output.stat().st_mode) == 0o600

    # The fake logs every request: about 60 bytes each, three times the limit in all.
    for n in range(200):
        await http_get("127.0.0.1", spec.port, f"/health?n={n}", timeout=5)
    await wait_for(
        lambda: any("/health?n=199 " in line for line in agent.supervisor.log_tail(spec.shard_id)),
        "the last request's line in the tail",
    )
    await wait_for(lambda: b"/health?n=0 " not in output.read_bytes(), "the file to be emptied")
    # The engine carries on at the file's new end (O_APPEND), not at its old offset.
    await http_get("127.0.0.1", spec.port, "/health?n=after", timeout=5)
    await wait_for(lambda: b"/health?n=after " in output.read_bytes(), "a line after the truncation")
    assert output.stat().st_size < 4096 + 1024
    await wait_for(
        lambda: any("/health?n=after " in line for line in agent.supervisor.log_tail(spec.shard_id)),
        "the line after the truncation in the tail",
    )
    await agent.supervisor.stop(spec.shard_id, grace=5)
    assert not output.exists()


# --- adoption ------------------------------------------------------------------------------------


async def test_a_restarted_agent_adopts_the_running_engine(nursery: trio.Nursery, lab: Lab) -> None:
    binaries = lab.binaries(FAKE_ENGINE_FORK_WORKER="1")
    first = await start_agent(nursery, lab, binaries=binaries)
    spec = llama_spec()
    await first.supervisor.start(spec, KEY)
    await first.wait_state(spec.shard_id, READY)
    await first.wait_compute(spec.shard_id)
    [engine] = lab.state(spec.shard_id).processes
    await wait_for(lambda: len(group_of(engine)) == 2, "the engine's forked worker")
    group = group_of(engine)

    await first.cut()
    assert all(is_alive(pid) for pid in group), "an agent restart must not stop engines"

    second = await start_agent(nursery, lab, binaries=binaries)
    # Adopted before run() reported started: the agent's first Register lists it.
    [running] = second.supervisor.running()
    assert (running.pid, running.adopted, running.compute) == (engine.pid, True, Compute())
    adopted = second.of(spec.shard_id)[0]
    assert (adopted.state, adopted.compute, adopted.pid) == (STARTING, Compute(), engine.pid)
    await second.wait_state(spec.shard_id, READY)
    assert second.states(spec.shard_id) == [STARTING, READY]
    await wait_for(
        lambda: (
            f"forked worker pid {(group - {engine.pid}).pop()}" in second.supervisor.log_tail(spec.shard_id)
        ),
        "output from before the restart in the tail",
    )

    assert await second.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")
    assert [pid for pid in group if is_alive(pid)] == []
    assert not lab.shard_dir(spec.shard_id).exists()


async def test_an_adopted_engine_that_exits_fails_the_shard(nursery: trio.Nursery, lab: Lab) -> None:
    first = await start_agent(nursery, lab)
    spec = llama_spec()
    await first.supervisor.start(spec, KEY)
    await first.wait_state(spec.shard_id, READY)
    await first.cut()
    [engine] = lab.state(spec.shard_id).processes

    second = await start_agent(nursery, lab)
    await second.wait_state(spec.shard_id, READY)
    os.kill(engine.pid, signal.SIGKILL)
    failed = await second.wait_state(spec.shard_id, FAILED)
    assert failed.reason == f"the engine (pid {engine.pid}) exited"
    assert any(line.startswith("fake engine pid") for line in failed.log_tail)
    assert not lab.shard_dir(spec.shard_id).exists()


def _write_state(lab: Lab, spec: ShardSpec, process: ProcessRecord) -> Path:
    """What an earlier agent would have left: the shard's state file, next to any output."""
    directory = lab.shard_dir(spec.shard_id)
    if not directory.exists():
        shard_state.make_dirs(lab.work_dir / "shards", spec.shard_id)
    record = ShardRecord(
        spec=spec, engine_key=KEY, commands=("engine",), health_port=spec.port, processes=(process,)
    )
    shard_state.write(directory, record)
    return directory


async def test_a_zombie_counts_as_dead(nursery: trio.Nursery, lab: Lab) -> None:
    spec = llama_spec("zombie")
    directory = shard_state.make_dirs(lab.work_dir / "shards", spec.shard_id)
    argv = ["sh", "-c", "echo said before the restart"]
    output = processes.open_output(directory / "engine.out")
    try:
        # Never waited for until the end: it stays a zombie, which kill(pid, 0) calls alive.
        zombie = await trio.lowlevel.open_process(argv, stdout=output, start_new_session=True)
    finally:
        os.close(output)
    try:
        await wait_for(lambda: read_stat(zombie.pid).state == "Z", "the child to become a zombie")
        process = ProcessRecord(
            name="engine",
            pid=zombie.pid,
            pgid=zombie.pid,
            argv=tuple(argv),
            cmdline=tuple(argv),
            start_time=read_stat(zombie.pid).start_time,
        )
        _write_state(lab, spec, process)

        agent = await start_agent(nursery, lab)
        failed = await agent.wait_state(spec.shard_id, FAILED)
        assert failed.reason == "exited while the agent was down"
        assert "said before the restart" in failed.log_tail
        assert agent.supervisor.running() == []
        assert not directory.exists()
    finally:
        await zombie.wait()


async def test_a_reused_pid_is_not_adopted_and_not_touched(nursery: trio.Nursery, lab: Lab) -> None:
    spec = llama_spec("reused")
    stranger = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        # The record says an engine ran under this pid; what runs there now is someone else's.
        engine_argv = (str(lab.root / "llama-server"), "-m", spec.model_path, "--port", str(spec.port))
        process = ProcessRecord(
            name="engine",
            pid=stranger.pid,
            pgid=stranger.pid,
            argv=engine_argv,
            cmdline=(ENGINE_PYTHON, str(lab.root / "fake_engine.py"), *engine_argv[1:]),
            start_time=read_stat(stranger.pid).start_time,
        )
        directory = _write_state(lab, spec, process)

        agent = await start_agent(nursery, lab)
        failed = await agent.wait_state(spec.shard_id, FAILED)
        assert failed.reason == "exited while the agent was down"
        assert not directory.exists()
        assert is_alive(stranger.pid), "a process that only reused the pid was signalled"
    finally:
        stranger.kill()
        await stranger.wait()


@pytest.mark.skipif(not processes.in_initial_pid_namespace(), reason="NVML's pids are the host's")
async def test_a_gpu_process_no_shard_describes_is_killed(nursery: trio.Nursery, lab: Lab) -> None:
    first = await start_agent(nursery, lab)
    spec = llama_spec()
    await first.supervisor.start(spec, KEY)
    await first.wait_state(spec.shard_id, READY)
    await first.wait_compute(spec.shard_id)
    await first.cut()
    [engine] = lab.state(spec.shard_id).processes

    foreign = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        held = [{"pid": pid, "used_gpu_memory": 512 * MIB} for pid in (foreign.pid, os.getpid(), engine.pid)]
        nvml = FakeNvml({"gpus": [{"uuid": "GPU-0", "compute_processes": held}]})
        second = await start_agent(nursery, lab, nvml=nvml)
        with trio.fail_after(DEADLINE):
            assert await foreign.wait() == -signal.SIGKILL
        assert is_alive(engine.pid), "the adopted engine holds its GPU memory rightfully"
        [running] = second.supervisor.running()
        assert running.adopted and running.pid == engine.pid
        await second.supervisor.stop(spec.shard_id, grace=5)
    finally:
        if foreign.returncode is None:
            foreign.kill()
            await foreign.wait()


# --- compute -------------------------------------------------------------------------------------


async def test_compute_is_the_gpu_memory_of_every_process_of_the_shard(
    nursery: trio.Nursery, lab: Lab
) -> None:
    machine: dict = {
        "gpus": [{"uuid": "GPU-a", "compute_processes": []}, {"uuid": "GPU-b", "compute_processes": []}]
    }
    agent = await start_agent(
        nursery, lab, nvml=FakeNvml(machine), binaries=lab.binaries(FAKE_ENGINE_FORK_WORKER="1")
    )
    gpu = GpuRef(index=0, uuid="GPU-a", gpu_class="l40s-45g", compute_capability="8.9")
    spec = llama_spec(gpus=(gpu,))
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes
    await wait_for(lambda: len(group_of(engine)) == 2, "the engine's forked worker")
    [worker] = group_of(engine) - {engine.pid}

    # Memory shows up a moment after Ready, as an engine's KV cache does; one assignment, so a
    # reading taken meanwhile sees all of it or none.
    machine["gpus"] = [
        {
            "uuid": "GPU-a",
            "compute_processes": [
                {"pid": engine.pid, "used_gpu_memory": 1000 * MIB},
                {"pid": 999_999_999, "used_gpu_memory": 7 * MIB},  # not the shard's
            ],
        },
        {
            "uuid": "GPU-b",
            "compute_processes": [
                {"pid": worker, "used_gpu_memory": 300 * MIB},
                {"pid": engine.pid, "used_gpu_memory": 20 * MIB},
            ],
        },
    ]
    expected = Compute(
        gpus=(GpuUse(index=0, uuid="GPU-a", used_mib=1000), GpuUse(index=1, uuid="GPU-b", used_mib=320))
    )
    assert await agent.wait_compute(spec.shard_id) == expected
    assert lab.state(spec.shard_id).compute == expected
    assert agent.supervisor.running()[0].compute == expected
    await agent.supervisor.stop(spec.shard_id, grace=5)


# --- draining ------------------------------------------------------------------------------------


def _complete(port: int) -> int | str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            response.read()
            return response.status
    except (urllib.error.URLError, ConnectionError) as exc:
        return str(exc)


async def _busy(port: int) -> int | None:
    status, body = await http_get(
        "127.0.0.1", port, "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5
    )
    assert status == 200
    return busy_requests(body.decode())


async def _until_busy(port: int) -> None:
    with trio.fail_after(DEADLINE):
        busy = await _busy(port)
        while not busy:
            await trio.sleep(0.05)
            busy = await _busy(port)


async def test_drain_waits_for_the_request_in_flight(nursery: trio.Nursery, lab: Lab) -> None:
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_RESPONSE_DELAY="1.5"))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    answers: list[int | str] = []

    async def ask() -> None:
        answers.append(await trio.to_thread.run_sync(_complete, spec.port))

    nursery.start_soon(ask)
    await _until_busy(spec.port)
    assert await agent.supervisor.drain(spec.shard_id, timeout=DEADLINE) == (True, "stopped")
    assert answers == [200], "the engine was stopped under a request"
    assert agent.states(spec.shard_id)[-3:] == [READY, DRAINING, STOPPED]


async def test_drain_stops_after_its_timeout_anyway(nursery: trio.Nursery, lab: Lab) -> None:
    agent = await start_agent(nursery, lab, binaries=lab.binaries(FAKE_ENGINE_RESPONSE_DELAY="60"))
    spec = llama_spec()
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    answers: list[int | str] = []

    async def ask() -> None:
        answers.append(await trio.to_thread.run_sync(_complete, spec.port))

    nursery.start_soon(ask)
    await _until_busy(spec.port)
    began = trio.current_time()
    assert await agent.supervisor.drain(spec.shard_id, timeout=0.5, grace=5) == (True, "stopped")
    assert 0.5 <= trio.current_time() - began < DEADLINE
    assert agent.states(spec.shard_id)[-2:] == [DRAINING, STOPPED]
    await wait_for(lambda: bool(answers), "the cut-off request to end")
    assert answers != [200]


async def test_a_vllm_engine_traces_to_the_agents_collector_when_the_agent_traces(
    nursery: trio.Nursery, lab: Lab
) -> None:
    """The real process's command line names the collector; its headers are in the environment
    only."""
    from llmgw.core.engines.tracing import EngineTracing

    tracing = EngineTracing("http://127.0.0.1:4318", headers={"x-api-key": "collector-s3cret"})
    agent = await start_agent(nursery, lab, engine_tracing=tracing)
    spec = attrs.evolve(ray_spec("vllm-traced", rendezvous_port=free_port()), launcher="mp")
    await agent.supervisor.start(spec, KEY)
    await agent.wait_state(spec.shard_id, READY)
    [engine] = lab.state(spec.shard_id).processes
    cmdline = read_cmdline(engine.pid) or ()
    assert cmdline[cmdline.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4318/v1/traces"
    assert "collector-s3cret" not in " ".join(cmdline)
    environ = proc_environ(engine.pid)
    assert environ["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "x-api-key=collector-s3cret"
    assert environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert await agent.supervisor.stop(spec.shard_id, grace=5) == (True, "stopped")


async def test_adoption_is_a_span_failed_with_the_reason_when_the_engine_is_gone(
    nursery: trio.Nursery, lab: Lab
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from llmgw import tracing

    exporter = InMemorySpanExporter()
    tracing.install(exporter, "llmgw-agent-test", batch=False)
    try:
        first = await start_agent(nursery, lab)
        alive_spec, gone_spec = llama_spec("kept"), llama_spec("gone")
        for spec in (alive_spec, gone_spec):
            await first.supervisor.start(spec, KEY)
            await first.wait_state(spec.shard_id, READY)
        await first.cut()
        [gone] = lab.state(gone_spec.shard_id).processes
        os.killpg(gone.pgid, signal.SIGKILL)
        await wait_for(lambda: not is_alive(gone.pid), "the engine to be gone")
        second = await start_agent(nursery, lab)
        await second.wait_state(gone_spec.shard_id, FAILED)
        spans = {
            s.attributes["llmgw.shard"]: s
            for s in exporter.get_finished_spans()
            if s.name == "agent.adopt_shard"
        }
        assert set(spans) == {"kept", "gone"}
        assert spans["kept"].status.status_code is StatusCode.UNSET
        assert spans["gone"].status.status_code is StatusCode.ERROR
        assert spans["kept"].attributes["llmgw.replica"] == alive_spec.replica_id
        assert await second.supervisor.stop(alive_spec.shard_id, grace=5) == (True, "stopped")
    finally:
        tracing.shutdown()
