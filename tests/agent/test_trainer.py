"""The agent's trainer with real processes: tests/fake_train_child.py speaks the child's protocol.

Its behaviour comes from knobs.json in the job's base directory. Everything lives in a 0755
directory under /tmp so that an unprivileged engine user can run it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.agent.processes import members, process_table, read_stat
from llmgw.agent.trainer import (
    PROGRESS_INTERVAL,
    Progress,
    Trainer,
    apply_event,
    child_script,
    progress_due,
    read_record,
)
from llmgw.core.training import JobState, QaPair, TrainParams, TrainSpec
from llmgw.wire.messages import Gpu, JobPiece, JobStatus
from llmgw.wire.pieces import UploadInterrupted
from tests.helpers import DEADLINE, PROJECT_ROOT, TESTS, wait_for

pytestmark = pytest.mark.slow

# The engine user cannot run the virtualenv's interpreter (it lives under /root); the fake child
# needs only the standard library.
CHILD_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
FAKE_CHILD = TESTS / "fake_train_child.py"
PAIRS = tuple(QaPair(question=f"q{i}?", answer=f"a{i}.") for i in range(8))
FILES = ("adapter_config.json", "adapter_model.safetensors")


# --- pure parts ------------------------------------------------------------------------------------


def test_events_fold_into_progress() -> None:
    progress = Progress()
    for line in [
        '{"event": "start", "total_steps": 5, "device": "cpu", "examples": 3}',
        "some library printed this",
        '{"event": "step", "step": 1, "total_steps": 5, "loss": 1.5, "peak_mib": 300}',
        "[1, 2]",
        '{"event": "step", "step": 2, "total_steps": 5, "loss": 1.25, "peak_mib": 290}',
    ]:
        progress = apply_event(progress, line)
    assert progress == Progress(total_steps=5, step=2, loss=1.25, peak_mib=300)
    done = apply_event(progress, '{"event": "done", "peak_mib": 310, "files": ["a", 3, "b"]}')
    assert (done.done, done.files, done.peak_mib) == (True, ("a", "b"), 310)
    failed = apply_event(progress, '{"event": "error", "message": "CUDA out of\\nmemory"}')
    assert failed.error == "CUDA out of memory" and not failed.done


def test_progress_is_due_at_most_every_interval() -> None:
    assert progress_due(None, 5.0)
    assert not progress_due(5.0, 5.0 + PROGRESS_INTERVAL / 2)
    assert progress_due(5.0, 5.0 + PROGRESS_INTERVAL)


def test_the_child_script_sits_beside_the_trainer() -> None:
    assert child_script() == PROJECT_ROOT / "llmgw" / "agent" / "train_child.py"


def test_the_agent_imports_no_torch() -> None:
    code = (
        "import sys, llmgw.agent.run, llmgw.agent.trainer, llmgw.agent.link, llmgw.cli\n"
        "heavy = {'torch', 'peft', 'transformers', 'accelerate'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PROJECT_ROOT, timeout=60)


# --- the lab -----------------------------------------------------------------------------------------


@attrs.define
class Lab:
    root: Path

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def base(self) -> Path:
        return self.root / "base"

    def job_dir(self, job_id: str) -> Path:
        return self.work_dir / "jobs" / job_id

    def knobs(self, **knobs: object) -> None:
        (self.base / "knobs.json").write_text(json.dumps(knobs))
        (self.base / "knobs.json").chmod(0o644)

    def release(self) -> None:
        (self.base / "release").touch()

    def spec(self, job_id: str = "job-1", **changes: object) -> TrainSpec:
        fields: dict[str, object] = {
            "job_id": job_id,
            "model": "tiny",
            "adapter": "tiny-qa",
            "base_dir": str(self.base),
            "params": TrainParams(steps=5, seed=3),
            "pairs": PAIRS,
            **changes,
        }
        return TrainSpec(**fields)

    def child_pid(self, job_id: str = "job-1") -> int:
        record = read_record(self.job_dir(job_id))
        assert record.child is not None
        return record.child.pid


@pytest.fixture
def lab() -> Iterator[Lab]:
    root = Path(tempfile.mkdtemp(prefix="llmgw-train-"))
    root.chmod(0o755)
    (root / "base").mkdir(mode=0o755)
    shutil.copyfile(FAKE_CHILD, root / "fake_train_child.py")
    (root / "fake_train_child.py").chmod(0o644)
    lab = Lab(root)
    lab.knobs()
    try:
        yield lab
    finally:
        kill_recorded_children(lab.work_dir)
        shutil.rmtree(root, ignore_errors=True)


def kill_recorded_children(work_dir: Path) -> None:
    jobs = work_dir / "jobs"
    if not jobs.is_dir():
        return
    for directory in jobs.iterdir():
        try:
            record = read_record(directory)
        except ValueError:
            continue
        for process in (record.child, record.converter):
            if process is None:
                continue
            stat_ = read_stat(process.pid)
            if stat_ is not None and stat_.start_time == process.start_time:
                try:
                    os.killpg(process.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@attrs.define
class Uploads:
    """The link's end of an upload, in memory: the Uploading status and the pieces, in order."""

    statuses: list[JobStatus] = attrs.field(factory=list)
    pieces: list[JobPiece] = attrs.field(factory=list)
    interrupt: bool = False

    async def __call__(self, status: JobStatus, pieces: AsyncIterator[JobPiece]) -> None:
        self.statuses.append(status)
        async for piece in pieces:
            if self.interrupt:
                raise UploadInterrupted("the peer closed the connection")
            self.pieces.append(piece)

    def files(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for piece in self.pieces:
            out[piece.file] = out.get(piece.file, b"") + base64.b64decode(piece.data)
        return out


@attrs.define
class Agent:
    trainer: Trainer
    statuses: list[JobStatus]
    uploads: Uploads
    scope: trio.CancelScope
    exited: trio.Event

    def states(self, job_id: str = "job-1") -> list[str]:
        states: list[str] = []
        for status in self.statuses:
            if status.job_id == job_id and (not states or states[-1] != status.state):
                states.append(status.state)
        return states

    def last(self, job_id: str = "job-1") -> JobStatus:
        return [s for s in self.statuses if s.job_id == job_id][-1]

    async def wait_state(self, state: str, job_id: str = "job-1") -> JobStatus:
        try:
            await wait_for(lambda: state in self.states(job_id), f"job {job_id} to be {state}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; statuses: {self.statuses}") from None
        return next(s for s in self.statuses if s.job_id == job_id and s.state == state)

    async def wait_gone(self, job_id: str = "job-1") -> None:
        await wait_for(lambda: not self.trainer.running() and not self.trainer._jobs, f"job {job_id} to end")

    async def cut(self) -> None:
        """What an agent restart does to the trainer: run() is cancelled."""
        self.scope.cancel()
        await self.exited.wait()


async def start_agent(
    nursery: trio.Nursery, lab: Lab, *, gpus: tuple[Gpu, ...] = (), **options: object
) -> Agent:
    statuses: list[JobStatus] = []
    uploads = Uploads()
    settings: dict[str, object] = {
        "train_python": CHILD_PYTHON,
        "run_as": None,
        "threads": 1,
        "check_overlay": False,
        "script": lab.root / "fake_train_child.py",
        **options,
    }
    trainer = Trainer(lab.work_dir, gpus=lambda: gpus, on_status=statuses.append, upload=uploads, **settings)
    scope = trio.CancelScope()
    exited = trio.Event()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await trainer.run(task_status=task_status)
        finally:
            exited.set()

    await nursery.start(run)
    return Agent(trainer=trainer, statuses=statuses, uploads=uploads, scope=scope, exited=exited)


def is_alive(pid: int) -> bool:
    stat_ = read_stat(pid)
    return stat_ is not None and stat_.alive


def proc_text(pid: int, name: str) -> str:
    return (Path("/proc") / str(pid) / name).read_bytes().decode()


def expected_file(name: str, seed: int = 3) -> bytes:
    size = {"adapter_model.safetensors": 1300000, "adapter_config.json": 300}[name]
    pattern = bytes((seed + i) % 251 for i in range(251))
    return (pattern * (size // 251 + 1))[:size]


# --- a job's life -------------------------------------------------------------------------------------


async def test_a_job_trains_then_sends_its_files_in_pieces_with_their_digests(
    nursery: trio.Nursery, lab: Lab
) -> None:
    agent = await start_agent(nursery, lab)
    spec = lab.spec()
    ok, message = await agent.trainer.start(spec)
    assert ok and message == "starting on cpu"
    assert await agent.trainer.start(spec) == (True, "already running")
    await wait_for(lambda: agent.uploads.statuses, "the upload", DEADLINE)
    await agent.wait_gone()

    [uploading] = agent.uploads.statuses
    assert uploading.state == JobState.UPLOADING
    assert (uploading.step, uploading.total_steps, uploading.device) == (5, 5, "cpu")
    assert uploading.loss == pytest.approx(0.4) and uploading.peak_mib == 105
    assert [f.name for f in uploading.files] == list(FILES)
    received = agent.uploads.files()
    for digest in uploading.files:
        data = received[digest.name]
        assert data == expected_file(digest.name)
        assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    counts = {p.file: p.count for p in agent.uploads.pieces}
    assert counts == {"adapter_config.json": 1, "adapter_model.safetensors": 3}
    assert [p.index for p in agent.uploads.pieces if p.file == "adapter_model.safetensors"] == [0, 1, 2]

    assert agent.states() == [JobState.TRAINING]  # Uploading went with the pieces, through the link
    assert agent.trainer.running() == []
    assert not lab.job_dir("job-1").exists()


async def test_the_job_directory_is_private_and_the_child_gets_a_minimal_environment(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", "join-secret-4242")
    lab.knobs(hold_at=2)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in agent.trainer.log_tail("job-1")), "the hold")
    job_dir = lab.job_dir("job-1")
    modes = {
        path.relative_to(job_dir).as_posix(): stat.S_IMODE(path.stat().st_mode)
        for path in [job_dir, *job_dir.rglob("*")]
    }
    assert modes == {
        ".": 0o711,
        "state.json": 0o600,
        "child.out": 0o600,
        "child.err": 0o600,
        "run": 0o700,
        "run/out": 0o700,
        "run/train_child.py": 0o600,
        "run/child.json": 0o600,
        "run/pairs.jsonl": 0o600,
    }
    child = json.loads((job_dir / "run/child.json").read_text())
    assert child == {
        "base_dir": str(lab.base),
        "pairs_path": str(job_dir / "run/pairs.jsonl"),
        "output_dir": str(job_dir / "run/out"),
        "device": "cpu",
        "params": {
            "rank": 8,
            "alpha": 16,
            "dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"],
            "steps": 5,
            "epochs": 3,
            "learning_rate": 2e-4,
            "batch_size": 4,
            "max_seq_len": 512,
            "seed": 3,
        },
    }
    environ = proc_text(lab.child_pid(), "environ")
    assert "join-secret-4242" not in environ
    variables = dict(item.split("=", 1) for item in environ.split("\0") if "=" in item)
    assert variables["OMP_NUM_THREADS"] == "1" and variables["CUDA_VISIBLE_DEVICES"] == ""
    assert "LLMGW_JOIN_TOKEN" not in variables
    lab.release()
    await agent.wait_gone()


async def test_progress_is_rate_limited_and_ends_on_the_last_step(nursery: trio.Nursery, lab: Lab) -> None:
    agent = await start_agent(nursery, lab)
    started = trio.current_time()
    await agent.trainer.start(lab.spec(params=TrainParams(steps=400)))
    await agent.wait_gone()
    elapsed = trio.current_time() - started
    training = [s for s in agent.statuses if s.state == JobState.TRAINING]
    # One when the child starts, one for the last step, and at most one per interval between.
    assert len(training) <= elapsed / PROGRESS_INTERVAL + 3, (len(training), elapsed)
    assert len(training) < 100
    assert (training[-1].step, training[-1].total_steps) == (400, 400)
    steps = [s.step for s in training]
    assert steps == sorted(steps)


async def test_a_failing_child_fails_the_job_with_its_reason_and_log_tail(
    nursery: trio.Nursery, lab: Lab
) -> None:
    lab.knobs(fail_at=3)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec())
    failed = await agent.wait_state(JobState.FAILED)
    assert failed.reason == "training failed: fake failure at step 3"
    assert "RuntimeError: fake failure" in failed.log_tail
    assert failed.step == 2
    await agent.wait_gone()
    assert not lab.job_dir("job-1").exists() and agent.uploads.statuses == []


