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


def test_profiles_may_name_a_llamacpp_build_only() -> None:
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
    vllm = problems(engine="vllm", model="s", gpu_class="h100-80g", gpus_per_node=1, engine_version="0.33.0")
    assert vllm == ["profiles.p.engine_version: agents install llama.cpp builds only, not vLLM"]
