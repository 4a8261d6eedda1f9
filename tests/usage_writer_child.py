"""Child process for the kill -9 test of the usage recorder in test_usage.py.

Usage: usage_writer_child.py <data_dir>. Records a full batch and waits for its commit, prints
"committed", then records a few more that wait for the next flush interval (an hour away), prints
"recorded", and waits to be killed.
"""

import sys
from pathlib import Path

import trio

from llmgw.server.store import UsageRecord, open_store
from llmgw.server.usage_book import UsageRecorder

MAX_BATCH = 20
UNFLUSHED = 7
# Bounded so that a child whose test died before killing it does not linger.
MAX_LIFETIME_S = 60


def record(i: int) -> UsageRecord:
    return UsageRecord(1_700_000_000.0 + i, "acme", "k-00000001", "m", "r-1", 1, 1, 1.0, 200)


async def main() -> None:
    store = await open_store(Path(sys.argv[1]))
    recorder = UsageRecorder(store, flush_interval=3600, max_batch=MAX_BATCH)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        seen = recorder.flushes.version
        for i in range(MAX_BATCH):
            recorder.record(record(i))
        await recorder.flushes.wait_past(seen)
        print("committed", flush=True)
        for i in range(MAX_BATCH, MAX_BATCH + UNFLUSHED):
            recorder.record(record(i))
        print("recorded", flush=True)
        await trio.sleep(MAX_LIFETIME_S)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
