"""The agent's trainer: runs one training job at a time in a child process, and sends back what it made.

A job is one task of the trainer's nursery, and goes: prepare its directory → (first job only)
make sure the child's Python has the pinned peft/accelerate → start the child → follow its events
until it exits → convert the adapter to GGUF when asked → announce the files (JobStatus
Uploading) and send them in pieces. The server decides Succeeded once it has verified them.
A failure anywhere ends the job Failed with one line saying why and the child's last lines; a
cancel stops the child's whole process group. Either way the job's directory goes.

torch and friends are the child's alone (llmgw/agent/train_child.py, a standalone script the agent
copies next to the job): the agent must start on a node that has none of them.

Layout of a job (:class:`llmgw.core.train_run.JobLayout` names each path; the engines' user must
not be able to rewrite what root acts on, so the files that name processes to signal, and the
ones root reads, are root's):

    <work_dir>/jobs/<job_id>/           root, 0711
        state.json                      root, 0600: the spec and the processes (for adoption)
        child.out, child.err            root, 0600: the child's stdout (events) and stderr
        convert.out                     root, 0600: the converter's output
        run/                            the engines' user, 0700: the child's own directory
            train_child.py, child.json, pairs.jsonl   (0600)
            out/                        adapter_model.safetensors, adapter_config.json, adapter.gguf

Cancelling ``run()`` — the agent stopping or restarting — leaves a training child running; the
next agent adopts it from state.json and follows its events file again. A child that ended while
no agent ran is judged by its events: finished ("done") goes on to conversion and upload, else
Failed. A conversion or upload cut short by the restart is done again.

What to start, what the child's events and end mean, and when to report are decided in
:mod:`llmgw.core.train_run`; this module does the processes, files and messages.

Traced (when tracing is on): a job's run is ``train.run``, a child of the StartJob command's span
(so of the server's trace of the job), from its start to its teardown (failed with the reason),
with a span per step: ``train.prepare``, ``train.train`` (the child, with its steps, loss and
peak memory as attributes), ``train.convert``, ``train.upload``. An adopted job's run is a trace
of its own.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import tracing
from llmgw.agent import runas, state_file
from llmgw.agent.processes import (
    KILL_WAIT,
    ProcessRecord,
    base_environment,
    describe_exit,
    group_is_ours,
    kill_groups,
    members,
    open_output,
    open_pidfd,
    process_table,
    read_cmdline,
    read_stat,
    signal_group,
    stop_groups,
    wait_for_exit,
)
from llmgw.agent.train_overlay import Overlay, OverlayFailed
from llmgw.core.train_device import Choice, child_threads, choose_device
from llmgw.core.train_run import (
    CHILD_SCRIPT,
    JobLayout,
    Progress,
    adoption_problem,
    apply_event,
    child_argv,
    child_config,
    child_environment,
    progress_due,
    training_failure,
    upload_time_limit,
)
from llmgw.core.train_run import PROGRESS_INTERVAL as PROGRESS_INTERVAL  # the tests read it here
from llmgw.core.training import GGUF_FILE, JOB_LIFECYCLE, JobState, TrainSpec, dump_pairs
from llmgw.wire.messages import Gpu, JobPiece, JobStatus, RunningJob
from llmgw.wire.pieces import UploadInterrupted, fileobj_digest, iter_pieces

log = logging.getLogger(__name__)

STATE_VERSION = 1

# How often the child's events and output files are read.
FOLLOW_INTERVAL = 0.1
# Lines of the child's (and the converter's) output sent with a failure: enough for a traceback.
TAIL_LINES = 50
# The longest event line taken; a longer one is noise, not an event.
MAX_EVENT_BYTES = 64 * 1024
# Grace for what is left of a job that failed (a helper the child forked).
FAILED_GRACE = 10.0
# The converter imports torch and rewrites every tensor of the adapter.
CONVERT_TIMEOUT = 1800.0
_UPLOADED = "Uploaded"  # the agent's last word on a job that went well; the server says Succeeded

Upload = Callable[[JobStatus, AsyncIterator[JobPiece]], Awaitable[None]]


def child_script() -> Path:
    """The training child as shipped: beside this module, or in the frozen binary's bundle
    (build/llmgw.spec carries it there as a data file)."""
    bundle = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and bundle:
        return Path(bundle) / "llmgw" / "agent" / CHILD_SCRIPT
    return Path(__file__).with_name(CHILD_SCRIPT)


def job_id_problem(job_id: str) -> str:
    return state_file.id_problem("job id", job_id)


# --- the state file ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class JobRecord:
    spec: TrainSpec  # without its pairs: those are in run/pairs.jsonl
    device: str  # JobStatus.device
    child: ProcessRecord | None = None
    converter: ProcessRecord | None = None


def write_record(directory: Path, record: JobRecord) -> None:
    state_file.write(directory, STATE_VERSION, record)


def read_record(directory: Path) -> JobRecord:
    """Raises ValueError when the file is missing or cannot be understood."""
    return state_file.read(directory, STATE_VERSION, JobRecord, "a job")


# --- a job ---------------------------------------------------------------------------------------


class _JobFailed(Exception):
    """Ends the job Failed with this reason."""


class _LineReader:
    """New complete lines of a file the agent owns, from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self, *, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if (final and self._partial) or len(self._partial) > MAX_EVENT_BYTES:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode(errors="replace").rstrip("\r") for line in lines]


