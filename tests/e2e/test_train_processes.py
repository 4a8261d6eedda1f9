"""`llmgw ctl train` through real processes: server, agent, the real training child and converter.

The tiny Llama of tests/tiny_llama.py is trained on the CPU. The agent runs the child as root
here (engines.run_as: null): the test venv's Python lives under /root, which the engines' user
cannot enter; tests/test_trainer.py shows the child running as that user.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.processes import read_cmdline
from tests.procs import Server, start_agent, wait_until, write_yaml
from tests.real_parts import llama_cpp_converters, require_converters, require_training_stack
from tests.tiny_llama import QA_PAIRS, tiny_llama_dir, tiny_llama_gguf

pytestmark = pytest.mark.slow

# The child imports torch and loads the model before its first step: seconds when idle, far more
# on a loaded 2-core machine.
FIRST_STEP_DEADLINE = 180.0
# A whole job (torch import, 30 steps, conversion): about 15 s when idle.
JOB_DEADLINE = 600.0

MODEL = "tiny"


@pytest.fixture(scope="module")
def parts():
    require_training_stack()
    require_converters()
    return tiny_llama_dir(), llama_cpp_converters() / "convert_lora_to_gguf.py"


def start_fleet(tmp_path: Path, converter: Path, base: Path, **extra: object) -> tuple[Server, object]:
    """A server whose catalog serves the tiny model with llama.cpp (its GGUF; training reads the
    safetensors directory `base` on the node), and one agent, cpu-1; ``extra``: more top-level
    sections of both configs (tracing)."""
    # A 6 s liveness window: training on the CPU starves the agent of it for a while on a loaded
    # machine, and a node that looks lost fails its job (a killed agent is still seen within it).
    server = Server(tmp_path, heartbeat_interval=0.5, missed_heartbeats=12)
    # A llama.cpp profile serves the model, so its adapters are converted to GGUF; no replica
    # runs (min_replicas 0): this test is about training.
    catalog = {
        "models": {MODEL: {"path": str(tiny_llama_gguf()), "format": "gguf"}},
        "profiles": {
            "tiny-cpu": {
                "model": MODEL,
                "engine": "llamacpp",
                "gpu_class": None,
                "memory_mib": 256,
                "min_replicas": 0,
                "max_replicas": 1,
            }
        },
    }
    import yaml

    write_yaml(server.config, {**yaml.safe_load(server.config.read_text()), **catalog, **extra})
    server.start()
    engines = {"run_as": None, "train_python": sys.executable, "lora_converter": str(converter)}
    agent = start_agent(tmp_path, server, "cpu-1", engines=engines, **extra)
    wait_until(lambda: server.nodes().get("cpu-1", {}).get("connected"), "the agent", proc=agent)
    return server, agent


def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in QA_PAIRS)
    )
    return path


def train(server: Server, tmp_path: Path, base: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """`ctl train`, which follows the job to its end unless --detach: a whole job's time."""
    return server.ctl(
        "train", "--model", MODEL, "--node", "cpu-1", "--base-dir", str(base),
        "--data", str(pairs_file(tmp_path)), "--name", name, *extra,
        timeout=JOB_DEADLINE,
    )  # fmt: skip


def job(server: Server, job_id: str) -> dict:
    return server.admin("GET", f"/admin/v1/jobs/{job_id}")


