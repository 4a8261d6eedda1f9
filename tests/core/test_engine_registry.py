"""The engine registry's contract: every descriptor is whole, names are checked against it, and
nothing outside ``llmgw/core/engines`` names an engine (so a new one is one module there).
"""

from __future__ import annotations

import ast

import attrs
import pytest

from llmgw.core import engines
from llmgw.core.catalog import Model, Profile, validate_profile
from llmgw.core.engines import DEFAULT_BINARIES, ENGINES, LAUNCHERS, Engine, build_plan, registry, validate
from llmgw.core.engines.load_metrics import BUSY_METRICS, ENGINE_METRICS
from llmgw.core.shard import ShardSpec
from tests.helpers import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "llmgw"
ENGINES_DIR = PACKAGE / "core" / "engines"


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_descriptor_has_every_part(name: str) -> None:
    engine = ENGINES[name]
    assert engine.name == name and engine.display_name
    assert callable(engine.plan) and callable(engine.validate)
    # A spec's default launcher must be every engine's.
    assert engine.launchers and engine.launchers[0] == attrs.fields(ShardSpec).launcher.default
    assert engine.adapter_files and engine.adapter_path("/copy", ()).startswith("/copy")
    assert engine.metrics.engine == name and engine.metrics.running and engine.metrics.waiting
    check = engine.help
    assert hasattr(DEFAULT_BINARIES, check.program) and check.help_args and check.version_args
    assert check.argv_prefix >= 1 and check.min_help_lines > 0
    assert check.widest_specs


@pytest.mark.parametrize("name", list(ENGINES))
def test_widest_specs_are_the_engines_own_and_launch_its_program(name: str) -> None:
    """engine-check strips argv_prefix tokens: the program and what precedes the engine's options."""
    check = ENGINES[name].help
    for label, shard in check.widest_specs:
        assert shard.engine == name and validate(shard) == [], label
        plan = build_plan(shard, engine_key="k", binaries=DEFAULT_BINARIES)
        for command in (c for c in plan.commands if c.name == "engine"):
            assert command.argv[0] == getattr(DEFAULT_BINARIES, check.program)
            assert command.argv[check.argv_prefix].startswith("-"), label


def test_an_unknown_engine_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(registry.UnknownEngine, match="engine 'tgi' is not one of vllm, sglang, llamacpp"):
        engines.get("tgi")
    shard = ShardSpec(shard_id="s", replica_id="r", model="m", model_path="/m", engine="tgi", port=8000)
    assert validate(shard) == ["engine 'tgi' is not one of vllm, sglang, llamacpp"]
    profile = Profile(name="p", model="m", engine="tgi", gpu_class="h100-80g", gpus_per_node=1, memory_mib=1)
    model = Model(name="m", path="/m", format="safetensors")
    assert "profiles.p.engine: 'tgi' is not one of vllm, sglang, llamacpp" in validate_profile(
        profile, {"m": model}
    )


def test_tables_derived_from_the_descriptors() -> None:
    assert LAUNCHERS == ("mp", "ray")
    assert [m.engine for m in ENGINE_METRICS] == list(ENGINES)
    assert {m.running for m in ENGINE_METRICS} <= BUSY_METRICS
    assert registry.with_launcher("ray") == ["vllm"]
    assert registry.only_on_cpu() == "only vLLM and llama.cpp run on the CPU"


def test_a_new_engine_is_one_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered, an engine is planned, validated and accepted by the catalog with no other change."""
    vllm = ENGINES["vllm"]
    tgi = attrs.evolve(vllm, name="tgi", display_name="TGI", launchers=("mp",), runs_on_cpu=True)
    monkeypatch.setattr(registry, "ENGINES", {**ENGINES, "tgi": tgi})
    shard = ShardSpec(shard_id="s", replica_id="r", model="m", model_path="/m", engine="tgi", port=8000)
    assert validate(shard) == []
    assert build_plan(shard, engine_key=None, binaries=DEFAULT_BINARIES).health_port == 8000
    assert "only vLLM, llama.cpp and TGI run on the CPU" in registry.only_on_cpu()
    ray = attrs.evolve(
        shard, launcher="ray", gpus=(), leader_address="a", node_address="a", mgmt_interface="e"
    )
    assert "launcher 'ray' is for vLLM only; TGI starts its own ranks" in validate(ray)
    profile = Profile(name="p", model="m", engine="tgi", gpu_class=None, memory_mib=1)
    assert validate_profile(profile, {"m": Model(name="m", path="/m", format="safetensors")}) == []


def _engine_names_outside_engines_package() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(ENGINES_DIR):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in ENGINES:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_outside_core_engines_names_an_engine() -> None:
    """Every other module looks an engine up; one naming it by string is a table to keep in step."""
    assert _engine_names_outside_engines_package() == []


def test_descriptors_are_engines() -> None:
    assert all(isinstance(engine, Engine) for engine in ENGINES.values())
