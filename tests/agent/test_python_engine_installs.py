"""vLLM and SGLang releases installed by the agent into a virtual environment each, offline, from
a local wheelhouse holding stand-in packages under the engines' names (tests/stand_in_engine.py):
the pinned version, one install shared by concurrent shards, the engine's entry point run from the
environment, pip's own reason when a version is not there, nothing half-made left behind."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import trio

from llmgw.agent.installs import EngineInstalls, InstallFailed, PythonEngineSource
from llmgw.core.engines import EngineBinaries
from llmgw.core.shard import ShardSpec
from llmgw.ctl import engine_check
from tests.stand_in_engine import build_wheel, venv_python

pytestmark = pytest.mark.slow


def spec(engine: str, version: str) -> ShardSpec:
    return ShardSpec(
        shard_id=f"{engine}-{version}-s0",
        replica_id="r1",
        model="m",
        model_path="/models/m",
        engine=engine,
        engine_version=version,
        port=1,
    )


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("stand-ins")
    house = work / "wheelhouse"
    build_wheel(work, "vllm", "0.33.0", house)
    build_wheel(work, "sglang", "0.5.23", house)
    # A release that renamed a flag llmgw gives every vLLM (as releases do): its help lacks it.
    build_wheel(work, "vllm", "0.35.0", house, without_flags=("--served-model-name",))
    return house


def offline(engines_dir: Path, wheelhouse: Path, python: str | None = None) -> EngineInstalls:
    source = PythonEngineSource(venv_python=python or venv_python(), find_links=str(wheelhouse))
    return EngineInstalls(engines_dir, python=source)


async def test_pinned_releases_are_installed_offline_once_each_and_run_from_their_environment(
    tmp_path: Path, wheelhouse: Path
) -> None:
    engines_dir = tmp_path / "engines"
    installs = offline(engines_dir, wheelhouse)
    progress: list[str] = []
    results: dict[str, list[Path]] = {"vllm": [], "sglang": []}

    async def one(engine: str, version: str) -> None:
        results[engine].append(await installs.ensure(spec(engine, version), progress.append))

    async with trio.open_nursery() as nursery:
        for _ in range(2):  # two shards of each at once: one install each
            nursery.start_soon(one, "vllm", "0.33.0")
            nursery.start_soon(one, "sglang", "0.5.23")
    vllm_venv = engines_dir / "vllm-0.33.0" / "venv"
    sglang_venv = engines_dir / "sglang-0.5.23" / "venv"
    assert results == {"vllm": [vllm_venv, vllm_venv], "sglang": [sglang_venv, sglang_venv]}
    assert progress.count("installing vLLM 0.33.0: making its virtual environment") == 1
    assert progress.count("installing SGLang 0.5.23: making its virtual environment") == 1
    assert any(line.startswith("installing vLLM 0.33.0: Processing ") for line in progress), progress
    assert any("Successfully installed vllm-0.33.0" in line for line in progress), progress
    # Checked against its own help before any replica runs it (its help passes).
    assert "installing vLLM 0.33.0: checking its flags against `vllm serve --help=all`" in progress
    assert (
        "installing SGLang 0.5.23: checking its flags against `python -m sglang.launch_server --help`"
        in progress
    )

    # The shard's command lines name the environment's entry points, and they run.
    binaries = installs.binaries(spec("vllm", "0.33.0"), EngineBinaries())
    assert binaries.vllm == str(vllm_venv / "bin" / "vllm") and binaries.ray == str(vllm_venv / "bin" / "ray")
    # Its Python too: vLLM's CPU build is started by module with it.
    assert binaries.python == str(vllm_venv / "bin" / "python") and binaries.llama_server == "llama-server"
    assert installs.binaries(spec("sglang", "0.5.23"), EngineBinaries()).python == str(
        sglang_venv / "bin" / "python"
    )
    assert (await version_of(binaries.vllm))[:3] == ["vllm", "0.33.0", "stand-in"]
    sglang = await version_of(str(sglang_venv / "bin/python"), "-m", "sglang.launch_server")
    assert sglang[:3] == ["sglang", "0.5.23", "stand-in"]
    # Run by the environment's interpreter, not the one that made it.
    assert sglang[3] == str(sglang_venv / "bin/python")
    check_published(engines_dir, vllm_venv)
    # ctl engine-check finds what the agent installed.
    assert engine_check.find_python_engine("vllm", "vllm", engines_dir)[0] == binaries.vllm
    assert engine_check.find_python_engine("sglang", "python", engines_dir)[0] == str(
        sglang_venv / "bin/python"
    )

    # Installed: the next shard does not run pip, even with a wheelhouse that is gone.
    again = offline(engines_dir, tmp_path / "no-such-wheelhouse")
    later: list[str] = []
    assert await again.ensure(spec("vllm", "0.33.0"), later.append) == vllm_venv
    assert later == []


async def test_a_version_not_in_the_wheelhouse_fails_with_pips_reason_and_leaves_nothing(
    tmp_path: Path, wheelhouse: Path
) -> None:
    engines_dir = tmp_path / "engines"
    with pytest.raises(InstallFailed) as failed:
        await offline(engines_dir, wheelhouse).ensure(spec("vllm", "0.34.0"), print)
    reason = str(failed.value)
    assert reason.startswith("engine install: vLLM 0.34.0: ")
    assert "ERROR: Could not find a version that satisfies the requirement vllm==0.34.0" in reason, reason
    assert not (engines_dir / "vllm-0.34.0").exists()

    with pytest.raises(InstallFailed, match="cannot run /nonexistent/python3 .*engines.venv_python"):
        await offline(engines_dir, wheelhouse, python="/nonexistent/python3").ensure(
            spec("vllm", "0.33.0"), print
        )
    assert not (engines_dir / "vllm-0.33.0").exists()

    with pytest.raises(InstallFailed, match="expected a pinned release"):
        offline(engines_dir, wheelhouse).binaries(spec("vllm", ">=0.33"), EngineBinaries())


async def test_a_release_whose_help_lacks_a_flag_fails_its_shards_and_is_not_installed_again(
    tmp_path: Path, wheelhouse: Path
) -> None:
    engines_dir = tmp_path / "engines"
    progress: list[str] = []
    with pytest.raises(InstallFailed) as failed:
        await offline(engines_dir, wheelhouse).ensure(spec("vllm", "0.35.0"), progress.append)
    reason = str(failed.value)
    assert reason.startswith(
        "engine check: vLLM 0.35.0: its help lacks flags llmgw gives it: --served-model-name ("
    )
    assert "vLLM mp 2 nodes, rank 0" in reason  # which commands use it
    # Kept and marked: the next shard fails at once with the same reason, without pip.
    assert (engines_dir / "vllm-0.35.0" / "installed.json").is_file()
    later: list[str] = []
    with pytest.raises(InstallFailed) as again:
        await offline(engines_dir, tmp_path / "no-wheelhouse").ensure(spec("vllm", "0.35.0"), later.append)
    assert str(again.value) == reason and later == []


async def test_a_partial_environment_left_by_a_dead_agent_is_made_again(
    tmp_path: Path, wheelhouse: Path
) -> None:
    engines_dir = tmp_path / "engines"
    partial = engines_dir / "sglang-0.5.23" / "venv" / "bin"
    partial.mkdir(parents=True)
    (partial / "python").write_text("#!/bin/sh\nexit 1\n")  # no installed.json beside it
    venv = await offline(engines_dir, wheelhouse).ensure(spec("sglang", "0.5.23"), print)
    assert (await version_of(str(venv / "bin/python"), "-m", "sglang.launch_server"))[:2] == [
        "sglang",
        "0.5.23",
    ]


async def version_of(*argv: str) -> list[str]:
    """What the entry point answers to --version, as words."""
    with trio.fail_after(60):
        done = await trio.run_process([*argv, "--version"], capture_stdout=True, capture_stderr=True)
    return done.stdout.decode().split()


def check_published(engines_dir: Path, venv: Path) -> None:
    """Root's, and readable by every user: the engines' user runs it, only root changes it."""
    for path in (engines_dir, venv.parent, venv / "bin", venv / "bin" / "vllm"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
        assert path.stat().st_uid == 0
    done = json.loads((venv.parent / "installed.json").read_text())
    assert "vllm==0.33.0" in done["what"]
