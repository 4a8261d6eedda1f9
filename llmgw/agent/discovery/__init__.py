"""What a node is made of: GPUs, RDMA ports, CPUs, memory, and its management interface.

Synchronous and blocking (NVML calls, sysfs reads): the agent runs it with
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmgw.agent.discovery import host
from llmgw.agent.discovery.infiniband import fabric_name, read_ib_ports
from llmgw.agent.discovery.nvml import read_gpus
from llmgw.agent.discovery.simulated import read_simulated
from llmgw.wire.messages import Inventory


def discover(
    *,
    local_address: str = "",
    fabric_override: str | None = None,
    nvml: Any = None,
    sysfs_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    own_pids: frozenset[int] = frozenset(),
    own_ports: frozenset[int] = frozenset(),
    simulate: Path | None = None,
    node: str = "",
) -> Inventory:
    """The node's inventory as the server's placement will see it.

    ``local_address`` is the address this agent uses to reach the server; ``fabric_override``
    (agent.yaml's ``fabric:``) replaces the fabric named from the ports, and "" there makes the
    node a single-node island on purpose. ``simulate`` (agent.yaml's ``discovery.simulate``) is
    a file of GPUs and RDMA ports read instead of NVML and ``sysfs_root``; ``node`` names the
    uuids it makes up. Host, CPUs, memory and the management interface are always this machine's.
    ``own_ports`` are our shards' ports: the listening ports reported in use are the others.
    """
    if simulate is None:
        gpus, gpu_note = read_gpus(nvml, own_pids)
        ib_ports = read_ib_ports(sysfs_root)
    else:
        reading = read_simulated(simulate, node)
        gpus, gpu_note, ib_ports = reading.gpus, reading.gpu_note, reading.ib_ports
    memory_total, memory_available = host.memory_mib(proc_root)
    return Inventory(
        hostname=host.hostname(),
        cpu_count=host.cpu_count(),
        memory_total_mib=memory_total,
        memory_available_mib=memory_available,
        gpus=gpus,
        ib_ports=ib_ports,
        fabric=fabric_name(ib_ports) if fabric_override is None else fabric_override,
        mgmt_interface=host.interface_for_address(local_address, proc_root=proc_root)
        if local_address
        else "",
        mgmt_address=local_address,
        gpu_note=gpu_note,
        simulated=simulate is not None,
        ports_in_use=tuple(sorted(host.listening_ports(proc_root) - own_ports)),
    )


__all__ = ["discover"]
