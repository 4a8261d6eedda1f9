"""InfiniBand and RoCE ports from sysfs, and the fabric they put the node on.

Everything comes from ``/sys/class/infiniband/<device>/ports/<n>/``, in the formats the kernel
writes there: ``state`` is "4: ACTIVE", ``rate`` is "200 Gb/sec (4X HDR)", ``gids/<i>`` is eight
colon-separated groups of four hex digits, and ``gid_attrs/types/<i>`` is "IB/RoCE v1" or
"RoCE v2" (reading an unused entry fails with EINVAL). A node without the directory has no
RDMA adapters: a single-node island, not an error.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from llmgw.core.rdma import port_island
from llmgw.wire.messages import IbPort

ROCE_V2 = "RoCE v2"


def read_ib_ports(sysfs_root: Path = Path("/sys")) -> tuple[IbPort, ...]:
    """Every port of every RDMA device, ordered by device name then port number."""
    class_dir = sysfs_root / "class" / "infiniband"
    if not class_dir.is_dir():
        return ()
    ports = []
    for device_dir in sorted(class_dir.iterdir()):
        ports_dir = device_dir / "ports"
        if not ports_dir.is_dir():
            continue
        port_dirs = [p for p in ports_dir.iterdir() if p.name.isdigit()]
        for port_dir in sorted(port_dirs, key=lambda p: int(p.name)):
            ports.append(_read_port(device_dir.name, port_dir))
    return tuple(ports)


def fabric_name(ports: tuple[IbPort, ...]) -> str:
    """The island this node's ports join, named from the first ACTIVE port that has a subnet.

    InfiniBand: "ib-" + GID 0's subnet prefix ("ib-fe80::"). Every subnet manager hands out the
    default prefix fe80:: unless told otherwise, so separate IB islands that all keep the default
    get the same name; operators with several of them must set ``fabric:`` in agent.yaml.
    RoCE: "roce-" + the /24 of the RoCE v2 IPv4 address ("roce-10.0.0"), since routed RoCE
    reaches what IP reaches and a /24 is the usual rack or rail network.
    "" when no port is ACTIVE: the node is a single-node island.
    """
    for port in ports:
        if port.state == "ACTIVE" and port.subnet:
            return port_island(port)
    return ""


def _read_port(device: str, port_dir: Path) -> IbPort:
    state = _read(port_dir / "state")
    link_layer = _read(port_dir / "link_layer")
    gid_index, ipv4 = _roce_v2_ipv4_gid(port_dir) if link_layer == "Ethernet" else (None, "")
    return IbPort(
        device=device,
        port=int(port_dir.name),
        # "4: ACTIVE": the number is the kernel's enum, the word is what people read.
        state=state.split(":", 1)[-1].strip(),
        rate_gbps=_rate_gbps(_read(port_dir / "rate")),
        link_layer=link_layer,
        roce_v2_gid_index=gid_index,
        subnet=ipv4 if link_layer == "Ethernet" else _subnet_prefix(_read(port_dir / "gids" / "0")),
    )


def _roce_v2_ipv4_gid(port_dir: Path) -> tuple[int | None, str]:
    """The lowest GID index that is RoCE v2 and holds an IPv4 address, and that address.

    NCCL's default index is usually a v1 or link-local entry, which does not route between
    hosts; this is the entry to pass as NCCL_IB_GID_INDEX.
    """
    types_dir = port_dir / "gid_attrs" / "types"
    if not types_dir.is_dir():
        return None, ""
    for index in sorted(int(p.name) for p in types_dir.iterdir() if p.name.isdigit()):
        if _read(types_dir / str(index)) != ROCE_V2:
            continue
        ipv4 = _ipv4_mapped(_read(port_dir / "gids" / str(index)))
        if ipv4:
            return index, ipv4
    return None, ""


def _ipv4_mapped(gid: str) -> str:
    """The dotted IPv4 address a GID such as ::ffff:0a00:0005 carries, or ""."""
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return ""
    return str(mapped) if mapped else ""


def _subnet_prefix(gid: str) -> str:
    """The first four groups of a GID: the subnet prefix the subnet manager assigned."""
    try:
        exploded = ipaddress.IPv6Address(gid).exploded
    except ValueError:
        return ""
    return ":".join(exploded.split(":")[:4])


def _rate_gbps(rate: str) -> float:
    # "200 Gb/sec (4X HDR)", "2.5 Gb/sec (1X SDR)"
    try:
        return float(rate.split(maxsplit=1)[0])
    except (IndexError, ValueError):
        return 0.0


def _read(path: Path) -> str:
    """A sysfs attribute's text, or "" where it cannot be read.

    Unused GID table entries fail with EINVAL rather than reading empty, and attributes vary
    between kernel versions, so an unreadable attribute means "not there".
    """
    try:
        return path.read_text().strip()
    except OSError:
        return ""
