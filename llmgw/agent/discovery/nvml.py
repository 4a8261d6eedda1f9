"""GPUs through NVML: the only module of llmgw that imports pynvml.

The caller may pass any object with pynvml's function, constant and exception names instead of
the module; the tests describe fake machines that way. A node without the NVML library (or without
the pynvml package) is a CPU-only node, not an error: the answer is no GPUs and a note saying why.
"""

from __future__ import annotations

from typing import Any

from llmgw.agent.processes import in_initial_pid_namespace
from llmgw.core.gpu_class import gpu_class
from llmgw.wire.messages import ForeignProcess, Gpu, GpuUse

MIB = 2**20


def read_gpus(
    nvml: Any = None, own_pids: frozenset[int] = frozenset(), *, host_pids: bool | None = None
) -> tuple[tuple[Gpu, ...], str]:
    """The node's GPUs in NVML index order, and a note ("" when NVML answered).

    ``own_pids`` are the processes llmgw started (every process of its shards): any other process
    holding memory on a GPU makes that GPU unhealthy, since placement would count on memory that
    is not there.

    NVML names processes by their pids in the host's pid namespace. ``host_pids`` says whether
    ours are those too (None: find out). In a container with a pid namespace of its own they are
    not, so no process can be told apart from our engines: none is judged foreign, as the
    supervisor's kill sweep does. Otherwise every engine of ours would mark its GPUs unhealthy
    and get its replica evicted. Such a node then trusts that nothing else uses its GPUs.
    """
    if host_pids is None:
        host_pids = in_initial_pid_namespace()
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return (), f"no NVML: {exc}"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return (), f"no NVML: {exc}"
    try:
        gpus = tuple(_read_gpu(nvml, i, own_pids, host_pids) for i in range(nvml.nvmlDeviceGetCount()))
    except nvml.NVMLError as exc:
        # A GPU that fell off the bus (GpuIsLost) or needs a reset: listing the others would
        # invite placements on a node that needs an operator, so it shows none and says why.
        return (), f"NVML failed: {exc}"
    finally:
        nvml.nvmlShutdown()
    return gpus, ""


def _read_gpu(nvml: Any, index: int, own_pids: frozenset[int], host_pids: bool = True) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    ecc_uncorrected = _ecc_uncorrected(nvml, handle)
    running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    foreign = [p for p in running if p.pid not in own_pids] if host_pids else []
    # usedGpuMemory is None where the driver cannot say (Windows WDDM); a compute process
    # holds a context either way, so only an explicit 0 counts as holding nothing.
    foreign_memory = any(p.usedGpuMemory != 0 for p in foreign)
    return Gpu(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=name,
        gpu_class=gpu_class(name, memory.total),
        memory_total_mib=memory.total // MIB,
        memory_used_mib=memory.used // MIB,
        compute_capability=f"{major}.{minor}",
        ecc_uncorrected=ecc_uncorrected,
        foreign_processes=tuple(
            ForeignProcess(pid=p.pid, name=_process_name(nvml, p.pid), used_mib=(p.usedGpuMemory or 0) // MIB)
            for p in foreign
        ),
        problems=gpu_problems(ecc_uncorrected, foreign_memory=foreign_memory),
    )


def gpu_problems(ecc_uncorrected: int, *, foreign_memory: bool) -> tuple[str, ...]:
    """A GPU's health flags (Gpu.problems) from what was read of it; simulated GPUs use it too,
    so both kinds turn unhealthy for the same reasons."""
    problems = []
    if ecc_uncorrected > 0:
        problems.append("ecc-uncorrected")
    if foreign_memory:
        problems.append("foreign-memory")
    return tuple(problems)


def gpu_memory_by_pid(nvml: Any = None) -> dict[int, tuple[GpuUse, ...]]:
    """GPU memory each process holds, by pid: one GpuUse per card, in index order.

    Empty without NVML, or when it fails: the caller then sees no process on any GPU, which for a
    shard means it computes on the CPU as far as anyone can tell. Pids are as the host sees them.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return {}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return {}
    uses: dict[int, list[GpuUse]] = {}
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            held: dict[int, int] = {}
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                # None where the driver cannot say: the process holds a context all the same.
                held[process.pid] = held.get(process.pid, 0) + (process.usedGpuMemory or 0)
            for pid, used in held.items():
                uses.setdefault(pid, []).append(GpuUse(index=index, uuid=uuid, used_mib=used // MIB))
    except nvml.NVMLError:
        return {}
    finally:
        nvml.nvmlShutdown()
    return {pid: tuple(cards) for pid, cards in uses.items()}


def _ecc_uncorrected(nvml: Any, handle: Any) -> int:
    """Volatile (since driver load) uncorrected ECC errors; -1 for a GPU without ECC."""
    try:
        return nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
    except nvml.NVMLError_NotSupported:
        # Consumer cards and ECC switched off: nothing to count, which is no fault.
        return -1


def _process_name(nvml: Any, pid: int) -> str:
    # The process may have exited since the list was taken, or live in another pid namespace.
    try:
        return _text(nvml.nvmlSystemGetProcessName(pid))
    except nvml.NVMLError:
        return ""


def _text(value: str | bytes) -> str:
    # Bindings for old drivers hand back bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else value
