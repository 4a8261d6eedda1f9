"""Where a training child runs: the card (or the CPU), and with how many threads.

Pure decisions for the agent's trainer. The card is chosen from a fresh inventory: the healthy
one with the most free memory, if that is at least what the job says it needs. An engine may
already be on that card; what counts is the memory it leaves. A node without GPUs trains on the
CPU. (What the child's Python must hold is :mod:`llmgw.core.train_overlay`'s.)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from llmgw.core.inventory import Gpu


@attrs.frozen(kw_only=True)
class Choice:
    """Where a job trains: ``device`` ("cuda:<index>" or "cpu"), or ``refusal`` saying why nowhere."""

    device: str = ""
    gpu_index: int | None = None
    refusal: str = ""

    @property
    def ok(self) -> bool:
        return not self.refusal

    @property
    def child_device(self) -> str:
        """The device as the child sees it: the chosen card is the only one it is shown."""
        return "cpu" if self.gpu_index is None else "cuda:0"

    @property
    def label(self) -> str:
        """For JobStatus.device: what the child uses, and which card of the node that is."""
        return "cpu" if self.gpu_index is None else f"cuda:0 (GPU {self.gpu_index})"


def choose_device(gpus: Sequence[Gpu], need_mib: int) -> Choice:
    """The CPU on a node without GPUs; else the healthy card with the most free memory, when it
    has at least ``need_mib``; else a refusal naming each card's free memory."""
    if not gpus:
        return Choice(device="cpu")
    if need_mib <= 0:
        return Choice(
            refusal=f"need_mib must be above 0 on a node with GPUs (how much of one card the job "
            f"needs), got {need_mib}"
        )
    healthy = [gpu for gpu in gpus if gpu.healthy]
    if healthy:
        # The lowest index wins a tie, so the same inventory always gives the same card.
        best = max(healthy, key=lambda gpu: (gpu.memory_free_mib, -gpu.index))
        if best.memory_free_mib >= need_mib:
            return Choice(device=f"cuda:{best.index}", gpu_index=best.index)
    cards = ", ".join(_describe(gpu) for gpu in sorted(gpus, key=lambda gpu: gpu.index))
    return Choice(refusal=f"no healthy card has {need_mib} MiB free: {cards}")


def _describe(gpu: Gpu) -> str:
    free = f"GPU {gpu.index} {gpu.memory_free_mib} MiB free"
    return free if gpu.healthy else f"{free} (unhealthy: {', '.join(gpu.problems)})"


def child_threads(configured: int | None, cpu_count: int, *, on_gpu: bool) -> int:
    """OMP_NUM_THREADS for the child: the configured number, else one core left to the agent on
    a CPU node (its link and heartbeats must keep up), and 1 beside a GPU."""
    if configured is not None:
        return configured
    return 1 if on_gpu else max(1, cpu_count - 1)
