"""The usage account: one durable record per gateway request, written in batches.

:meth:`UsageRecorder.record` only appends to memory, so a request never waits for the disk.
:meth:`UsageRecorder.run` writes what has gathered in one transaction (one fsync) every
``flush_interval``, or as soon as ``max_batch`` records are waiting.

**What can be lost.** On a graceful stop (cancellation) nothing: the rest is written, shielded,
before run returns. On kill -9 or power loss, the records not yet committed: those of the last
``flush_interval`` (1 s by default), and never more than ``max_batch`` (500) plus the batch being
committed while the store keeps up. A committed batch survives both (the store fsyncs every commit).

**Bounded memory.** When the store falls behind (a slow disk, a failing write, retried every
interval) records wait in memory up to ``max_pending``; past that the oldest are dropped, counted
in :attr:`UsageRecorder.dropped` and logged, since a server that runs out of memory loses them all.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from datetime import UTC, date, datetime, time, timedelta

import trio

from llmgw.server.changes import Changes
from llmgw.server.store import USAGE_GROUPS, Store, StoreError, UsageRecord

__all__ = ["UsageRecord", "UsageRecorder", "parse_group_by", "parse_time"]

log = logging.getLogger(__name__)

# The window kill -9 may lose, against one fsync per interval: at 1 s the disk sees one commit a
# second however busy the gateway is.
FLUSH_INTERVAL = 1.0
# A busy gateway writes sooner than the interval, keeping each transaction short.
MAX_BATCH = 500
# About 30 MB of records: minutes of a busy gateway's traffic while the store is stuck.
MAX_PENDING = 100_000


class UsageRecorder:
    def __init__(
        self,
        store: Store,
        *,
        flush_interval: float = FLUSH_INTERVAL,
        max_batch: int = MAX_BATCH,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if max_pending < max_batch:
            raise ValueError(f"max_pending ({max_pending}) must be at least max_batch ({max_batch})")
        self._store = store
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._pending: collections.deque[UsageRecord] = collections.deque()
        self._batch_full = trio.Event()
        self.written = 0  # records committed
        self.dropped = 0  # records dropped because max_pending was reached
        self.flushes = Changes()  # bumped after every commit, for whoever waits on one

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, record: UsageRecord) -> None:
        """Adds a record to the next batch; never waits."""
        self._pending.append(record)
        self._drop_over_cap()
        if len(self._pending) >= self._max_batch:
            self._batch_full.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Writes batches until cancelled, then writes what is left."""
        task_status.started()
        written = True
        try:
            while True:
                with trio.move_on_after(self._flush_interval):
                    if written:
                        await self._batch_full.wait()
                    else:
                        # The store is failing: retry after the interval, not as fast as records come.
                        await trio.sleep_forever()
                written = await self._write_batch()
        finally:
            with trio.CancelScope(shield=True):
                await self._write_rest()

    async def summarise(
        self, group_by: Sequence[str], since: float | None = None, until: float | None = None
    ) -> list[dict]:
        """Totals per group of the committed records with ``since <= time < until`` (wall-clock
        unix seconds): up to one flush interval behind :meth:`record`."""
        return await self._store.summarise_usage(list(group_by), since, until)

    async def _write_batch(self) -> bool:
        """Writes up to max_batch records in one transaction; False if the store refused them,
        which are then back at the front of the queue for the next try."""
        batch = [self._pending.popleft() for _ in range(min(len(self._pending), self._max_batch))]
        if len(self._pending) < self._max_batch:
            self._batch_full = trio.Event()
        if not batch:
            return True
        try:
            # Shielded: cancelled before it began, the batch would be neither written nor
            # queued. It is short (the store's busy timeout bounds it), and the cancel lands at
            # the loop's next wait, with the batch committed.
            with trio.CancelScope(shield=True):
                await self._store.add_usage(batch)
        except StoreError as e:
            # The account must not take the server down; the next interval tries again.
            log.warning(
                "usage: %d records not written, retrying in %g s: %s", len(batch), self._flush_interval, e
            )
            self._pending.extendleft(reversed(batch))
            self._drop_over_cap()
            return False
        self.written += len(batch)
        self.flushes.bump()
        return True

    async def _write_rest(self) -> None:
        while self._pending:
            if not await self._write_batch():
                log.error("usage: stopping with %d records that could not be written", len(self._pending))
                return

    def _drop_over_cap(self) -> None:
        over = len(self._pending) - self._max_pending
        if over <= 0:
            return
        for _ in range(over):
            self._pending.popleft()
        if self.dropped == 0 or (self.dropped + over) // self._max_batch > self.dropped // self._max_batch:
            # Logged on the first drop and then once per max_batch dropped, not once per record.
            log.error(
                "usage: the store is not keeping up; %d records dropped so far (over %d waiting)",
                self.dropped + over,
                self._max_pending,
            )
        self.dropped += over


def parse_group_by(text: str, field: str = "by") -> list[str]:
    """``"tenant,model,day"`` → those names, checked; ``""`` → [] (one total)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in USAGE_GROUPS]
    if unknown:
        raise ValueError(
            f"{field}: cannot group by {', '.join(unknown)} (expected a list of: {', '.join(USAGE_GROUPS)})"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: each of {', '.join(USAGE_GROUPS)} may be given once")
    return names


def parse_time(text: str, field: str, *, end_of_day: bool = False) -> float:
    """Wall-clock unix seconds from an ISO date or date and time, UTC unless it says otherwise.

    A bare date is that day's start, or with ``end_of_day`` the next day's start, so that
    ``until=2026-11-30`` takes in the whole of that day.
    """
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        start = datetime.combine(day, time(), tzinfo=UTC)
        return (start + timedelta(days=1) if end_of_day else start).timestamp()
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{field}: expected a date (2026-11-01) or a date and time, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
