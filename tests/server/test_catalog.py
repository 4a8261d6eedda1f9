"""The server's catalog over a real store: who owns an entry, what a change may do, and how the
reconciler hears of it."""

from __future__ import annotations

import logging

import attrs
import pytest
import trio
import trio.testing

from llmgw.core.catalog import Model, Profile, name_problem
from llmgw.core.shard import Adapter
from llmgw.server.catalog import API, CONFIG, Catalog, Change, Invalid, NotFound, Refused
from llmgw.server.store import CatalogRow, Store, StoreError

SMOL = Model(name="smollm2-135m", path="/models/smollm2.gguf", format="gguf")
SMOL_CPU = Profile(
    name="smollm2-cpu", model="smollm2-135m", engine="llamacpp", gpu_class=None, memory_mib=1024
)
QWEN = Model(name="org/qwen", path="Qwen/Qwen2.5-7B-Instruct", format="safetensors")
QWEN_L40S = Profile(
    name="qwen-l40s",
    model="org/qwen",
    engine="vllm",
    gpu_class="l40s-45g",
    gpus_per_node=2,
    tensor_parallel=2,
    memory_mib=40_000,
    max_replicas=3,
)
# An API profile that uses the config's model.
SMOL_API = attrs.evolve(SMOL_CPU, name="smollm2-api")


@pytest.fixture
async def store(open_test_store):  # on both backends
    s = await open_test_store()
    yield s
    await s.aclose()


async def rows(store: Store) -> dict[tuple[str, str], CatalogRow]:
    return {(row.kind, row.name): row for row in await store.list_catalog()}


def sources(catalog: Catalog, kind: str) -> dict[str, str]:
    return {entry.name: entry.source for entry in catalog.entries(kind)}


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2-135m", "Qwen/Qwen2.5-7B-Instruct", "llama3.1:8b", "a", "x" * 128])
def test_usable_names(name: str):
    assert name_problem(name) is None


@pytest.mark.parametrize("name", ["", "a b", "-flag", "/abs", "tab\there", "x" * 129, "émoji"])
def test_unusable_names(name: str):
    assert name_problem(name).startswith("expected a name of letters, digits")


# --- loading: server.yaml's entries and the store's ---------------------------------------------


async def test_config_entries_are_stored_as_config_and_api_entries_survive_a_restart(store: Store):
    catalog = await Catalog.load(store, [SMOL], [SMOL_CPU])
    assert catalog.models() == {"smollm2-135m": SMOL}
    assert catalog.profiles() == {"smollm2-cpu": SMOL_CPU}
    await catalog.apply([QWEN], [QWEN_L40S])

    again = await Catalog.load(store, [SMOL], [SMOL_CPU])
    assert sources(again, "model") == {"org/qwen": API, "smollm2-135m": CONFIG}
    assert sources(again, "profile") == {"qwen-l40s": API, "smollm2-cpu": CONFIG}
    assert again.profiles()["qwen-l40s"] == QWEN_L40S


async def test_a_new_server_yaml_replaces_the_old_ones_entries(store: Store):
    first = await Catalog.load(store, [SMOL, QWEN], [SMOL_CPU, QWEN_L40S])
    stamped = {entry.name: entry.updated for entry in first.entries("model")}

    moved = attrs.evolve(SMOL, path="/elsewhere/smollm2.gguf")
    second = await Catalog.load(store, [moved], [SMOL_CPU])
    assert second.models() == {"smollm2-135m": moved}
    assert list(second.profiles()) == ["smollm2-cpu"]
    assert set(await rows(store)) == {("model", "smollm2-135m"), ("profile", "smollm2-cpu")}
    assert second.entries("model")[0].updated > stamped["smollm2-135m"]

    # Started again with the same file: nothing changed, so nothing is re-stamped.
    third = await Catalog.load(store, [moved], [SMOL_CPU])
    assert third.entries("model") == second.entries("model")


async def test_server_yaml_takes_over_an_api_entry_of_the_same_name(store: Store):
    catalog = await Catalog.load(store, [], [])
    await catalog.apply([SMOL], [SMOL_CPU])
    declared = attrs.evolve(SMOL_CPU, band=7)
    catalog = await Catalog.load(store, [SMOL], [declared])
    assert sources(catalog, "profile") == {"smollm2-cpu": CONFIG}
    assert catalog.profiles()["smollm2-cpu"].band == 7


async def test_a_model_server_yaml_drops_stays_while_an_api_profile_uses_it(store: Store, caplog):
    catalog = await Catalog.load(store, [SMOL, QWEN], [])
    await catalog.apply([], [SMOL_API])

    with caplog.at_level(logging.WARNING, logger="llmgw.server.catalog"):
        catalog = await Catalog.load(store, [], [])
    # The unused model went with the file; the used one stays, now the API's to remove.
    assert sources(catalog, "model") == {"smollm2-135m": API}
    assert 'no longer declares model "smollm2-135m"' in caplog.text
    await catalog.remove("profile", "smollm2-api")
    await catalog.remove("model", "smollm2-135m")
    assert await rows(store) == {}


