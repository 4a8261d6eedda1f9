"""llama.cpp: one ``llama-server`` on one node, on GPUs or on the CPU.

Flags are those of llama-server build 11434's help.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmgw.core.engines import samples
from llmgw.core.engines.common import EngineBinaries, device_env, listen_address
from llmgw.core.engines.descriptor import Engine, EngineMetrics, HelpCheck
from llmgw.core.shard import Adapter, Command, LaunchPlan, ShardSpec
from llmgw.core.training import GGUF_FILE, FileDigest

DISPLAY_NAME = "llama.cpp"

# More layers than any model has: every layer on the GPUs. A number rather than "all", which
# older builds do not know.
ALL_LAYERS = "999"


def plan(spec: ShardSpec, *, engine_key: str | None, binaries: EngineBinaries) -> LaunchPlan:
    builtins = [
        "-m", spec.model_path,
        "--alias", spec.model,
        "--host", listen_address(spec),
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
    if spec.adapters:
        # Loaded at scale 0: a request for the base model gets the base model, and one naming an
        # adapter gets it through the per-request list the gateway adds (select_adapter).
        builtins.append("--lora-init-without-apply")
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


def validate(spec: ShardSpec) -> list[str]:
    reasons = []
    if spec.nodes > 1:
        reasons.append(f"llama.cpp runs on one node, and this shard spans {spec.nodes}")
    for field, value in (("dtype", spec.dtype), ("quantization", spec.quantization)):
        if value is not None:
            reasons.append(
                f"llama.cpp takes its quantization from the GGUF file; {field} {value!r} cannot apply"
            )
    if not spec.model_path.endswith(".gguf"):
        reasons.append(f"llama.cpp loads a .gguf file, and model_path {spec.model_path!r} is not one")
    # llama.cpp splits --alias and --lora values at commas.
    if "," in spec.model:
        reasons.append(f"model name {spec.model!r} holds a comma, which llama.cpp reads as two aliases")
    for adapter in spec.adapters:
        if "," in adapter.path:
            reasons.append(
                f"adapter path {adapter.path!r} holds a comma, which llama.cpp reads as two adapters"
            )
    return reasons


def adapter_path(directory: str, files: tuple[FileDigest, ...]) -> str:
    """llama.cpp is given the copy's GGUF file (--lora FILE), not its directory."""
    gguf = next((f.name for f in files if f.name.endswith(".gguf")), GGUF_FILE)
    return f"{directory}/{gguf}"


def select_adapter(names: Sequence[str], name: str | None) -> dict[str, Any]:
    """The request's `lora` list: ``name`` at scale 1, every other adapter the engine holds at 0
    (all at 0 for the base model, ``name`` None). An id is the adapter's place among the --lora
    flags. Every adapter is listed, the base model's requests too: a slot that served an adapter
    otherwise keeps something of it for the next request (seen on build 11434)."""
    return {"lora": [{"id": i, "scale": 1.0 if n == name else 0.0} for i, n in enumerate(names)]}


_CHECK = {"model_path": "/models/check.gguf", "dtype": None, "quantization": None}
_CHECK_ADAPTERS = (Adapter(name="a1", path="/adapters/a1.gguf"), Adapter(name="a2", path="/adapters/a2.gguf"))

ENGINE = Engine(
    name="llamacpp",
    display_name=DISPLAY_NAME,
    plan=plan,
    validate=validate,
    runs_on_cpu=True,
    multi_node=False,
    only_format="gguf",
    installed_build="llama_server",
    # --lora takes a path alone; the adapter's name is llmgw's.
    adapters_as_name_eq_path=False,
    adapter_files=(GGUF_FILE,),
    adapter_path=adapter_path,
    select_adapter=select_adapter,
    # llama-server b11434 with --metrics has no KV gauge: saturation comes from its slots.
    metrics=EngineMetrics("llamacpp", "llamacpp:requests_processing", "llamacpp:requests_deferred"),
    help=HelpCheck(
        program="llama_server",
        help_args=("--help",),
        version_args=("--version",),
        argv_prefix=1,  # `llama-server`
        min_help_lines=600,  # build 11434 prints 736
        widest_specs=(
            (
                "llama.cpp on GPUs",
                samples.base(
                    "llamacpp", **_CHECK, gpus=(samples.h100(0),), tensor_parallel=1, adapters=_CHECK_ADAPTERS
                ),
            ),
            (
                "llama.cpp on the CPU",
                samples.base("llamacpp", **_CHECK, gpus=(), tensor_parallel=1, cpu_threads=2),
            ),
        ),
    ),
)
