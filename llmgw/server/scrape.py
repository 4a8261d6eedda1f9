"""Engine metrics: each Ready replica's /metrics, scraped on an interval, as its load.

For every Ready replica the scraper GETs rank 0's ``/metrics`` with the replica's engine key and
keeps three numbers: requests running, requests the engine queued (waiting), and saturation (0 idle
… 1 full). Which metric names give them depends on the engine (see ``core.engines.load_metrics``); the text is
parsed with prometheus_client's parser, never by hand.

A replica whose engine does not answer (refused, timed out, not 200, not Prometheus text) has no
load until it answers again: stale numbers would mislead scaling and routing more than none. That
it stopped or started answering is logged once per change, not on every scrape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import attrs
import trio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core.engines.load_metrics import ENGINE_METRICS
from llmgw.core.replica import Replica, ReplicaState
from llmgw.core.scaling import EngineLoad
from llmgw.http_probe import ProbeFailed, http_get
from llmgw.server.nodes import NodeRegistry
from llmgw.server.replicas import ReplicaManager

log = logging.getLogger(__name__)

# Seconds between scrapes: vLLM itself updates its gauges about this often, and scaling decisions
# are made over minutes.
SCRAPE_INTERVAL = 5.0
# One engine's answer: an engine busy generating still answers /metrics in milliseconds; one that
# takes longer than this is as good as unreachable for load purposes.
SCRAPE_TIMEOUT = 2.0
# The parser is pure Python, so its time grows with the text: vLLM's with many adapters runs to a
# few hundred KiB, which would hold the gateway's event loop for too long. Past this size the parse
# runs in a worker thread.
PARSE_INLINE_BYTES = 64 * 1024


@attrs.frozen
class EngineSample:
    """One replica's engine as of its last good scrape."""

    model: str
    engine: str
    running: int
    waiting: int
    saturation: float | None  # None: the engine has no KV metric and its slot count is unknown


def parse_engine_metrics(text: str, model: str = "", slots: int | None = None) -> EngineSample | None:
    """The load in an engine's /metrics text; None when no known engine's metrics are there.

    Raises ValueError for text that is not Prometheus exposition. Values of the same name are
    added up (vLLM labels them per data-parallel engine and per model name); saturation is the
    highest KV fill reported, or running/slots when that is tighter (or the only thing known).
    """
    sums: dict[str, float] = {}
    highest: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value):
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            highest[sample.name] = max(highest.get(sample.name, -math.inf), sample.value)
    for names in ENGINE_METRICS:
        if names.running not in sums:
            continue
        running = round(sums[names.running])
        waiting = round(sums.get(names.waiting, 0.0))
        fills = [highest[name] for name in names.saturation if name in highest][:1]
        if slots:
            fills.append(running / slots)
        saturation = min(1.0, max(0.0, max(fills))) if fills else None
        return EngineSample(model, names.engine, running, waiting, saturation)
    return None


@attrs.define
class _Target:
    replica: Replica
    host: str
    port: int
    key: str | None
    slots: int | None


class EngineScraper:
    def __init__(
        self,
        replicas: ReplicaManager,
        registry: NodeRegistry,
        interval: float = SCRAPE_INTERVAL,
        *,
        slots: Callable[[Replica], int | None] | None = None,
        timeout: float = SCRAPE_TIMEOUT,
        on_round: Callable[[], None] | None = None,
    ) -> None:
        self._replicas = replicas
        self._registry = registry
        self._interval = interval
        self._slots = slots  # requests a replica serves at once, when its profile says
        self._timeout = min(timeout, interval)
        self._on_round = on_round  # told after each round: the loads the router reads changed
        self._samples: dict[str, EngineSample] = {}
        # Per replica: whether its last scrape succeeded; absent until its first scrape.
        self._reachable: dict[str, bool] = {}
        self.rounds = 0  # completed scrape rounds (tests wait on this)

    # --- reading -------------------------------------------------------------------------------

    def load(self, replica_id: str) -> EngineLoad | None:
        """The replica's load for scaling and routing; None while its engine does not answer."""
        sample = self._samples.get(replica_id)
        if sample is None:
            return None
        saturation = sample.saturation
        if saturation is None:
            # llama.cpp defers a request only when every slot is busy: waiting means full. Without
            # a slot count nothing else is known, and the waiting count carries the signal.
            saturation = 1.0 if sample.waiting > 0 else 0.0
        return EngineLoad(running=sample.running, waiting=sample.waiting, saturation=saturation)

    def snapshot(self) -> dict[str, EngineSample]:
        """Every replica with a good last scrape, by id (for the gateway's /metrics)."""
        return dict(self._samples)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            started = trio.current_time()
            await self.scrape_once()
            await trio.sleep_until(started + self._interval)

    async def scrape_once(self) -> None:
        """One round: every Ready replica, at once, each bounded by the timeout."""
        targets = list(self._targets())
        live = {target.replica.id for target in targets}
        # Gone or no longer Ready: forget it, so that coming back counts as a first scrape.
        for replica_id in [r for r in self._reachable if r not in live]:
            del self._reachable[replica_id]
            self._samples.pop(replica_id, None)
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(self._scrape, target)
        self.rounds += 1
        if self._on_round is not None:
            self._on_round()

    def _targets(self) -> Iterable[_Target]:
        for record in self._replicas.list():
            if record.state != ReplicaState.READY or not record.shards:
                continue
            leader = record.shards[0]
            node = self._registry.get(leader.node)
            if node is None:
                continue
            host = node.inventory.reached_at  # as the router addresses it
            slots = self._slots(record) if self._slots is not None else None
            yield _Target(record, host, leader.port, self._replicas.key_of(record.id), slots)

    async def _scrape(self, target: _Target) -> None:
        replica_id = target.replica.id
        headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
        try:
            status, body = await http_get(
                target.host, target.port, "/metrics", headers=headers, timeout=self._timeout
            )
            if status != 200:
                raise ProbeFailed(f"/metrics answered {status}")
            text = body.decode("utf-8", "replace")
            parse = lambda: parse_engine_metrics(text, target.replica.model, target.slots)  # noqa: E731
            sample = parse() if len(body) <= PARSE_INLINE_BYTES else await trio.to_thread.run_sync(parse)
            if sample is None:
                raise ProbeFailed("/metrics has no vLLM, SGLang or llama.cpp load metrics")
        except (ProbeFailed, ValueError) as error:
            self._samples.pop(replica_id, None)
            if self._reachable.get(replica_id) is not False:
                log.warning(
                    "engine metrics of replica %s (%s:%d) unavailable: %s",
                    replica_id,
                    target.host,
                    target.port,
                    error,
                )
            self._reachable[replica_id] = False
            return
        self._samples[replica_id] = sample
        if self._reachable.get(replica_id) is False:
            log.info(
                "engine metrics of replica %s (%s:%d) available again", replica_id, target.host, target.port
            )
        self._reachable[replica_id] = True
