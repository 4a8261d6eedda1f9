"""The supervisor's building blocks on their own: /proc reading, output files, state files, the
HTTP probe, GPU memory by process, the engine user."""

from __future__ import annotations

import collections
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.agent import processes, runas, shard_state
from llmgw.agent.discovery.nvml import gpu_memory_by_pid
from llmgw.agent.processes import OutputFollower, ProcessRecord, ProcStat
from llmgw.agent.shard_state import ShardRecord
from llmgw.core.engines.load_metrics import busy_requests
from llmgw.core.shard import GpuRef, ShardSpec
from llmgw.http_probe import ProbeFailed, http_get
from llmgw.wire.messages import Compute, GpuUse
from tests.agent.test_discovery import FakeNvml
from tests.helpers import wait_for

# --- /proc ---------------------------------------------------------------------------------------


def test_stat_parses_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    fields = ["S", "1", "4242", "4242", "0", "-1", "4194560"] + ["0"] * 12 + ["987654"] + ["0"] * 10
    (tmp_path / "4242" / "stat").write_text(f"4242 (my (odd) name) {' '.join(fields)}\n")
    assert processes.read_stat(4242, tmp_path) == ProcStat(state="S", ppid=1, pgrp=4242, start_time=987654)
    assert processes.read_stat(4243, tmp_path) is None


def test_stat_of_a_real_process_matches_what_python_knows() -> None:
    own = processes.read_stat(os.getpid())
    assert own is not None and own.alive
    assert (own.ppid, own.pgrp) == (os.getppid(), os.getpgrp())


def _stat(state: str, ppid: int, pgrp: int) -> ProcStat:
    return ProcStat(state=state, ppid=ppid, pgrp=pgrp, start_time=0)


def test_members_are_the_groups_living_processes_and_their_descendants() -> None:
    table = {
        1: _stat("S", 0, 1),
        10: _stat("S", 1, 10),  # the engine, leader of group 10
        11: _stat("S", 10, 10),  # a forked worker
        12: _stat("S", 10, 12),  # a helper in a session of its own
        13: _stat("R", 12, 12),  # the helper's child
        14: _stat("S", 1, 10),  # a worker orphaned to pid 1, still in the group
        15: _stat("Z", 10, 10),  # a zombie: gone
        20: _stat("S", 1, 20),  # someone else
        21: _stat("S", 20, 20),
    }
    assert processes.members([10], table) == {10, 11, 12, 13, 14}
    assert processes.members([], table) == set()
    assert processes.members([20], table) == {20, 21}


def test_a_zombie_is_dead_and_a_reused_pid_is_not_the_same_process(monkeypatch: pytest.MonkeyPatch) -> None:
    zombie = subprocess.Popen(["true"])
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        # Not reaped: the child stays a zombie, which kill(pid, 0) would call alive.
        os.kill(zombie.pid, 0)
        trio.run(wait_for, lambda: processes.read_stat(zombie.pid).state == "Z", "the child to be a zombie")
        assert not processes.read_stat(zombie.pid).alive

        # Popen returns once the exec began; /proc may show the new command line a moment later.
        trio.run(wait_for, lambda: processes.read_cmdline(sleeper.pid) == ("sleep", "60"), "sleep to run")
        sleeper_stat = processes.read_stat(sleeper.pid)
        own = ProcessRecord(
            name="engine",
            pid=sleeper.pid,
            pgid=sleeper.pid,
            argv=("/usr/bin/sleep", "60"),
            cmdline=("elsewhere",),
            start_time=sleeper_stat.start_time,
        )
        # argv ends the command line (sleep was found on PATH as "sleep").
        assert processes.is_same_process(own)
        assert processes.group_is_ours(own)
        assert processes.is_same_process(attrs.evolve(own, argv=("x",), cmdline=("sleep", "60")))
        later = attrs.evolve(own, start_time=sleeper_stat.start_time + 1)
        assert not processes.is_same_process(later)
        other = attrs.evolve(own, argv=("llama-server", "-m", "x.gguf"))
        assert not processes.is_same_process(other)
        # Its pid is some other process now: its group is that process's, not ours to signal.
        assert not processes.group_is_ours(other)
        assert not processes.group_is_ours(later)
        processes.signal_group(other, signal.SIGKILL)
        assert processes.read_stat(sleeper.pid).alive
        # A leader killed a moment ago shows an empty command line while it exits (before it is
        # a zombie): with its start time it is still ours, and so is its group.
        monkeypatch.setattr(processes, "read_cmdline", lambda pid: ())
        assert processes.group_is_ours(other) and not processes.group_is_ours(later)
    finally:
        zombie.wait()
        sleeper.kill()
        sleeper.wait()