async def test_a_child_that_exits_without_a_word_fails_with_its_exit_code(
    nursery: trio.Nursery, lab: Lab
) -> None:
    lab.knobs(crash_at=2)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec())
    failed = await agent.wait_state(JobState.FAILED)
    assert failed.reason == "the training child exited with code 3"
    assert any("fake child: uid" in line for line in failed.log_tail)


async def test_an_interrupted_upload_fails_the_job(nursery: trio.Nursery, lab: Lab) -> None:
    agent = await start_agent(nursery, lab)
    agent.uploads.interrupt = True
    await agent.trainer.start(lab.spec())
    failed = await agent.wait_state(JobState.FAILED)
    assert failed.reason == "the upload was interrupted: the peer closed the connection"
    await agent.wait_gone()
    assert not lab.job_dir("job-1").exists()


async def test_cancel_stops_the_whole_group_even_a_child_ignoring_sigterm(
    nursery: trio.Nursery, lab: Lab
) -> None:
    lab.knobs(hold_at=2, fork_helper=True, ignore_sigterm=True)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in agent.trainer.log_tail("job-1")), "the hold")
    record = read_record(lab.job_dir("job-1")).child
    assert record is not None
    group = members([record.pgid], process_table())
    assert len(group) == 2 and record.pid in group  # the child and its helper

    with trio.fail_after(DEADLINE):
        assert await agent.trainer.cancel("job-1", grace=0.5) == (True, "cancelled")
    assert not any(is_alive(pid) for pid in group)
    assert agent.last().state == JobState.CANCELLED and agent.last().log_tail == ()
    assert not lab.job_dir("job-1").exists()
    assert agent.trainer.running() == []
    assert await agent.trainer.cancel("job-1", grace=0.5) == (False, "not running")


