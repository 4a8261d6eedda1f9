"""Usage journals (server/journal.py): every record a worker wrote reaches the store exactly once."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from llmgw.server.journal import (
    JournalShipper,
    JournalWriter,
    encode,
    older_segments,
    parse_segment,
    segment_name,
    whole_lines,
)
from llmgw.server.store import Store, UsageRecord, open_store


def record(i: int, tenant: str = "acme") -> UsageRecord:
    return UsageRecord(float(i), tenant, "k-00000001", "m", "r-1", 10, i, 1.5, 200)


def test_only_whole_lines_are_taken():
    assert whole_lines(b"a\nb\npart") == ([b"a", b"b"], 4)
    assert whole_lines(b"part") == ([], 0)
    assert whole_lines(b"") == ([], 0)


def test_segment_names_sort_by_worker_then_sequence_and_older_ones_are_known():
    names = [segment_name("w0", 2), segment_name("w0", 10), segment_name("w1", 1)]
    assert sorted(names) == names
    assert parse_segment(segment_name("w0", 10)) == ("w0", 10)
    assert parse_segment("w0.journal") is None
    assert older_segments(names) == {segment_name("w0", 2)}


@pytest.fixture
async def store(tmp_path: Path):
    store = await open_store(tmp_path / "data")
    yield store
    await store.aclose()


async def usage_count(store: Store) -> int:
    rows = await store.summarise_usage([], None, None)
    return rows[0]["requests"] if rows else 0


async def test_records_are_shipped_once_however_often_the_shipper_runs(store, tmp_path):
    journals = tmp_path / "journals"
    journals.mkdir(mode=0o700)
    writer = JournalWriter(journals, "w0")
    for i in range(5):
        writer.record(record(i))
    shipper = JournalShipper(store, journals)
    assert await shipper.ship_once() == 5
    assert await shipper.ship_once() == 0
    writer.record(record(5))
    assert await shipper.ship_once() == 1
    assert await usage_count(store) == 6
    (journal,) = journals.iterdir()
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600


async def test_a_partial_last_line_waits_and_a_new_shipper_resumes_where_the_store_says(store, tmp_path):
    journals = tmp_path / "journals"
    journals.mkdir()
    path = journals / segment_name("w0", 1)
    line = encode(record(1))
    path.write_bytes(encode(record(0)) + line[:7])  # a worker killed in the middle of a write
    assert await JournalShipper(store, journals).ship_once() == 1
    path.write_bytes(path.read_bytes() + line[7:])  # the rest arrives
    # A restarted server's shipper: it starts from the offset the store kept, not from 0.
    assert await JournalShipper(store, journals).ship_once() == 1
    assert await usage_count(store) == 2


async def test_a_restarted_worker_starts_a_new_segment_and_the_old_one_goes_once_shipped(store, tmp_path):
    journals = tmp_path / "journals"
    journals.mkdir()
    first = JournalWriter(journals, "w0")
    first.record(record(0))
    os.write(first._fd, encode(record(1))[:5])  # killed mid-write: a torn line
    first.close()
    second = JournalWriter(journals, "w0")
    second.record(record(2))
    assert sorted(p.name for p in journals.iterdir()) == [segment_name("w0", 1), segment_name("w0", 2)]
    assert await JournalShipper(store, journals).ship_once() == 2
    assert sorted(p.name for p in journals.iterdir()) == [segment_name("w0", 2)]
    assert await store.journal_offsets() == {segment_name("w0", 2): len(encode(record(2)))}


async def test_a_damaged_line_is_skipped_and_the_rest_still_shipped(store, tmp_path):
    journals = tmp_path / "journals"
    journals.mkdir()
    (journals / segment_name("w0", 1)).write_bytes(encode(record(0)) + b"not json\n" + encode(record(1)))
    assert await JournalShipper(store, journals).ship_once() == 2


async def test_two_servers_sharing_a_store_ship_their_same_named_segments_each_once(
    open_test_store, tmp_path
):
    """Both servers' first worker writes w0.1.journal: keyed by server, neither's offset moves the
    other's, and every record of both lands once, however often each ships."""
    store = await open_test_store()
    try:
        shippers, writers = [], []
        for server, count in (("cp1", 3), ("cp2", 5)):
            journals = tmp_path / server
            journals.mkdir()
            writer = JournalWriter(journals, "w0")
            for i in range(count):
                writer.record(record(i, tenant=server))
            writers.append(writer)
            shippers.append(JournalShipper(store, journals, owner=server))
        assert [await s.ship_once() for s in shippers] == [3, 5]
        assert [await s.ship_once() for s in shippers] == [0, 0]
        writers[0].record(record(9, tenant="cp1"))
        assert [await s.ship_once() for s in shippers] == [1, 0]
        totals = {
            row["tenant"]: row["requests"] for row in await store.summarise_usage(["tenant"], None, None)
        }
        assert totals == {"cp1": 4, "cp2": 5}
        assert set(await store.journal_offsets()) == {
            "cp1/" + segment_name("w0", 1),
            "cp2/" + segment_name("w0", 1),
        }
    finally:
        await store.aclose()
