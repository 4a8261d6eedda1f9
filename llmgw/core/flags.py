"""Engine flags against the engine's own ``--help``: which flags llmgw emits that an engine lacks.

Pure: help texts and argvs come in as values and ``ctl engine-check`` runs the engines, so the
decisions are tested on captured help texts without vLLM, SGLang or a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs

from llmgw.core.engines import EngineBinaries, build_plan
from llmgw.core.shard import Adapter, Fabric, GpuRef, ShardSpec

# An option token: a dash or two, then a name that ends in a letter or digit. Neither a word
# character nor a dash may touch it on either side, so "--port" is not found in "--port-range".
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*(?<=[A-Za-z0-9]))(?![\w-])")
# Where a definition line's option list ends: a run of spaces before the description.
_DESCRIPTION = re.compile(r"\s{2,}(?=[^\s-])")

# argv tokens before the engine's own options: `vllm serve <model>`, `python -m sglang.launch_server`
# (whose "-m" is the interpreter's, not SGLang's), `llama-server`.
ENGINE_ARGV_PREFIX = {"vllm": 3, "sglang": 3, "llamacpp": 1}

# Fewer help lines than this means the text was probably cut (a pager, a pipe closed early, a
# terminal scroll-back): a llama.cpp help cut to 400 of its lines once reported five live flags as
# missing. Each is about four fifths of what the release llmgw's builders follow prints, so a
# release that trims its help a little does not warn, and a cut one does.
LLAMACPP_MIN_HELP_LINES = 600  # build 11434 prints 736
VLLM_MIN_HELP_LINES = 1000  # 0.33.0 `serve --help=all` prints 1293; plain `--help` only 34
SGLANG_MIN_HELP_LINES = 1100  # 0.5.23 `launch_server --help` prints 1436
MIN_HELP_LINES = {
    "llamacpp": LLAMACPP_MIN_HELP_LINES,
    "vllm": VLLM_MIN_HELP_LINES,
    "sglang": SGLANG_MIN_HELP_LINES,
}
_TRUNCATION_HINTS = {
    "vllm": "; plain `vllm serve --help` lists only option groups: use `--help=all`",
}


@attrs.frozen(kw_only=True)
class CheckResult:
    missing: tuple[str, ...]  # flags the argvs use that the help does not define, in first-use order
    truncated_warning: str | None  # set when the help is shorter than the engine's usual one

    @property
    def ok(self) -> bool:
        return not self.missing


@attrs.frozen(kw_only=True)
class CheckedCommand:
    """One engine command of a widest plan: which shard it comes from, and its engine options."""

    label: str  # e.g. "vLLM mp 2 nodes, rank 1 (headless)"
    options: tuple[str, ...]  # argv after ENGINE_ARGV_PREFIX


def help_flags(help_text: str) -> frozenset[str]:
    """The options a help text defines: the tokens at the head of each line starting with '-'.

    Prose mentioning a flag does not count: "--foo was removed" must not make --foo look alive.
    """
    flags: set[str] = set()
    for line in help_text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("-"):
            flags.update(OPTION.findall(_DESCRIPTION.split(stripped, maxsplit=1)[0]))
    return frozenset(flags)


def argv_flags(argv: Iterable[str]) -> list[str]:
    """The flags an argv uses, in order, each once; ``--x=y`` counts as ``--x``.

    Tokens that are not options (values, paths, "-1") are skipped.
    """
    flags: list[str] = []
    for token in argv:
        name = token.split("=", 1)[0]
        if OPTION.fullmatch(name) and name not in flags:
            flags.append(name)
    return flags


def check(argv_list: Iterable[Sequence[str]], help_text: str, *, engine: str) -> CheckResult:
    """Every flag of ``argv_list`` (engine options, without the engine's argv prefix) against
    ``engine``'s help text."""
    defined = help_flags(help_text)
    missing: list[str] = []
    for argv in argv_list:
        missing += [flag for flag in argv_flags(argv) if flag not in defined and flag not in missing]
    return CheckResult(missing=tuple(missing), truncated_warning=truncation_warning(help_text, engine))


def truncation_warning(help_text: str, engine: str) -> str | None:
    lines = len(help_text.splitlines())
    expected = MIN_HELP_LINES[engine]
    if lines >= expected:
        return None
    return (
        f"the help has {lines} lines, fewer than the {expected} expected: it looks truncated, so "
        f"flags reported missing may be there{_TRUNCATION_HINTS.get(engine, '')}"
    )


# --- the widest commands llmgw produces ------------------------------------------------------------

# Placeholder values: only the flags matter. A key is given so that SGLang's --api-key is emitted.
_KEY = "engine-check-placeholder-key"
_ADAPTERS = (Adapter(name="a1", path="/adapters/a1"), Adapter(name="a2", path="/adapters/a2"))
_IB = Fabric(kind="ib", hcas=("mlx5_0",))


def _h100(index: int) -> GpuRef:
    return GpuRef(index=index, uuid=f"GPU-{index}", gpu_class="h100-80g", compute_capability="9.0")


def _base(engine: str, **changes: object) -> ShardSpec:
    # Every optional setting on: each adds its flag. extra_flags stay empty: they are the
    # profile's, not llmgw's, and a profile's author checks them against their own engine.
    base = ShardSpec(
        shard_id="check-s0",
        replica_id="check",
        model="check-model",
        model_path="/models/check",
        engine=engine,
        gpus=(_h100(0), _h100(1)),
        tensor_parallel=2,
        node_address="10.0.0.1",
        mgmt_interface="eth0",
        port=8100,
        ctx_size=8192,
        parallel=16,
        dtype="bfloat16",
        quantization="fp8",
        adapters=_ADAPTERS,
    )
    return attrs.evolve(base, **changes)


def _two_nodes(engine: str, rank: int, **changes: object) -> ShardSpec:
    return _base(
        engine,
        nodes=2,
        rank=rank,
        leader_address="10.0.0.1",
        node_address=f"10.0.0.{rank + 1}",
        rendezvous_port=29500,
        pipeline_parallel=2,
        fabric=_IB,
        **changes,
    )


def widest_specs() -> dict[str, tuple[tuple[str, ShardSpec], ...]]:
    """Per engine, the shards whose commands together use every flag llmgw can emit.

    Multi-node included: a flag only a second node uses is the one nobody sees go missing.
    """
    llama = {"model_path": "/models/check.gguf", "dtype": None, "quantization": None}
    llama_adapters = (
        Adapter(name="a1", path="/adapters/a1.gguf"),
        Adapter(name="a2", path="/adapters/a2.gguf"),
    )
    return {
        "llamacpp": (
            (
                "llama.cpp on GPUs",
                _base("llamacpp", **llama, gpus=(_h100(0),), tensor_parallel=1, adapters=llama_adapters),
            ),
            ("llama.cpp on the CPU", _base("llamacpp", **llama, gpus=(), tensor_parallel=1, cpu_threads=2)),
        ),
        "vllm": (
            ("vLLM mp 2 nodes, rank 0", _two_nodes("vllm", 0)),
            ("vLLM mp 2 nodes, rank 1 (headless)", _two_nodes("vllm", 1)),
            ("vLLM Ray 2 nodes, leader", _two_nodes("vllm", 0, launcher="ray")),
            ("vLLM Ray 2 nodes, worker", _two_nodes("vllm", 1, launcher="ray")),
        ),
        "sglang": (
            ("SGLang 2 nodes, rank 0", _two_nodes("sglang", 0)),
            ("SGLang 2 nodes, rank 1", _two_nodes("sglang", 1)),
        ),
    }


def widest_commands(engine: str, binaries: EngineBinaries | None = None) -> tuple[CheckedCommand, ...]:
    """The engine commands of ``widest_specs()[engine]``, built by the same builders the agent runs.

    Only commands named "engine" are the engine's: a Ray worker node runs `ray start` alone, whose
    flags are Ray's, not vLLM's.
    """
    binaries = binaries or EngineBinaries()
    prefix = ENGINE_ARGV_PREFIX[engine]
    commands = []
    for label, spec in widest_specs()[engine]:
        plan = build_plan(spec, engine_key=_KEY, binaries=binaries)
        commands += [
            CheckedCommand(label=label, options=c.argv[prefix:]) for c in plan.commands if c.name == "engine"
        ]
    return tuple(commands)


def users_of(flag: str, commands: Iterable[CheckedCommand]) -> list[str]:
    """The labels of the commands that use ``flag``."""
    return [c.label for c in commands if flag in argv_flags(c.options)]
