"""lora_convert: finding llama.cpp's converter, its command line and its environment (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.lora_convert import convert_argv, converter_env, find_converter
from llmgw.core.training import GGUF_FILE


def layout(root: Path, *, gguf_py: bool = True, conversion: bool = True, hf_script: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    script = root / "convert_lora_to_gguf.py"
    script.write_text("# converter\n")
    if gguf_py:
        (root / "gguf-py" / "gguf").mkdir(parents=True)
    if conversion:
        (root / "conversion").mkdir()
    if hf_script:
        (root / "convert_hf_to_gguf.py").write_text("# older trees keep the model classes here\n")
    return script


def test_find_converter_accepts_a_complete_tree(tmp_path: Path) -> None:
    script = layout(tmp_path / "llama.cpp")
    assert find_converter(str(script)) == script


def test_find_converter_accepts_an_older_tree_with_convert_hf(tmp_path: Path) -> None:
    script = layout(tmp_path / "llama.cpp", conversion=False, hf_script=True)
    assert find_converter(str(script)) == script


@pytest.mark.parametrize("configured", [None, ""])
def test_find_converter_without_configuration(configured: str | None) -> None:
    assert find_converter(configured) is None


def test_find_converter_refuses_what_cannot_run(tmp_path: Path) -> None:
    assert find_converter(str(tmp_path / "missing" / "convert_lora_to_gguf.py")) is None
    no_gguf = layout(tmp_path / "no-gguf", gguf_py=False)
    assert find_converter(str(no_gguf)) is None
    no_models = layout(tmp_path / "no-models", conversion=False)
    assert find_converter(str(no_models)) is None
    assert find_converter(str(tmp_path / "no-gguf")) is None  # a directory, not the script
    assert find_converter("convert_lora_to_gguf.py") is None  # relative: depends on the cwd


def test_convert_argv_always_passes_base() -> None:
    argv = convert_argv(
        "/usr/bin/python3",
        Path("/opt/llama.cpp/convert_lora_to_gguf.py"),
        Path("/jobs/j1/out"),
        Path("/models/llama"),
        Path("/jobs/j1/out") / GGUF_FILE,
    )
    assert argv[:2] == ["/usr/bin/python3", "/opt/llama.cpp/convert_lora_to_gguf.py"]
    assert argv[argv.index("--base") + 1] == "/models/llama"
    assert argv[argv.index("--outfile") + 1] == "/jobs/j1/out/adapter.gguf"
    assert argv[argv.index("--outtype") + 1] == "f32"
    assert argv[-1] == "/jobs/j1/out"  # the positional adapter directory comes last
    assert "--base-model-id" not in argv


def test_converter_env_puts_the_gguf_py_beside_the_script_first() -> None:
    script = Path("/opt/llama.cpp/convert_lora_to_gguf.py")
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/overlay", "NO_LOCAL_GGUF": "1"}
    env = converter_env(script, base)
    assert env["PYTHONPATH"] == "/opt/llama.cpp/gguf-py:/overlay"
    assert "NO_LOCAL_GGUF" not in env
    assert env["PATH"] == "/usr/bin"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert base["NO_LOCAL_GGUF"] == "1"  # the caller's mapping is left alone


def test_converter_env_without_a_base() -> None:
    env = converter_env(Path("/opt/llama.cpp/convert_lora_to_gguf.py"))
    assert env["PYTHONPATH"] == "/opt/llama.cpp/gguf-py"
    assert set(env) == {"PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONDONTWRITEBYTECODE"}
