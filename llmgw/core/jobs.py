"""Training jobs on the server: the record, and every decision about it, as pure functions.

A job is created Pending, sent to its node's agent when that agent is connected and nothing else
trains there, then moves as the agent reports (Training, Converting, Uploading) until the server
decides Succeeded (every file arrived and verified), or it ends Failed or Cancelled. The agent is
the truth about what runs, the server is the truth about what ended: a terminal job never changes
again, and an agent still running a job the server has ended is told to cancel it.

Times are wall-clock unix seconds passed in as ``now`` (they are shown to operators and survive a
restart); nothing here reads a clock. Every change of a job's state goes through
:data:`~llmgw.core.training.JOB_LIFECYCLE`, so a move its table does not draw raises where it
is made. Whether a node is *lost* is not decided here: the registry
applies :mod:`llmgw.core.liveness` and calls :func:`node_lost`. A disconnect alone is not a loss
(the agent may be restarting and keeps its child running), except for an upload, whose pieces
travel on the link that broke and cannot resume.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw.core.inventory import Gpu
from llmgw.core.reports import JobStatus, RunningJob
from llmgw.core.training import (
    ACTIVE_STATES,
    JOB_LIFECYCLE,
    TERMINAL_STATES,
    FileDigest,
    JobState,
    TrainSpec,
)

frozen = attrs.frozen(kw_only=True)

# How far along an active job is. An agent's report of an earlier state than the job is in was
# overtaken (sent before a later one, or repeated by a Register) and is ignored.
ORDER = {
    JobState.PENDING: 0,
    JobState.SENT: 1,
    JobState.TRAINING: 2,
    JobState.CONVERTING: 3,
    JobState.UPLOADING: 4,
}
# Lines of the child's output a job keeps: enough for a traceback's end, small in the store.
LOG_TAIL_LINES = 50


@frozen
class Job:
    id: str
    node: str  # where it trains (TrainSpec travels to that node and does not name it)
    # With its pairs: a Pending job must survive a restart and still be sendable.
    spec: TrainSpec
    # Changed only through JOB_LIFECYCLE. Converted, so that a record built from the store's
    # plain strings holds the enum like any other.
    state: JobState = attrs.field(default=JobState.PENDING, converter=JobState)
    reason: str = ""
    created: float = 0.0
    sent: float | None = None  # StartJob sent
    training: float | None = None  # the agent reported Training
    converting: float | None = None
    uploading: float | None = None
    finished: float | None = None  # reached a terminal state
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    peak_mib: int = 0
    device: str = ""
    log_tail: tuple[str, ...] = ()
    files: tuple[FileDigest, ...] = ()  # the manifest announced with Uploading
    cancel_requested: bool = False  # CancelJob sent; Cancelled when the agent confirms

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def end(job: Job, state: JobState, reason: str, now: float) -> Job:
    """``job`` in a terminal state; a job already ended stays as it was."""
    assert state in TERMINAL_STATES, state
    if job.terminal:
        return job
    return JOB_LIFECYCLE.move(job, state, reason=reason, finished=now)


def fail(job: Job, reason: str, now: float) -> Job:
    return end(job, JobState.FAILED, reason, now)


# --- scheduling ---------------------------------------------------------------------------------


def to_send(jobs: Iterable[Job], connected: Iterable[str]) -> list[Job]:
    """The Pending jobs to send now: at most one per node, the oldest, and only to a connected
    node where no job is active (one child per node: two would fight over the card's memory)."""
    busy = {job.node for job in jobs if job.active}
    online = set(connected)
    chosen: dict[str, Job] = {}
    for job in sorted(jobs, key=lambda j: (j.created, j.id)):
        if job.state != JobState.PENDING or job.node in busy or job.node not in online:
            continue
        chosen.setdefault(job.node, job)
    return sorted(chosen.values(), key=lambda j: (j.created, j.id))


def mark_sent(job: Job, now: float) -> Job:
    assert job.state == JobState.PENDING, job.state
    return JOB_LIFECYCLE.move(job, JobState.SENT, sent=now)


def unsend(job: Job) -> Job:
    """StartJob never left (the node was not connected after all): Pending again."""
    if job.state != JobState.SENT:
        return job
    return JOB_LIFECYCLE.move(job, JobState.PENDING, sent=None)


# --- the agent's reports ------------------------------------------------------------------------

# When the agent reports each state for the first time, the job records that time in this field.
_STARTED_FIELD = {
    JobState.TRAINING: "training",
    JobState.CONVERTING: "converting",
    JobState.UPLOADING: "uploading",
}


def apply_status(job: Job, status: JobStatus, now: float) -> Job:
    """``job`` after the agent's report; the same job when the report is stale or not allowed.

    Allowed: forward moves among the active states (progress within one state only forward in
    steps), Failed and Cancelled from any active state. Never: Succeeded (the server decides it
    after verifying the files), anything after a terminal state, a move back, an Uploading
    without its manifest (that fails the job: there is nothing to verify against).
    """
    if job.terminal or job.state == JobState.PENDING or status.job_id != job.id:
        return job
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        tail = tuple(status.log_tail[-LOG_TAIL_LINES:]) or job.log_tail
        default = "cancelled" if status.state == JobState.CANCELLED else "failed on the node"
        ended = end(job, JobState(status.state), status.reason or default, now)
        return attrs.evolve(ended, log_tail=tail)
    if status.state not in ORDER or ORDER[status.state] < ORDER[job.state]:
        return job
    if status.state == job.state and status.step < job.step:
        return job  # progress overtaken by a later report
    if status.state == JobState.UPLOADING and job.state != JobState.UPLOADING and not status.files:
        return fail(job, "the agent announced an upload without its list of files", now)
    state = JobState(status.state)
    changes: dict[str, object] = {
        "step": max(status.step, job.step),
        "total_steps": status.total_steps or job.total_steps,
        "loss": status.loss if status.loss is not None else job.loss,
        "peak_mib": max(status.peak_mib, job.peak_mib),
        "device": status.device or job.device,
        "log_tail": tuple(status.log_tail[-LOG_TAIL_LINES:]) or job.log_tail,
    }
    if state != job.state:
        started = _STARTED_FIELD.get(state)
        if started is not None:
            changes[started] = now
        if state == JobState.UPLOADING:
            changes["files"] = status.files
    return JOB_LIFECYCLE.move(job, state, **changes)


def succeed(job: Job, now: float) -> Job:
    """Every announced file arrived and matched its digest (the shell kept them)."""
    assert job.state == JobState.UPLOADING, job.state
    return JOB_LIFECYCLE.move(job, JobState.SUCCEEDED, reason="", finished=now)


def agent_should_cancel(job: Job | None, status: JobStatus) -> bool:
    """An agent reports a job as running that the server has ended (or never knew): tell it to
    stop, so no child trains for nobody."""
    running = status.state in ACTIVE_STATES
    return running and (job is None or job.terminal)


# --- the node's link ----------------------------------------------------------------------------


@frozen
class Attached:
    """What a node's registration means for its jobs."""

    changed: tuple[Job, ...] = ()
    cancel: tuple[str, ...] = ()  # job ids the agent runs and must stop (ended or unknown here)


def attach(jobs: Mapping[str, Job], node: str, running: Iterable[RunningJob], now: float) -> Attached:
    """A node registered (after a reconnect, an agent restart or a server restart), listing the
    jobs its agent still runs. Those of its active jobs it lists are re-attached (moved forward to
    the state it reports); the others are gone with the agent's previous life and fail; an upload
    in progress fails, because its link broke. Jobs it runs that the server ended are cancelled."""
    listed = {r.job_id: r for r in running}
    changed: list[Job] = []
    for job in jobs.values():
        if job.node != node or not job.active:
            continue
        report = listed.get(job.id)
        if job.state == JobState.UPLOADING:
            changed.append(fail(job, "transfer interrupted: the link broke during the upload", now))
        elif report is None:
            changed.append(fail(job, "agent no longer runs it", now))
        elif ORDER.get(report.state, -1) > ORDER[job.state]:
            status = JobStatus(job_id=job.id, state=report.state, files=job.files)
            moved = apply_status(job, status, now)
            if moved != job:
                changed.append(moved)
    ended = {j.id for j in changed if j.terminal}
    cancel = tuple(
        sorted(
            job_id
            for job_id, report in listed.items()
            if report.state in ACTIVE_STATES
            and (job_id in ended or job_id not in jobs or jobs[job_id].terminal or jobs[job_id].node != node)
        )
    )
    return Attached(changed=tuple(changed), cancel=cancel)


def disconnected(jobs: Iterable[Job], node: str, now: float) -> list[Job]:
    """A node's link ended. Its agent may be back within the liveness window, still running its
    child, so training jobs stay; but an upload's pieces travelled on that link and cannot resume,
    and a cancel already asked for needs no confirmation from an agent that is not there (its
    next Register lists the job if it still runs, and it is cancelled then)."""
    changed = []
    for job in jobs:
        if job.node != node or not job.active:
            continue
        if job.state == JobState.UPLOADING:
            changed.append(fail(job, "transfer interrupted: the link broke during the upload", now))
        elif job.cancel_requested:
            changed.append(end(job, JobState.CANCELLED, "cancelled (the node disconnected)", now))
    return changed


def node_lost(jobs: Iterable[Job], node: str, now: float) -> list[Job]:
    """Nothing heard from the node for the liveness window: its active jobs failed with it. A
    Pending job waits for the node to come back."""
    changed = []
    for job in jobs:
        if job.node == node and job.active:
            if job.state == JobState.UPLOADING:
                changed.append(fail(job, f"transfer interrupted: node {node} lost", now))
            else:
                changed.append(fail(job, f"node {node} lost", now))
    return changed


def after_restart(job: Job, now: float) -> Job:
    """The server restarted: an upload in progress cannot continue (its pieces were dropped with
    the process); other active jobs wait for their agent's Register to re-attach or fail them."""
    if job.state == JobState.UPLOADING:
        return fail(job, "transfer interrupted: the server restarted", now)
    return job


# --- the operator -------------------------------------------------------------------------------


class CancelRefused(Exception):
    """The job cannot be cancelled; the message says why."""


@frozen
class Cancel:
    job: Job
    send: bool  # send CancelJob to the node's agent


def cancel(job: Job, connected: bool, now: float) -> Cancel:
    """The operator cancels. Pending: at once. Active on a connected node: CancelJob goes to the
    agent and the job is Cancelled when it confirms. Active on a node that is not connected: at
    once (its agent cancels the job when it registers again listing it)."""
    if job.terminal:
        raise CancelRefused(f"job {job.id} already ended: {job.state}")
    if job.state == JobState.PENDING:
        return Cancel(job=end(job, JobState.CANCELLED, "cancelled before it was sent", now), send=False)
    if not connected:
        reason = f"cancelled while node {job.node} was not connected"
        return Cancel(job=end(job, JobState.CANCELLED, reason, now), send=False)
    return Cancel(job=attrs.evolve(job, cancel_requested=True), send=True)


def cancel_answered(job: Job, ok: bool, message: str, now: float) -> Job:
    """The agent answered CancelJob. A refusal means it does not run the job (any more): nothing
    is left to wait for. Accepted: its JobStatus Cancelled follows."""
    if ok or job.terminal:
        return job
    return end(job, JobState.CANCELLED, f"cancelled (agent: {message or 'not running'})", now)


def memory_problems(node: str, gpus: Sequence[Gpu], need_mib: int) -> list[str]:
    """Refused at once rather than by the agent later: a GPU node needs a memory figure, and no
    card of the node may be smaller than it. (Free memory is the agent's to judge, when the job
    starts: engines come and go meanwhile.)"""
    if not gpus:
        return []
    largest = max(gpu.memory_total_mib for gpu in gpus)
    if need_mib <= 0:
        return [
            f"need_mib: node {node} has {len(gpus)} GPU(s); give the MiB of one card the job needs"
            f" (its largest card has {largest:,} MiB)"
        ]
    if need_mib > largest:
        return [f"need_mib: {need_mib:,} MiB is more than any card of node {node} has ({largest:,} MiB)"]
    return []


# --- for people -----------------------------------------------------------------------------------


def timings(job: Job, now: float) -> dict[str, float | None]:
    """Wall time per phase, in seconds: queue (created → sent), train (sent → converting or
    uploading), convert, upload; a phase still running counts up to ``now``; None if not reached."""
    end_time = job.finished if job.finished is not None else now

    def span(start: float | None, stop: float | None) -> float | None:
        if start is None:
            return None
        return max(0.0, (stop if stop is not None else end_time) - start)

    train_end = job.converting if job.converting is not None else job.uploading
    return {
        "queue": span(job.created, job.sent),
        "train": span(job.sent, train_end),
        "convert": span(job.converting, job.uploading),
        "upload": span(job.uploading, job.finished),
        "total": span(job.created, job.finished),
    }
