"""The catalog: models, and the profiles that say how a model is served.

A profile is checked as a whole when the catalog is loaded, so that a mistake is reported once, at
the field that holds it, instead of as a replica that never places or an engine that fails minutes
into loading on some node. What can only be judged against a node's GPUs (fp8 on an old card, the
adapters a fabric offers) is left to :mod:`llmgw.core.engines.validate` at launch.

Every type here is frozen attrs over plain values (str, int, float, bool, tuple, None) and nested
attrs, so cattrs structures them from the server's configuration without hooks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from llmgw.core import installs, weights
from llmgw.core.engines import registry
from llmgw.core.engines.descriptor import Engine
from llmgw.core.engines.registry import LAUNCHERS
from llmgw.core.routing import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_PREFIX_CHARS, POLICIES
from llmgw.core.shard import Adapter, ShardSpec
from llmgw.core.training import ADAPTER_NAME, GGUF_FILE, FileDigest

frozen = attrs.frozen(kw_only=True)

MODEL_FORMATS = ("gguf", "safetensors")

# Names travel in URLs, table columns, log lines and one-line errors, so no spaces or control
# characters; '/' and ':' stay allowed because clients know models by hub ids ("org/model") and
# tags ("llama3.1:8b").
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")
NAME_RULE = "letters, digits and . _ : @ + / -, starting with a letter or digit, at most 128 characters"


@frozen
class Model:
    name: str  # what clients ask for
    path: str  # weights on the nodes (a .gguf file, a directory, a hub id) or a URL they fetch
    format: str  # one of MODEL_FORMATS
    # The weights' sha256 (64 hex digits): a node fetching them from a URL checks it (required
    # then), and one copy serves every profile naming the same checksum (llmgw.core.weights).
    sha256: str | None = None


@frozen
class Profile:
    name: str
    model: str  # a Model's name
    engine: str  # a name in llmgw.core.engines.ENGINES
    gpu_class: str | None  # e.g. "l40s-45g"; None = runs on the CPU (an engine that can)
    # A llama.cpp build (b10991) the agent installs before starting the engine, from the node's
    # engines.llamacpp_url, or a vLLM/SGLang release (0.33.0) it installs into a virtual
    # environment from the node's package index (llmgw.core.installs). None: the node's
    # configured engine.
    engine_version: str | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # MiB per GPU for a GPU profile; host memory for a CPU profile.
    memory_mib: int
    cpu_cores: int = 1  # CPU profiles only: a GPU profile's host needs are not modelled
    launcher: str = "mp"  # one of the engine's launchers
    flags: tuple[str, ...] = ()  # extra argv tokens for the engine
    adapters: tuple[Adapter, ...] = ()
    # Load adapters at run time, at most this many per replica (the engine's runtime LoRA API;
    # llmgw.core.adapter_residency decides which and where), instead of all of them at start.
    max_loaded_adapters: int | None = None
    max_lora_rank: int | None = None  # the highest rank among its adapters; None: the engine's default
    ctx_size: int | None = None
    parallel: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    band: int = 0  # priority band, higher wins; below 0 is allowed, for work that yields to all
    startup_timeout: float = 600.0  # seconds from start until the engine serves the model
    # Time to first token its requests should not exceed (seconds); None: the gateway's default.
    ttft_target: float | None = None
    # Placement's score: False packs replicas onto the fullest nodes that fit, keeping whole
    # nodes free for large profiles; True spreads them over the emptiest.
    spread: bool = False
    # How the gateway picks among the replicas (llmgw.core.routing): prefix, least-loaded or
    # round-robin; with prefix, how far a replica may go past the average load before a key
    # spills over, and how many characters of the prompt make the key.
    routing: str = DEFAULT_POLICY
    routing_load_factor: float = DEFAULT_LOAD_FACTOR
    routing_prefix_chars: int = DEFAULT_PREFIX_CHARS
    # With min_replicas 0: seconds without a request before the last replica is stopped.
    scale_to_zero_after: float = 900.0


@frozen
class StoredAdapter:
    """An adapter the server keeps (a training job made it), as profiles may name it."""

    name: str
    model: str  # the catalog model it was trained for
    files: tuple[FileDigest, ...]


class AdapterUnavailable(Exception):
    """A shard names a stored adapter that cannot be served; the message says which and why."""


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a model or a profile; None when it can."""
    if _NAME.fullmatch(name):
        return None
    return f"expected a name of {NAME_RULE}, got {name!r}"


