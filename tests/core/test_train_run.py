"""A training job's run as decisions (core/train_run.py): no processes, no files."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.train_run import (
    PROGRESS_INTERVAL,
    UPLOAD_WAIT,
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
from llmgw.core.training import FileDigest, TrainParams, TrainSpec

LAYOUT = JobLayout(Path("/work/jobs/job-1"))
BASE = {"PATH": "/usr/bin", "HOME": "/home/engine"}


def test_the_layout_keeps_roots_files_outside_the_childs_directory() -> None:
    root_owned = (LAYOUT.events, LAYOUT.log, LAYOUT.convert_log)
    assert all(path.parent == LAYOUT.directory for path in root_owned)
    assert LAYOUT.run_dir == LAYOUT.directory / "run"
    assert LAYOUT.out_dir.parent == LAYOUT.run_dir
    assert all(path.parent == LAYOUT.run_dir for path in LAYOUT.child_inputs())
    assert [p.name for p in LAYOUT.child_inputs()] == ["train_child.py", "pairs.jsonl", "child.json"]


def test_the_child_runs_its_script_on_its_config() -> None:
    assert child_argv("/usr/bin/python3", LAYOUT) == [
        "/usr/bin/python3",
        "/work/jobs/job-1/run/train_child.py",
        "/work/jobs/job-1/run/child.json",
    ]


def test_the_childs_environment_shows_it_the_chosen_card_only_and_keeps_it_offline() -> None:
    env = child_environment(BASE, threads=1, gpu_index=3, pythonpath="/overlay")
    assert {key: env[key] for key in BASE} == BASE
    assert (env["CUDA_DEVICE_ORDER"], env["CUDA_VISIBLE_DEVICES"]) == ("PCI_BUS_ID", "3")
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("1", "1")
    assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]) == ("1", "1")
    assert env["PYTHONPATH"] == "/overlay"


def test_on_the_cpu_the_child_sees_no_card_and_no_empty_pythonpath() -> None:
    env = child_environment(BASE, threads=7, gpu_index=None, pythonpath="")
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["OMP_NUM_THREADS"] == "7"
    assert "PYTHONPATH" not in env


def test_the_childs_config_is_plain_json_with_every_parameter() -> None:
    params = TrainParams(steps=5, target_modules=("q_proj", "k_proj"))
    spec = TrainSpec(job_id="job-1", model="m", adapter="a", base_dir="/models/m", params=params)
    config = json.loads(child_config(spec, LAYOUT, "cuda:0"))
    assert config == {
        "base_dir": "/models/m",
        "pairs_path": "/work/jobs/job-1/run/pairs.jsonl",
        "output_dir": "/work/jobs/job-1/run/out",
        "device": "cuda:0",
        "params": {
            "rank": 8,
            "alpha": 16,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj"],
            "steps": 5,
            "epochs": 3,
            "learning_rate": 2e-4,
            "batch_size": 4,
            "max_seq_len": 512,
            "seed": 0,
        },
    }


@given(st.lists(st.one_of(st.text(max_size=80), st.sampled_from(['{"event": "step"', "{}", "[]", "null"]))))
def test_no_line_breaks_the_fold_and_peak_memory_never_falls(lines: list[str]) -> None:
    progress = Progress(peak_mib=100)
    for line in lines:
        after = apply_event(progress, line)
        assert after.peak_mib >= progress.peak_mib
        progress = after


def test_progress_goes_first_at_once_then_once_per_interval() -> None:
    assert progress_due(None, 0.0)
    assert not progress_due(10.0, 10.0)
    assert progress_due(10.0, 10.0 + PROGRESS_INTERVAL)
    assert progress_due(10.0, 10.5, interval=0.5)


DONE = Progress(total_steps=5, step=5, done=True, files=("adapter_model.safetensors",))


def test_a_child_that_reported_done_and_exited_0_finished() -> None:
    assert training_failure(DONE, 0) == ""
    assert training_failure(DONE, None) == ""  # adopted: its exit status is not ours to read


def test_what_the_child_said_beats_how_it_exited() -> None:
    failed = Progress(error="CUDA out of memory")
    assert training_failure(failed, 1) == "training failed: CUDA out of memory"
    assert training_failure(failed, -signal.SIGKILL) == "training failed: CUDA out of memory"


def test_an_exit_without_done_or_with_a_bad_status_fails_saying_how() -> None:
    assert training_failure(DONE, 3) == "the training child exited with code 3"
    assert training_failure(Progress(), -signal.SIGKILL) == "the training child was killed by SIGKILL"
    assert training_failure(Progress(), 0) == "the training child exited with code 0 without reporting done"
    assert training_failure(Progress(), None) == "the training child exited without reporting done"


def test_an_adopted_job_goes_on_while_its_child_lives_or_once_it_finished() -> None:
    assert adoption_problem(Progress(step=2), child_alive=True) == ""
    assert adoption_problem(DONE, child_alive=False) == ""
    lost = "the training child exited while the agent was down, without reporting done"
    assert adoption_problem(Progress(step=2), child_alive=False) == lost
    assert adoption_problem(Progress(done=True, error="disk full"), child_alive=False) == lost


def test_an_upload_may_take_the_link_wait_plus_a_second_per_mebibyte() -> None:
    assert upload_time_limit([]) == UPLOAD_WAIT
    files = [FileDigest(name="a", size=3 * 2**20, sha256="0"), FileDigest(name="b", size=2**20, sha256="0")]
    assert upload_time_limit(files) == UPLOAD_WAIT + 4
