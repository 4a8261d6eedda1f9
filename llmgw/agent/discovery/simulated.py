"""Simulated GPUs: a node's hardware read from a file (agent.yaml's ``discovery.simulate``).

The GPUs come out as NVML discovery makes them — the class from the product name and memory,
health flags by the same rule — so placement cannot tell them from real ones; only
``Inventory.simulated`` says so. Nothing here touches NVML, so an agent with simulated GPUs runs
without pynvml, and on a machine that has real GPUs it leaves them and their processes alone.

The file is read again at every discovery, like NVML is asked again: editing ``used_mib`` or
``ecc_errors`` changes what the server sees. The agent checks the file once at start (a bad one
stops it with status 2); if a later edit breaks it, the node shows no GPUs and says why, as it
does when NVML fails.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.agent.discovery.infiniband import read_ib_ports
from llmgw.agent.discovery.nvml import MIB, gpu_problems
from llmgw.config import ConfigError, SimulatedGpu, SimulatedNode, load_simulated_node
from llmgw.core.gpu_class import gpu_class
from llmgw.wire.messages import Gpu, IbPort

NOTE_PREFIX = "simulated GPUs"


@attrs.frozen
class SimulatedReading:
    """What one read of the file gives: GPUs, a note ("" when the file read well), RDMA ports."""

    gpus: tuple[Gpu, ...]
    gpu_note: str
    ib_ports: tuple[IbPort, ...]


def read_simulated(path: Path, node: str) -> SimulatedReading:
    """The node described by the file at ``path``; ``node`` names the made-up uuids."""
    try:
        spec = load_simulated_node(path)
    except ConfigError as exc:
        return SimulatedReading(gpus=(), gpu_note=f"{NOTE_PREFIX}: {exc}", ib_ports=())
    ib_ports = read_ib_ports(spec.infiniband_sysfs) if spec.infiniband_sysfs is not None else ()
    return SimulatedReading(gpus=simulated_gpus(spec, node), gpu_note="", ib_ports=ib_ports)


def simulated_gpus(spec: SimulatedNode, node: str) -> tuple[Gpu, ...]:
    """The file's GPUs in its order, which is their index order."""
    return tuple(_gpu(gpu, index, node) for index, gpu in enumerate(spec.gpus))


def simulated_uuid(node: str, index: int) -> str:
    # Stable across agent restarts and unique in a fleet of simulated nodes, as real uuids are;
    # "sim" in it keeps it from being taken for a real card in a log.
    return f"GPU-sim-{node}-{index}"


def _gpu(gpu: SimulatedGpu, index: int, node: str) -> Gpu:
    return Gpu(
        index=index,
        uuid=gpu.uuid or simulated_uuid(node, index),
        name=gpu.name,
        gpu_class=gpu_class(gpu.name, gpu.memory_mib * MIB),
        memory_total_mib=gpu.memory_mib,
        memory_used_mib=gpu.used_mib,
        compute_capability=gpu.compute_capability,
        ecc_uncorrected=gpu.ecc_errors,
        # No process holds memory on a card that does not exist, so none can be foreign.
        problems=gpu_problems(gpu.ecc_errors, foreign_memory=False),
    )


class _NvmlOffError(Exception):
    def __str__(self) -> str:
        return "NVML is not used: this agent's GPUs are simulated"


class NvmlOff:
    """pynvml's face (see :mod:`llmgw.agent.discovery.nvml`) for an agent with simulated GPUs:
    NVML never initialises, so whatever goes through it sees no GPU and no GPU process.

    The supervisor takes it instead of pynvml: its per-process accounting then reports shards
    on the CPU (which is where a stand-in engine computes), and its sweep of foreign GPU
    processes cannot kill a real program on a machine that has real GPUs.
    """

    NVMLError = _NvmlOffError

    def nvmlInit(self) -> None:
        raise _NvmlOffError()


__all__ = ["NvmlOff", "SimulatedReading", "read_simulated", "simulated_gpus", "simulated_uuid"]
