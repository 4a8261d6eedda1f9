"""How a process's end reads in a reason: the exit code it gave, or the signal that killed it."""

from __future__ import annotations

import signal


def describe_exit(returncode: int) -> str:
    """``returncode`` as subprocess gives it: negative for the signal that ended the process."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"