async def test_an_api_profile_the_new_models_do_not_fit_is_kept_with_a_warning(store: Store, caplog):
    catalog = await Catalog.load(store, [SMOL], [])
    await catalog.apply([], [SMOL_API])
    as_safetensors = attrs.evolve(SMOL, path="/models/smollm2", format="safetensors")

    with caplog.at_level(logging.WARNING, logger="llmgw.server.catalog"):
        catalog = await Catalog.load(store, [as_safetensors], [])
    assert list(catalog.profiles()) == ["smollm2-api"]
    assert (
        "profiles.smollm2-api.model: llama.cpp loads gguf, and 'smollm2-135m' is safetensors" in caplog.text
    )
    assert "llmgw ctl delete profile smollm2-api" in caplog.text


async def test_a_stored_entry_that_cannot_be_read_stops_the_load_naming_it(store: Store):
    await store.save_catalog_entry("profile", "old", '{"engine": "vllm", "gpus": 2}', API, 1.0)
    with pytest.raises(StoreError) as info:
        await Catalog.load(store, [], [])
    message = str(info.value)
    assert f"{store.where}: the stored catalog cannot be read: " in message
    assert "profiles.old.gpus: unknown key" in message


# --- apply ------------------------------------------------------------------------------------


async def test_apply_creates_updates_and_leaves_alone(store: Store):
    catalog = await Catalog.load(store, [], [])
    assert await catalog.apply([QWEN], [QWEN_L40S]) == [
        Change("model", "org/qwen", "created"),
        Change("profile", "qwen-l40s", "created"),
    ]
    written = (await rows(store))[("profile", "qwen-l40s")]
    assert written.source == API
    assert '"name"' not in written.spec  # the row's key names it

    wider = attrs.evolve(QWEN_L40S, max_replicas=5)
    assert await catalog.apply([QWEN], [wider]) == [
        Change("model", "org/qwen", "unchanged"),
        Change("profile", "qwen-l40s", "updated"),
    ]
    assert catalog.profiles()["qwen-l40s"].max_replicas == 5


async def test_apply_is_all_or_nothing_and_names_every_field(store: Store):
    catalog = await Catalog.load(store, [], [])
    broken = attrs.evolve(QWEN_L40S, model="nope", nodes=0)
    with pytest.raises(Invalid) as info:
        await catalog.apply([QWEN, attrs.evolve(SMOL, path="/models/smollm2")], [broken])
    assert info.value.problems == [
        "models.smollm2-135m.path: a gguf model is one .gguf file, and '/models/smollm2' is not one",
        "profiles.qwen-l40s.nodes: must be at least 1, not 0",
        "profiles.qwen-l40s.model: no model named 'nope' in the catalog",
    ]
    assert catalog.models() == {}
    assert await rows(store) == {}


async def test_apply_refuses_bad_names_and_twins(store: Store):
    catalog = await Catalog.load(store, [], [])
    with pytest.raises(Invalid) as info:
        await catalog.apply([QWEN, QWEN], [attrs.evolve(QWEN_L40S, name="has space")])
    assert info.value.problems[:2] == [
        "models.org/qwen: given twice",
        "profiles.has space: expected a name of letters, digits and . _ : @ + / -, starting with a letter "
        "or digit, at most 128 characters, got 'has space'",
    ]


async def test_apply_refuses_to_touch_what_server_yaml_owns(store: Store):
    catalog = await Catalog.load(store, [SMOL], [SMOL_CPU])
    with pytest.raises(Refused) as info:
        await catalog.apply([attrs.evolve(SMOL, path="/x.gguf")], [attrs.evolve(SMOL_CPU, band=1)])
    assert info.value.problems == [
        "models.smollm2-135m: declared in server.yaml; change it there and restart the server",
        "profiles.smollm2-cpu: declared in server.yaml; change it there and restart the server",
    ]
    assert catalog.models() == {"smollm2-135m": SMOL}


async def test_replacing_a_model_must_keep_its_profiles_valid(store: Store):
    catalog = await Catalog.load(store, [], [])
    await catalog.apply([attrs.evolve(SMOL, name="smol-api")], [attrs.evolve(SMOL_CPU, model="smol-api")])
    with pytest.raises(Invalid) as info:
        await catalog.apply([Model(name="smol-api", path="/models/smol", format="safetensors")], [])
    assert info.value.problems == [
        "profiles.smollm2-cpu.model: llama.cpp loads gguf, and 'smol-api' is safetensors"
    ]


# --- scale ------------------------------------------------------------------------------------


async def test_scale_sets_bounds_and_keeps_what_is_not_given(store: Store):
    catalog = await Catalog.load(store, [], [])
    await catalog.apply([QWEN], [QWEN_L40S])
    entry = await catalog.scale("qwen-l40s", min_replicas=2)
    assert (entry.spec.min_replicas, entry.spec.max_replicas, entry.source) == (2, 3, API)
    await catalog.scale("qwen-l40s", 0, 0)
    again = await Catalog.load(store, [], [])
    assert (again.profiles()["qwen-l40s"].min_replicas, again.profiles()["qwen-l40s"].max_replicas) == (0, 0)


