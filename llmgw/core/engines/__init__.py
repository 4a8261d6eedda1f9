"""Engine adapters: a shard spec becomes the ordered commands that run it on its node.

Pure functions of the spec: no processes are started here (the agent's supervisor does that), so
every engine's command line, multi-node included, is tested without the engine or a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.core.engines import llamacpp, sglang, vllm
from llmgw.core.engines.common import EngineBinaries
from llmgw.core.engines.validate import InvalidShard, validate
from llmgw.core.shard import LaunchPlan, ShardSpec

__all__ = ["EngineBinaries", "InvalidShard", "build_plan", "validate"]

_PLANNERS: dict[str, Callable[..., LaunchPlan]] = {
    "vllm": vllm.plan,
    "sglang": sglang.plan,
    "llamacpp": llamacpp.plan,
}


def build_plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    """The commands that run ``spec`` on its node; raises InvalidShard with every reason it cannot.

    ``engine_key`` is the replica's key, kept out of the spec so that the spec can be written to
    disk; None starts the engine without one.
    """
    reasons = validate(spec)
    if reasons:
        raise InvalidShard(reasons)
    return _PLANNERS[spec.engine](spec, engine_key=engine_key, binaries=binaries)
