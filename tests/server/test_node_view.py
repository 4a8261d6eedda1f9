"""What the reconciler's shell makes of a node's inventory (server.replicas.node_view)."""

from __future__ import annotations

from llmgw.core.catalog import Profile
from llmgw.core.inventory import Gpu, IbPort, Inventory
from llmgw.core.liveness import NodeState
from llmgw.core.placement import ClusterView, place
from llmgw.core.shard import Fabric
from llmgw.server.nodes import Node
from llmgw.server.replicas import node_view


def node(**inventory: object) -> Node:
    return Node(
        name="n1",
        agent_version="0.1.0",
        inventory=Inventory(
            hostname="n1", cpu_count=8, memory_total_mib=65536, memory_available_mib=60000, **inventory
        ),
        state=NodeState.ONLINE,
        first_seen=0.0,
        last_seen=0.0,
        state_since=0.0,
        last_heard=0.0,
        session=object(),  # connected
    )


def test_ports_the_node_reports_in_use_are_not_given_to_engines():
    view = node_view(node(ports_in_use=(20000, 20001)))
    assert view.ports_in_use == {20000, 20001}
    profile = Profile(name="p", model="m", engine="llamacpp", gpu_class=None, memory_mib=512)
    placement = place(ClusterView(nodes=(view,)), profile, (20000, 20009))
    assert placement.shards[0].port == 20002


def test_the_rdma_of_the_node_s_fabric_with_the_gid_index_of_the_chosen_adapters():
    def roce(device: str, gid: int, ipv4: str) -> IbPort:
        return IbPort(
            device=device, port=1, state="ACTIVE", rate_gbps=100, link_layer="Ethernet", roce_v2_gid_index=gid,
            subnet=ipv4,
        )  # fmt: skip

    ports = (roce("mlx5_0", 1, "10.0.0.5"), roce("mlx5_1", 3, "10.0.0.6"), roce("mlx5_2", 3, "10.0.0.7"))
    view = node_view(node(ib_ports=ports, fabric="roce-10.0.0", gpus=(
        Gpu(index=0, uuid="g0", name="NVIDIA H100 80GB HBM3", gpu_class="h100-80g", memory_total_mib=81559,
            memory_used_mib=0, compute_capability="9.0"),
    )))  # fmt: skip
    assert view.rdma == Fabric(kind="roce", hcas=("mlx5_1", "mlx5_2"), gid_index=3)
