"""Adapters loaded at run time (a profile's max_loaded_adapters): vLLM's and SGLang's flags and
environment, checked against their captured help texts, and how their model lists are read."""

from __future__ import annotations

import attrs
import pytest

from llmgw.core import flags
from llmgw.core.catalog import Model, Profile, validate_profile
from llmgw.core.engines import build_plan, registry
from llmgw.core.engines.common import EngineBinaries
from llmgw.core.engines.samples import ADAPTERS, base
from llmgw.core.engines.validate import validate
from llmgw.core.engines.vllm import lora_rank_choice
from llmgw.core.training import lora_rank
from tests.helpers import TESTS

HELP = TESTS / "fixtures" / "engine-help"
HELP_FILES = {
    "vllm": HELP / "vllm-0.33.0-serve-help.txt",
    "sglang": HELP / "sglang-0.5.23-launch_server-help.txt",
}


def engine_command(engine: str, **changes: object):
    spec = base(engine, **changes)
    plan = build_plan(spec, engine_key="k", binaries=EngineBinaries())
    return next(c for c in plan.commands if c.name == "engine")


def value_after(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_on_demand_starts_with_room_for_n_adapters_and_none_registered() -> None:
    command = engine_command("vllm", max_loaded_adapters=3, max_lora_rank=12, adapters=ADAPTERS)
    assert "--enable-lora" in command.argv
    assert value_after(command.argv, "--max-loras") == "3"
    assert value_after(command.argv, "--max-lora-rank") == "16"  # 12 rounds up to vLLM's next choice
    assert "--lora-modules" not in command.argv
    assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_vllm_without_max_loaded_adapters_registers_them_at_start_as_before() -> None:
    command = engine_command("vllm", adapters=ADAPTERS)
    assert value_after(command.argv, "--lora-modules") == "a1=/adapters/a1"
    assert "--max-loras" not in command.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in command.env


def test_sglang_on_demand_flags() -> None:
    command = engine_command("sglang", max_loaded_adapters=4, adapters=ADAPTERS)
    assert "--enable-lora" in command.argv and "--lora-paths" not in command.argv
    assert value_after(command.argv, "--max-loaded-loras") == "4"
    # SGLang refuses --max-loaded-loras below --max-loras-per-batch (its default is 8).
    assert value_after(command.argv, "--max-loras-per-batch") == "4"
    assert value_after(command.argv, "--max-lora-rank") == "16"
    assert value_after(command.argv, "--lora-target-modules") == "all"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_on_demand_flag_is_in_the_engines_help(engine: str) -> None:
    command = engine_command(engine, max_loaded_adapters=4, max_lora_rank=64)
    result = flags.check(
        [command.argv[flags_prefix(engine) :]], HELP_FILES[engine].read_text(), engine=engine
    )
    assert result.missing == ()
    # And the help's own choices: vLLM's rank is one of its list.
    if engine == "vllm":
        assert "--max-lora-rank {1,8,16,32,64,128,256,320,512}" in HELP_FILES[engine].read_text()


def flags_prefix(engine: str) -> int:
    return registry.ENGINES[engine].help.argv_prefix


def test_vllm_rank_choices() -> None:
    assert [lora_rank_choice(r) for r in (None, 1, 2, 8, 9, 300, 512)] == [16, 1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError):
        lora_rank_choice(513)
    assert any(
        "above vLLM's largest" in r for r in validate(base("vllm", max_loaded_adapters=2, max_lora_rank=600))
    )


def test_llamacpp_cannot_load_at_run_time() -> None:
    spec = base("llamacpp", model_path="/m/x.gguf", dtype=None, quantization=None, gpus=(), tensor_parallel=1)
    assert any(
        "cannot load adapters at run time" in r for r in validate(attrs.evolve(spec, max_loaded_adapters=2))
    )


def problems(profile: Profile, models: dict[str, Model]) -> list[tuple[str, str]]:
    prefix = f"profiles.{profile.name}."
    return [tuple(r.removeprefix(prefix).split(": ", 1)) for r in validate_profile(profile, models)]


def test_the_catalog_refuses_max_loaded_adapters_where_it_cannot_apply() -> None:
    models = {
        "m": Model(name="m", path="/m/x.gguf", format="gguf"),
        "h": Model(name="h", path="/m/h", format="safetensors"),
    }
    llama = Profile(
        name="p", model="m", engine="llamacpp", gpu_class=None, memory_mib=1000, max_loaded_adapters=2
    )
    assert any(field == "max_loaded_adapters" for field, _ in problems(llama, models))
    vllm = Profile(
        name="v",
        model="h",
        engine="vllm",
        gpu_class="h100-80g",
        gpus_per_node=1,
        memory_mib=1000,
        max_loaded_adapters=0,
    )
    assert ("max_loaded_adapters", "must be at least 1, not 0") in problems(vllm, models)
    rank_alone = attrs.evolve(vllm, max_loaded_adapters=None, max_lora_rank=8)
    assert ("max_lora_rank", "applies with max_loaded_adapters only") in problems(rank_alone, models)
    assert not [r for r in problems(attrs.evolve(vllm, max_loaded_adapters=3), models) if "adapters" in r[0]]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_adapters_an_engine_holds_are_read_from_its_model_list(engine: str) -> None:
    api = registry.ENGINES[engine].runtime_adapters
    listing = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "root": "/models/base", "parent": None},
            {"id": "sql", "object": "model", "root": "/a/sql", "parent": "base"},
            {"id": "bot", "object": "model", "root": "/a/bot", "parent": "base"},
            {"id": "other", "object": "model", "parent": "another-base"},
        ],
    }
    assert api.held(listing, "base") == ["bot", "sql"]
    assert api.load_body("sql", "/a/sql") == {"lora_name": "sql", "lora_path": "/a/sql"}
    assert api.unload_body("sql") == {"lora_name": "sql"}
    with pytest.raises(ValueError):
        api.held({"error": "x"}, "base")
    assert registry.ENGINES["llamacpp"].runtime_adapters is None


def test_the_rank_an_engine_needs_is_the_highest_in_a_peft_config() -> None:
    assert lora_rank({"r": 8, "lora_alpha": 16}) == 8
    assert lora_rank({"r": 8, "rank_pattern": {"q_proj": 32, "v_proj": 4}}) == 32
    assert lora_rank({"lora_alpha": 16}) is None
    assert lora_rank({"r": True}) is None and lora_rank([8]) is None
