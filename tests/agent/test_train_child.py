"""The training child as the agent runs it: a subprocess on the tiny Llama, JSON events on stdout.

One thread (OMP_NUM_THREADS=1), a minimal environment, the script copied into the job directory.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.real_parts import require_training_stack
from tests.tiny_llama import TRAIN_PARAMS, child_env, tiny_llama_dir, write_job

# Module level: without torch and peft there is nothing here to run.
require_training_stack()

pytestmark = pytest.mark.slow

# Training 50 steps takes ~5 s alone; generous for a loaded 2-core machine.
RUN_DEADLINE = 300.0
STOP_DEADLINE = 10.0  # SIGTERM to exit: the default action ends the process at once


def run_child(argv: list[str]) -> tuple[int, list[dict], str]:
    done = subprocess.run(
        argv, capture_output=True, text=True, env=child_env(), timeout=RUN_DEADLINE, stdin=subprocess.DEVNULL
    )
    # Every stdout line is one JSON object: json.loads fails the test on anything else.
    events = [json.loads(line) for line in done.stdout.splitlines()]
    return done.returncode, events, done.stderr


def test_child_trains_an_adapter(tmp_path: Path) -> None:
    base = tiny_llama_dir()
    argv = write_job(tmp_path / "job", base)
    started = time.monotonic()
    rc, events, stderr = run_child(argv)
    took = time.monotonic() - started
    assert rc == 0, f"child exited {rc}: {events[-1:]}\n{stderr[-3000:]}"

    steps = TRAIN_PARAMS["steps"]
    assert events[0] == {"event": "start", "total_steps": steps, "device": "cpu", "examples": 20}
    step_events = events[1:-1]
    assert [e["step"] for e in step_events] == list(range(1, steps + 1))
    for e in step_events:
        assert e["event"] == "step" and e["total_steps"] == steps
        assert math.isfinite(e["loss"]) and e["peak_mib"] > 0
    done = events[-1]
    assert done["event"] == "done" and done["peak_mib"] > 0
    assert done["files"] == ["adapter_model.safetensors", "adapter_config.json"]

    losses = [e["loss"] for e in step_events]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"\n50 steps in {took:.1f}s; loss {first:.3f} -> {last:.3f}; peak RSS {done['peak_mib']} MiB")
    assert last < 0.6 * first, losses

    out = tmp_path / "job" / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(done["files"])  # nothing half-written left
    for name in done["files"]:
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    # The same job trains the same adapter: the losses repeat exactly (the first steps suffice:
    # the batches and the adapter's initial weights do not depend on the number of steps).
    rc, again, stderr = run_child(write_job(tmp_path / "again", base, steps=5))
    assert rc == 0, stderr[-3000:]
    assert [e["loss"] for e in again[1:-1]] == losses[:5]


def test_epochs_decide_the_length_when_steps_is_zero(tmp_path: Path) -> None:
    rc, events, stderr = run_child(write_job(tmp_path / "job", tiny_llama_dir(), steps=0, epochs=1))
    assert rc == 0, stderr[-3000:]
    assert events[0]["total_steps"] == 5  # 20 pairs in batches of 4, once
    assert [e["event"] for e in events] == ["start"] + ["step"] * 5 + ["done"]


def test_bad_base_dir_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    rc, events, _ = run_child(write_job(tmp_path / "job", missing))
    assert rc == 1
    assert len(events) == 1 and events[0]["event"] == "error", events
    assert "base_dir" in events[0]["message"] and str(missing) in events[0]["message"]
    assert not (tmp_path / "job" / "out").exists()


def test_bad_pairs_line_is_an_error_naming_it(tmp_path: Path) -> None:
    argv = write_job(tmp_path / "job", tiny_llama_dir())
    pairs = tmp_path / "job" / "pairs.jsonl"
    pairs.write_text(pairs.read_text() + "\n{not json\n")
    rc, events, _ = run_child(argv)
    assert rc == 1
    assert len(events) == 1 and events[0]["event"] == "error", events
    assert "pairs_path" in events[0]["message"] and "line 22" in events[0]["message"], events


def test_bad_target_module_is_an_error_naming_it(tmp_path: Path) -> None:
    rc, events, _ = run_child(write_job(tmp_path / "job", tiny_llama_dir(), target_modules=["nope_proj"]))
    assert rc == 1
    assert events[-1]["event"] == "error" and "params.target_modules" in events[-1]["message"], events
    assert not any(e["event"] == "done" for e in events)


def test_sigterm_stops_the_child_promptly(tmp_path: Path) -> None:
    argv = write_job(tmp_path / "job", tiny_llama_dir(), steps=100_000)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=child_env(),
        start_new_session=True,  # as the agent runs it: its own process group
    )
    try:
        seen = read_until_step(proc, RUN_DEADLINE)
        assert seen[0]["event"] == "start"
        stopped_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=STOP_DEADLINE) == -signal.SIGTERM
        print(f"\nstopped {time.monotonic() - stopped_at:.2f}s after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    assert not (tmp_path / "job" / "out" / "adapter_model.safetensors").exists()


def read_until_step(proc: subprocess.Popen, deadline: float) -> list[dict]:
    """The child's events up to its first step event, failing after ``deadline`` seconds."""
    events: list[dict] = []
    buffer = b""
    until = time.monotonic() + deadline
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while not any(e["event"] == "step" for e in events):
            left = until - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no step event after {deadline}s: {events}")
            if not selector.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"child exited ({proc.wait()}) before a step: {events}")
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            events += [json.loads(line) for line in lines if line]
    return events
