"""SGLang: ``python -m sglang.launch_server`` on every node; rank 0 serves HTTP.

Flags are those of SGLang 0.5.23's help. Its tensor-parallel flag is ``--tp-size``: ``--tp`` works
only through argparse's prefix matching, which a future flag starting with ``--tp`` would break.
"""

from __future__ import annotations

from llmgw.core.engines.common import LISTEN_ALL, EngineBinaries, collective_env, device_env
from llmgw.core.shard import Command, LaunchPlan, ShardSpec


def plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    serves_http = spec.rank == 0
    builtins = [
        "--model-path", spec.model_path,
        "--served-model-name", spec.model,
        "--host", LISTEN_ALL,
        "--port", str(spec.port),
        "--tp-size", str(spec.tensor_parallel),
        "--enable-metrics",  # the router's load signals (queue, running requests) come from /metrics
    ]  # fmt: skip
    if spec.pipeline_parallel > 1:
        builtins += ["--pp-size", str(spec.pipeline_parallel)]
    if spec.nodes > 1:
        builtins += [
            "--nnodes", str(spec.nodes),
            "--node-rank", str(spec.rank),
            "--dist-init-addr", f"{spec.leader_address}:{spec.rendezvous_port}",
        ]  # fmt: skip
    if spec.ctx_size is not None:
        builtins += ["--context-length", str(spec.ctx_size)]
    if spec.parallel is not None:
        builtins += ["--max-running-requests", str(spec.parallel)]
    if spec.dtype is not None:
        builtins += ["--dtype", spec.dtype]
    if spec.quantization is not None:
        builtins += ["--quantization", spec.quantization]
    if spec.adapters:
        builtins += ["--enable-lora", "--lora-paths", *(f"{a.name}={a.path}" for a in spec.adapters)]
    if engine_key and serves_http:
        # SGLang is the one engine whose key must go on the command line: it reads no environment
        # variable for it. Only the rank that serves HTTP checks a key, so only it gets one.
        builtins += ["--api-key", engine_key]
    engine = Command(
        name="engine",
        # Built-ins after the profile's flags: argparse keeps the last value.
        argv=(binaries.python, "-m", "sglang.launch_server", *spec.extra_flags, *builtins),
        env={**device_env(spec), **collective_env(spec)},
        serves_http=serves_http,
    )
    return LaunchPlan(commands=(engine,), health_port=spec.port if serves_http else None)