async def test_one_job_at_a_time(nursery: trio.Nursery, lab: Lab) -> None:
    lab.knobs(hold_at=2)
    agent = await start_agent(nursery, lab)
    assert (await agent.trainer.start(lab.spec()))[0]
    ok, message = await agent.trainer.start(lab.spec("job-2"))
    assert not ok and message == "job job-1 is running on this node, and a node trains one job at a time"
    assert [j.job_id for j in agent.trainer.running()] == ["job-1"]
    lab.release()
    await agent.wait_gone()


async def test_invalid_jobs_and_no_card_with_enough_memory_are_refused(
    nursery: trio.Nursery, lab: Lab
) -> None:
    card = Gpu(
        index=0,
        uuid="GPU-0",
        name="L4",
        gpu_class="l4-23g",
        memory_total_mib=23000,
        memory_used_mib=20000,
        compute_capability="8.9",
    )
    agent = await start_agent(nursery, lab, gpus=(card,))
    ok, message = await agent.trainer.start(lab.spec(need_mib=8000))
    assert not ok and message == "no healthy card has 8000 MiB free: GPU 0 3000 MiB free"
    assert agent.last().state == JobState.FAILED and agent.last().reason == message

    ok, message = await agent.trainer.start(lab.spec("../up", params=TrainParams(rank=0)))
    assert not ok and message.startswith("invalid job: job id '../up' must be")
    assert "rank: must be 1..1024, got 0" in message
    assert agent.trainer.running() == [] and not (lab.work_dir / "jobs").exists()


