"""Training jobs' decisions, pure: examples per rule, then a state machine playing agents, links
and an operator against them and checking what must always hold."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmgw.core import jobs as core
from llmgw.core.states import IllegalTransition
from llmgw.core.training import (
    ACTIVE_STATES,
    JOB_LIFECYCLE,
    TERMINAL_STATES,
    FileDigest,
    JobState,
    QaPair,
    TrainSpec,
)
from llmgw.wire.codec import converter
from llmgw.wire.messages import JobStatus, RunningJob

T0 = 1_700_000_000.0
FILES = (FileDigest(name="adapter_model.safetensors", size=10, sha256="0" * 64),)


def job(job_id: str = "j-1", node: str = "n1", created: float = T0, **changes) -> core.Job:
    spec = TrainSpec(
        job_id=job_id,
        model="m",
        adapter=f"a-{job_id}",
        base_dir="/w",
        pairs=(QaPair(question="q", answer="a"),),
    )
    return attrs.evolve(core.Job(id=job_id, node=node, spec=spec, created=created), **changes)


def status(state: str, job_id: str = "j-1", **fields) -> JobStatus:
    return JobStatus(job_id=job_id, state=state, **fields)


# --- scheduling ---------------------------------------------------------------------------------


def test_the_oldest_pending_job_of_a_connected_idle_node_is_sent():
    jobs = [
        job("j-new", created=T0 + 5),
        job("j-old", created=T0),
        job("j-other", node="n2", created=T0 + 1),
        job("j-away", node="n3"),
    ]
    assert [j.id for j in core.to_send(jobs, ["n1", "n2"])] == ["j-old", "j-other"]


def test_nothing_is_sent_to_a_node_with_an_active_job():
    jobs = [job("j-run", state=JobState.TRAINING), job("j-wait", created=T0 + 1)]
    assert core.to_send(jobs, ["n1"]) == []
    ended = [job("j-run", state=JobState.FAILED), job("j-wait", created=T0 + 1)]
    assert [j.id for j in core.to_send(ended, ["n1"])] == ["j-wait"]


def test_sent_then_unsent_is_pending_again():
    sent = core.mark_sent(job(), T0 + 1)
    assert (sent.state, sent.sent) == (JobState.SENT, T0 + 1)
    assert core.unsend(sent) == job()


# --- the agent's reports ------------------------------------------------------------------------


def test_reports_move_the_job_forward_with_progress_and_times():
    j = core.mark_sent(job(), T0 + 1)
    j = core.apply_status(
        j, status(JobState.TRAINING, step=1, total_steps=50, loss=2.5, device="cpu"), T0 + 2
    )
    assert (j.state, j.training, j.step, j.total_steps, j.loss, j.device) == (
        JobState.TRAINING,
        T0 + 2,
        1,
        50,
        2.5,
        "cpu",
    )
    j = core.apply_status(
        j, status(JobState.TRAINING, step=9, total_steps=50, loss=1.0, peak_mib=300), T0 + 3
    )
    assert (j.step, j.loss, j.peak_mib, j.training) == (9, 1.0, 300, T0 + 2)
    j = core.apply_status(j, status(JobState.CONVERTING), T0 + 4)
    j = core.apply_status(j, status(JobState.UPLOADING, files=FILES), T0 + 5)
    assert (j.state, j.converting, j.uploading, j.files, j.step, j.peak_mib) == (
        JobState.UPLOADING,
        T0 + 4,
        T0 + 5,
        FILES,
        9,
        300,
    )
    done = core.succeed(j, T0 + 6)
    assert (done.state, done.finished) == (JobState.SUCCEEDED, T0 + 6)
    assert core.timings(done, T0 + 100) == {"queue": 1, "train": 3, "convert": 1, "upload": 1, "total": 6}


def test_stale_and_backward_reports_are_ignored():
    j = core.apply_status(core.mark_sent(job(), T0), status(JobState.TRAINING, step=5), T0)
    assert core.apply_status(j, status(JobState.TRAINING, step=3), T0) == j
    assert core.apply_status(j, status(JobState.SENT), T0) == j
    assert core.apply_status(j, status("Bogus"), T0) == j
    assert core.apply_status(j, status(JobState.TRAINING, job_id="j-2"), T0) == j


def test_the_agent_never_decides_succeeded():
    j = core.apply_status(core.mark_sent(job(), T0), status(JobState.UPLOADING, files=FILES), T0)
    assert core.apply_status(j, status(JobState.SUCCEEDED), T0) == j


def test_terminal_states_are_final():
    for state in TERMINAL_STATES:
        ended = job(state=state, finished=T0)
        for report in (JobState.TRAINING, JobState.FAILED, JobState.CANCELLED, JobState.SUCCEEDED):
            assert core.apply_status(ended, status(report), T0 + 1) == ended
        assert core.fail(ended, "late", T0 + 1) == ended


def test_failure_keeps_reason_and_log_tail():
    j = core.mark_sent(job(), T0)
    lines = tuple(f"line {i}" for i in range(80))
    failed = core.apply_status(j, status(JobState.FAILED, reason="child exited 1", log_tail=lines), T0 + 1)
    assert (failed.state, failed.reason, failed.finished) == (JobState.FAILED, "child exited 1", T0 + 1)
    assert failed.log_tail == lines[-core.LOG_TAIL_LINES :]


def test_an_upload_without_files_fails():
    j = core.apply_status(core.mark_sent(job(), T0), status(JobState.UPLOADING), T0)
    assert (j.state, j.reason) == (JobState.FAILED, "the agent announced an upload without its list of files")


def test_a_report_for_a_job_the_server_ended_or_never_knew_cancels_it_on_the_agent():
    assert core.agent_should_cancel(None, status(JobState.TRAINING))
    assert core.agent_should_cancel(job(state=JobState.FAILED), status(JobState.TRAINING))
    assert not core.agent_should_cancel(job(state=JobState.FAILED), status(JobState.CANCELLED))
    assert not core.agent_should_cancel(job(state=JobState.TRAINING), status(JobState.TRAINING))


# --- links, nodes, restarts -----------------------------------------------------------------------


def test_register_reattaches_listed_jobs_and_fails_the_others():
    jobs = {
        "j-1": job("j-1", state=JobState.TRAINING, step=4),
        "j-2": job("j-2", state=JobState.SENT),
        "j-3": job("j-3", state=JobState.UPLOADING, files=FILES),
        "j-4": job("j-4", node="n2", state=JobState.TRAINING),
        "j-5": job("j-5", state=JobState.CANCELLED),
    }
    running = [
        RunningJob(job_id="j-1", state=JobState.CONVERTING),
        RunningJob(job_id="j-5", state=JobState.TRAINING),
        RunningJob(job_id="j-x", state=JobState.TRAINING),
    ]
    out = core.attach(jobs, "n1", running, T0)
    changed = {j.id: j for j in out.changed}
    assert (changed["j-1"].state, changed["j-1"].step) == (JobState.CONVERTING, 4)
    assert (changed["j-2"].state, changed["j-2"].reason) == (JobState.FAILED, "agent no longer runs it")
    assert changed["j-3"].state == JobState.FAILED and "transfer interrupted" in changed["j-3"].reason
    assert "j-4" not in changed
    assert out.cancel == ("j-5", "j-x")


def test_register_listing_the_state_it_is_in_changes_nothing():
    jobs = {"j-1": job(state=JobState.TRAINING)}
    assert core.attach(jobs, "n1", [RunningJob(job_id="j-1", state=JobState.TRAINING)], T0) == core.Attached()


def test_a_disconnect_fails_only_an_upload_and_ends_a_requested_cancel():
    jobs = [
        job("j-1", state=JobState.TRAINING),
        job("j-2", state=JobState.UPLOADING, files=FILES),
        job("j-3", state=JobState.CONVERTING, cancel_requested=True),
        job("j-4", node="n2", state=JobState.UPLOADING, files=FILES),
    ]
    changed = {j.id: j for j in core.disconnected(jobs, "n1", T0)}
    assert sorted(changed) == ["j-2", "j-3"]
    assert changed["j-2"].reason == "transfer interrupted: the link broke during the upload"
    assert changed["j-3"].state == JobState.CANCELLED


def test_a_lost_node_fails_its_active_jobs_with_that_reason():
    jobs = [
        job("j-1", state=JobState.TRAINING),
        job("j-2"),
        job("j-3", state=JobState.UPLOADING, files=FILES),
    ]
    changed = {j.id: j for j in core.node_lost(jobs, "n1", T0)}
    assert changed["j-1"].reason == "node n1 lost"
    assert changed["j-3"].reason == "transfer interrupted: node n1 lost"
    assert "j-2" not in changed  # Pending waits for the node to come back


def test_a_server_restart_ends_an_upload():
    assert core.after_restart(job(state=JobState.UPLOADING), T0).state == JobState.FAILED
    assert core.after_restart(job(state=JobState.TRAINING), T0).state == JobState.TRAINING


# --- the operator -------------------------------------------------------------------------------


def test_cancel_pending_at_once_and_active_through_the_agent():
    pending = core.cancel(job(), connected=True, now=T0)
    assert (pending.job.state, pending.send) == (JobState.CANCELLED, False)
    active = core.cancel(job(state=JobState.TRAINING), connected=True, now=T0)
    assert (active.job.state, active.job.cancel_requested, active.send) == (JobState.TRAINING, True, True)
    confirmed = core.apply_status(active.job, status(JobState.CANCELLED, reason="cancelled"), T0 + 1)
    assert confirmed.state == JobState.CANCELLED
    refused = core.cancel_answered(active.job, ok=False, message="not running", now=T0 + 1)
    assert (refused.state, refused.reason) == (JobState.CANCELLED, "cancelled (agent: not running)")
    away = core.cancel(job(state=JobState.TRAINING), connected=False, now=T0)
    assert (away.job.state, away.send) == (JobState.CANCELLED, False)
    assert away.job.reason == "cancelled while node n1 was not connected"
    with pytest.raises(core.CancelRefused, match="already ended: Failed"):
        core.cancel(job(state=JobState.FAILED), connected=True, now=T0)


# --- the lifecycle table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (JobState.SUCCEEDED, JobState.TRAINING),  # an ended job never runs again
        (JobState.FAILED, JobState.CANCELLED),  # nor ends twice
        (JobState.PENDING, JobState.TRAINING),  # nothing trains what was never sent
        (JobState.PENDING, JobState.FAILED),  # nor fails
        (JobState.TRAINING, JobState.SENT),  # reports only move forward
        (JobState.UPLOADING, JobState.CONVERTING),
        (JobState.TRAINING, JobState.SUCCEEDED),  # Succeeded only once the files are verified
    ],
)
def test_job_moves_nothing_may_make(old, new):
    with pytest.raises(IllegalTransition, match=f"job: {old} → {new} is not a legal move"):
        JOB_LIFECYCLE.move(job(state=old), new)


def test_the_rules_refuse_an_illegal_move_instead_of_making_it():
    with pytest.raises(IllegalTransition):
        core.end(job(), JobState.FAILED, "a Pending job has nothing to fail", T0)


def test_a_job_state_is_its_plain_string_in_the_store_and_an_old_record_still_loads():
    j = core.apply_status(core.mark_sent(job(), T0), status(JobState.TRAINING, step=2), T0 + 1)
    record = json.dumps(converter.unstructure(j))
    assert json.loads(record)["state"] == "Training"
    # A record as the store held it before states were enums: the same JSON, plain strings.
    old = {**converter.unstructure(job()), "state": "Sent", "sent": T0}
    loaded = converter.structure(json.loads(json.dumps(old)), core.Job)
    assert loaded.state is JobState.SENT and loaded == core.mark_sent(job(), T0)
    assert converter.structure(json.loads(record), core.Job) == j
    assert job(state="Failed").state is JobState.FAILED  # built from a string, it holds the enum


# --- the state machine ------------------------------------------------------------------------------

NODES = ("n1", "n2")
REPORTS = (
    JobState.PENDING,
    JobState.SENT,
    JobState.TRAINING,
    JobState.CONVERTING,
    JobState.UPLOADING,
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.CANCELLED,
    "Bogus",
)


class JobsMachine(RuleBasedStateMachine):
    """The shell's part, played with arbitrary timing: jobs are created, sent, reported on
    (in and out of order), cancelled, their nodes connect, disconnect and are lost."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[str, core.Job] = {}
        self.connected: set[str] = set()
        self.now = T0
        self.ended: dict[str, core.Job] = {}  # first terminal value of each job
        self.server_succeeded: set[str] = set()

    def tick(self) -> float:
        self.now += 1
        return self.now

    def put(self, after: core.Job) -> None:
        before = self.jobs.get(after.id)
        assert isinstance(after.state, JobState), repr(after.state)
        if before is None:
            assert after.state == JobState.PENDING
        else:
            assert JOB_LIFECYCLE.allows(before.state, after.state), f"{before.state} → {after.state}"
        if before is not None and before.terminal:
            assert after == before, f"terminal job {before.id} changed"
        if after.state == JobState.SUCCEEDED:
            assert after.id in self.server_succeeded, "Succeeded not decided by the server"
        self.jobs[after.id] = after
        if after.terminal:
            self.ended.setdefault(after.id, after)

    @rule(node=st.sampled_from(NODES))
    def create(self, node: str) -> None:
        job_id = f"j-{len(self.jobs)}"
        self.put(job(job_id, node=node, created=self.tick()))

    @initialize(nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=4))
    def some_jobs_and_their_nodes(self, nodes: list[str]) -> None:
        """Runs start with work to do: without it most steps of a run act on nothing."""
        for node in nodes:
            self.create(node)
        for node in set(nodes):
            assert core.attach(self.jobs, node, [], self.tick()) == core.Attached()  # nothing active yet
            self.connected.add(node)

    @rule()
    def schedule(self) -> None:
        chosen = core.to_send(self.jobs.values(), self.connected)
        nodes = [j.node for j in chosen]
        assert len(nodes) == len(set(nodes))
        for j in chosen:
            assert j.node in self.connected
            assert not any(o.active and o.node == j.node for o in self.jobs.values())
            self.put(core.mark_sent(j, self.tick()))

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), state=st.sampled_from(REPORTS), step=st.integers(0, 5), with_files=st.booleans())
    def report(self, data, state: str, step: int, with_files: bool) -> None:
        j = self.jobs[data.draw(st.sampled_from(sorted(self.jobs)))]
        files = FILES if with_files else ()
        after = core.apply_status(j, status(state, job_id=j.id, step=step, files=files), self.tick())
        if after != j:
            assert not j.terminal
            assert after.state != JobState.SUCCEEDED
            assert after.step >= j.step
        self.put(after)

    def ids(self, which) -> list[str]:
        return sorted(i for i, j in self.jobs.items() if which(j))

    @precondition(lambda self: self.ids(lambda j: j.active and j.node in self.connected))
    @rule(data=st.data(), convert=st.booleans(), moves=st.integers(1, 3), step=st.integers(0, 5))
    def agent_moves_on(self, data, convert: bool, moves: int, step: int) -> None:
        """The agent's own path, in order, so that runs reach the late states as well as the odd
        reports above: Training, Converting when the model needs GGUF, Uploading with its files."""
        job_id = data.draw(st.sampled_from(self.ids(lambda j: j.active and j.node in self.connected)))
        following = {
            JobState.SENT: JobState.TRAINING,
            JobState.TRAINING: JobState.CONVERTING if convert else JobState.UPLOADING,
            JobState.CONVERTING: JobState.UPLOADING,
            JobState.UPLOADING: JobState.UPLOADING,
        }
        for _ in range(moves):
            j = self.jobs[job_id]
            if not j.active:
                break
            state = following[j.state]
            files = FILES if state == JobState.UPLOADING else ()
            self.put(core.apply_status(j, status(state, job_id=j.id, step=step, files=files), self.tick()))

    @precondition(lambda self: self.ids(lambda j: j.state == JobState.UPLOADING))
    @rule(data=st.data())
    def verified(self, data) -> None:
        job_id = data.draw(st.sampled_from(self.ids(lambda j: j.state == JobState.UPLOADING)))
        self.server_succeeded.add(job_id)
        self.put(core.succeed(self.jobs[job_id], self.tick()))

    @precondition(lambda self: self.ids(lambda j: j.state == JobState.SENT))
    @rule(data=st.data())
    def never_left(self, data) -> None:
        """StartJob found the node gone (NodeUnavailable): the shell unsends."""
        job_id = data.draw(st.sampled_from(self.ids(lambda j: j.state == JobState.SENT)))
        self.put(core.unsend(self.jobs[job_id]))

    @precondition(lambda self: self.ids(lambda j: j.active))
    @rule(data=st.data())
    def shell_fails(self, data) -> None:
        """What the shell fails itself, and only active jobs: StartJob unanswered or refused, an
        upload it cannot keep."""
        job_id = data.draw(st.sampled_from(self.ids(lambda j: j.active)))
        self.put(core.fail(self.jobs[job_id], "shell", self.tick()))

    @precondition(lambda self: self.ids(lambda j: j.cancel_requested))
    @rule(data=st.data(), ok=st.booleans())
    def cancel_answered(self, data, ok: bool) -> None:
        j = self.jobs[data.draw(st.sampled_from(self.ids(lambda j: j.cancel_requested)))]
        self.put(core.cancel_answered(j, ok, "not running", self.tick()))

    @precondition(lambda self: self.ids(lambda j: j.state == JobState.UPLOADING))
    @rule()
    def server_restart(self) -> None:
        """Only an upload is the restart's to end (the others wait for their agent), so it is
        played when one is under way; the nodes come back through register."""
        self.connected.clear()
        for j in list(self.jobs.values()):
            self.put(core.after_restart(j, self.tick()))

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        j = self.jobs[data.draw(st.sampled_from(sorted(self.jobs)))]
        try:
            decision = core.cancel(j, j.node in self.connected, self.tick())
        except core.CancelRefused:
            assert j.terminal
            return
        assert decision.send == (j.active and j.node in self.connected)
        self.put(decision.job)

    @rule(node=st.sampled_from(NODES), data=st.data())
    def register(self, node: str, data) -> None:
        mine = sorted(i for i, j in self.jobs.items() if j.node == node)
        listed = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        running = [
            RunningJob(job_id=i, state=data.draw(st.sampled_from(sorted(ACTIVE_STATES)))) for i in listed
        ]
        before = dict(self.jobs)
        out = core.attach(self.jobs, node, running, self.tick())
        for j in out.changed:
            self.put(j)
        self.connected.add(node)
        for job_id, j in before.items():
            if j.node == node and j.active and job_id not in listed:
                assert self.jobs[job_id].state == JobState.FAILED
        for job_id in out.cancel:
            assert self.jobs[job_id].terminal

    @rule(node=st.sampled_from(NODES))
    def disconnect(self, node: str) -> None:
        self.connected.discard(node)
        for j in core.disconnected(self.jobs.values(), node, self.tick()):
            self.put(j)
        assert not any(j.node == node and j.state == JobState.UPLOADING for j in self.jobs.values())

    @rule(node=st.sampled_from(NODES))
    def lost(self, node: str) -> None:
        self.connected.discard(node)
        for j in core.node_lost(self.jobs.values(), node, self.tick()):
            assert j.reason.endswith(f"node {node} lost")
            self.put(j)
        assert not any(j.node == node and j.active for j in self.jobs.values())

    @invariant()
    def one_active_job_per_node(self) -> None:
        for node in NODES:
            assert sum(1 for j in self.jobs.values() if j.node == node and j.active) <= 1

    @invariant()
    def ended_jobs_stay_ended(self) -> None:
        for job_id, first in self.ended.items():
            assert self.jobs[job_id] == first
            assert first.finished is not None

    @invariant()
    def uploads_have_manifests(self) -> None:
        for j in self.jobs.values():
            if j.state == JobState.UPLOADING:
                assert j.files


JobsMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_jobs_machine = JobsMachine.TestCase


def test_memory_problems_of_a_gpu_node():
    from llmgw.core.jobs import memory_problems
    from llmgw.wire.messages import Gpu

    card = Gpu(
        index=0, uuid="u", name="L40S", gpu_class="l40s-45g",
        memory_total_mib=46068, memory_used_mib=40000, compute_capability="8.9",
    )  # fmt: skip
    assert memory_problems("cpu-1", (), 0) == []  # a CPU node trains on the CPU
    assert memory_problems("g1", (card,), 20000) == []  # free memory is the agent's to judge
    assert memory_problems("g1", (card,), 0) == [
        "need_mib: node g1 has 1 GPU(s); give the MiB of one card the job needs (its largest card has 46,068 MiB)"
    ]
    assert memory_problems("g1", (card,), 46069) == [
        "need_mib: 46,069 MiB is more than any card of node g1 has (46,068 MiB)"
    ]