def validate_model(model: Model) -> list[str]:
    """Why ``model`` cannot be in the catalog; empty when it can."""
    where = f"models.{model.name}"
    reasons = []
    if not model.name:
        reasons.append("models: a model needs a name")
    if not model.path:
        reasons.append(f"{where}.path: empty")
    if model.format not in MODEL_FORMATS:
        reasons.append(f"{where}.format: {model.format!r} is not one of {', '.join(MODEL_FORMATS)}")
    elif model.format == "gguf" and not _file_part(model.path).endswith(".gguf"):
        # llama.cpp loads one file; a directory of shards has to be merged first.
        reasons.append(f"{where}.path: a gguf model is one .gguf file, and {model.path!r} is not one")
    if problem := weights.sha256_problem(model.sha256):
        reasons.append(f"{where}.sha256: {problem}")
    elif problem := weights.path_problem(model.path, model.sha256):
        reasons.append(f"{where}.path: {problem}")
    elif weights.is_remote(model.path) and model.format != "gguf":
        reasons.append(
            f"{where}.path: a node fetches one file, a gguf model; a {model.format} model is a directory"
        )
    return reasons


def _file_part(path: str) -> str:
    # A URL's query (a signed download link) is not part of the file's name.
    return path.split("?", 1)[0] if weights.is_remote(path) else path


def validate_profile(profile: Profile, models: Mapping[str, Model]) -> list[str]:
    """Why ``profile`` cannot be served, each reason led by the field that holds the mistake."""
    where = f"profiles.{profile.name}"
    reasons = [f"{where}.{field}: {reason}" for field, reason in _field_reasons(profile, models)]
    if not profile.name:
        reasons.insert(0, "profiles: a profile needs a name")
    return reasons


def _field_reasons(profile: Profile, models: Mapping[str, Model]) -> list[tuple[str, str]]:
    reasons = _bounds(profile)
    model = models.get(profile.model)
    if model is None:
        reasons.append(("model", f"no model named {profile.model!r} in the catalog"))
    engine = registry.ENGINES.get(profile.engine)
    if engine is None:
        reasons.append(("engine", f"{profile.engine!r} is not one of {', '.join(registry.ENGINES)}"))
        return reasons
    name = engine.display_name
    if profile.launcher not in LAUNCHERS:
        reasons.append(("launcher", f"{profile.launcher!r} is not one of {', '.join(LAUNCHERS)}"))
    elif profile.launcher not in engine.launchers:
        owners = registry.display_names(registry.with_launcher(profile.launcher))
        reasons.append(
            ("launcher", f"{profile.launcher!r} is for {owners} only; {name} starts its own ranks")
        )
    if not engine.multi_node and profile.nodes > 1:
        reasons.append(("nodes", f"{name} runs on one node, not {profile.nodes}"))
    if engine.only_format and model is not None and model.format != engine.only_format:
        reasons.append(("model", f"{name} loads {engine.only_format}, and {model.name!r} is {model.format}"))
    if profile.gpu_class is None:
        reasons.extend(_cpu_reasons(profile, engine))
    else:
        reasons.extend(_gpu_reasons(profile))
    if profile.min_replicas > profile.max_replicas >= 0:
        reasons.append(
            ("min_replicas", f"{profile.min_replicas} is above max_replicas {profile.max_replicas}")
        )
    reasons.extend(_adapter_reasons(profile))
    reasons.extend(_on_demand_reasons(profile, engine))
    if profile.engine_version is not None:
        if engine.installed_build is None:
            reasons.append(("engine_version", f"agents install no versions of {name}"))
        elif engine.python_package is not None:
            if problem := installs.python_version_problem(profile.engine_version, engine.python_variants):
                reasons.append(("engine_version", problem))
        elif problem := installs.version_problem(profile.engine_version):
            reasons.append(("engine_version", problem))
    return reasons


