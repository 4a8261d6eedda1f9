"""What the training child's Python must hold, and how the agent makes up for what it lacks.

The child's Python is the operator's (on a GPU node, the one vLLM uses: its torch and CUDA are
known to work there). peft and accelerate are pinned, because the child's code is written against
their API; when that Python lacks the pinned versions, the agent installs exactly those, without
their dependencies, into an overlay directory put on the child's PYTHONPATH. Never torch, never a
second environment: a second torch would be gigabytes and could disagree with the node's driver.
Pure: the argv to probe and to install, and the judgement of what the probe printed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

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