def test_describe_exit_names_signals() -> None:
    assert processes.describe_exit(3) == "exited with code 3"
    assert processes.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def test_base_environment_is_not_the_agents(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", "join-secret")
    user, _ = runas.resolve(None, tmp_path)
    env = processes.base_environment(user)
    assert set(env) == {"PATH", "LANG", "HOME", "XDG_CACHE_HOME", "USER", "LOGNAME"}
    assert env["HOME"] == str(tmp_path / "home" / user.name)
    assert env["XDG_CACHE_HOME"] == str(tmp_path / "home" / user.name / ".cache")


# --- output files ----------------------------------------------------------------------------------


def test_follower_keeps_whole_lines_and_shows_what_a_terminal_would(tmp_path: Path) -> None:
    path = tmp_path / "engine.out"
    tail: collections.deque[str] = collections.deque(maxlen=3)
    follower = OutputFollower(path, tail, prefix="[x] ")
    follower.read_available()  # no file yet: nothing, no error
    fd = processes.open_output(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.write(fd, b"one\r\ntwo\nloading 10%\rloading 100%\nhalf")
        follower.read_available()
        assert list(tail) == ["[x] one", "[x] two", "[x] loading 100%"]
        os.write(fd, b" a line\n")
        follower.read_available()
        assert tail[-1] == "[x] half a line"
        os.write(fd, b"no newline at the end")
        follower.read_available(final=True)
        assert tail[-1] == "[x] no newline at the end"
    finally:
        os.close(fd)


def test_follower_empties_a_file_past_the_limit_and_the_writer_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "MAX_OUTPUT_BYTES", 1000)
    path = tmp_path / "engine.out"
    tail: collections.deque[str] = collections.deque(maxlen=5)
    follower = OutputFollower(path, tail)
    fd = processes.open_output(path)
    try:
        for i in range(101):  # 1010 bytes: past the limit
            os.write(fd, f"line {i:04}\n".encode())
        follower.read_available()
        assert tail[-1] == "line 0100"
        assert path.stat().st_size == 0
        # O_APPEND: the writer's next line lands at the new end, not at its old offset.
        os.write(fd, b"after\n")
        assert path.read_bytes() == b"after\n"
        follower.read_available()
        assert tail[-1] == "after"
    finally:
        os.close(fd)


def test_follower_skips_ahead_in_a_long_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "CATCH_UP_BYTES", 100)
    path = tmp_path / "engine.out"
    path.write_bytes(b"".join(f"old line {i:04}\n".encode() for i in range(1000)))
    tail: collections.deque[str] = collections.deque(maxlen=50)
    OutputFollower(path, tail).read_available()
    assert tail[-1] == "old line 0999"
    assert all(line.startswith("old line 09") for line in tail)  # whole lines only


# --- state files -----------------------------------------------------------------------------------


def _record(**changes: object) -> ShardRecord:
    spec = ShardSpec(
        shard_id="shard-1",
        replica_id="replica-1",
        model="tiny",
        model_path="/models/tiny.gguf",
        engine="llamacpp",
        port=8001,
        gpus=(GpuRef(index=0, uuid="GPU-0", gpu_class="l40s-45g", compute_capability="8.9"),),
    )
    fields = {
        "spec": spec,
        "engine_key": "engine-key",
        "commands": ("engine",),
        "health_port": 8001,
        "processes": (
            ProcessRecord(
                name="engine", pid=123, pgid=123, argv=("llama-server", "-m"), cmdline=("x",), start_time=9
            ),
        ),
        "compute": Compute(gpus=(GpuUse(index=0, uuid="GPU-0", used_mib=1024),)),
        **changes,
    }
    return ShardRecord(**fields)


