"""Where a training child runs, and with what: the card (or the CPU), its threads, its Python path.

Pure decisions for the agent's trainer. The card is chosen from a fresh inventory: the healthy
one with the most free memory, if that is at least what the job says it needs. An engine may
already be on that card; what counts is the memory it leaves. A node without GPUs trains on the
CPU.

The child's Python is the operator's (on a GPU node, the one vLLM uses: its torch and CUDA are
known to work there). peft and accelerate are pinned, because the child's code is written against
their API; when that Python lacks the pinned versions, the agent installs exactly those, without
their dependencies, into an overlay directory put on the child's PYTHONPATH. Never torch, never a
second environment: a second torch would be gigabytes and could disagree with the node's driver.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import attrs

from llmgw.wire.messages import Gpu

# The versions the training child is written against.
PINS: tuple[tuple[str, str], ...] = (("peft", "0.21.2"), ("accelerate", "1.15.0"))

# Run with `<train_python> -c`: prints {"peft": "0.21.2" | null, ...}. It imports each package
# (not just reads its metadata): a package that is installed but cannot import with this Python's
# torch is as good as missing.
PROBE_SCRIPT = """\
import importlib, json
found = {}
for name in %s:
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", None) or "unknown"
    except Exception:
        found[name] = None
print(json.dumps(found))
"""


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


# --- the pinned overlay ---------------------------------------------------------------------------


def pin_specs(pins: Sequence[tuple[str, str]] = PINS) -> list[str]:
    return [f"{name}=={version}" for name, version in pins]


def pins_hash(pins: Sequence[tuple[str, str]] = PINS) -> str:
    """Names the overlay directory: new pins install beside the old overlay, never over it."""
    return hashlib.sha256("\n".join(pin_specs(pins)).encode()).hexdigest()[:16]


def probe_argv(python: str, pins: Sequence[tuple[str, str]] = PINS) -> list[str]:
    return [python, "-c", PROBE_SCRIPT % json.dumps([name for name, _ in pins])]


def install_argv(python: str, target: str, pins: Sequence[tuple[str, str]] = PINS) -> list[str]:
    """pip into ``target`` only: no dependencies (torch and the rest are the node's own) and only
    wheels, so installing runs no package's build code."""
    return [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--target",
        target,
        *pin_specs(pins),
    ]


def parse_probe(output: str) -> dict[str, str | None] | None:
    """The probe's last line as {package: version or None}; None when it printed no such line."""
    lines = output.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not isinstance(found, dict):
        return None
    return {str(k): v if isinstance(v, str) else None for k, v in found.items()}


def overlay_problems(
    found: Mapping[str, str | None] | None, pins: Sequence[tuple[str, str]] = PINS
) -> list[str]:
    """What keeps the probed Python from running the child: empty when every pin is met."""
    if found is None:
        return ["the probe printed no versions (does this Python run at all?)"]
    problems = []
    for name, version in pins:
        have = found.get(name)
        if have is None:
            problems.append(f"{name} is missing (need {version})")
        elif have != version:
            problems.append(f"{name} is {have} (need {version})")
    return problems
