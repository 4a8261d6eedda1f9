"""The trainer's spans, with the SDK's in-memory exporter and real child processes (the fake child
of tests/fake_train_child.py): a job's run continues the StartJob command's trace, with a span per
step; a failure marks the step it happened in and the run, with the reason."""

from __future__ import annotations

import pytest
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from llmgw import tracing
from llmgw.core.training import JobState
from tests.agent.test_trainer import lab, start_agent  # noqa: F401 - lab is a fixture


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "llmgw-agent-test", batch=False)
    yield exporter
    tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        found.setdefault(s.name, []).append(s)
    return found


async def test_a_jobs_run_is_a_span_per_step_beneath_the_command(nursery: trio.Nursery, lab, spans) -> None:  # noqa: F811
    agent = await start_agent(nursery, lab)
    with tracing.span("agent.start_job") as command:  # what the link does with StartJob's trace
        ok, _ = await agent.trainer.start(lab.spec())
    assert ok
    await agent.wait_gone()
    found = by_name(spans)
    [run] = found["train.run"]
    assert run.parent.span_id == command.get_span_context().span_id
    assert run.context.trace_id == command.get_span_context().trace_id
    assert (run.attributes["llmgw.job"], run.attributes["llmgw.adapter"]) == ("job-1", lab.spec().adapter)
    assert run.attributes["llmgw.state"] == "Uploaded" and run.status.status_code is StatusCode.UNSET
    steps = ["train.prepare", "train.train", "train.upload"]
    for step in steps:
        [span] = found[step]
        assert span.parent.span_id == run.context.span_id, step
    assert "train.convert" not in found  # the spec asked for no GGUF
    prepare, train, upload = (found[s][0] for s in steps)
    assert prepare.end_time <= train.start_time and train.end_time <= upload.start_time
    assert upload.end_time <= run.end_time
    assert (train.attributes["llmgw.train.steps"], train.attributes["llmgw.train.peak_mib"]) == (5, 105)
    assert train.attributes["llmgw.train.loss"] == pytest.approx(0.4)
    assert upload.attributes["llmgw.files"] == 2


async def test_a_failed_step_and_the_run_carry_the_reason(nursery: trio.Nursery, lab, spans) -> None:  # noqa: F811
    lab.knobs(fail_at=3)
    agent = await start_agent(nursery, lab)
    await agent.trainer.start(lab.spec())
    await agent.wait_state(JobState.FAILED)
    await agent.wait_gone()
    found = by_name(spans)
    [run], [train] = found["train.run"], found["train.train"]
    assert run.parent is None  # no command span was current: a trace of its own
    assert run.status.status_code is StatusCode.ERROR
    assert run.status.description == "training failed: fake failure at step 3"
    assert (
        train.status.status_code is StatusCode.ERROR and "fake failure at step 3" in train.status.description
    )
    assert train.attributes["llmgw.train.steps"] == 2
    assert "train.upload" not in found
