"""Stopping process groups (agent/processes.py), the one way the supervisor and the trainer stop
what they started: SIGTERM group by group within one grace, SIGKILL after, children reaped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio

from llmgw.agent import processes
from llmgw.agent.processes import ProcessRecord
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


async def start_group(script: str) -> tuple[trio.Process, ProcessRecord]:
    """``sh -c script`` as the leader of a session (so a group) of its own."""
    argv = ["sh", "-c", script]
    process = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    stat = processes.read_stat(process.pid)
    assert stat is not None
    record = ProcessRecord(
        name="sh",
        pid=process.pid,
        pgid=stat.pgrp,
        argv=tuple(argv),
        cmdline=processes.read_cmdline(process.pid) or (),
        start_time=stat.start_time,
    )
    return process, record


async def test_groups_get_sigterm_one_at_a_time_in_the_order_given(tmp_path: Path) -> None:
    order = tmp_path / "order"
    started = []
    for name in ("first", "second"):
        # Each takes a moment to go after SIGTERM: signalled together, the two would race.
        process, record = await start_group(
            f"trap 'sleep 0.3; echo {name} >> {order}; exit 0' TERM; touch {tmp_path / name}; "
            "while :; do sleep 0.05; done"
        )
        started.append((process, record))
    await wait_for(lambda: (tmp_path / "first").exists() and (tmp_path / "second").exists(), "the traps")
    left = await processes.stop_groups([r for _, r in started], 10.0, children=[p for p, _ in started])
    assert left == set()
    assert order.read_text().split() == ["first", "second"]
    assert [p.returncode for p, _ in started] == [0, 0]  # reaped: no zombies left behind


async def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    process, record = await start_group(
        f"trap '' TERM; sh -c 'trap \"\" TERM; sleep 60' & touch {tmp_path / 'up'}; wait"
    )
    await wait_for(lambda: (tmp_path / "up").exists(), "the group to start")
    group = processes.members([record.pgid], processes.process_table())
    assert len(group) >= 2
    with trio.fail_after(processes.KILL_WAIT):
        assert await processes.stop_groups([record], 0.3, children=[process]) == set()
    assert process.returncode == -9
    assert processes.members([record.pgid], processes.process_table()) == set()


async def test_a_descendant_in_a_session_of_its_own_is_signalled_too(tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    process, record = await start_group(f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 60' & wait")
    await wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), "the helper")
    helper = int(pidfile.read_text())
    try:
        assert processes.read_stat(helper).pgrp != record.pgid
        with trio.fail_after(processes.KILL_WAIT):
            assert await processes.kill_groups([record]) == set()

        def helper_gone() -> bool:
            stat = processes.read_stat(helper)
            return stat is None or not stat.alive

        # Orphaned, it is no longer seen as the group's: it goes on its own time (a sleep of 60 s
        # would outlast the wait, unless it was killed).
        await wait_for(helper_gone, "the helper to be killed", deadline=5.0)
    finally:
        process.poll()
        if (stat := processes.read_stat(helper)) is not None and stat.alive:
            os.kill(helper, 9)
