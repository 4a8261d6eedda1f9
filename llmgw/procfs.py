"""A process as /proc/PID/stat shows it: shared by the agent (its engines, its training children)
and the server (its gateway workers), which both tell a process from a later one reusing its pid
by its start time."""

from __future__ import annotations

from pathlib import Path

import attrs

PROC = Path("/proc")


@attrs.frozen(kw_only=True)
class ProcStat:
    """The parts of /proc/PID/stat llmgw uses."""

    state: str  # "R", "S", "D", "Z" (zombie), ...
    ppid: int
    pgrp: int
    start_time: int  # clock ticks after boot: with the pid, this names one process for good

    @property
    def alive(self) -> bool:
        # A zombie has exited and waits only to be reaped, which in a container whose PID 1 is
        # not an init may never happen; kill(pid, 0) still succeeds on it, so it is not asked.
        return self.state not in ("Z", "X")


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    # the fields that follow start after the last ")".
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 of the man page (state); field N is fields[N - 3].
    return ProcStat(state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]), start_time=int(fields[19]))


def start_time_of(pid: int) -> int | None:
    """The start time of a living process with this pid; None when there is none (or a zombie)."""
    stat = read_stat(pid)
    return stat.start_time if stat is not None and stat.alive else None
