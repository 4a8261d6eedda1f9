"""Every engine llmgw runs, by the name catalogs and shard specs give it.

The one place that lists them: a new engine is its module in this package and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from llmgw.core.engines import llamacpp, sglang, vllm
from llmgw.core.engines.descriptor import Engine

# In this order wherever engines are listed: messages, engine-check, metric lookups.
ENGINES: Mapping[str, Engine] = MappingProxyType(
    {engine.name: engine for engine in (vllm.ENGINE, sglang.ENGINE, llamacpp.ENGINE)}
)
# Every engine's launchers, each once, in the engines' order.
LAUNCHERS = tuple(dict.fromkeys(launcher for engine in ENGINES.values() for launcher in engine.launchers))


class UnknownEngine(ValueError):
    """A name that is no engine's; the message names the ones there are."""


def get(name: str) -> Engine:
    """The engine called ``name``; raises UnknownEngine naming the valid ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngine(f"engine {name!r} is not one of {', '.join(ENGINES)}") from None


def display_names(names: list[str]) -> str:
    """Engines' names as people read them, joined: "vLLM", "vLLM and SGLang"."""
    shown = [ENGINES[name].display_name for name in names] or ["no engine"]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def with_launcher(launcher: str) -> list[str]:
    return [name for name, engine in ENGINES.items() if launcher in engine.launchers]


def only_on_cpu() -> str:
    """Which engines run on the CPU, as the end of a refusal: "only llama.cpp runs on the CPU"."""
    names = [name for name, engine in ENGINES.items() if engine.runs_on_cpu]
    return f"only {display_names(names)} {'runs' if len(names) == 1 else 'run'} on the CPU"
