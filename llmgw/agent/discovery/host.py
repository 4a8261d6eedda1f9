"""The host itself: name, CPUs, memory, and which interface holds the management address."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

# ioctl request that returns an interface's IPv4 address (linux/sockios.h).
SIOCGIFADDR = 0x8915
# struct ifreq: a 16-byte interface name, then a struct sockaddr; sockaddr_in's address sits
# after its 2-byte family and 2-byte port.
_IFREQ_SIZE = 40
_IFNAMSIZ = 16
_SOCKADDR_IN_ADDR = slice(_IFNAMSIZ + 4, _IFNAMSIZ + 8)


def hostname() -> str:
    return socket.gethostname()


def cpu_count() -> int:
    # The CPUs this process may run on, not the machine's: a container or a cpuset gets fewer.
    return len(os.sched_getaffinity(0))


def memory_mib(proc_root: Path = Path("/proc")) -> tuple[int, int]:
    """(total, available) memory in MiB from ``meminfo``."""
    kib = {}
    for line in (proc_root / "meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            kib[key] = int(fields[0])
    # MemAvailable counts reclaimable cache too, which is what a new engine can get; MemFree
    # alone understates it badly on a node that has been reading weights from disk.
    return kib["MemTotal"] // 1024, kib["MemAvailable"] // 1024


# /proc/net/tcp's "st" column for a listening socket (TCP_LISTEN in the kernel's tcp_states.h).
TCP_LISTEN = "0A"


def listening_ports(proc_root: Path = Path("/proc")) -> frozenset[int]:
    """The TCP ports sockets listen on in this network namespace, IPv4 and IPv6, any address.

    Any address counts: an engine binds 0.0.0.0, which fails while anything holds the port on
    one address. Lines read "  0: 00000000:1F90 00000000:0000 0A ..." (local address:port in hex,
    remote, state).
    """
    ports: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_root / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel or namespace
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == TCP_LISTEN:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return frozenset(ports)


def interface_for_address(ip: str, *, proc_root: Path = Path("/proc")) -> str:
    """The name of the local interface holding ``ip`` ("" when none does).

    NCCL and Gloo need an interface name (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), and the one
    that reaches the server is the one to use. IPv4 asks the kernel per interface with
    SIOCGIFADDR, which sees each interface's primary address only; IPv6 reads ``net/if_inet6``.
    """
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ""
    # A dual-stack socket reports an IPv4 peer's local address as ::ffff:a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv4Address):
        return _ipv4_interface(address)
    return _ipv6_interface(address, proc_root)


def _ipv4_interface(address: ipaddress.IPv4Address) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack(f"{_IFREQ_SIZE}s", name.encode()[: _IFNAMSIZ - 1])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:
                # EADDRNOTAVAIL: the interface has no IPv4 address.
                continue
            if reply[_SOCKADDR_IN_ADDR] == address.packed:
                return name
    return ""


def _ipv6_interface(address: ipaddress.IPv6Address, proc_root: Path) -> str:
    # One line per address: "fe80000000000000020000fffe000001 04 40 20 80     eth0"
    # (address in hex, interface index, prefix length, scope, flags, name).
    try:
        lines = (proc_root / "net" / "if_inet6").read_text().splitlines()
    except OSError:
        # No IPv6 in this kernel or namespace.
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and int(fields[0], 16) == int(address):
            return fields[5]
    return ""
