"""Engines: what llmgw knows of each (one descriptor per engine), and a shard spec made into the
ordered commands that run it on its node.

Pure functions of the spec: no processes are started here (the agent's supervisor does that), so
every engine's command line, multi-node included, is tested without the engine or a GPU. Other
modules look an engine up here (``get``, ``ENGINES``) rather than naming it.
"""

from __future__ import annotations

from llmgw.core.engines.common import EngineBinaries
from llmgw.core.engines.descriptor import Engine, EngineMetrics, HelpCheck
from llmgw.core.engines.registry import ENGINES, LAUNCHERS, UnknownEngine, get
from llmgw.core.engines.validate import InvalidShard, validate
from llmgw.core.shard import LaunchPlan, ShardSpec

__all__ = [
    "DEFAULT_BINARIES",
    "ENGINES",
    "LAUNCHERS",
    "Engine",
    "EngineBinaries",
    "EngineMetrics",
    "HelpCheck",
    "InvalidShard",
    "UnknownEngine",
    "build_plan",
    "get",
    "validate",
]

# How engines are invoked when nothing says otherwise: names on PATH.
DEFAULT_BINARIES = EngineBinaries()


def build_plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    """The commands that run ``spec`` on its node; raises InvalidShard with every reason it cannot.

    ``engine_key`` is the replica's key, kept out of the spec so that the spec can be written to
    disk; None starts the engine without one.
    """
    reasons = validate(spec)
    if reasons:
        raise InvalidShard(reasons)
    return get(spec.engine).plan(spec, engine_key=engine_key, binaries=binaries)
