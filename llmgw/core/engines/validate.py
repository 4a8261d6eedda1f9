"""Refusing a shard before launch, when it could only fail on the node or run wrong.

An engine that cannot start says so minutes into loading a model, in its own words, on a node
nobody is watching; some mistakes do not even fail (fp8 on a card without fp8 falls back to a slow
path). Each reason is a sentence naming the values involved, for the operator to act on.
"""

from __future__ import annotations

from llmgw.core.engines import registry
from llmgw.core.engines.descriptor import Engine
from llmgw.core.engines.registry import LAUNCHERS
from llmgw.core.shard import FABRIC_KINDS, ShardSpec

# Hardware fp8 arrived with Ada (8.9) and Hopper (9.0); older cards emulate it slowly.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
# Flags that would replace the key llmgw gives each replica, locking the router out of it.
KEY_FLAGS = ("--api-key", "--api-key-file")


class InvalidShard(ValueError):
    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = tuple(reasons)


def validate(spec: ShardSpec) -> list[str]:
    """Why ``spec`` cannot be launched; empty when it can."""
    try:
        engine = registry.get(spec.engine)
    except registry.UnknownEngine as e:
        return [str(e)]
    return [
        *_topology(spec),
        *_gpus(spec, engine),
        *_rendezvous(spec, engine),
        *_fabric(spec),
        *_precision(spec),
        *engine.validate(spec),
        *_flags_and_names(spec, engine),
    ]


def _topology(spec: ShardSpec) -> list[str]:
    reasons = []
    for field, value in (
        ("nodes", spec.nodes),
        ("tensor parallelism", spec.tensor_parallel),
        ("pipeline parallelism", spec.pipeline_parallel),
    ):
        if value < 1:
            reasons.append(f"{field} must be at least 1, not {value}")
    if spec.nodes >= 1 and not 0 <= spec.rank < spec.nodes:
        reasons.append(f"rank {spec.rank} is outside 0..{spec.nodes - 1} for a {spec.nodes}-node shard")
    if not 1 <= spec.port <= 65535:
        reasons.append(f"port {spec.port} is not a TCP port")
    for field, value in (("ctx_size", spec.ctx_size), ("parallel", spec.parallel)):
        if value is not None and value < 1:
            reasons.append(f"{field} must be at least 1 when set, not {value}")
    return reasons


def _gpus(spec: ShardSpec, engine: Engine) -> list[str]:
    tp, pp = spec.tensor_parallel, spec.pipeline_parallel
    if not spec.gpus:
        if not engine.runs_on_cpu:
            return [f"{engine.display_name} needs GPUs and this shard has none ({registry.only_on_cpu()})"]
        if (tp, pp) != (1, 1):
            return [f"a CPU shard runs with tensor parallelism 1 × pipeline 1, not {tp} × {pp}"]
        return []
    reasons = []
    if spec.nodes * len(spec.gpus) != tp * pp:
        reasons.append(
            f"tensor parallelism {tp} × pipeline {pp} needs {_count(tp * pp, 'GPU')}, "
            f"this shard spans {_count(spec.nodes, 'node')} × {_count(len(spec.gpus), 'GPU')}"
        )
    classes = sorted({gpu.gpu_class for gpu in spec.gpus})
    if len(classes) > 1:
        # Tensor-parallel ranks run in lockstep: the group runs at the pace, and within the
        # memory, of its smallest card.
        reasons.append(
            f"a tensor-parallel group must be one GPU class, this shard mixes {', '.join(classes)}"
        )
    return reasons