def test_state_file_round_trips_and_is_private(tmp_path: Path) -> None:
    directory = shard_state.make_dirs(tmp_path / "shards", "shard-1")
    record = _record()
    shard_state.write(directory, record)
    assert stat.S_IMODE(os.stat(directory / "state.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "shards").st_mode) == 0o700
    assert shard_state.read(directory) == record
    assert "engine-key" not in repr(record)
    assert not (directory / "state.json.tmp").exists()
    [(found_dir, found)] = shard_state.read_all(tmp_path / "shards")
    assert (found_dir, found) == (directory, record)


def test_unreadable_state_files_are_reported_not_raised(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    (shards / "empty").mkdir(parents=True)
    (shards / "old").mkdir()
    (shards / "old" / "state.json").write_text('{"version": 0}')
    (shards / "junk").mkdir()
    (shards / "junk" / "state.json").write_text('{"version": 1, "spec": 3}')
    found = dict(shard_state.read_all(shards))
    assert all(isinstance(problem, ValueError) for problem in found.values())
    assert "not a version 1 state file" in str(found[shards / "old"])
    assert shard_state.read_all(tmp_path / "nowhere") == []


def test_shard_ids_that_could_leave_the_directory_are_refused() -> None:
    assert shard_state.id_problem("replica-7.shard-0") == ""
    for bad in ("", ".", "..", "../x", "a/b", "-rf", "x" * 129, "a\0b"):
        assert shard_state.id_problem(bad), bad


# --- the probe -------------------------------------------------------------------------------------


async def _serve_once(response: bytes, task_status=trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    stream = await listeners[0].accept()
    async with stream:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(4096)
        assert request.startswith(b"GET /metrics HTTP/1.1\r\n")
        assert b"authorization: Bearer k" in request.lower().replace(b"bearer", b"Bearer")
        await stream.send_all(response)
    await listeners[0].aclose()


async def test_http_get_returns_status_and_body(nursery: trio.Nursery) -> None:
    body = b"vllm:num_requests_running 2.0\n"
    response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    port = await nursery.start(_serve_once, response)
    status, got = await http_get(
        "127.0.0.1", port, "/metrics", headers={"Authorization": "Bearer k"}, timeout=5
    )
    assert (status, got) == (200, body)


async def test_http_get_without_an_answer_raises_probe_failed(nursery: trio.Nursery) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ProbeFailed):
            await http_get("127.0.0.1", port, "/health", timeout=5)
    port = await nursery.start(_serve_once, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
    with pytest.raises(ProbeFailed, match="closed the connection|peer closed"):
        await http_get("127.0.0.1", port, "/metrics", headers={"Authorization": "Bearer k"}, timeout=5)


def test_busy_requests_adds_running_and_queued_of_any_engine() -> None:
    vllm = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    assert busy_requests(vllm) == 3
    assert busy_requests("llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n") == 0
    assert busy_requests('sglang:num_running_reqs{name="a b}"} 4 1700000000\n') == 4
    assert busy_requests("process_cpu_seconds_total 12\n") is None


# --- GPU memory by process -------------------------------------------------------------------------


def test_gpu_memory_by_pid_lists_each_process_per_card() -> None:
    mib = 2**20
    nvml = FakeNvml(
        {
            "gpus": [
                {"uuid": "GPU-a", "compute_processes": [{"pid": 10, "used_gpu_memory": 1000 * mib}]},
                {
                    "uuid": "GPU-b",
                    "compute_processes": [
                        {"pid": 10, "used_gpu_memory": 200 * mib},
                        {"pid": 11, "used_gpu_memory": None},
                    ],
                },
            ]
        }
    )
    assert gpu_memory_by_pid(nvml) == {
        10: (GpuUse(index=0, uuid="GPU-a", used_mib=1000), GpuUse(index=1, uuid="GPU-b", used_mib=200)),
        11: (GpuUse(index=1, uuid="GPU-b", used_mib=0),),
    }
    assert nvml.shutdowns == 1
    assert gpu_memory_by_pid(FakeNvml({"init_error": "LibraryNotFound"})) == {}


# --- the engine user -------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule for an agent running as root")
def test_as_root_a_missing_user_starts_nothing_and_root_is_only_what_was_asked_for(tmp_path: Path) -> None:
    with pytest.raises(runas.NoEngineUser, match="no user 'llmgw-no-such-user' on this node"):
        runas.resolve("llmgw-no-such-user", tmp_path)
    for asked in (None, "root"):
        user, note = runas.resolve(asked, tmp_path)
        assert (user.uid, user.switch) == (0, False) and note.startswith("engines run as root")


@pytest.mark.skipif(os.geteuid() == 0, reason="the rule for an agent that is not root")
def test_not_root_engines_run_as_the_agents_own_user_with_a_reason(tmp_path: Path) -> None:
    user, note = runas.resolve("llmgw-no-such-user", tmp_path)
    assert not user.switch and user.credentials() == {} and user.uid == os.geteuid()
    assert "llmgw-no-such-user" in note
    user, note = runas.resolve(None, tmp_path)
    assert (user.switch, note) == (False, "")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_an_existing_user_gets_its_groups_and_a_private_home(tmp_path: Path) -> None:
    import pwd

    entry = pwd.getpwnam("nobody")
    user, note = runas.resolve("nobody", tmp_path)
    assert note == "" and user.switch
    assert user.credentials() == {
        "user": entry.pw_uid,
        "group": entry.pw_gid,
        "extra_groups": list(user.groups),
    }
    runas.prepare_home(user)
    info = os.stat(user.home)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (entry.pw_uid, 0o700)
    assert stat.S_IMODE(os.stat(user.home.parent).st_mode) == 0o711


async def test_spawned_process_gets_its_own_session(tmp_path: Path) -> None:
    user, _ = runas.resolve(None, tmp_path)
    runas.prepare_home(user)
    process = await processes.spawn(
        [sys.executable, "-c", "import os; print(os.getsid(0), os.getcwd())"],
        env=processes.base_environment(user),
        user=user,
        output=tmp_path / "out",
    )
    assert await process.wait() == 0
    sid, cwd = (tmp_path / "out").read_text().split()
    assert int(sid) == process.pid
    assert cwd == str(user.home)
