"""Which RDMA adapters of a node a multi-node shard's collectives use, and with which GID.

A node may have adapters on more than one island (a rail network and a storage network, say):
NCCL given an adapter whose peer is on another island hangs, so only the node's fabric's ports
are chosen. On RoCE, each adapter has its own GID table, and the RoCE v2 IPv4 entry need not sit
at the same index on every adapter; NCCL takes one NCCL_IB_GID_INDEX for every adapter it uses,
so only adapters whose entry is at the chosen index are given to it.
"""

from __future__ import annotations

import collections
import ipaddress

from llmgw.core.inventory import IbPort
from llmgw.core.shard import Fabric


def port_island(port: IbPort) -> str:
    """The fabric a port joins: "roce-" + the /24 of its RoCE v2 IPv4 address ("roce-10.0.0"), or
    "ib-" + its GID 0 subnet prefix ("ib-fe80::"); "" without a subnet."""
    if not port.subnet:
        return ""
    if port.is_roce:
        return "roce-" + port.subnet.rsplit(".", 1)[0]
    return "ib-" + str(ipaddress.IPv6Address(port.subnet + "::"))


def chosen_fabric(ports: tuple[IbPort, ...], fabric: str) -> Fabric:
    """The adapters (and RoCE GID index) of the node's ``fabric`` a shard's NCCL is given."""
    active = [port for port in ports if port.state == "ACTIVE"]
    if not active or not fabric:
        return Fabric()
    on_fabric = [port for port in active if port_island(port) == fabric]
    # A fabric named by the operator (agent.yaml fabric:) need not match a port's own name.
    chosen = on_fabric or active
    roce = [port for port in chosen if port.is_roce]
    if not roce:
        return Fabric(kind="ib", hcas=tuple(sorted({port.device for port in chosen})))
    indexed = [port for port in roce if port.roce_v2_gid_index is not None]
    if not indexed:
        return Fabric(kind="roce", hcas=tuple(sorted({port.device for port in roce})))
    # The index most adapters share, the first adapter's on a tie: the most bandwidth NCCL can use.
    counts = collections.Counter(port.roce_v2_gid_index for port in indexed)
    most = max(counts.values())
    index = next(p.roce_v2_gid_index for p in indexed if counts[p.roce_v2_gid_index] == most)
    hcas = tuple(sorted({port.device for port in indexed if port.roce_v2_gid_index == index}))
    return Fabric(kind="roce", hcas=hcas, gid_index=index)
