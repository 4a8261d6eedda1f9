"""What every engine's command builder shares: binaries, GPU selection, collectives' network."""

from __future__ import annotations

import attrs

from llmgw.core.shard import ShardSpec

# Engines listen on every address of the node: the router and the agent's health check reach
# them over the management network. The engine key keeps everyone else out.
LISTEN_ALL = "0.0.0.0"


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
