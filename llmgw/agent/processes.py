"""The agent's processes at the operating-system level (a shard's engines and sidecars, a training
job's child and converter): spawning, recognising, signalling, stopping, output.

Linux only: what the agent knows of a process it did not start (one an earlier agent left
running) comes from /proc, and a process group is the unit that is signalled, because engines
fork workers that hold GPU memory and outlive a signal sent to the leader alone.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from llmgw.agent.runas import EngineUser
from llmgw.core.exits import describe_exit as describe_exit  # re-exported: the shells take it from here
from llmgw.procfs import PROC, ProcStat, read_stat  # re-exported, as above

# The inode of the initial pid namespace (the kernel's PROC_PID_INIT_INO). NVML reports pids as
# the host sees them; inside another namespace they name other processes, or none.
INITIAL_PID_NAMESPACE = 0xEFFFFFFC

# A process's output file is emptied in place past this size: an engine that logs every request
# would otherwise fill the disk over weeks. O_APPEND makes the engine carry on at the new end.
MAX_OUTPUT_BYTES = 64 * 2**20
# The most of a file read into the tail in one go: only the last lines are kept, so a follower
# that fell behind (or an adopted engine's long history) skips to near the end.
CATCH_UP_BYTES = 256 * 2**10
# A "line" without a newline (a progress bar, binary noise) is cut at this length.
MAX_LINE_BYTES = 4096
# After SIGKILL: a process in uninterruptible sleep (a GPU driver call) takes a moment to go.
KILL_WAIT = 10.0
# How often the process groups being stopped are looked at.
GONE_POLL = 0.1


@attrs.frozen(kw_only=True)
class ProcessRecord:
    """One process of a shard, as the state file keeps it to find the process again."""

    name: str  # the command's name: "engine", "ray-head", ...
    pid: int
    pgid: int
    argv: tuple[str, ...]  # what the agent ran
    # /proc/PID/cmdline as last seen. An interpreter, a wrapper script or a process that sets
    # its own title shows something other than argv there.
    cmdline: tuple[str, ...]
    start_time: int


def read_cmdline(pid: int) -> tuple[str, ...] | None:
    """The process's argv as it shows it now; () for a zombie. None when there is no such process."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    parts = raw.split(b"\0")
    if parts[-1] == b"":  # the usual terminating NUL (a retitled process may have none)
        parts.pop()
    return tuple(part.decode(errors="replace") for part in parts)


def is_same_process(record: ProcessRecord) -> bool:
    """Whether ``record.pid`` is still, and alive as, the process the record describes.

    The start time is what defends against a reused pid; the command line must also agree,
    either as last seen or by ending with the arguments the agent gave.
    """
    stat = read_stat(record.pid)
    if stat is None or not stat.alive or stat.start_time != record.start_time:
        return False
    cmdline = read_cmdline(record.pid)
    if cmdline is None:
        return False
    return cmdline == record.cmdline or _ends_with(cmdline, record.argv[1:])


def _ends_with(whole: Sequence[str], tail: Sequence[str]) -> bool:
    return bool(tail) and len(whole) >= len(tail) and tuple(whole[len(whole) - len(tail) :]) == tuple(tail)


def group_is_ours(record: ProcessRecord) -> bool:
    """Whether signalling ``record.pgid`` reaches the record's group and no one else's.

    A pid number stays reserved while a group bears it, so if the leader has gone, whatever is
    left in the group was started under it. Only a living leader that is some other process
    means the number was reused, and the group with it.
    """
    stat = read_stat(record.pgid)
    if stat is None or not stat.alive:
        return True
    if record.pgid != record.pid:
        return False
    # A leader killed a moment ago shows an empty command line while it exits, before it is a
    # zombie: with its start time, that is still the leader (taking it for another process made
    # a stop report its group gone while the group was still exiting).
    exiting = stat.start_time == record.start_time and read_cmdline(record.pid) == ()
    return exiting or is_same_process(record)


