"""A profile serving a stored adapter, through real processes: a server whose store keeps an
adapter (put there as a finished job leaves it), an agent running fake engines. The server sends
the adapter's files to the node before the replica starts; the engine is started with --lora on
the delivered copy, whose files match the stored digests. A profile naming an adapter the server
does not keep is refused by the admin API with the field named, and one declared in server.yaml
(which is read before the adapters) fails to start with that reason."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
from pathlib import Path

import pytest
import yaml

from llmgw.agent import shard_state
from llmgw.core import jobs as core_jobs
from llmgw.core.training import FileDigest, JobState, TrainSpec
from llmgw.server.jobs import Adapter, _adapter_row, _job_row
from llmgw.server.store import ops
from llmgw.server.store.sqlite import _Tx as SqliteTx
from llmgw.server.store.sqlite import open_writer
from tests.e2e.test_replicas_processes import fake_llama_server
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml

pytestmark = pytest.mark.slow

MODEL = "tiny"
# Over one piece (512 KiB), so the copy arrives in several.
ADAPTER_FILES = {
    "adapter_model.safetensors": b"\x01" * 4096,
    "adapter_config.json": b'{"r": 8, "lora_alpha": 16}',
    "adapter.gguf": bytes(range(256)) * 2500,
}


def keep_adapter(data_dir: Path, name: str) -> tuple[FileDigest, ...]:
    """What a succeeded job leaves: the files under <data_dir>/adapters/<name>/ and, in one
    transaction, the job's row and the adapter's."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = data_dir / "adapters" / name
    directory.mkdir(mode=0o700, parents=True)
    for file, data in ADAPTER_FILES.items():
        (directory / file).write_bytes(data)
    files = tuple(
        FileDigest(name=file, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for file, data in ADAPTER_FILES.items()
    )
    now = time.time()
    spec = TrainSpec(job_id="j-0001", model=MODEL, adapter=name, base_dir="/models/tiny", gguf=True)
    job = core_jobs.Job(
        id="j-0001", node="n1", spec=spec, state=JobState.SUCCEEDED, created=now, finished=now, files=files
    )
    adapter = Adapter(name=name, model=MODEL, job_id=job.id, created=now, files=files, gguf=True)
    conn = open_writer(data_dir)  # before the server starts: no event loop needed
    try:
        with conn:
            ops.finish_job(SqliteTx(conn), _job_row(job), _adapter_row(adapter))
    finally:
        conn.close()
    return files


def cpu_profile(adapter_source: str, **fields: object) -> dict:
    return {
        "model": MODEL,
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 256,
        "cpu_cores": 1,
        "adapters": [{"name": f"{adapter_source}-lora", "source": adapter_source}],
        **fields,
    }


def replica_of(server: Server, profile: str) -> dict | None:
    found = [r for r in server.admin("GET", "/admin/v1/replicas")["replicas"] if r["profile"] == profile]
    return found[0] if found else None


def test_a_profile_serves_a_stored_adapter_delivered_to_its_node(tmp_path: Path):
    server = Server(
        tmp_path,
        heartbeat_interval=0.5,
        missed_heartbeats=4,
        # Long enough that a failed start stays visible while the test looks.
        reconcile={"restart": {"initial_delay": "60s"}},
    )
    files = keep_adapter(server.data_dir, "qa")
    catalog = {
        "models": {MODEL: {"path": "/models/tiny.gguf", "format": "gguf"}},
        "profiles": {"tiny-qa": cpu_profile("qa"), "tiny-gone": cpu_profile("gone")},
    }
    write_yaml(server.config, {**yaml.safe_load(server.config.read_text()), **catalog})
    server.start()
    engines = {"llama_server": fake_llama_server(tmp_path), "run_as": None, "stop_grace": "2s"}
    agent = start_agent(tmp_path, server, "n1", engines=engines)
    work_dir = tmp_path / "agent-n1"
    try:
        ready = wait_until(
            lambda: (r := replica_of(server, "tiny-qa")) and r["state"] == "Ready" and r,
            "the tiny-qa replica to be Ready",
            deadline=60,
            proc=agent,
        )
        # The engine was given the delivered GGUF, and the copy is exactly what the server keeps.
        [(_, record)] = [
            (d, r)
            for d, r in shard_state.read_all(work_dir / "shards")
            if r.spec.shard_id == ready["shards"][0]["shard_id"]
        ]
        argv = record.processes[-1].argv
        lora = Path(argv[argv.index("--lora") + 1])
        assert lora.name == "adapter.gguf" and lora.parent.parent == work_dir / "adapters"
        assert lora.parent.name.startswith("qa-")
        gguf = next(f for f in files if f.name == "adapter.gguf")
        data = lora.read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (gguf.size, gguf.sha256)
        assert sorted(p.name for p in lora.parent.iterdir()) == ["adapter.gguf"]  # what llama.cpp loads
        # The spec kept (and reported) is the server's: the path on the node is for argv only.
        assert [(a.source, a.path) for a in record.spec.adapters] == [("qa", "")]

        # server.yaml's profile naming an adapter nobody kept: its start fails, saying why.
        def gone_reason() -> str:
            record = replica_of(server, "tiny-gone")
            reasons = [record["reason"], *(s["reason"] for s in record["shards"])] if record else []
            return next((r for r in reasons if "no stored adapter" in r), "")

        reason = wait_until(gone_reason, "the tiny-gone replica to fail", deadline=30)
        assert "adapter 'gone-lora': no stored adapter 'gone' of model 'tiny'" in reason
        assert "no stored adapter 'gone'" in server.proc.output()

        # Through the admin API, such a profile is refused with the field named.
        try:
            server.admin(
                "POST",
                "/admin/v1/catalog",
                {"profiles": [{"name": "tiny-x", **cpu_profile("nope")}]},
            )
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
            assert e.code == 400, body
            assert body["error"]["problems"] == [
                "profiles.tiny-x.adapters[0].source: no stored adapter 'nope' of model 'tiny'"
            ]
        else:
            raise AssertionError("a profile naming an adapter that is not kept was accepted")
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(work_dir)
