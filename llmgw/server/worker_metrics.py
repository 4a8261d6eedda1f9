"""The gateway's /metrics across its workers: whichever worker a scrape reaches answers for all.

The kernel spreads connections over the workers (SO_REUSEPORT), so a scrape of the gateway port
reaches one of them at random. Answering with that worker's counters alone would make every counter
jump between the workers' values from one scrape to the next, and no rate() would mean anything.
So each worker writes its own series, labelled ``worker="wN"``, to ``<id>.metrics`` in the workers'
directory every ``WRITE_INTERVAL``, and the worker a scrape reaches answers with its own series read
now and its siblings' from their files (at most that old). Summed over ``worker``, a counter is the
gateway's; a restarted worker starts its series again from zero, which Prometheus reads as a reset.

The engines' load (``llmgw_engine_*``) is what the server pushed to every worker alike: it is shown
once, from the answering worker, without a worker label.

Each worker also shows itself: ``llmgw_gateway_worker_info{worker, pid}``, whether it serves, its
lease's time left (several workers), and its open connections (``llmgw_gateway_connections``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from llmgw.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

WRITE_INTERVAL = 1.0
# A sibling's file older than this is from a worker that is gone or stuck: its series are left out.
STALE_AFTER = 5.0
SUFFIX = ".metrics"
# Families the server pushes to every worker alike: shown once, unlabelled.
FLEET_WIDE_PREFIX = "llmgw_engine_"


@attrs.frozen
class WorkerInfo:
    """What a worker says of itself on /metrics."""

    pid: int
    serving: bool
    lease_left: float | None  # seconds; None for a lone worker, which holds no lease
    slots: tuple[tuple[str, int], ...] = ()  # (replica, its slots this worker holds), when leased


class _WorkerGauges:
    """A collector for GatewayMetrics' registry: the worker itself, as of the scrape."""

    def __init__(self, info: Callable[[], WorkerInfo]) -> None:
        self._info = info

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        info = self._info()
        up = GaugeMetricFamily(
            "llmgw_gateway_worker_info", "A gateway worker process, by pid", labels=["pid"]
        )
        up.add_metric([str(info.pid)], 1)
        serving = GaugeMetricFamily(
            "llmgw_gateway_worker_serving", "1 while the worker's pushed state is fresh enough to serve"
        )
        serving.add_metric([], 1 if info.serving else 0)
        families: list[Metric] = [up, serving]
        if info.lease_left is not None:
            lease = GaugeMetricFamily(
                "llmgw_gateway_worker_lease_seconds_left",
                "Seconds the worker's quota and slot lease still holds",
            )
            lease.add_metric([], info.lease_left)
            families.append(lease)
            slots = GaugeMetricFamily(
                "llmgw_gateway_worker_slots", "A replica's slots this worker holds", labels=["replica"]
            )
            for replica, share in info.slots:
                slots.add_metric([replica], share)
            families.append(slots)
        return families


class _Families:
    """Metric families as generate_latest reads a registry."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


class SharedExposition:
    """One worker's part of the gateway's /metrics, and the whole of it (see the module's doc)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        directory: Path,
        worker: str,
        info: Callable[[], WorkerInfo],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self._directory = directory
        self._worker = worker
        self._clock = clock
        self.path = directory / f"{worker}{SUFFIX}"
        metrics.registry.register(_WorkerGauges(info))

    def _own(self) -> tuple[list[Metric], list[Metric]]:
        """This worker's families now: (labelled with the worker, fleet-wide ones as they are)."""
        labelled, fleet_wide = [], []
        for family in self._metrics.registry.collect():
            if family.name.startswith(FLEET_WIDE_PREFIX):
                fleet_wide.append(family)
                continue
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [
                s._replace(labels={**s.labels, "worker": self._worker})
                for s in family.samples
                # A counter's _created sample reads back from the text as a family of its own, which
                # would then be typed twice; Prometheus needs none of them.
                if not s.name.endswith("_created")
            ]
            labelled.append(copy)
        return labelled, fleet_wide

    def write(self) -> None:
        """This worker's labelled series to its file, replaced whole (a reader never sees half)."""
        labelled, _ = self._own()
        text = generate_latest(_Families(labelled))
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(text)
        os.replace(tmp, self.path)

    def exposition(self) -> bytes:
        """Every living worker's series, merged family by family (one HELP and TYPE each)."""
        labelled, fleet_wide = self._own()
        merged: dict[str, Metric] = {family.name: family for family in labelled}
        now = self._clock()
        for path in sorted(self._directory.glob(f"*{SUFFIX}")):
            if path == self.path:
                continue
            try:
                if now - path.stat().st_mtime > STALE_AFTER:
                    continue
                text = path.read_text()
            except OSError:
                continue  # gone between the listing and the read: a worker that stopped
            try:
                families = list(text_string_to_metric_families(text))
            except ValueError as exc:
                log.warning("ignoring %s: %s", path.name, exc)
                continue
            for family in families:
                mine = merged.get(family.name)
                if mine is None:
                    merged[family.name] = family
                elif mine.type == family.type:
                    mine.samples = [*mine.samples, *family.samples]
        return generate_latest(_Families([*merged.values(), *fleet_wide]))