async def test_the_child_runs_as_the_engines_user(nursery: trio.Nursery, lab: Lab, engine_user: str) -> None:
    lab.knobs(hold_at=2)
    agent = await start_agent(nursery, lab, run_as=engine_user)
    await agent.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in agent.trainer.log_tail("job-1")), "the hold")
    entry = pwd.getpwnam(engine_user)
    status = proc_text(lab.child_pid(), "status")
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids == [str(entry.pw_uid)] * 4
    job_dir = lab.job_dir("job-1")
    owners = {p.relative_to(job_dir).as_posix(): p.stat().st_uid for p in [job_dir, *job_dir.rglob("*")]}
    user_owned = {"run", "run/out", "run/train_child.py", "run/child.json", "run/pairs.jsonl"}
    assert {name for name, uid in owners.items() if uid == entry.pw_uid} == user_owned
    assert {name for name, uid in owners.items() if uid == 0} == set(owners) - user_owned
    lab.release()
    await agent.wait_gone()
    assert {f.name for f in agent.uploads.statuses[0].files} == set(FILES)


def test_an_output_file_is_read_only_if_it_is_a_regular_file_of_the_engines_user(tmp_path: Path) -> None:
    from llmgw.agent import runas
    from llmgw.agent.trainer import _open_output

    user, _ = runas.resolve(None, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
    with _open_output(out, "adapter_config.json", user) as file:
        assert file.read() == b"{}"
    secret = tmp_path / "root-only"
    secret.write_text("secret")
    (out / "adapter_model.safetensors").symlink_to(secret)
    with pytest.raises(OSError):  # ELOOP: a link is never followed
        _open_output(out, "adapter_model.safetensors", user)
    other = attrs.evolve(user, uid=user.uid + 4242)
    with pytest.raises(ValueError, match="not a regular file of the engines' user"):
        _open_output(out, "adapter_config.json", other)
    with pytest.raises(ValueError, match="not a bare file name"):
        _open_output(out, "../root-only", user)
    (tmp_path / "elsewhere").mkdir()
    shutil.rmtree(out)
    out.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):  # nor is a linked output directory
        _open_output(out, "adapter_config.json", user)


