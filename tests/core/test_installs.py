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