def _on_demand_reasons(profile: Profile, engine: Engine) -> list[tuple[str, str]]:
    reasons = []
    if profile.max_loaded_adapters is not None:
        if engine.runtime_adapters is None:
            reasons.append(
                (
                    "max_loaded_adapters",
                    f"{engine.display_name} loads adapters at start only: list them, without this key",
                )
            )
        elif profile.max_loaded_adapters < 1:
            reasons.append(("max_loaded_adapters", f"must be at least 1, not {profile.max_loaded_adapters}"))
    if profile.max_lora_rank is not None:
        if profile.max_loaded_adapters is None:
            reasons.append(("max_lora_rank", "applies with max_loaded_adapters only"))
        elif profile.max_lora_rank < 1:
            reasons.append(("max_lora_rank", f"must be at least 1, not {profile.max_lora_rank}"))
    return reasons


def _adapter_reasons(profile: Profile) -> list[tuple[str, str]]:
    reasons = []
    names = [adapter.name for adapter in profile.adapters]
    for index, adapter in enumerate(profile.adapters):
        where = f"adapters[{index}]"
        if not adapter.name:
            reasons.append((f"{where}.name", "empty: clients ask for an adapter by its name"))
        elif names.index(adapter.name) != index:
            reasons.append((f"{where}.name", f"{adapter.name!r} is given twice"))
        if adapter.path and adapter.source:
            reasons.append((where, "set path (files on the node) or source (a stored adapter), not both"))
        elif not adapter.path and not adapter.source:
            reasons.append((f"{where}.path", "set path (files on the node) or source (a stored adapter)"))
        elif adapter.source and not ADAPTER_NAME.fullmatch(adapter.source):
            reasons.append((f"{where}.source", f"{adapter.source!r} is not an adapter name"))
        if adapter.files:
            # Filled in by the server from what it keeps, so that nodes get exactly those files.
            reasons.append((f"{where}.files", "set by the server from the stored adapter; leave it out"))
    return reasons


def stored_adapter_problems(profile: Profile, stored: Mapping[str, StoredAdapter]) -> list[str]:
    """Why the stored adapters ``profile`` names cannot be served by it (empty when they can):
    each must be kept, be of the profile's model, and have the files its engine loads."""
    problems = []
    for index, adapter in enumerate(profile.adapters):
        if not adapter.source:
            continue
        where = f"profiles.{profile.name}.adapters[{index}].source"
        try:
            served_files(profile.engine, profile.model, stored.get(adapter.source), adapter.source)
        except AdapterUnavailable as e:
            problems.append(f"{where}: {e}")
    return problems


def served_files(
    engine: str, model: str, stored: StoredAdapter | None, source: str
) -> tuple[FileDigest, ...]:
    """The files of stored adapter ``source`` that ``engine`` loads, serving ``model``; raises
    AdapterUnavailable when it is not kept, is another model's, or lacks one of them."""
    if stored is None:
        raise AdapterUnavailable(f"no stored adapter {source!r} of model {model!r}")
    if stored.model != model:
        raise AdapterUnavailable(
            f"stored adapter {source!r} was trained for model {stored.model!r}, not {model!r}"
        )
    by_name = {f.name: f for f in stored.files}
    known = registry.ENGINES.get(engine)
    needed = known.adapter_files if known is not None else ()
    missing = [name for name in needed if name not in by_name]
    if missing == [GGUF_FILE]:
        raise AdapterUnavailable(
            f"stored adapter {source!r} has no GGUF file, which llama.cpp loads "
            "(train it again with a llama.cpp profile in the catalog, or serve it with vLLM or SGLang)"
        )
    if missing:
        raise AdapterUnavailable(f"stored adapter {source!r} lacks {', '.join(missing)}")
    return tuple(by_name[name] for name in needed)


def with_stored_files(spec: ShardSpec, stored: Mapping[str, StoredAdapter]) -> ShardSpec:
    """``spec`` with the files of every stored adapter it names filled in; raises
    AdapterUnavailable, naming the adapter, when one cannot be served."""
    adapters = []
    for adapter in spec.adapters:
        if adapter.source:
            try:
                files = served_files(spec.engine, spec.model, stored.get(adapter.source), adapter.source)
            except AdapterUnavailable as e:
                raise AdapterUnavailable(f"adapter {adapter.name!r}: {e}") from None
            adapter = attrs.evolve(adapter, files=files)
        adapters.append(adapter)
    return attrs.evolve(spec, adapters=tuple(adapters))


