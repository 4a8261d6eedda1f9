"""`llmgw ctl train`, `jobs`, `job show|cancel` and `adapters [download]`, against the in-process
server of test_jobs_server with its scripted agent driving the job."""

from __future__ import annotations

import argparse
import hashlib
import json
import stat
from pathlib import Path

import pytest
import trio

from llmgw.core.training import JobState
from llmgw.ctl.client import AdminClient
from llmgw.ctl.commands import EXIT_USAGE, add_ctl_parser
from llmgw.wire.messages import CancelJob, JobStatus, StartJob
from tests.helpers import wait_for
from tests.server.test_jobs_server import ADAPTER_FILES, ADMIN_TOKEN, PAIRS, FakeAgent, Server, start_server


def run_ctl(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmgw")
    add_ctl_parser(parser.add_subparsers(dest="role", required=True))
    args = parser.parse_args(["ctl", *argv])
    return args.func(args)


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text(PAIRS)
    return path


@pytest.fixture
def ctl_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LLMGW_CONTEXT", str(tmp_path / "context.json"))
    monkeypatch.setenv("LLMGW_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("NO_COLOR", "1")


def train_argv(pairs: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        "tiny",
        "--node",
        "n1",
        "--base-dir",
        "/w/tiny",
        "--data",
        str(pairs),
        "--name",
        "tiny-qa",
        "--steps",
        "3",
        "--target-modules",
        "q_proj,k_proj,v_proj",
        *extra,
    ]


def test_a_bad_line_is_refused_with_its_number_and_nothing_is_sent(
    tmp_path: Path, ctl_env, monkeypatch, capsys
):
    sent = []
    monkeypatch.setattr(AdminClient, "_request", lambda self, *a: sent.append(a))
    monkeypatch.setenv("LLMGW_SERVER", "http://127.0.0.1:9")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n\n{"question": "q"}\nnot json\n')
    assert run_ctl(train_argv(bad)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"error: {bad}: line 3: answer must be a non-empty string" in err
    assert f"error: {bad}: line 4: not JSON (Expecting value)" in err
    assert "nothing was sent" in err
    assert sent == []


async def drive_to_success(server: Server, agent: FakeAgent) -> str:
    start = await agent.answer(StartJob)
    job_id = start.spec.job_id
    assert start.spec.params.steps == 3
    assert start.spec.params.target_modules == ("q_proj", "k_proj", "v_proj")
    for step in range(4):
        await agent.send(
            JobStatus(job_id=job_id, state=JobState.TRAINING, step=step, total_steps=3, loss=2.0 - step / 2)
        )
    await agent.send(JobStatus(job_id=job_id, state=JobState.CONVERTING, step=3, total_steps=3))
    await agent.upload(job_id, ADAPTER_FILES)
    return job_id


async def test_train_follows_the_job_to_succeeded_then_lists_and_downloads(
    tmp_path: Path, nursery, ctl_env, monkeypatch, pairs_file: Path, capsys
):
    server = await start_server(nursery, tmp_path / "data")
    monkeypatch.setenv("LLMGW_SERVER", server.admin_url)
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    async with trio.open_nursery() as inner:
        result = {}

        async def ctl() -> None:
            result["code"] = await trio.to_thread.run_sync(run_ctl, train_argv(pairs_file))

        inner.start_soon(ctl)
        job_id = await drive_to_success(server, agent)
    assert result["code"] == 0
    out = capsys.readouterr().out
    assert f"job {job_id}: Pending (adapter tiny-qa for tiny on node n1)" in out
    assert f"job {job_id}: Succeeded; adapter tiny-qa kept" in out

    assert await trio.to_thread.run_sync(run_ctl, ["jobs"]) == 0
    listing = capsys.readouterr().out
    assert job_id in listing and "Succeeded" in listing and "3/3" in listing
    assert await trio.to_thread.run_sync(run_ctl, ["job", "show", job_id]) == 0
    shown = capsys.readouterr().out
    for word in ("wall time", "QUEUE", "TRAIN", "CONVERT", "UPLOAD", "adapter_model.safetensors"):
        assert word in shown
    assert await trio.to_thread.run_sync(run_ctl, ["--json", "adapters"]) == 0
    [adapter] = json.loads(capsys.readouterr().out)["adapters"]
    assert adapter["name"] == "tiny-qa"

    out_dir = tmp_path / "downloaded"
    assert (
        await trio.to_thread.run_sync(run_ctl, ["adapters", "download", "tiny-qa", "-o", str(out_dir)]) == 0
    )
    for name, data in ADAPTER_FILES.items():
        path = out_dir / name
        assert path.read_bytes() == data
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "sha256 ok" in capsys.readouterr().out
    # Files already there are never replaced.
    assert (
        await trio.to_thread.run_sync(run_ctl, ["adapters", "download", "tiny-qa", "-o", str(out_dir)]) == 1
    )
    assert "cannot write" in capsys.readouterr().err


async def test_a_download_that_does_not_match_the_listing_is_removed(
    tmp_path: Path, nursery, ctl_env, monkeypatch, pairs_file: Path, capsys
):
    server = await start_server(nursery, tmp_path / "data")
    monkeypatch.setenv("LLMGW_SERVER", server.admin_url)
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    assert await trio.to_thread.run_sync(run_ctl, [*train_argv(pairs_file), "--detach"]) == 0
    await drive_to_success(server, agent)
    await wait_for(lambda: server.jobs.list()[0].state == JobState.SUCCEEDED, "Succeeded")
    kept = server.data_dir / "adapters" / "tiny-qa" / "adapter_config.json"
    kept.write_bytes(b'{"r": 9, "lora_alpha": 16}')  # same size, other bytes
    out_dir = tmp_path / "out"
    assert (
        await trio.to_thread.run_sync(run_ctl, ["adapters", "download", "tiny-qa", "-o", str(out_dir)]) == 1
    )
    err = capsys.readouterr().err
    assert "adapter_config.json: got 26 bytes with sha256" in err and "the file was removed" in err
    assert not (out_dir / "adapter_config.json").exists()
    assert hashlib.sha256((out_dir / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_a_listing_naming_a_path_outside_the_directory_writes_nothing(
    tmp_path: Path, ctl_env, monkeypatch, capsys
):
    """A hostile (or broken) server's listing: `../x` is refused before any file is written."""
    listing = {
        "adapters": [
            {
                "name": "evil",
                "files": [
                    {"name": "adapter_config.json", "size": 2, "sha256": "0" * 64},
                    {"name": "../outside", "size": 2, "sha256": "0" * 64},
                ],
            }
        ]
    }
    downloads = []
    monkeypatch.setattr(AdminClient, "get", lambda self, path: listing)
    monkeypatch.setattr(AdminClient, "download", lambda self, path, dest: downloads.append(dest))
    out_dir = tmp_path / "out"
    assert run_ctl(["adapters", "download", "evil", "-o", str(out_dir)]) == 1
    assert "not bare file names: ['../outside']" in capsys.readouterr().err
    assert downloads == [] and not (tmp_path / "outside").exists()


async def test_a_failed_job_prints_its_reason_and_log_tail(
    tmp_path: Path, nursery, ctl_env, monkeypatch, pairs_file: Path, capsys
):
    server = await start_server(nursery, tmp_path / "data")
    monkeypatch.setenv("LLMGW_SERVER", server.admin_url)
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    async with trio.open_nursery() as inner:
        result = {}

        async def ctl() -> None:
            result["code"] = await trio.to_thread.run_sync(run_ctl, train_argv(pairs_file))

        inner.start_soon(ctl)
        start = await agent.answer(StartJob)
        await agent.send(
            JobStatus(
                job_id=start.spec.job_id,
                state=JobState.FAILED,
                reason="the child exited with status 1",
                log_tail=("Traceback (most recent call last):", "OSError: /w/tiny has no config.json"),
            )
        )
    assert result["code"] == 1
    err = capsys.readouterr().err
    assert f"job {start.spec.job_id}: Failed: the child exited with status 1" in err
    assert "  OSError: /w/tiny has no config.json" in err


async def test_job_cancel(tmp_path: Path, nursery, ctl_env, monkeypatch, pairs_file: Path, capsys):
    server = await start_server(nursery, tmp_path / "data")
    monkeypatch.setenv("LLMGW_SERVER", server.admin_url)
    agent = FakeAgent("n1", server.link_port)
    await agent.connect(nursery)
    assert await trio.to_thread.run_sync(run_ctl, [*train_argv(pairs_file), "--detach"]) == 0
    start = await agent.answer(StartJob)
    job_id = start.spec.job_id
    assert await trio.to_thread.run_sync(run_ctl, ["job", "cancel", job_id]) == 0
    assert f"job {job_id}: cancelling" in capsys.readouterr().out
    await agent.answer(CancelJob)
    await agent.send(JobStatus(job_id=job_id, state=JobState.CANCELLED, reason="cancelled by the operator"))
    await wait_for(lambda: server.jobs.get(job_id).state == JobState.CANCELLED, "Cancelled")
    assert await trio.to_thread.run_sync(run_ctl, ["job", "cancel", job_id]) == 1
    assert "already ended: Cancelled" in capsys.readouterr().err
