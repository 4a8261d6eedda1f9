"""Placeholder shards for ``ctl engine-check``: each engine's widest specs are built from these.

Only the flags matter, not the values. Every optional setting is on, since each adds its flag;
extra_flags stay empty: they are the profile's, not llmgw's, and a profile's author checks them
against their own engine.
"""

from __future__ import annotations

import attrs

from llmgw.core.shard import Adapter, Fabric, GpuRef, ShardSpec

ADAPTERS = (Adapter(name="a1", path="/adapters/a1"), Adapter(name="a2", path="/adapters/a2"))
IB = Fabric(kind="ib", hcas=("mlx5_0",))
H100_MIB = 81559


def h100(index: int) -> GpuRef:
    return GpuRef(
        index=index,
        uuid=f"GPU-{index}",
        gpu_class="h100-80g",
        compute_capability="9.0",
        memory_total_mib=H100_MIB,
    )


def base(engine: str, **changes: object) -> ShardSpec:
    spec = ShardSpec(
        shard_id="check-s0",
        replica_id="check",
        model="check-model",
        model_path="/models/check",
        engine=engine,
        gpus=(h100(0), h100(1)),
        tensor_parallel=2,
        node_address="10.0.0.1",
        mgmt_interface="eth0",
        port=8100,
        ctx_size=8192,
        parallel=16,
        gpu_memory_mib=H100_MIB // 2,
        dtype="bfloat16",
        quantization="fp8",
        adapters=ADAPTERS,
    )
    return attrs.evolve(spec, **changes)


def two_nodes(engine: str, rank: int, **changes: object) -> ShardSpec:
    return base(
        engine,
        nodes=2,
        rank=rank,
        leader_address="10.0.0.1",
        node_address=f"10.0.0.{rank + 1}",
        rendezvous_port=29500,
        pipeline_parallel=2,
        fabric=IB,
        **changes,
    )