def child_pids(job_id: str) -> list[int]:
    """Processes whose command line runs this job's training child."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmdline = read_cmdline(int(entry.name)) or ()
            if any("train_child.py" in part for part in cmdline) and any(job_id in part for part in cmdline):
                found.append(int(entry.name))
    return found


def kill_children(job_id: str) -> None:
    for pid in child_pids(job_id):
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ctl_train_follows_a_real_job_to_a_gguf_adapter_kept_and_downloadable(tmp_path, parts):
    base, converter = parts
    server, agent = start_fleet(tmp_path, converter, base)
    try:
        started = time.monotonic()
        result = train(server, tmp_path, base, "tiny-qa", "--steps", "30", "--lr", "0.003")
        wall = time.monotonic() - started
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Succeeded" in result.stdout

        jobs = server.admin("GET", "/admin/v1/jobs")["jobs"]
        assert [(j["adapter"], j["state"]) for j in jobs] == [("tiny-qa", "Succeeded")]
        shown = job(server, jobs[0]["id"])
        assert shown["step"] == shown["total_steps"] == 30
        assert shown["peak_mib"] > 0 and shown["device"] == "cpu"
        timings = shown["timings"]
        print(
            f"\njob wall {wall:.1f} s (ctl): queue {timings['queue']:.2f} s, train {timings['train']:.2f} s,"
            f" convert {timings['convert']:.2f} s, upload {timings['upload']:.2f} s;"
            f" peak RSS {shown['peak_mib']} MiB"
        )

        adapters = {a["name"]: a for a in server.admin("GET", "/admin/v1/adapters")["adapters"]}
        assert adapters["tiny-qa"]["model"] == MODEL and adapters["tiny-qa"]["gguf"]
        files = {f["name"]: f for f in adapters["tiny-qa"]["files"]}
        assert set(files) == {"adapter_model.safetensors", "adapter_config.json", "adapter.gguf"}

        out = tmp_path / "downloaded"
        result = server.ctl("adapters", "download", "tiny-qa", "-o", str(out))
        assert result.returncode == 0, result.stderr
        for name, digest in files.items():
            data = (out / name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest["sha256"]
            assert (out / name).stat().st_mode & 0o777 == 0o600
        assert (out / "adapter.gguf").read_bytes()[:4] == b"GGUF"
        # The agent keeps nothing of a finished job.
        assert not list((tmp_path / "agent-cpu-1" / "jobs").glob("*/run"))
    finally:
        agent.stop()
        server.proc.stop()


def test_a_job_whose_agent_is_killed_fails_with_that_reason(tmp_path, parts):
    base, converter = parts
    server, agent = start_fleet(tmp_path, converter, base)
    job_id = ""
    try:
        result = train(server, tmp_path, base, "long-one", "--steps", "100000", "--detach", "--json")
        assert result.returncode == 0, result.stderr
        job_id = json.loads(result.stdout)["id"]
        wait_until(
            lambda: job(server, job_id)["step"] >= 1, "training to begin", FIRST_STEP_DEADLINE, proc=agent
        )

        agent.kill9()
        failed = wait_until(
            lambda: (j := job(server, job_id))["state"] == "Failed" and j, "the job to fail", proc=server.proc
        )
        assert failed["reason"] == "node cpu-1 lost"
    finally:
        kill_children(job_id)  # the child outlives a killed agent, as engines do
        server.proc.stop()


def test_cancel_stops_the_child(tmp_path, parts):
    base, converter = parts
    server, agent = start_fleet(tmp_path, converter, base)
    job_id = ""
    try:
        result = train(server, tmp_path, base, "to-cancel", "--steps", "100000", "--detach", "--json")
        job_id = json.loads(result.stdout)["id"]
        wait_until(
            lambda: job(server, job_id)["step"] >= 1, "training to begin", FIRST_STEP_DEADLINE, proc=agent
        )
        pids = child_pids(job_id)
        assert pids, "the child runs"

        result = server.ctl("job", "cancel", job_id)
        assert result.returncode == 0, result.stderr
        wait_until(lambda: job(server, job_id)["state"] == "Cancelled", "the job to be cancelled")
        wait_until(lambda: not child_pids(job_id), "the child to be gone")
        assert not (tmp_path / "agent-cpu-1" / "jobs" / job_id).exists()
    finally:
        kill_children(job_id)
        agent.stop()
        server.proc.stop()


def test_a_bad_pairs_line_is_refused_with_its_number_before_anything_is_sent(tmp_path, parts):
    base, converter = parts
    server, agent = start_fleet(tmp_path, converter, base)
    try:
        data = tmp_path / "bad.jsonl"
        data.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
        result = server.ctl(
            "train", "--model", MODEL, "--node", "cpu-1", "--base-dir", str(base),
            "--data", str(data), "--name", "bad",
        )  # fmt: skip
        assert result.returncode == 2
        assert "line 2" in result.stderr and "answer" in result.stderr
        assert server.admin("GET", "/admin/v1/jobs")["jobs"] == []
    finally:
        agent.stop()
        server.proc.stop()
