"""The RDMA adapters and RoCE GID index a node's shards are given (llmgw.core.rdma)."""

from __future__ import annotations

from llmgw.core.inventory import IbPort
from llmgw.core.rdma import chosen_fabric, port_island
from llmgw.core.shard import Fabric


def roce(device: str, gid: int | None, ipv4: str = "10.0.0.5", state: str = "ACTIVE") -> IbPort:
    return IbPort(
        device=device,
        port=1,
        state=state,
        rate_gbps=100.0,
        link_layer="Ethernet",
        roce_v2_gid_index=gid,
        subnet=ipv4 if gid is not None else "",
    )


def ib(device: str, prefix: str = "fe80:0000:0000:0000", state: str = "ACTIVE") -> IbPort:
    return IbPort(device=device, port=1, state=state, rate_gbps=200.0, link_layer="InfiniBand", subnet=prefix)


def test_each_adapter_s_own_gid_index_decides_which_adapters_nccl_gets():
    # mlx5_0's RoCE v2 IPv4 entry is at 3, mlx5_1's and mlx5_2's at 5: NCCL takes one index for
    # all, so the two that share one go, with their index, and not mlx5_0's 3 for everyone.
    ports = (roce("mlx5_0", 3, "10.0.0.5"), roce("mlx5_1", 5, "10.0.0.6"), roce("mlx5_2", 5, "10.0.0.7"))
    assert chosen_fabric(ports, "roce-10.0.0") == Fabric(kind="roce", hcas=("mlx5_1", "mlx5_2"), gid_index=5)


def test_a_tie_goes_to_the_first_adapter_s_index():
    ports = (roce("mlx5_0", 3, "10.0.0.5"), roce("mlx5_1", 5, "10.0.0.6"))
    assert chosen_fabric(ports, "roce-10.0.0") == Fabric(kind="roce", hcas=("mlx5_0",), gid_index=3)


def test_adapters_on_another_island_or_down_are_left_out():
    ports = (
        roce("mlx5_0", 3, "10.0.0.5"),
        roce("mlx5_1", 3, "192.168.7.5"),  # the storage network: another island
        roce("mlx5_2", 3, "10.0.0.7", state="DOWN"),
    )
    assert port_island(ports[1]) == "roce-192.168.7"
    assert chosen_fabric(ports, "roce-10.0.0") == Fabric(kind="roce", hcas=("mlx5_0",), gid_index=3)


def test_infiniband_gets_its_fabric_s_adapters_and_no_gid():
    ports = (ib("mlx5_0"), ib("mlx5_1"), ib("mlx5_2", state="DOWN"))
    assert chosen_fabric(ports, "ib-fe80::") == Fabric(kind="ib", hcas=("mlx5_0", "mlx5_1"))


def test_an_operator_named_fabric_takes_every_active_adapter():
    assert chosen_fabric((ib("mlx5_0"), ib("mlx5_1")), "rack-7") == Fabric(
        kind="ib", hcas=("mlx5_0", "mlx5_1")
    )


def test_no_fabric_or_no_active_port_is_no_rdma():
    assert chosen_fabric((ib("mlx5_0"),), "") == Fabric()
    assert chosen_fabric((ib("mlx5_0", state="DOWN"),), "ib-fe80::") == Fabric()
    assert chosen_fabric((), "ib-fe80::") == Fabric()


def test_roce_without_a_v2_ipv4_entry_has_no_index():
    assert chosen_fabric((roce("mlx5_0", None),), "rack-7") == Fabric(kind="roce", hcas=("mlx5_0",))
