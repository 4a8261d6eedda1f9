"""The usage recorder: batches, what a stop or a kill loses, summaries."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

from llmgw.server.store import Store, StoreError, UsageRecord, open_store, ops
from llmgw.server.store.sqlite import _Tx as SqliteTx
from llmgw.server.store.sqlite import open_writer
from llmgw.server.usage_book import UsageRecorder, parse_group_by, parse_time
from tests.helpers import TESTS, kill_9_after

CHILD = TESTS / "usage_writer_child.py"

DAY1 = datetime(2026, 11, 1, 12, tzinfo=UTC).timestamp()
DAY2 = datetime(2026, 11, 2, 9, tzinfo=UTC).timestamp()


def usage(
    i: int = 0, *, tenant="acme", model="m", time=DAY1, prompt=10, completion=5, status=200, latency=100.0
):
    return UsageRecord(time + i, tenant, "k-00000001", model, "r-1", prompt, completion, latency, status)


class CountingStore:
    """The SQLite store's usage operations, with every write transaction noted: (trio time,
    records in it).

    Synchronous underneath: the autojump clock jumps while a task waits for a worker thread,
    which would make the noted times meaningless.
    """

    def __init__(self, data_dir: Path, failures: int = 0) -> None:
        self.conn = open_writer(data_dir)
        self.writes: list[tuple[float, int]] = []
        self.failures = failures  # the first writes to fail, as a full disk would

    async def add_usage(self, records):
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise StoreError("disk full")
        self.writes.append((trio.current_time(), len(records)))
        with self.conn:
            ops.add_usage(SqliteTx(self.conn), records)

    def stored(self) -> int:
        rows = ops.summarise_usage(SqliteTx(self.conn), [], None, None)
        return rows[0]["requests"] if rows else 0


@pytest.fixture
def counting(tmp_path: Path):
    s = CountingStore(tmp_path / "data")
    yield s
    s.conn.close()


@pytest.fixture
async def store(open_test_store):  # on both backends
    s = await open_test_store()
    yield s
    await s.aclose()


async def stored(store: Store) -> int:
    rows = await store.summarise_usage([], None, None)
    return rows[0]["requests"] if rows else 0


async def test_records_within_a_window_land_in_one_transaction(counting: CountingStore, autojump_clock):
    recorder = UsageRecorder(counting, flush_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for i in range(30):
            recorder.record(usage(i))
            await trio.sleep(0.01)
        await recorder.flushes.wait_past(0)
        assert counting.writes == [(1.0, 30)]
        recorder.record(usage(31))
        await recorder.flushes.wait_past(1)
        assert counting.writes == [(1.0, 30), (2.0, 1)]
        nursery.cancel_scope.cancel()
    assert counting.stored() == 31 == recorder.written


async def test_a_full_batch_is_written_at_once(counting: CountingStore, autojump_clock):
    recorder = UsageRecorder(counting, flush_interval=1.0, max_batch=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for i in range(25):
            recorder.record(usage(i))
        while recorder.written < 20:
            await recorder.flushes.wait_past(recorder.flushes.version)
        assert counting.writes == [(0.0, 10), (0.0, 10)]  # at once, not after the interval
        await recorder.flushes.wait_past(recorder.flushes.version)
        assert counting.writes[2:] == [(1.0, 5)]  # the rest, after the interval
        nursery.cancel_scope.cancel()
    assert counting.stored() == 25


async def test_a_graceful_stop_writes_everything(counting: CountingStore, autojump_clock):
    recorder = UsageRecorder(counting, flush_interval=60.0, max_batch=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for i in range(250):
            recorder.record(usage(i))
        nursery.cancel_scope.cancel()
    # Written at the stop, long before the interval, in batches of at most max_batch.
    assert counting.writes == [(0.0, 100), (0.0, 100), (0.0, 50)]
    assert counting.stored() == 250
    assert recorder.pending == 0


async def test_a_failing_store_is_retried_and_nothing_is_lost(
    counting: CountingStore, autojump_clock, caplog
):
    counting.failures = 2
    recorder = UsageRecorder(counting, flush_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for i in range(5):
            recorder.record(usage(i))
        await recorder.flushes.wait_past(0)
        nursery.cancel_scope.cancel()
    assert counting.writes == [(3.0, 5)]  # failed at 1 s and at 2 s
    assert counting.stored() == 5
    assert "5 records not written, retrying in 1 s: disk full" in caplog.text


async def test_past_the_cap_the_oldest_are_dropped_and_counted(store: Store, caplog):
    recorder = UsageRecorder(store, max_batch=2, max_pending=4)
    for i in range(7):
        recorder.record(usage(i))
    assert (recorder.pending, recorder.dropped) == (4, 3)
    assert "3 records dropped so far" not in caplog.text
    assert "1 records dropped so far (over 4 waiting)" in caplog.text
    with trio.CancelScope() as scope:
        scope.cancel()
        await recorder.run()
    rows = await store.summarise_usage([], DAY1 + 3, None)
    assert rows[0]["requests"] == 4  # the newest: 3, 4, 5, 6


async def test_max_pending_must_hold_a_batch(store: Store):
    with pytest.raises(ValueError, match=r"max_pending \(5\) must be at least max_batch \(10\)"):
        UsageRecorder(store, max_batch=10, max_pending=5)


@pytest.mark.slow
async def test_kill_9_loses_only_the_unflushed_window(tmp_path: Path):
    data_dir = tmp_path / "data"
    await kill_9_after(CHILD, [str(data_dir)], b"recorded\n")

    store = await open_store(data_dir)
    try:
        # The committed batch (20) survives; the 7 waiting for the next interval are the loss.
        assert await stored(store) == 20
    finally:
        await store.aclose()


async def test_summaries_by_tenant_model_and_day(store: Store):
    await store.add_usage(
        [
            usage(0, tenant="acme", model="a", latency=100.0),
            usage(1, tenant="acme", model="a", latency=300.0, status=500, completion=0),
            usage(2, tenant="acme", model="b"),
            usage(0, tenant="beta", model="a", time=DAY2, prompt=7, completion=3),
        ],
    )
    recorder = UsageRecorder(store)
    by_tenant = await recorder.summarise(["tenant"])
    assert by_tenant == [
        {
            "tenant": "acme",
            "requests": 3,
            "prompt_tokens": 30,
            "completion_tokens": 10,
            "total_tokens": 40,
            "errors": 1,
            "avg_latency_ms": pytest.approx(500 / 3),
        },
        {
            "tenant": "beta",
            "requests": 1,
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "errors": 0,
            "avg_latency_ms": 100.0,
        },
    ]
    rows = await recorder.summarise(["model", "day"])
    assert [(r["model"], r["day"], r["requests"]) for r in rows] == [
        ("a", "2026-11-01", 2),
        ("a", "2026-11-02", 1),
        ("b", "2026-11-01", 1),
    ]
    day2 = parse_time("2026-11-02", "since")
    assert [r["tenant"] for r in await recorder.summarise(["tenant"], since=day2)] == ["beta"]
    assert [r["tenant"] for r in await recorder.summarise(["tenant"], until=day2)] == ["acme"]
    [total] = await recorder.summarise([])
    assert total["requests"] == 4
    assert await recorder.summarise([], since=DAY2 + 1) == []


def test_parse_group_by():
    assert parse_group_by("tenant, model,day") == ["tenant", "model", "day"]
    assert parse_group_by("") == []
    with pytest.raises(
        ValueError, match=r"^by: cannot group by replica \(expected a list of: tenant, model, adapter, day\)"
    ):
        parse_group_by("tenant,replica")
    with pytest.raises(ValueError, match="^by: each of"):
        parse_group_by("day,day")


def test_parse_time():
    start = datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    assert parse_time("2026-11-01", "since") == start
    assert parse_time("2026-11-01", "until", end_of_day=True) == start + 86_400
    assert parse_time("2026-11-01T06:00", "since") == start + 6 * 3600
    assert parse_time("2026-11-01T06:00+01:00", "since") == start + 5 * 3600
    with pytest.raises(ValueError, match="^until: expected a date"):
        parse_time("yesterday", "until")