# --- GGUF conversion -------------------------------------------------------------------------------------


def fake_lora_convert(monkeypatch: pytest.MonkeyPatch, lab: Lab, exit_code: int = 0) -> Path:
    """A stand-in for llmgw.agent.lora_convert and a converter script that writes adapter.gguf."""
    script = lab.root / "convert_lora_to_gguf.py"
    script.write_text(
        "import sys\n"
        "args = sys.argv[1:]\n"
        "print('converting', args, flush=True)\n"
        f"if {exit_code}: print('ValueError: bad vocab', flush=True); sys.exit({exit_code})\n"
        "open(args[args.index('--outfile') + 1], 'wb').write(b'GGUF' + b'0' * 100)\n"
    )
    script.chmod(0o644)
    module = types.ModuleType("llmgw.agent.lora_convert")
    module.find_converter = lambda configured: Path(configured) if configured else None
    module.convert_argv = lambda python, script, adapter_dir, base_dir, outfile: [
        python,
        str(script),
        "--base",
        str(base_dir),
        "--outfile",
        str(outfile),
        str(adapter_dir),
    ]
    module.converter_env = lambda script: {"PYTHONPATH": str(Path(script).parent / "gguf-py")}
    monkeypatch.setitem(sys.modules, "llmgw.agent.lora_convert", module)
    import llmgw.agent

    monkeypatch.setattr(llmgw.agent, "lora_convert", module, raising=False)
    return script