async def test_scale_refusals(store: Store):
    catalog = await Catalog.load(store, [SMOL], [SMOL_CPU])
    await catalog.apply([QWEN], [QWEN_L40S])
    with pytest.raises(Invalid) as info:
        await catalog.scale("qwen-l40s", min_replicas=4)
    assert info.value.problems == ["profiles.qwen-l40s.min_replicas: 4 is above max_replicas 3"]
    with pytest.raises(NotFound, match='no profile named "nope"'):
        await catalog.scale("nope", 1, 1)
    with pytest.raises(Refused, match='profile "smollm2-cpu" is declared in server.yaml'):
        await catalog.scale("smollm2-cpu", 2, 2)


# --- remove -----------------------------------------------------------------------------------


async def test_remove(store: Store):
    catalog = await Catalog.load(store, [SMOL], [SMOL_CPU])
    await catalog.apply([QWEN], [QWEN_L40S, attrs.evolve(QWEN_L40S, name="qwen-2")])
    with pytest.raises(Refused) as info:
        await catalog.remove("model", "org/qwen")
    assert info.value.problems == [
        'model "org/qwen" is used by profile qwen-2, qwen-l40s; delete or change those first'
    ]
    await catalog.remove("profile", "qwen-l40s")
    await catalog.remove("profile", "qwen-2")
    await catalog.remove("model", "org/qwen")
    assert set(await rows(store)) == {("model", "smollm2-135m"), ("profile", "smollm2-cpu")}

    with pytest.raises(NotFound, match='no model named "org/qwen"'):
        await catalog.remove("model", "org/qwen")
    with pytest.raises(Refused, match="remove it there and restart the server"):
        await catalog.remove("profile", "smollm2-cpu")
    with pytest.raises(Refused):
        await catalog.remove("model", "smollm2-135m")


# --- telling the reconciler ---------------------------------------------------------------------


async def test_wait_changed_wakes_on_each_change_and_never_misses_one(store: Store):
    catalog = await Catalog.load(store, [], [])
    seen = catalog.version
    woke: list[int] = []

    async def waiter() -> None:
        woke.append(await catalog.wait_changed(seen))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await catalog.apply([QWEN], [])
    assert woke == [seen + 1]

    # What changes nothing moves no version.
    await catalog.apply([QWEN], [])
    assert catalog.version == seen + 1
    # A change made while nobody waited is seen by the next wait at once.
    await catalog.apply([], [QWEN_L40S])
    await catalog.scale("qwen-l40s", 1, 3)
    assert catalog.version == seen + 2
    with trio.fail_after(1):
        assert await catalog.wait_changed(seen + 1) == seen + 2


# --- adapters' names --------------------------------------------------------------------------


async def test_an_adapter_named_as_a_model_is_refused_naming_both(store: Store):
    catalog = await Catalog.load(store, [SMOL], [])
    clash = attrs.evolve(SMOL_API, adapters=(Adapter(name="org/qwen", path="/a/q.gguf"),))
    with pytest.raises(Invalid) as info:
        await catalog.apply([QWEN], [clash])
    assert info.value.problems == [
        "profiles.smollm2-api.adapters[0].name: adapter 'org/qwen' of model 'smollm2-135m' has the name "
        "of model 'org/qwen'; clients ask for both by name, so rename one"
    ]
    # ... and a model declared after an adapter of its name is refused too.
    fine = attrs.evolve(SMOL_API, adapters=(Adapter(name="sql", path="/a/sql.gguf"),))
    await catalog.apply([], [fine])
    with pytest.raises(Invalid) as info:
        await catalog.apply([attrs.evolve(QWEN, name="sql")], [])
    assert "adapter 'sql' of model 'smollm2-135m' has the name of model 'sql'" in info.value.problems[0]


async def test_one_adapter_name_for_two_base_models_is_refused(store: Store):
    catalog = await Catalog.load(store, [SMOL, QWEN], [])
    sql = (Adapter(name="sql", path="/a/sql"),)
    await catalog.apply([], [attrs.evolve(QWEN_L40S, adapters=sql)])
    with pytest.raises(Invalid) as info:
        await catalog.apply([], [attrs.evolve(SMOL_API, adapters=(Adapter(name="sql", path="/a/sql.gguf"),))])
    assert info.value.problems == [
        "profiles.smollm2-api.adapters[0].name: adapter 'sql' of model 'smollm2-135m' has the name of an "
        "adapter of model 'org/qwen' (profile 'qwen-l40s'); rename one"
    ]
    # Two profiles of one model may both list it: that is one adapter served two ways.
    await catalog.apply([], [attrs.evolve(QWEN_L40S, name="qwen-2", adapters=sql)])
