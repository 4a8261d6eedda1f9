"""vLLM: ``vllm serve``, across nodes with its own multiprocessing or with a Ray cluster.

Flags are those of vLLM 0.33's ``vllm serve --help=all`` (the plain ``--help`` lists only groups).
"""

from __future__ import annotations

from llmgw.core.engines import samples
from llmgw.core.engines.common import (
    LISTEN_ALL,
    EngineBinaries,
    as_fraction,
    collective_env,
    device_env,
    fp8_dtype_reasons,
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

DISPLAY_NAME = "vLLM"
# The most of a card vLLM is told to take: its own default, so that a profile reserving the
# whole card runs as it would unset, and the CUDA context and allocator keep the slack they need
# beyond vLLM's budget.
MAX_MEMORY_UTILIZATION = 0.92
# `--max-lora-rank {1,8,16,32,64,128,256,320,512}` (default 16) in 0.33's help: a rank between
# two choices takes the larger.
LORA_RANK_CHOICES = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_LORA_RANK = 16


def plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    if spec.launcher == "ray":
        return _ray_plan(spec, engine_key=engine_key, binaries=binaries)
    return _mp_plan(spec, engine_key=engine_key, binaries=binaries)


def _mp_plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    # Every node runs `vllm serve` with the same model and sizes; only rank 0 serves HTTP, the
    # others run their GPU workers headless and join rank 0's master port.
    serves_http = spec.rank == 0
    builtins = _serve_flags(spec)
    if spec.tensor_parallel * spec.pipeline_parallel > 1:
        # Said explicitly: vLLM's default depends on what it finds (its help: mp only while the
        # ranks fit this node's GPUs, Ray beyond that), and a multi-node shard never fits.
        builtins += ["--distributed-executor-backend", "mp"]
    if spec.nodes > 1:
        builtins += [
            "--nnodes", str(spec.nodes),
            "--node-rank", str(spec.rank),
            "--master-addr", spec.leader_address,
            "--master-port", str(spec.rendezvous_port),
        ]  # fmt: skip
    if not serves_http:
        builtins.append("--headless")
    engine = Command(
        name="engine",
        argv=_serve_argv(spec, binaries, builtins),
        env=_engine_env(spec, engine_key if serves_http else None),
        serves_http=serves_http,
    )
    return LaunchPlan(commands=(engine,), health_port=spec.port if serves_http else None)


def _ray_plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    head_address = f"{spec.leader_address}:{spec.rendezvous_port}"
    if spec.rank != 0:
        # A worker node only lends its GPUs to the leader's Ray cluster; vLLM's workers there are
        # Ray actors, started by this node's raylet with this environment.
        worker = Command(
            name="ray-worker",
            argv=(binaries.ray, "start", "--address", head_address, *_ray_node_flags(spec)),
            env=_node_env(spec),
            waits_for_leader=True,
        )
        return LaunchPlan(commands=(worker,), health_port=None)
    head = Command(
        name="ray-head",
        argv=(
            binaries.ray,
            "start",
            "--head",
            "--port",
            str(spec.rendezvous_port),
            *_ray_node_flags(spec),
        ),  # fmt: skip
        env=_node_env(spec),
    )
    engine = Command(
        name="engine",
        argv=_serve_argv(spec, binaries, [*_serve_flags(spec), "--distributed-executor-backend", "ray"]),
        # Without an address, a vLLM that starts before the head is up starts a Ray of its own,
        # and one made earlier on this node by another replica would be found instead.
        env={**_engine_env(spec, engine_key), "RAY_ADDRESS": head_address},
        # The head on this node is the leader's rendezvous point: wait for it.
        waits_for_leader=True,
        serves_http=True,
    )
    return LaunchPlan(commands=(head, engine), health_port=spec.port)


def _ray_node_flags(spec: ShardSpec) -> tuple[str, ...]:
    # Ray otherwise picks the address of the default route, which on a node with several
    # networks need not be the one the other nodes reach it on. --block keeps `ray start` in the
    # foreground, so the shard's supervisor owns it.
    return ("--node-ip-address", spec.node_address, "--block")


def _serve_flags(spec: ShardSpec) -> list[str]:
    flags = [
        "--served-model-name", spec.model,
        "--host", LISTEN_ALL,
        "--port", str(spec.port),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        "--pipeline-parallel-size", str(spec.pipeline_parallel),
    ]  # fmt: skip
    share = memory_share(spec)
    if share is not None:
        # vLLM's budget on each card (weights, activations, KV cache) is this share of the card:
        # by default most of it, whatever placement reserved, and a neighbour would run out.
        flags += ["--gpu-memory-utilization", as_fraction(share)]
    if spec.ctx_size is not None:
        flags += ["--max-model-len", str(spec.ctx_size)]
    if spec.parallel is not None:
        flags += ["--max-num-seqs", str(spec.parallel)]
    if spec.dtype is not None:
        flags += ["--dtype", spec.dtype]
    if spec.quantization is not None:
        flags += ["--quantization", spec.quantization]
    if spec.max_loaded_adapters:
        # Loaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING, in the environment): room for
        # this many in one batch, and none registered at start.
        flags += [
            "--enable-lora",
            "--max-loras", str(spec.max_loaded_adapters),
            "--max-lora-rank", str(lora_rank_choice(spec.max_lora_rank)),
        ]  # fmt: skip
    elif spec.adapters:
        flags += ["--enable-lora", "--lora-modules", *(f"{a.name}={a.path}" for a in spec.adapters)]
    return flags


def lora_rank_choice(rank: int | None) -> int:
    """The least of vLLM's --max-lora-rank choices that holds ``rank`` (its default without one)."""
    if rank is None:
        return DEFAULT_LORA_RANK
    for choice in LORA_RANK_CHOICES:
        if rank <= choice:
            return choice
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest, {LORA_RANK_CHOICES[-1]}")


def _serve_argv(spec: ShardSpec, binaries: EngineBinaries, builtins: list[str]) -> tuple[str, ...]:
    # Built-ins after the profile's flags: argparse keeps the last value, so a profile cannot
    # move the port or rename the model under the router.
    return (binaries.vllm, "serve", spec.model_path, *spec.extra_flags, *builtins)


def _node_env(spec: ShardSpec) -> dict[str, str]:
    env = {**device_env(spec), **collective_env(spec)}
    if spec.node_address:
        # This node's own address, which vLLM reports to its peers; the leader's would send every
        # rank's traffic to rank 0.
        env["VLLM_HOST_IP"] = spec.node_address
    return env


def _engine_env(spec: ShardSpec, engine_key: str | None) -> dict[str, str]:
    env = _node_env(spec)
    if spec.max_loaded_adapters:
        # Without it vLLM has no /v1/load_lora_adapter (nor unload).
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if engine_key:
        # In the environment: a command line is readable by every user of the node.
        env["VLLM_API_KEY"] = engine_key
    return env


def memory_share(spec: ShardSpec) -> int | None:
    """The reserved share of each card, in hundredths: vLLM's budget covers all it allocates."""
    return reserved_share(spec, cap=MAX_MEMORY_UTILIZATION)


def validate(spec: ShardSpec) -> list[str]:
    reasons = fp8_dtype_reasons(spec, DISPLAY_NAME)
    if spec.max_loaded_adapters and (spec.max_lora_rank or 0) > LORA_RANK_CHOICES[-1]:
        reasons.append(f"max_lora_rank {spec.max_lora_rank} is above vLLM's largest, {LORA_RANK_CHOICES[-1]}")
    if memory_share(spec) == 0:
        card_mib = min(gpu.memory_total_mib for gpu in spec.gpus)
        reasons.append(
            f"{spec.gpu_memory_mib:,} MiB reserved per GPU is under a hundredth of the {card_mib:,} MiB "
            f"card, the least {DISPLAY_NAME} can be given: reserve more memory per GPU"
        )
    return reasons


ENGINE = Engine(
    name="vllm",
    display_name=DISPLAY_NAME,
    installed_build="vllm",
    python_package="vllm",
    # Ray too: the ranks of a replica must run the Ray its vLLM was installed with.
    python_binaries=("vllm", "ray"),
    plan=plan,
    validate=validate,
    # Its own multiprocessing (with --nnodes across nodes), or a Ray cluster made of one head and
    # one worker per node.
    launchers=("mp", "ray"),
    adapter_files=PEFT_FILES,
    adapter_path=directory_of_copy,
    # /v1/models lists each adapter it holds, with `parent` naming the base model.
    runtime_adapters=RuntimeAdapters(
        load_path="/v1/load_lora_adapter", unload_path="/v1/unload_lora_adapter"
    ),
    # vLLM < 0.10 called its KV gauge gpu_cache_usage_perc.
    metrics=EngineMetrics(
        "vllm",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    help=HelpCheck(
        program="vllm",
        # Plain `--help` lists only the option groups.
        help_args=("serve", "--help=all"),
        version_args=("--version",),
        argv_prefix=3,  # `vllm serve <model>`
        min_help_lines=1000,  # 0.33.0 `serve --help=all` prints 1293; plain `--help` only 34
        truncation_hint="; plain `vllm serve --help` lists only option groups: use `--help=all`",
        widest_specs=(
            ("vLLM mp 2 nodes, rank 0", samples.two_nodes("vllm", 0)),
            ("vLLM mp 2 nodes, rank 1 (headless)", samples.two_nodes("vllm", 1)),
            ("vLLM Ray 2 nodes, leader", samples.two_nodes("vllm", 0, launcher="ray")),
            ("vLLM Ray 2 nodes, worker", samples.two_nodes("vllm", 1, launcher="ray")),
            (
                "vLLM, adapters loaded at run time",
                samples.base("vllm", max_loaded_adapters=4, max_lora_rank=64),
            ),
        ),
    ),
)
