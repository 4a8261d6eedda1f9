"""Engine build layout and order (llmgw.core.installs)."""

from __future__ import annotations

from pathlib import PurePath

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import installs


def test_builds_are_ordered_by_number_not_by_string() -> None:
    assert installs.newest_first(["llama-b9999", "llama-b10991", "llama-old", "llama-b10990"]) == [
        "llama-b10991",
        "llama-b10990",
        "llama-b9999",
        "llama-old",
    ]


@given(st.lists(st.integers(0, 10**6), unique=True))
def test_newest_first_is_descending_numbers(numbers: list[int]) -> None:
    ordered = installs.newest_first([f"llama-b{n}" for n in numbers])
    assert [int(name.removeprefix("llama-b")) for name in ordered] == sorted(numbers, reverse=True)


def test_layout_and_names() -> None:
    assert installs.llamacpp_build_dir(PurePath("/e"), "10991", "cpu") == PurePath(
        "/e/b10991-cpu/llama-b10991"
    )
    assert installs.llamacpp_build_dir(PurePath("/e"), "b10991", "cuda12") == PurePath(
        "/e/b10991-cuda12/llama-b10991"
    )
    assert installs.version_problem("b10991") is None and installs.version_problem("10991") is None
    assert installs.version_problem("../x") == "expected a llama.cpp build like b10991 or 10991, got '../x'"
    assert installs.variant_problem("cuda12") is None
    assert installs.variant_problem("CUDA/12") is not None


def test_profiles_name_a_llamacpp_build_or_a_pinned_python_engine_release() -> None:
    from llmgw.core.catalog import Model, Profile, validate_profile

    models = {
        "m": Model(name="m", path="/m.gguf", format="gguf"),
        "s": Model(name="s", path="/s", format="safetensors"),
    }

    def problems(**options) -> list[str]:
        base = {"name": "p", "model": "m", "engine": "llamacpp", "gpu_class": None, "memory_mib": 512}
        return validate_profile(Profile(**{**base, **options}), models)

    assert problems(engine_version="b10991") == []
    assert problems(engine_version="latest") == [
        "profiles.p.engine_version: expected a llama.cpp build like b10991 or 10991, got 'latest'"
    ]
    # vLLM and SGLang: a pinned release, installed into a virtual environment.
    gpu = {"model": "s", "gpu_class": "h100-80g", "gpus_per_node": 1}
    for engine in ("vllm", "sglang"):
        for version in ("0.33.0", "0.5.23.post1", "1.0rc2"):
            assert problems(engine=engine, **gpu, engine_version=version) == [], (engine, version)
        for version in (">=0.33", "latest", "0.33.*", "b10991"):
            assert problems(engine=engine, **gpu, engine_version=version) == [
                f"profiles.p.engine_version: expected a pinned release like 0.33.0 or 0.32.0-cpu (no ranges, no names),"
                f" got {version!r}"
            ], (engine, version)


def test_pip_is_configured_through_its_environment_and_offline_with_a_wheelhouse_alone() -> None:
    from llmgw.core.installs import pip_environment

    offline = pip_environment(None, "/srv/wheelhouse")
    assert offline["PIP_FIND_LINKS"] == "/srv/wheelhouse" and offline["PIP_NO_INDEX"] == "1"
    assert "PIP_INDEX_URL" not in offline
    mirror = pip_environment("https://user:pw@mirror.example/simple", None)
    assert mirror["PIP_INDEX_URL"] == "https://user:pw@mirror.example/simple" and "PIP_NO_INDEX" not in mirror
    both = pip_environment("https://mirror.example/simple", "/srv/wheelhouse")
    assert "PIP_NO_INDEX" not in both and both["PIP_FIND_LINKS"] == "/srv/wheelhouse"
    assert "PIP_INDEX_URL" not in pip_environment(None, None)  # pip's own default index


def test_venv_layout_and_progress_lines() -> None:
    from llmgw.core.installs import pip_progress, venv_binaries, venv_root

    root = venv_root(PurePath("/e"), "vllm", "0.33.0")
    assert root == PurePath("/e/vllm-0.33.0")
    assert venv_binaries(root / "venv", ("vllm", "ray")) == {
        "vllm": "/e/vllm-0.33.0/venv/bin/vllm",
        "ray": "/e/vllm-0.33.0/venv/bin/ray",
    }
    assert venv_binaries(root / "venv", ("python",)) == {"python": "/e/vllm-0.33.0/venv/bin/python"}
    assert pip_progress("Collecting vllm==0.33.0\n") == "Collecting vllm==0.33.0"
    assert pip_progress("  Downloading vllm-0.33.0-py3-none-any.whl (1.2 MB)") == (
        "Downloading vllm-0.33.0-py3-none-any.whl (1.2 MB)"
    )
    assert pip_progress("Requirement already satisfied: pip") is None
    assert pip_progress("") is None


def test_a_new_install_fails_its_check_only_for_flags_a_complete_help_lacks() -> None:
    from llmgw.core.flags import CheckResult, install_problem

    users = {"--served-model-name": ["vLLM mp 2 nodes, rank 0", "vLLM, adapters loaded at run time"]}
    missing = CheckResult(missing=("--served-model-name",), truncated_warning=None)
    assert install_problem(missing, users) == (
        "its help lacks flags llmgw gives it: --served-model-name (vLLM mp 2 nodes, rank 0; vLLM, adapters"
        " loaded at run time)"
    )
    # A help that looks cut proves nothing missing: it passes (the caller logs the warning).
    cut = CheckResult(missing=("--served-model-name",), truncated_warning="the help has 34 lines")
    assert install_problem(cut, users) is None
    assert install_problem(CheckResult(missing=(), truncated_warning=None), {}) is None


def test_environments_are_ordered_by_release_number() -> None:
    from llmgw.core.installs import venvs_newest_first

    names = [
        "vllm-0.9.0",
        "vllm-0.33.0",
        "vllm-0.33.0.post1",
        "sglang-0.5.23",
        "b10991-cpu",
        "vllm-latest",
        "vllm-",
    ]
    assert venvs_newest_first("vllm", names) == ["vllm-0.33.0.post1", "vllm-0.33.0", "vllm-0.9.0"]
    assert venvs_newest_first("sglang", names) == ["sglang-0.5.23"]


def test_a_pin_may_name_a_build_of_its_own_distribution() -> None:
    """vLLM's CPU build is pinned as 0.32.0-cpu: release and variant, and only a variant the
    engine has; its environments are found with the others, by release number."""
    assert installs.split_variant("0.32.0-cpu") == ("0.32.0", "cpu")
    assert installs.split_variant("0.33.0") == ("0.33.0", None)
    assert installs.python_version_problem("0.32.0-cpu", ("cpu",)) is None
    problem = installs.python_version_problem("0.32.0-rocm", ("cpu",))
    assert problem is not None and "'rocm'" in problem and "cpu" in problem
    assert installs.python_version_problem("0.32.0-cpu") is not None  # an engine without variants
    assert installs.python_version_problem(">=0.32-cpu", ("cpu",)) is not None
    names = ["vllm-0.9.0", "vllm-0.32.0-cpu", "vllm-0.33.0", "vllm-0.32.0-rocm", "sglang-0.5.23"]
    assert installs.venvs_newest_first("vllm", names, ("cpu",)) == [
        "vllm-0.33.0",
        "vllm-0.32.0-cpu",
        "vllm-0.9.0",
    ]