def process_table() -> dict[int, ProcStat]:
    """Every process's stat, by pid (zombies included)."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            table[int(entry.name)] = stat
    return table


def members(pgids: Iterable[int], table: Mapping[int, ProcStat]) -> set[int]:
    """Living processes in the groups ``pgids``, and their descendants wherever they went.

    Descendants count because a program may start helpers in a session of their own, and those
    hold GPU memory as much as the leader does.
    """
    groups = set(pgids)
    verdicts: dict[int, bool] = {}

    def belongs(pid: int) -> bool:
        path: list[int] = []
        current = pid
        while True:
            if current in verdicts:
                verdict = verdicts[current]
                break
            stat = table.get(current)
            if stat is None:
                verdict = False
                break
            path.append(current)
            if stat.pgrp in groups:
                verdict = True
                break
            # pid 1 adopts every orphan, and a table read while processes come and go may loop.
            if stat.ppid <= 1 or stat.ppid in path:
                verdict = False
                break
            current = stat.ppid
        verdicts.update(dict.fromkeys(path, verdict))
        return verdict

    return {pid for pid, stat in table.items() if stat.alive and belongs(pid)}


def signal_group(record: ProcessRecord, signum: int) -> None:
    if not group_is_ours(record):
        return
    try:
        os.killpg(record.pgid, signum)
    except ProcessLookupError:
        pass  # nothing left in the group


def in_initial_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INITIAL_PID_NAMESPACE
    except OSError:
        return False


# --- stopping groups -----------------------------------------------------------------------------


async def stop_groups(
    processes: Sequence[ProcessRecord], grace: float, *, children: Iterable[trio.Process] = ()
) -> set[int]:
    """SIGTERM group by group, in the order given, within one ``grace``; then SIGKILL what is left.

    One group at a time, because the order can matter (vLLM under Ray shuts its workers down
    through the Ray head its sidecar runs). ``children`` (the ones this agent started) are reaped
    once their groups are gone. Returns the pids still alive ``KILL_WAIT`` after the SIGKILL:
    empty when everything went.
    """
    deadline = trio.current_time() + grace
    for process in processes:
        await signal_groups([process], signal.SIGTERM)
        await until_gone([process], deadline)
    left: set[int] = set()
    if not await until_gone(processes, trio.current_time()):
        left = await kill_groups(processes)
    for child in children:
        child.poll()  # reaps it: it is gone
    return left


async def kill_groups(processes: Sequence[ProcessRecord]) -> set[int]:
    """SIGKILL to each group now; the pids still alive ``KILL_WAIT`` later (empty when all went)."""
    await signal_groups(processes, signal.SIGKILL)
    if await until_gone(processes, trio.current_time() + KILL_WAIT):
        return set()
    return await living_members(processes)


async def signal_groups(processes: Sequence[ProcessRecord], signum: int) -> None:
    """Signals each process's group, and by pid each descendant that left its group (a helper in a
    session of its own): it holds GPU memory as much as the group does."""
    pgids = {p.pgid for p in processes if group_is_ours(p)}
    # Read before signalling: a leader killed at once leaves its helpers to pid 1, where they no
    # longer look like descendants.
    table = await trio.to_thread.run_sync(process_table)
    for process in processes:
        signal_group(process, signum)
    for pid in members(pgids, table):
        if table[pid].pgrp not in pgids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


async def until_gone(processes: Sequence[ProcessRecord], deadline: float) -> bool:
    """Waits until nothing of the processes' groups lives, or ``deadline``; whether they went."""
    while await living_members(processes):
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(GONE_POLL)
    return True


async def living_members(processes: Sequence[ProcessRecord]) -> set[int]:
    table = await trio.to_thread.run_sync(process_table)
    return members([p.pgid for p in processes if group_is_ours(p)], table)


# --- starting and watching ---------------------------------------------------------------------


