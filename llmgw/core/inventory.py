"""What a node is made of, as its agent's discovery finds it: CPUs, memory, GPUs, RDMA ports.

The agent sends it in Register and Heartbeat; placement and the reconciler read it. It lives in
the core, which decides on it, and the link carries it as it is (wire.messages re-exports it).
"""

from __future__ import annotations

import attrs

frozen = attrs.frozen(kw_only=True)


@frozen
class ForeignProcess:
    """A process holding GPU memory that llmgw did not start."""

    pid: int
    name: str = ""
    used_mib: int = 0


@frozen
class Gpu:
    index: int
    uuid: str
    name: str
    gpu_class: str  # e.g. "l40s-45g": product name + driver-reported memory rounded to GiB
    memory_total_mib: int
    memory_used_mib: int
    compute_capability: str  # "8.9"
    ecc_uncorrected: int = 0  # volatile uncorrected ECC errors; -1 when the GPU cannot say
    foreign_processes: tuple[ForeignProcess, ...] = ()
    # Health flags, empty when healthy: "ecc-uncorrected", "foreign-memory".
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def memory_free_mib(self) -> int:
        return max(0, self.memory_total_mib - self.memory_used_mib)


@frozen
class IbPort:
    """One port of an InfiniBand/RoCE adapter, from /sys/class/infiniband."""

    device: str  # "mlx5_0"
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    rate_gbps: float
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    # RoCE only: the GID table entry that is RoCE v2 and holds an IPv4 address (NCCL_IB_GID_INDEX).
    roce_v2_gid_index: int | None = None
    # GID 0's subnet prefix (IB) or the IPv4 of the RoCE v2 GID: what ties ports into one fabric.
    subnet: str = ""

    @property
    def is_roce(self) -> bool:
        return self.link_layer == "Ethernet"


# Where a node has no management address (one host, the server on loopback).
LOOPBACK = "127.0.0.1"


@frozen
class Inventory:
    hostname: str
    cpu_count: int
    memory_total_mib: int
    memory_available_mib: int
    gpus: tuple[Gpu, ...] = ()
    ib_ports: tuple[IbPort, ...] = ()
    # The island this node's multi-node placements may span; "" = a single-node island.
    fabric: str = ""
    # The interface holding the address this agent uses to reach the server (NCCL/GLOO socket ifname).
    mgmt_interface: str = ""
    mgmt_address: str = ""
    # Why the node has no GPUs listed, when NVML could not be used ("" when it could).
    gpu_note: str = ""
    # The GPUs and RDMA ports come from a file (agent.yaml's discovery.simulate), not the hardware.
    simulated: bool = False
    # TCP ports something other than our shards listens on: placement gives engines none of them,
    # or a start would fail on a port another program holds until the replica is moved.
    ports_in_use: tuple[int, ...] = ()

    @property
    def reached_at(self) -> str:
        """The address the control plane reaches the node's engines at, and they listen on."""
        return self.mgmt_address or LOOPBACK