async def test_a_gguf_job_is_converted_with_base_and_sends_three_files(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = fake_lora_convert(monkeypatch, lab)
    agent = await start_agent(nursery, lab, lora_converter=script)
    await agent.trainer.start(lab.spec(gguf=True))
    await agent.wait_gone()
    assert agent.states() == [JobState.TRAINING, JobState.CONVERTING]
    [uploading] = agent.uploads.statuses
    assert [f.name for f in uploading.files] == [*FILES, "adapter.gguf"]
    assert agent.uploads.files()["adapter.gguf"] == b"GGUF" + b"0" * 100


async def test_a_failed_conversion_fails_with_its_output(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = fake_lora_convert(monkeypatch, lab, exit_code=2)
    agent = await start_agent(nursery, lab, lora_converter=script)
    await agent.trainer.start(lab.spec(gguf=True))
    failed = await agent.wait_state(JobState.FAILED)
    assert failed.reason == "the GGUF conversion exited with code 2"
    assert "[convert] ValueError: bad vocab" in failed.log_tail
    assert any("--base" in line and str(lab.base) in line for line in failed.log_tail)


async def test_a_gguf_job_without_a_converter_fails_saying_what_to_set(
    nursery: trio.Nursery, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_lora_convert(monkeypatch, lab)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec(gguf=True))
    failed = await agent.wait_state(JobState.FAILED)
    assert "engines.lora_converter" in failed.reason and "convert_lora_to_gguf.py" in failed.reason


# --- an agent restart ---------------------------------------------------------------------------------------


async def test_a_restarted_agent_adopts_the_running_child(nursery: trio.Nursery, lab: Lab) -> None:
    lab.knobs(hold_at=3)
    first = await start_agent(nursery, lab)
    await first.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in first.trainer.log_tail("job-1")), "the hold")
    pid = lab.child_pid()
    await first.cut()
    assert is_alive(pid)  # an agent restart leaves the child training

    second = await start_agent(nursery, lab)
    assert [(j.job_id, j.state) for j in second.trainer.running()] == [("job-1", JobState.TRAINING)]
    assert second.statuses[0].step == 2  # what the events file said so far
    lab.release()
    await second.wait_gone()
    [uploading] = second.uploads.statuses
    assert uploading.step == 5 and {f.name for f in uploading.files} == set(FILES)
    assert second.uploads.files()["adapter_model.safetensors"] == expected_file("adapter_model.safetensors")


async def test_a_child_that_finished_while_no_agent_ran_is_uploaded(nursery: trio.Nursery, lab: Lab) -> None:
    lab.knobs(hold_at=3)
    first = await start_agent(nursery, lab)
    await first.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in first.trainer.log_tail("job-1")), "the hold")
    pid = lab.child_pid()
    await first.cut()
    lab.release()
    await wait_for(lambda: not is_alive(pid), "the child to finish alone")

    second = await start_agent(nursery, lab)
    await second.wait_gone()
    [uploading] = second.uploads.statuses
    assert uploading.step == 5 and {f.name for f in uploading.files} == set(FILES)


async def test_a_child_that_failed_while_no_agent_ran_fails_the_job(nursery: trio.Nursery, lab: Lab) -> None:
    lab.knobs(hold_at=3, crash_at=3)
    first = await start_agent(nursery, lab)
    await first.trainer.start(lab.spec())
    await wait_for(lambda: any("holding" in line for line in first.trainer.log_tail("job-1")), "the hold")
    pid = lab.child_pid()
    await first.cut()
    lab.release()
    await wait_for(lambda: not is_alive(pid), "the child to exit alone")

    second = await start_agent(nursery, lab)
    failed = await second.wait_state(JobState.FAILED)
    assert failed.reason == "the training child exited while the agent was down, without reporting done"
    await second.wait_gone()
    assert second.trainer.running() == [] and not lab.job_dir("job-1").exists()