def base_environment(user: EngineUser) -> dict[str, str]:
    """What every engine's environment starts from, before its command's own variables.

    Never the agent's environment: that may hold the join token (LLMGW_JOIN_TOKEN) and whatever
    else the agent was started with. PATH and LANG are taken over (the operator's PATH is how
    `vllm` and `ray` are found); HOME and the cache are the engine user's own, so model caches
    are written where that user may write.
    """
    return {
        "PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(user.home),
        "XDG_CACHE_HOME": str(user.home / ".cache"),
        # Some libraries (Ray among them) name their temporary directories after the user.
        "USER": user.name,
        "LOGNAME": user.name,
    }


def open_output(path: Path) -> int:
    """A fresh output file for one process: 0600, opened for appending.

    A file rather than a pipe: after an agent restart a pipe has no reader, and the engine's next
    write past the pipe's buffer fails with EPIPE inside whatever it was doing.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


async def spawn(
    argv: Sequence[str], *, env: Mapping[str, str], user: EngineUser, output: Path
) -> trio.Process:
    """Starts one process in its own session, writing stdout and stderr to ``output``.

    Its own session (and so process group): the shard is stopped by signalling the group, and a
    Ctrl-C or a signal to the agent's group does not reach the engines.
    """
    fd = open_output(output)
    try:
        return await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            env=dict(env),
            cwd=str(user.home),
            start_new_session=True,
            **user.credentials(),
        )
    finally:
        os.close(fd)


async def wait_for_exit(pidfd: int) -> None:
    """Returns when the process behind ``pidfd`` has exited (zombie or reaped).

    Works for processes that are not the agent's children, which an adopted engine never is.
    """
    await trio.lowlevel.wait_readable(pidfd)


def open_pidfd(record: ProcessRecord) -> int | None:
    """A pidfd for the record's process, if it is still that process and alive.

    Opened before the identity is checked: once open it keeps naming that process even if the
    pid is reused later, so the check cannot be raced.
    """
    try:
        pidfd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return None
    if not is_same_process(record):
        os.close(pidfd)
        return None
    return pidfd


# --- output files --------------------------------------------------------------------------------


class OutputFollower:
    """Follows one process's output file into a shard's tail of lines.

    Reads from the start of the file, so an adopted engine's output from before the agent's
    restart is in its tail. Empties the file in place once it passes ``MAX_OUTPUT_BYTES``: a line
    the engine writes between the last read and the truncation is lost, which costs less than a
    full disk.
    """

    def __init__(self, path: Path, tail: collections.deque[str], prefix: str = "") -> None:
        self.path = path
        self._tail = tail
        self._prefix = prefix
        self._offset = 0
        self._partial = b""

    async def follow(self, interval: float) -> None:
        while True:
            self.read_available()
            await trio.sleep(interval)

    def read_available(self, *, final: bool = False) -> None:
        """Takes what the file holds past the last read; ``final`` also takes an unended line."""
        try:
            with open(self.path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size < self._offset:  # emptied (by us, or by an operator)
                    self._offset, self._partial = 0, b""
                if size - self._offset > CATCH_UP_BYTES:
                    self._offset, self._partial = size - CATCH_UP_BYTES, b""
                    # Mid-line after the jump: the first (partial) line is dropped.
                    file.seek(self._offset)
                    data = file.read(size - self._offset)
                    data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
                else:
                    file.seek(self._offset)
                    data = file.read(size - self._offset)
                self._offset = size
        except FileNotFoundError:
            return
        self._take(data, final=final)
        if size > MAX_OUTPUT_BYTES:
            os.truncate(self.path, 0)
            self._offset = 0

    def _take(self, data: bytes, *, final: bool) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        elif len(self._partial) > MAX_LINE_BYTES:
            lines.append(self._partial)
            self._partial = b""
        for line in lines:
            self._tail.append(self._prefix + _displayed(line))


def _displayed(line: bytes) -> str:
    # A terminal shows what follows the last carriage return (progress bars redraw that way).
    text = line[:MAX_LINE_BYTES].decode(errors="replace").rstrip("\r")
    return text.rsplit("\r", 1)[-1]
