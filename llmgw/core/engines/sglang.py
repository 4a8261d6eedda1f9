"""SGLang: ``sglang.launch_server`` on every node (run by LAUNCH_PROGRAM); rank 0 serves HTTP.

Flags are those of SGLang 0.5.23's help. Its tensor-parallel flag is ``--tp-size``: ``--tp`` works
only through argparse's prefix matching, which a future flag starting with ``--tp`` would break.
"""

from __future__ import annotations

from llmgw.core.engines import samples
from llmgw.core.engines.common import (
    EngineBinaries,
    as_fraction,
    collective_env,
    device_env,
    fp8_dtype_reasons,
    listen_address,
    reserved_share,
)
from llmgw.core.engines.descriptor import (
    Engine,
    EngineMetrics,
    HelpCheck,
    RuntimeAdapters,
    directory_of_copy,
)
from llmgw.core.shard import Command, LaunchPlan, ShardSpec
from llmgw.core.training import PEFT_FILES

DISPLAY_NAME = "SGLang"
# --mem-fraction-static governs only SGLang's static pool (weights and KV cache); activations and
# CUDA-graph buffers come on top. Its own default keeps room for them outside the pool: at least
# 10 GiB on a card above 60 GiB, by its estimate about a sixth of an 80 GB card. As much is taken
# off the reservation, so that the whole process stays inside what placement reserved.
OUTSIDE_STATIC_SHARE = 0.17
# The rank an adapter loaded at run time may have when the profile says none: peft's default r
# is 8, and 16 is vLLM's default too.
DEFAULT_LORA_RANK = 16


# SGLang takes its key from --api-key alone, and a command line is readable by every user of the
# node. So it is started by this program, which moves the key from the environment (readable by
# its owner alone) into the server's own sys.argv, last (argparse keeps the last value), and out
# of the environment its children inherit; then it runs the server as `python -m` would.
KEY_VARIABLE = "LLMGW_ENGINE_KEY"
LAUNCH_PROGRAM = f"""\
import os, runpy, sys
key = os.environ.pop({KEY_VARIABLE!r}, "")
if key:
    sys.argv += ["--api-key", key]
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    serves_http = spec.rank == 0
    builtins = [
        "--model-path", spec.model_path,
        "--served-model-name", spec.model,
        "--host", listen_address(spec),
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
    share = memory_share(spec)
    if share is not None:
        # By default SGLang sizes its pool to most of the card, whatever placement reserved.
        builtins += ["--mem-fraction-static", as_fraction(share)]
    if spec.ctx_size is not None:
        builtins += ["--context-length", str(spec.ctx_size)]
    if spec.parallel is not None:
        builtins += ["--max-running-requests", str(spec.parallel)]
    if spec.dtype is not None:
        builtins += ["--dtype", spec.dtype]
    if spec.quantization is not None:
        builtins += ["--quantization", spec.quantization]
    if spec.max_loaded_adapters:
        # Loaded at run time: none at start, so SGLang cannot infer the rank or the modules from
        # them, and needs both said. As many in a batch as it holds (--max-loaded-loras may not
        # be below --max-loras-per-batch).
        n = str(spec.max_loaded_adapters)
        builtins += [
            "--enable-lora",
            "--max-loaded-loras", n,
            "--max-loras-per-batch", n,
            "--max-lora-rank", str(spec.max_lora_rank or DEFAULT_LORA_RANK),
            "--lora-target-modules", "all",
        ]  # fmt: skip
    elif spec.adapters:
        builtins += ["--enable-lora", "--lora-paths", *(f"{a.name}={a.path}" for a in spec.adapters)]
    env = {**device_env(spec), **collective_env(spec)}
    if engine_key and serves_http:
        # Only the rank that serves HTTP checks a key, so only it gets one (see LAUNCH_PROGRAM).
        env[KEY_VARIABLE] = engine_key
    engine = Command(
        name="engine",
        # Built-ins after the profile's flags: argparse keeps the last value.
        argv=(binaries.python, "-c", LAUNCH_PROGRAM, *spec.extra_flags, *builtins),
        env=env,
        serves_http=serves_http,
    )
    return LaunchPlan(commands=(engine,), health_port=spec.port if serves_http else None)


def memory_share(spec: ShardSpec) -> int | None:
    """The static pool's share of each card, in hundredths: the reservation less what SGLang
    uses outside the pool."""
    return reserved_share(spec, set_aside=OUTSIDE_STATIC_SHARE)


def validate(spec: ShardSpec) -> list[str]:
    reasons = fp8_dtype_reasons(spec, DISPLAY_NAME)
    if memory_share(spec) == 0:
        card_mib = min(gpu.memory_total_mib for gpu in spec.gpus)
        reasons.append(
            f"{spec.gpu_memory_mib:,} MiB reserved per GPU leaves {DISPLAY_NAME} no static pool once "
            f"{OUTSIDE_STATIC_SHARE:.0%} of the {card_mib:,} MiB card is set aside for its activations "
            "and CUDA graphs: reserve more memory per GPU"
        )
    return reasons


ENGINE = Engine(
    name="sglang",
    display_name=DISPLAY_NAME,
    installed_build="python",
    python_package="sglang",
    python_binaries=("python",),
    plan=plan,
    validate=validate,
    adapter_files=PEFT_FILES,
    adapter_path=directory_of_copy,
    # Its LoRA endpoints have no /v1 (fixtures/engine-help/README.md); its /v1/models lists the
    # adapters it holds beside the base model, as vLLM's does.
    runtime_adapters=RuntimeAdapters(load_path="/load_lora_adapter", unload_path="/unload_lora_adapter"),
    # Only exposed with --enable-metrics; token_usage is the KV pool's fill, 0..1.
    metrics=EngineMetrics(
        "sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)
    ),
    help=HelpCheck(
        program="python",
        help_args=("-m", "sglang.launch_server", "--help"),
        version_args=("-c", "import sglang; print(sglang.__version__)"),
        # `python -c LAUNCH_PROGRAM`, whose "-c" is the interpreter's, not SGLang's.
        argv_prefix=3,
        launch_options=("--api-key", "key"),
        min_help_lines=1100,  # 0.5.23 `launch_server --help` prints 1436
        widest_specs=(
            ("SGLang 2 nodes, rank 0", samples.two_nodes("sglang", 0)),
            ("SGLang 2 nodes, rank 1", samples.two_nodes("sglang", 1)),
            (
                "SGLang, adapters loaded at run time",
                samples.base("sglang", max_loaded_adapters=4, max_lora_rank=64),
            ),
        ),
    ),
)