def _rendezvous(spec: ShardSpec, engine: Engine) -> list[str]:
    if spec.launcher not in LAUNCHERS:
        return [f"launcher {spec.launcher!r} is not one of {', '.join(LAUNCHERS)}"]
    if spec.launcher not in engine.launchers:
        owners = registry.display_names(registry.with_launcher(spec.launcher))
        return [
            f"launcher {spec.launcher!r} is for {owners} only; {engine.display_name} starts its own ranks"
        ]
    if spec.launcher == "ray":
        # Even on one node: the Ray head listens on the node's address, and vLLM is pointed at it.
        needed_by = "a Ray-launched shard"
    elif spec.nodes > 1:
        needed_by = f"a {spec.nodes}-node shard"
    else:
        return []
    reasons = []
    for field, value in (
        ("leader_address", spec.leader_address),
        ("node_address", spec.node_address),
        ("mgmt_interface", spec.mgmt_interface),
    ):
        if not value:
            reasons.append(f"{needed_by} needs {field}, which is empty")
    if not 1 <= spec.rendezvous_port <= 65535:
        reasons.append(f"{needed_by} needs a rendezvous_port on the leader, not {spec.rendezvous_port}")
    return reasons


def _fabric(spec: ShardSpec) -> list[str]:
    fabric = spec.fabric
    if fabric.kind not in FABRIC_KINDS:
        return [f"fabric kind {fabric.kind!r} is not one of 'ib', 'roce' or '' (none)"]
    if not fabric.kind:
        if fabric.hcas:
            return [f"fabric kind '' (none) lists adapters {', '.join(fabric.hcas)}"]
        return []
    reasons = []
    if not fabric.hcas:
        # An empty NCCL_IB_HCA is an open list: NCCL would pick adapters on any fabric.
        reasons.append(f"fabric {fabric.kind!r} lists no adapters")
    if fabric.kind == "roce" and fabric.gid_index is None:
        reasons.append(
            "a RoCE fabric needs the GID index of its RoCE v2 IPv4 entry: NCCL's default is a v1 "
            "link-local entry on most hosts, which does not route"
        )
    return reasons


def _precision(spec: ShardSpec) -> list[str]:
    # Every fp8 variant (fp8, w8a8_fp8, modelopt_fp8, ...) computes in fp8.
    fp8 = [
        f"{field} {value!r}"
        for field, value in (("dtype", spec.dtype), ("quantization", spec.quantization))
        if value is not None and "fp8" in value.lower()
    ]
    reasons = []
    if fp8:
        too_old = []
        for gpu in spec.gpus:
            capability = _capability(gpu.compute_capability)
            if capability is None:
                reasons.append(
                    f"GPU {gpu.index} reports compute capability {gpu.compute_capability!r}, not MAJOR.MINOR"
                )
            elif capability < FP8_MIN_COMPUTE_CAPABILITY:
                too_old.append(f"GPU {gpu.index} ({gpu.gpu_class}) is {gpu.compute_capability}")
        if too_old:
            reasons.append(
                f"{' and '.join(fp8)}: fp8 needs compute capability 8.9 or newer, and {', '.join(too_old)}; "
                "refused rather than left to a slow fallback"
            )
    return reasons


def _flags_and_names(spec: ShardSpec, engine: Engine) -> list[str]:
    reasons = []
    for token in spec.extra_flags:
        if token.split("=", 1)[0] in KEY_FLAGS:
            reasons.append(
                f"extra flag {token.split('=', 1)[0]} would replace the key llmgw gives the replica, "
                "and the router would be locked out"
            )
    if spec.max_loaded_adapters is not None:
        if engine.runtime_adapters is None:
            reasons.append(f"{engine.display_name} cannot load adapters at run time (max_loaded_adapters)")
        elif spec.max_loaded_adapters < 1:
            reasons.append(f"max_loaded_adapters must be at least 1, not {spec.max_loaded_adapters}")
    names = [adapter.name for adapter in spec.adapters]
    for name in sorted({n for n in names if names.count(n) > 1}):
        reasons.append(f"adapter name {name!r} is given twice")
    for adapter in spec.adapters:
        if adapter.source and not adapter.path:
            # The agent fills the path in once the server has delivered the stored adapter.
            reasons.append(
                f"adapter {adapter.name!r}: stored adapter {adapter.source!r} has no path on this node "
                "(not delivered)"
            )
        elif not adapter.name or not adapter.path:
            reasons.append(f"adapter {adapter.name!r} at {adapter.path!r} needs both a name and a path")
        elif "=" in adapter.name and engine.adapters_as_name_eq_path:
            reasons.append(f"adapter name {adapter.name!r} holds '=', which ends the name in name=path")
    return reasons


def _capability(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
