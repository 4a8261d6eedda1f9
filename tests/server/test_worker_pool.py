"""The server's shell of gateway workers (server.workers.WorkerPool), with stand-in worker
processes: small scripts in place of `llmgw server --gateway-worker`, so that how a process ends
is the test's to choose. What the real workers do is tests/e2e/test_gateway_workers.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from llmgw.core.leases import LeaseLedger
from llmgw.server import workers as workers_module
from llmgw.server.changes import Changes
from llmgw.server.worker_link import Keys, Routes
from llmgw.server.workers import WorkerPool

# Takes the server's link, then: w1's first process closes it and ends a moment later (its link
# gone while it still runs); every other process holds its link until it is stopped.
STAND_IN = r"""
import json, os, socket, sys, time
spec = json.load(open(sys.argv[1]))
starts = os.path.join(spec["directory"], spec["id"] + ".starts")
with open(starts, "a") as file:
    file.write("x")
first_of_w1 = spec["id"] == "w1" and os.path.getsize(starts) == 1
path = os.path.join(spec["directory"], spec["id"] + ".sock")
if os.path.exists(path):
    os.unlink(path)
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen(1)
link, _ = listener.accept()
if first_of_w1:
    link.close()
    listener.close()
    time.sleep(0.05)
    sys.exit(3)
time.sleep(120)
"""


async def test_a_worker_whose_link_drops_before_it_dies_is_gone_to_the_ledger_before_its_successor_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Its link dropped while the process still ran: the shell waits to connect again, and finds it
    dead by then. The ledger must hear it is gone before the next process reports under its id:
    else it takes the new one's reports (numbered from 1 again) for old ones, ignores them, and
    the new worker holds no slot for minutes (the e2e failure: 503 after the 60 s queue wait)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(
        workers_module, "worker_command", lambda spec: [sys.executable, str(script), str(spec)]
    )
    events: list[tuple[str, str]] = []
    second_w1 = trio.Event()
    real_gone, real_start = LeaseLedger.gone, WorkerPool._start

    def gone(ledger: LeaseLedger, worker: str, now: float) -> None:
        events.append(("gone", worker))
        real_gone(ledger, worker, now)

    async def start(pool: WorkerPool, worker) -> None:
        events.append(("start", worker.id))
        if events.count(("start", "w1")) == 2:
            second_w1.set()
        await real_start(pool, worker)

    monkeypatch.setattr(LeaseLedger, "gone", gone)
    monkeypatch.setattr(WorkerPool, "_start", start)
    pool = WorkerPool(
        tmp_path / "workers",
        count=2,
        host="127.0.0.1",
        port=0,
        queue_timeout=60.0,
        ttft_target=1.0,
        keys=lambda: Keys(keys=(), tenants=()),
        routes=lambda: Routes(models=()),
        on_waiting=lambda model: None,
        keys_changed=Changes(),
        stop_on_exit=True,  # the stand-ins are stopped with the pool
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.run)  # its start waits for workers to serve: these never do
            await second_w1.wait()
            assert [e for e in events if e[1] == "w1"] == [("start", "w1"), ("gone", "w1"), ("start", "w1")]
            assert "exited with status 3" in (pool.workers()[1].failure or "")
            nursery.cancel_scope.cancel()
    assert events.count(("start", "w0")) == 1
