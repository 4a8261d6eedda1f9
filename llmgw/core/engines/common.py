"""What every engine's command builder shares: binaries, GPU selection, collectives' network."""

from __future__ import annotations

import attrs

from llmgw.core.inventory import LOOPBACK
from llmgw.core.shard import ShardSpec


def listen_address(spec: ShardSpec) -> str:
    """The one address an engine listens on: the node's management address, which the router,
    the scraper and the adapter loads reach it at (and the agent's probes), else loopback. Never
    every address of the node: on an address no part of llmgw uses, an engine would answer
    whoever reaches it there, the engine key its only guard. (The server's side of the same rule
    is Inventory.reached_at: placement copies the node's address into the spec.)"""
    return spec.node_address or LOOPBACK


@attrs.frozen(kw_only=True)
class EngineBinaries:
    """How the agent invokes each engine on its node (a name on PATH or an absolute path)."""

    llama_server: str = "llama-server"
    vllm: str = "vllm"
    python: str = "python3"  # the interpreter that has sglang installed
    ray: str = "ray"


def device_env(spec: ShardSpec) -> dict[str, str]:
    """The GPUs the shard's processes may see.

    Indices rather than UUIDs: older vLLM releases parse every entry as an integer, and Ray hands
    its workers indices anyway. CUDA numbers devices fastest-first unless told otherwise;
    PCI_BUS_ID makes its numbering NVML's, which is what ``GpuRef.index`` is.

    A CPU shard gets an empty list, hiding every GPU: a CUDA build of llama.cpp offloads host
    operations to device 0 even at ``-ngl 0`` (``--op-offload`` is on by default), which would
    take memory on a card placement gave to another shard.
    """
    if not spec.gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(gpu.index) for gpu in spec.gpus),
    }


def collective_env(spec: ShardSpec) -> dict[str, str]:
    """NCCL's and Gloo's network settings, for shards whose ranks talk to each other."""
    if spec.nodes == 1 and spec.tensor_parallel * spec.pipeline_parallel == 1:
        return {}
    env: dict[str, str] = {}
    if spec.mgmt_interface:
        # This node's own interface: names differ between nodes. NCCL matches a bare name as a
        # prefix ("eth1" also takes eth10); a leading "=" asks for exactly this one. Gloo takes
        # exact names and has no such syntax.
        env["NCCL_SOCKET_IFNAME"] = "=" + spec.mgmt_interface
        env["GLOO_SOCKET_IFNAME"] = spec.mgmt_interface
    fabric = spec.fabric
    if not fabric.kind:
        env["NCCL_IB_DISABLE"] = "1"
        return env
    # Exactly the chosen fabric's adapters ("=" again: mlx5_1 would also match mlx5_10).
    env["NCCL_IB_HCA"] = "=" + ",".join(fabric.hcas)
    if fabric.kind == "roce" and fabric.gid_index is not None:
        # NCCL's default GID is a RoCE v1 link-local entry on most hosts, which does not route.
        env["NCCL_IB_GID_INDEX"] = str(fabric.gid_index)
    return env


def reserved_share(spec: ShardSpec, *, set_aside: float = 0.0, cap: float = 1.0) -> int | None:
    """The share of each of the shard's cards that placement reserved for it, in hundredths;
    None when the reservation or the card's memory is unknown (the engine keeps its default).

    ``set_aside`` (a share of the card) is taken off first, for memory the engine uses beyond what
    its flag governs; ``cap`` bounds the result. Rounded down: a share rounded up would let the
    engine past the reservation, into a neighbour's memory.
    """
    if spec.gpu_memory_mib is None or not spec.gpus:
        return None
    # A tensor-parallel group is one GPU class; the smallest card bounds them all regardless.
    card_mib = min(gpu.memory_total_mib for gpu in spec.gpus)
    if card_mib <= 0:
        return None
    share = (spec.gpu_memory_mib * 100 - round(set_aside * 100) * card_mib) // card_mib
    return max(0, min(share, round(cap * 100)))


def as_fraction(hundredths: int) -> str:
    """Hundredths as the engines' fraction flags take them: 49 → "0.49"."""
    return f"{hundredths // 100}.{hundredths % 100:02d}"


def fp8_dtype_reasons(spec: ShardSpec, display_name: str) -> list[str]:
    """For an engine whose --dtype choices have no fp8 (it takes fp8 as a quantization)."""
    if spec.dtype is not None and "fp8" in spec.dtype.lower():
        return [
            f"dtype {spec.dtype!r} is not a --dtype choice of {display_name}, which takes fp8 "
            "as a quantization: set quantization 'fp8' instead"
        ]
    return []
