"""llama.cpp: one ``llama-server`` on one node, on GPUs or on the CPU.

Flags are those of llama-server build 11434's help.
"""

from __future__ import annotations

from llmgw.core.engines.common import LISTEN_ALL, EngineBinaries, device_env
from llmgw.core.shard import Command, LaunchPlan, ShardSpec

# More layers than any model has: every layer on the GPUs. A number rather than "all", which
# older builds do not know.
ALL_LAYERS = "999"


def plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    builtins = [
        "-m", spec.model_path,
        "--alias", spec.model,
        "--host", LISTEN_ALL,
        "--port", str(spec.port),
        "-ngl", ALL_LAYERS if spec.gpus else "0",
    ]  # fmt: skip
    if spec.ctx_size is not None:
        # Note: with --parallel set, llama.cpp splits this context among its slots.
        builtins += ["--ctx-size", str(spec.ctx_size)]
    if spec.parallel is not None:
        builtins += ["--parallel", str(spec.parallel)]
    if spec.cpu_threads is not None and not spec.gpus:
        # The cores placement reserved, and no more: by default llama.cpp takes every core, and
        # two replicas on one node would each slow the other down.
        builtins += ["--threads", str(spec.cpu_threads)]
    builtins.append("--metrics")  # the router's load signals come from /metrics
    for adapter in spec.adapters:
        # Each --lora adds to the list. llama.cpp also splits a value at commas, which is why
        # validation refuses an adapter path holding one.
        builtins += ["--lora", adapter.path]
    env = device_env(spec)
    if engine_key:
        # In the environment: a command line is readable by every user of the node.
        env["LLAMA_API_KEY"] = engine_key
    engine = Command(
        name="engine",
        # Built-ins after the profile's flags: llama.cpp keeps the last value, as argparse does.
        argv=(binaries.llama_server, *spec.extra_flags, *builtins),
        env=env,
        serves_http=True,
    )
    return LaunchPlan(commands=(engine,), health_port=spec.port)