@attrs.define(eq=False)
class _Job:
    spec: TrainSpec
    directory: Path
    device: str  # JobStatus.device
    choice: Choice | None  # None for an adopted job (its device is in ``device``)
    adopted: bool = False
    state: JobState = JobState.SENT  # changed only through JOB_LIFECYCLE
    progress: Progress = attrs.field(factory=Progress)
    record: JobRecord | None = None
    children: list[trio.Process] = attrs.field(factory=list)  # the ones this agent started
    pidfd: int | None = None  # an adopted child
    tail: collections.deque[str] = attrs.field(factory=lambda: collections.deque(maxlen=TAIL_LINES))
    last_sent: float | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: tuple[str, str] | None = None  # (Failed, Cancelled or _UPLOADED; reason), set once
    grace: float = FAILED_GRACE
    done: trio.Event = attrs.field(factory=trio.Event)
    span: Any = tracing.NO_SPAN  # train.run, until the teardown

    @property
    def layout(self) -> JobLayout:
        return JobLayout(self.directory)

    def processes(self) -> list[ProcessRecord]:
        if self.record is None:
            return []
        return [p for p in (self.record.child, self.record.converter) if p is not None]


class Trainer:
    """Runs this node's training jobs, one at a time. ``run()`` must be running for the rest."""

    def __init__(
        self,
        work_dir: Path,
        *,
        gpus: Callable[[], Sequence[Gpu]],
        on_status: Callable[[JobStatus], None],
        upload: Upload,
        train_python: str = "python3",
        run_as: str | None = "llmgw-engine",
        threads: int | None = None,
        lora_converter: Path | None = None,
        check_overlay: bool = True,
        script: Path | None = None,
        cpu_count: int | None = None,
    ) -> None:
        self._work_dir = work_dir
        self._jobs_dir = work_dir / "jobs"
        self._gpus = gpus
        self._on_status = on_status
        self._upload_to_server = upload
        self._python = train_python
        self._run_as = run_as
        self._threads = threads
        self._lora_converter = lora_converter
        self._check_overlay = check_overlay
        self._script = script or child_script()
        self._cpu_count = cpu_count or os.cpu_count() or 1
        self._overlay = Overlay(train_python, work_dir / "train-overlay")
        self._jobs: dict[str, _Job] = {}
        self._nursery: trio.Nursery | None = None
        self._recovered = trio.Event()

    # --- the public face ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopts what an earlier agent left, reports started, then serves until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._recover()
            self._recovered.set()
            task_status.started()
            await trio.sleep_forever()

    async def start(self, spec: TrainSpec) -> tuple[bool, str]:
        """Starts a job; returns once it is under way (its states are reported as they come)."""
        await self._recovered.wait()
        existing = self._jobs.get(spec.job_id)
        if existing is not None:
            if existing.ended is None:
                return True, "already running"
            return False, "still stopping; start it again once it has stopped"
        if self._jobs:
            other = next(iter(self._jobs))
            return False, f"job {other} is running on this node, and a node trains one job at a time"
        problems = [p for p in [job_id_problem(spec.job_id)] if p]
        problems += spec.params.problems()
        if not spec.pairs:
            problems.append("pairs: the job has no question/answer pairs")
        if problems:
            return self._refuse(spec, f"invalid job: {'; '.join(problems)}")
        try:
            gpus = await trio.to_thread.run_sync(self._gpus)
        except Exception as exc:  # discovery's own errors say what is wrong
            return self._refuse(spec, f"cannot read this node's GPUs: {exc}")
        choice = choose_device(gpus, spec.need_mib)
        if not choice.ok:
            return self._refuse(spec, choice.refusal)
        job = _Job(spec=spec, directory=self._jobs_dir / spec.job_id, device=choice.label, choice=choice)
        job.span = _run_span(job)  # beneath the StartJob command's span, current here
        self._jobs[spec.job_id] = job
        log.info(
            "starting job %s (adapter %s of %s) on %s", spec.job_id, spec.adapter, spec.model, job.device
        )
        self._spawner().start_soon(self._run_job, job)
        return True, f"starting on {job.device}"

    async def cancel(self, job_id: str, grace: float = 10.0) -> tuple[bool, str]:
        """Stops a job: SIGTERM to its process group, SIGKILL after ``grace``; its files go.

        Returns once nothing of it is left. A job this agent does not run is refused ("not
        running"): the server then ends it at once instead of waiting for a Cancelled status.
        """
        await self._recovered.wait()
        job = self._jobs.get(job_id)
        if job is None:
            return False, "not running"
        if job.ended is None:
            job.grace = grace
            self._end(job, JobState.CANCELLED, "cancelled")
        await job.done.wait()
        assert job.ended is not None
        state, reason = job.ended
        return True, "cancelled" if state == JobState.CANCELLED else f"it had ended already: {reason}"

    def running(self) -> list[RunningJob]:
        """The jobs under way (not those being torn down), for Register."""
        return [
            RunningJob(job_id=j.spec.job_id, state=j.state) for j in self._jobs.values() if j.ended is None
        ]

    def own_pids(self) -> frozenset[int]:
        """Every living process of every job (for discovery's foreign-process check). Blocking."""
        pgids = [p.pgid for job in self._jobs.values() for p in job.processes() if group_is_ours(p)]
        return frozenset(members(pgids, process_table()))

    def log_tail(self, job_id: str) -> tuple[str, ...]:
        job = self._jobs.get(job_id)
        return tuple(job.tail) if job is not None else ()

    # --- a job's life -------------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        """Runs a job to its end, then tears it down. Only an _end reaches the teardown: a
        cancellation of run() leaves the child running for the next agent."""
        with job.scope, tracing.use(job.span):
            try:
                if not job.adopted:
                    with tracing.span("train.prepare"):
                        await self._launch(job)
                if not job.progress.done:
                    with tracing.span("train.train") as trained:
                        try:
                            await self._train(job)
                        finally:
                            _progress_attributes(trained, job.progress)
                files = [name for name in job.progress.files]
                if job.spec.gguf:
                    with tracing.span("train.convert"):
                        files.append(await self._convert(job))
                with tracing.span("train.upload", {"llmgw.files": len(files)} if tracing.enabled() else None):
                    await self._upload(job, files)
                self._end(job, _UPLOADED, "")
            except _JobFailed as exc:
                self._end(job, JobState.FAILED, str(exc))
        await self._teardown(job)

    async def _launch(self, job: _Job) -> None:
        assert job.choice is not None
        try:
            user = await trio.to_thread.run_sync(self._engine_user)
            await trio.to_thread.run_sync(self._prepare, job, user)
        except OSError as exc:
            raise _JobFailed(f"cannot prepare the job's directory: {exc}") from None
        job.record = JobRecord(spec=attrs.evolve(job.spec, pairs=()), device=job.device)
        await self._save(job)
        try:
            pythonpath = await self._overlay.path(user) if self._check_overlay else ""
        except OverlayFailed as exc:
            raise _JobFailed(str(exc)) from None
        gpu_index = job.choice.gpu_index
        threads = child_threads(self._threads, self._cpu_count, on_gpu=gpu_index is not None)
        env = child_environment(
            base_environment(user), threads=threads, gpu_index=gpu_index, pythonpath=pythonpath
        )
        layout = job.layout
        argv = child_argv(self._python, layout)
        try:
            process = await _spawn(
                argv, env=env, user=user, cwd=layout.run_dir, stdout=layout.events, stderr=layout.log
            )
        except OSError as exc:
            raise _JobFailed(f"cannot start the training child ({self._python}): {exc}") from None
        job.children.append(process)
        job.record = attrs.evolve(job.record, child=_record("train", process, argv))
        await self._save(job)
        total = job.spec.params.total_steps(len(job.spec.pairs))
        job.progress = Progress(total_steps=total)
        self._advance(job, JobState.TRAINING)

    def _prepare(self, job: _Job, user: runas.EngineUser) -> None:
        """The job's directories and the child's inputs (blocking; in a worker thread)."""
        layout = job.layout
        self._jobs_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self._jobs_dir, 0o711)
        shutil.rmtree(job.directory, ignore_errors=True)  # a leftover of an earlier run
        job.directory.mkdir(mode=0o711)
        os.chmod(job.directory, 0o711)
        layout.run_dir.mkdir(mode=0o700)
        layout.out_dir.mkdir(mode=0o700)
        shutil.copyfile(self._script, layout.child_script)
        device = job.choice.child_device if job.choice else "cpu"
        _write_private(layout.pairs, dump_pairs(job.spec.pairs))
        _write_private(layout.child_config, child_config(job.spec, layout, device))
        os.chmod(layout.child_script, 0o600)
        for path in (layout.run_dir, layout.out_dir, *layout.child_inputs()):
            os.chown(path, user.uid, user.gid)

    async def _train(self, job: _Job) -> None:
        """Follows the child until it exits; returns when it finished, else raises _JobFailed."""
        events = _LineReader(job.layout.events)
        errors = _LineReader(job.layout.log)

        def read(final: bool = False) -> None:
            for line in events.read(final=final):
                job.progress = apply_event(job.progress, line)
            job.tail.extend(errors.read(final=final))

        async def follow() -> None:
            while True:
                before = job.progress
                read()
                if job.progress != before and progress_due(job.last_sent, trio.current_time()):
                    self._report(job)
                await trio.sleep(FOLLOW_INTERVAL)

        exit_status: int | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow)
            if job.children:
                exit_status = await job.children[0].wait()
            else:
                assert job.pidfd is not None
                await wait_for_exit(job.pidfd)
            nursery.cancel_scope.cancel()
        read(final=True)
        await self._stop_leftovers(job)
        failure = training_failure(job.progress, exit_status)
        if failure:
            raise _JobFailed(failure)
        self._report(job)  # the last step, whatever the rate limit held back

    async def _convert(self, job: _Job) -> str:
        """Runs llama.cpp's converter on the adapter; returns the GGUF file's name."""
        self._advance(job, JobState.CONVERTING)
        try:
            from llmgw.agent import lora_convert
        except ImportError:
            raise _JobFailed("this agent cannot convert adapters to GGUF (lora_convert is missing)") from None
        script = lora_convert.find_converter(str(self._lora_converter) if self._lora_converter else None)
        if script is None:
            where = (
                f" ({self._lora_converter} is not there, or has no gguf-py beside it)"
                if self._lora_converter
                else ""
            )
            raise _JobFailed(
                "the model is served by llama.cpp, so the adapter must be converted to GGUF, and "
                f"engines.lora_converter{where} must name llama.cpp's convert_lora_to_gguf.py"
            )
        user = await trio.to_thread.run_sync(self._engine_user)
        layout = job.layout
        outfile = layout.out_dir / GGUF_FILE
        argv = lora_convert.convert_argv(
            self._python, script, layout.out_dir, Path(job.spec.base_dir), outfile
        )
        env = {**base_environment(user), "OMP_NUM_THREADS": "1", **lora_convert.converter_env(script)}
        output = layout.convert_log
        try:
            process = await _spawn(argv, env=env, user=user, cwd=layout.run_dir, stdout=output, stderr=output)
        except OSError as exc:
            raise _JobFailed(f"cannot start the GGUF converter ({self._python}): {exc}") from None
        job.children.append(process)
        assert job.record is not None
        job.record = attrs.evolve(job.record, converter=_record("convert", process, argv))
        await self._save(job)
        lines = _LineReader(output)
        with trio.move_on_after(CONVERT_TIMEOUT) as timeout:
            status = await process.wait()
        if timeout.cancelled_caught:
            raise _JobFailed(f"the GGUF conversion took longer than {CONVERT_TIMEOUT:g}s")
        job.tail.extend(f"[convert] {line}" for line in lines.read(final=True))
        if status != 0:
            raise _JobFailed(f"the GGUF conversion {describe_exit(status)}")
        return GGUF_FILE

    async def _upload(self, job: _Job, names: list[str]) -> None:
        """Announces the files (JobStatus Uploading) and sends them, a piece at a time."""
        user = await trio.to_thread.run_sync(self._engine_user)
        opened: list[tuple[str, Any]] = []
        try:
            for name in names:
                try:
                    file = await trio.to_thread.run_sync(_open_output, job.layout.out_dir, name, user)
                except (OSError, ValueError) as exc:
                    raise _JobFailed(f"cannot read the output file {name}: {exc}") from None
                opened.append((name, file))
            digests = [await trio.to_thread.run_sync(fileobj_digest, name, file) for name, file in opened]
            JOB_LIFECYCLE.move_in_place(job, JobState.UPLOADING)
            status = self._status(job, files=tuple(digests))

            async def pieces() -> AsyncIterator[JobPiece]:
                for name, file in opened:
                    source = iter_pieces(job.spec.job_id, name, file)
                    while (piece := await trio.to_thread.run_sync(next, source, None)) is not None:
                        yield piece

            with trio.move_on_after(upload_time_limit(digests)) as timeout:
                try:
                    await self._upload_to_server(status, pieces())
                except UploadInterrupted as exc:
                    raise _JobFailed(f"the upload was interrupted: {exc}") from None
            if timeout.cancelled_caught:
                raise _JobFailed("the upload did not finish in time (is the link to the server down?)")
        finally:
            for _name, file in opened:
                file.close()

    # --- the end of a job -----------------------------------------------------------------------

    def _end(self, job: _Job, state: str, reason: str) -> None:
        """Records why the job ends (the first reason wins) and cancels its scope."""
        if job.ended is None:
            job.ended = (state, reason)
            job.scope.cancel()

    async def _teardown(self, job: _Job) -> None:
        assert job.ended is not None
        state, reason = job.ended
        with trio.CancelScope(shield=True):
            await self._stop_processes(job, job.grace)
            if job.pidfd is not None:
                os.close(job.pidfd)
                job.pidfd = None
            await trio.to_thread.run_sync(shutil.rmtree, job.directory, True)
        del self._jobs[job.spec.job_id]
        job.span.set_attribute("llmgw.state", state)
        tracing.end(job.span, error=reason if state == JobState.FAILED else None)
        if state == _UPLOADED:
            log.info("job %s: its files are sent", job.spec.job_id)
        else:
            log.info("job %s %s%s", job.spec.job_id, state.lower(), f": {reason}" if reason else "")
            JOB_LIFECYCLE.move_in_place(job, JobState(state))
            tail = tuple(job.tail) if state == JobState.FAILED else ()
            self._on_status(self._status(job, reason=reason, log_tail=tail))
        job.done.set()

    async def _stop_processes(self, job: _Job, grace: float) -> None:
        """SIGTERM to each group; SIGKILL what is left after ``grace``; the children reaped."""
        left = await stop_groups(job.processes(), grace, children=job.children)
        if left:
            log.error(
                "job %s: processes %s outlived SIGKILL by %gs", job.spec.job_id, sorted(left), KILL_WAIT
            )

    async def _stop_leftovers(self, job: _Job) -> None:
        """What the child forked and left in its group goes with it (it could hold the card)."""
        if job.record is not None and job.record.child is not None:
            await kill_groups([job.record.child])

    # --- adoption -------------------------------------------------------------------------------

    async def _recover(self) -> None:
        if not self._jobs_dir.is_dir():
            return
        for directory in sorted(self._jobs_dir.iterdir()):
            if not directory.is_dir():
                continue
            try:
                record = await trio.to_thread.run_sync(read_record, directory)
            except ValueError as exc:
                # Nothing in it can be trusted to name processes.
                log.error("%s; removing %s", exc, directory)
                await trio.to_thread.run_sync(shutil.rmtree, directory, True)
                continue
            job = _Job(spec=record.spec, directory=directory, device=record.device, choice=None, adopted=True)
            job.span = _run_span(job)
            job.record = record
            self._jobs[record.spec.job_id] = job
            why_not = await self._adopt(job)
            if why_not:
                log.warning("job %s: %s", record.spec.job_id, why_not)
                self._end(job, JobState.FAILED, why_not)
                self._spawner().start_soon(self._teardown, job)
                continue
            log.info("adopted job %s (%s)", record.spec.job_id, job.state.lower())
            self._report(job)
            self._spawner().start_soon(self._run_job, job)

    async def _adopt(self, job: _Job) -> str:
        """Takes the job over: "" when it can go on, else why not."""
        record = job.record
        assert record is not None
        if record.child is None:
            return "the agent went down while starting it"
        # A conversion cut short is done again; its leftover must not write beside the new one.
        if record.converter is not None:
            signal_group(record.converter, signal.SIGKILL)
            job.record = attrs.evolve(record, converter=None)
        events = _LineReader(job.layout.events)
        for line in await trio.to_thread.run_sync(lambda: events.read(final=True)):
            job.progress = apply_event(job.progress, line)
        job.tail.extend(_LineReader(job.layout.log).read(final=True))
        JOB_LIFECYCLE.move_in_place(job, JobState.TRAINING)
        job.pidfd = open_pidfd(record.child)
        return adoption_problem(job.progress, child_alive=job.pidfd is not None)

    # --- bookkeeping ------------------------------------------------------------------------------

    def _engine_user(self) -> runas.EngineUser:
        user, note = runas.resolve(self._run_as, self._work_dir)
        if note:
            log.debug(note)  # the supervisor says it once for the whole agent
        runas.prepare_home(user)
        return user

    def _spawner(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("Trainer.run() is not running")
        return self._nursery

    async def _save(self, job: _Job) -> None:
        assert job.record is not None
        try:
            await trio.to_thread.run_sync(write_record, job.directory, job.record)
        except OSError as exc:
            # Without its state the child could not be adopted, or stopped, after a restart.
            raise _JobFailed(f"cannot write the job's state file: {exc}") from None

    def _refuse(self, spec: TrainSpec, reason: str) -> tuple[bool, str]:
        self._on_status(JobStatus(job_id=spec.job_id, state=JobState.FAILED, reason=reason))
        return False, reason

    def _advance(self, job: _Job, state: JobState) -> None:
        if job.ended is None:
            JOB_LIFECYCLE.move_in_place(job, state)
            self._report(job)

    def _report(self, job: _Job) -> None:
        job.last_sent = trio.current_time()
        self._on_status(self._status(job))

    def _status(self, job: _Job, **details: Any) -> JobStatus:
        progress = job.progress
        return JobStatus(
            job_id=job.spec.job_id,
            state=job.state,
            step=progress.step,
            total_steps=progress.total_steps,
            loss=progress.loss,
            peak_mib=progress.peak_mib,
            device=job.device,
            **details,
        )


# --- helpers ---------------------------------------------------------------------------------------


async def _spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    user: runas.EngineUser,
    cwd: Path,
    stdout: Path,
    stderr: Path,
) -> trio.Process:
    """Starts one process as the engines' user in a session (so a process group) of its own,
    its stdout and stderr in files: they outlive the agent, so a restarted one reads on."""
    out_fd = open_output(stdout)
    err_fd = out_fd if stderr == stdout else open_output(stderr)
    try:
        return await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out_fd,
            stderr=err_fd,
            env=env,
            cwd=str(cwd),
            start_new_session=True,
            **user.credentials(),
        )
    finally:
        os.close(out_fd)
        if err_fd != out_fd:
            os.close(err_fd)


def _run_span(job: _Job) -> Any:
    if not tracing.enabled():
        return tracing.NO_SPAN
    spec = job.spec
    attributes = {
        "llmgw.job": spec.job_id,
        "llmgw.adapter": spec.adapter,
        "llmgw.model": spec.model,
        "llmgw.device": job.device,
        "llmgw.adopted": job.adopted,
    }
    return tracing.start("train.run", attributes)  # an adopted job's: no span is current


def _progress_attributes(span: Any, progress: Progress) -> None:
    if span.is_recording():
        span.set_attribute("llmgw.train.steps", progress.step)
        span.set_attribute("llmgw.train.peak_mib", progress.peak_mib)
        if progress.loss is not None:
            span.set_attribute("llmgw.train.loss", progress.loss)


def _record(name: str, process: trio.Process, argv: Sequence[str]) -> ProcessRecord:
    stat_ = read_stat(process.pid)
    assert stat_ is not None, "an unreaped child has a /proc entry"
    return ProcessRecord(
        name=name,
        pid=process.pid,
        pgid=stat_.pgrp,
        argv=tuple(argv),
        cmdline=read_cmdline(process.pid) or (),
        start_time=stat_.start_time,
    )


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w", encoding="utf-8") as file:
        file.write(text)


def _open_output(out_dir: Path, name: str, user: runas.EngineUser) -> Any:
    """An output file, opened so that the engines' user (who owns the directory) cannot make
    root read something else: no symbolic link, a regular file, that user's own."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a bare file name")
    dir_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != user.uid:
        os.close(fd)
        raise ValueError("not a regular file of the engines' user")
    return os.fdopen(fd, "rb")