def _bounds(profile: Profile) -> list[tuple[str, str]]:
    reasons = []
    for field, floor in (
        ("nodes", 1),
        ("tensor_parallel", 1),
        ("pipeline_parallel", 1),
        ("gpus_per_node", 0),
        ("cpu_cores", 1),
        ("memory_mib", 1),
        ("min_replicas", 0),
        ("max_replicas", 0),
    ):
        value = getattr(profile, field)
        if value < floor:
            reasons.append((field, f"must be at least {floor}, not {value}"))
    for field in ("ctx_size", "parallel"):
        value = getattr(profile, field)
        if value is not None and value < 1:
            reasons.append((field, f"must be at least 1 when set, not {value}"))
    if not profile.startup_timeout > 0:
        reasons.append(("startup_timeout", f"must be above 0 seconds, not {profile.startup_timeout}"))
    if profile.ttft_target is not None and not profile.ttft_target > 0:
        reasons.append(("ttft_target", f"must be above 0 seconds, not {profile.ttft_target}"))
    if profile.routing not in POLICIES:
        reasons.append(("routing", f"{profile.routing!r} is not one of {', '.join(POLICIES)}"))
    if not profile.routing_load_factor >= 1:
        # Below 1 the replicas together could not hold what is in flight: no replica would do.
        reasons.append(("routing_load_factor", f"must be at least 1, not {profile.routing_load_factor}"))
    if profile.routing_prefix_chars < 1:
        reasons.append(("routing_prefix_chars", f"must be at least 1, not {profile.routing_prefix_chars}"))
    if not profile.scale_to_zero_after > 0:
        reasons.append(("scale_to_zero_after", f"must be above 0 seconds, not {profile.scale_to_zero_after}"))
    return reasons


def _cpu_reasons(profile: Profile, engine: Engine) -> list[tuple[str, str]]:
    if not engine.runs_on_cpu:
        return [("gpu_class", f"{engine.display_name} needs GPUs and none is set ({registry.only_on_cpu()})")]
    reasons = []
    if profile.gpus_per_node:
        reasons.append(
            ("gpus_per_node", f"{profile.gpus_per_node} GPUs on a CPU profile: set gpu_class to use GPUs")
        )
    if (profile.tensor_parallel, profile.pipeline_parallel) != (1, 1):
        reasons.append(
            (
                "tensor_parallel",
                f"{profile.tensor_parallel} × pipeline {profile.pipeline_parallel} on a CPU profile, "
                "which runs as 1 × 1",
            )
        )
    return reasons


def _gpu_reasons(profile: Profile) -> list[tuple[str, str]]:
    if not profile.gpu_class:
        return [("gpu_class", "empty; leave it unset for a CPU profile")]
    if profile.gpus_per_node == 0:
        return [("gpus_per_node", f"a {profile.gpu_class} profile needs at least 1 GPU per node, not 0")]
    tp, pp = profile.tensor_parallel, profile.pipeline_parallel
    gpus = profile.nodes * profile.gpus_per_node
    if tp >= 1 and pp >= 1 and gpus >= 1 and tp * pp != gpus:
        # Each rank takes one GPU: any other count leaves cards idle or ranks without one.
        return [
            (
                "tensor_parallel",
                f"{tp} × pipeline {pp} needs {_count(tp * pp, 'GPU')}, the profile has "
                f"{_count(profile.nodes, 'node')} × {_count(profile.gpus_per_node, 'GPU')}",
            )
        ]
    return []


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def adapter_name_problems(profiles: Mapping[str, Profile], models: Mapping[str, Model]) -> list[str]:
    """Why the adapters of ``profiles`` cannot each be asked for by name among ``models`` (empty
    when they can): a client's `model` names a model or an adapter, so an adapter's name may not
    be a model's, nor name adapters of two different base models."""
    problems = []
    parents: dict[str, tuple[str, str]] = {}  # adapter name -> (its base model, the profile)
    for profile in sorted(profiles.values(), key=lambda p: p.name):
        for index, adapter in enumerate(profile.adapters):
            where = f"profiles.{profile.name}.adapters[{index}].name"
            if adapter.name in models:
                problems.append(
                    f"{where}: adapter {adapter.name!r} of model {profile.model!r} has the name of "
                    f"model {adapter.name!r}; clients ask for both by name, so rename one"
                )
                continue
            first = parents.setdefault(adapter.name, (profile.model, profile.name))
            if first[0] != profile.model:
                problems.append(
                    f"{where}: adapter {adapter.name!r} of model {profile.model!r} has the name of an "
                    f"adapter of model {first[0]!r} (profile {first[1]!r}); rename one"
                )
    return problems
