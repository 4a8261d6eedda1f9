"""Adapters move with the store: a SQLite store keeping an adapter whose files are only in its
data_dir (as an older llmgw kept them) is copied with `llmgw server store copy` into a real
PostgreSQL; a server on the new store with an EMPTY data_dir — another machine — rebuilds the
files from the store and delivers them to a node, whose engine starts with exactly those bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmgw.agent import shard_state
from tests.e2e.test_adapter_delivery_processes import MODEL, cpu_profile, keep_adapter, replica_of
from tests.e2e.test_replicas_processes import fake_llama_server
from tests.helpers import PROJECT_ROOT
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml

pytestmark = pytest.mark.slow


def test_a_server_with_an_empty_data_dir_on_the_copied_store_delivers_a_stored_adapter(
    tmp_path: Path, pg_cluster
):
    old = tmp_path / "old"
    old.mkdir()
    files = keep_adapter(old / "data", "qa")
    source_config = write_yaml(old / "server.yaml", {"data_dir": str(old / "data")})
    url = pg_cluster.url(pg_cluster.create_database())
    copied = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw",
            "server",
            "store",
            "copy",
            "--config",
            str(source_config),
            "--to",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PROJECT_ROOT,
        env={**os.environ, "LLMGW_TARGET_STORE_PASSWORD": pg_cluster.password},
    )
    assert copied.returncode == 0, copied.stderr
    chunks = next(line for line in copied.stdout.splitlines() if line.startswith("adapter_chunks"))
    assert int(chunks.split()[1]) >= len(files)
    assert "warning" not in copied.stderr

    new = tmp_path / "new"
    new.mkdir()
    password_file = new / "store-password"
    password_file.write_text(pg_cluster.password + "\n")
    password_file.chmod(0o600)
    server = Server(new, heartbeat_interval=0.5, missed_heartbeats=20)
    assert not server.data_dir.exists()  # nothing of the old machine here
    catalog = {
        "models": {MODEL: {"path": "/models/tiny.gguf", "format": "gguf"}},
        "profiles": {"tiny-qa": cpu_profile("qa")},
    }
    config = yaml.safe_load(server.config.read_text())
    write_yaml(server.config, {**config, **catalog, "store": url, "store_password_file": str(password_file)})
    server.start()
    engines = {"llama_server": fake_llama_server(new), "run_as": None, "stop_grace": "2s"}
    agent = start_agent(new, server, "n1", engines=engines)
    work_dir = new / "agent-n1"
    try:
        ready = wait_until(
            lambda: (r := replica_of(server, "tiny-qa")) and r["state"] == "Ready" and r,
            "the tiny-qa replica to be Ready",
            deadline=60,
            proc=agent,
        )
        # The new server wrote the files from the store, each matching its manifest.
        for digest in files:
            data = (server.data_dir / "adapters" / "qa" / digest.name).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (digest.size, digest.sha256)
        assert "written from the store" in server.proc.output()
        # The node got them and the engine was started on the delivered GGUF.
        [record] = [
            r
            for _, r in shard_state.read_all(work_dir / "shards")
            if r.spec.shard_id == ready["shards"][0]["shard_id"]
        ]
        argv = record.processes[-1].argv
        lora = Path(argv[argv.index("--lora") + 1])
        assert lora.parent.parent == work_dir / "adapters"
        gguf = next(f for f in files if f.name == "adapter.gguf")
        data = lora.read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (gguf.size, gguf.sha256)
    finally:
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(work_dir)
