"""The gateway's own /metrics, in Prometheus text, through prometheus_client.

Requests are counted from the relay's ``on_done(record)``, which runs on the hot path of every
request: it does a handful of dict lookups and increments, nothing that grows with traffic. The
labelled children are cached per (model, status) because prometheus_client's ``labels()`` checks
and joins its arguments on every call.

Queue depth and the engines' load are not pushed: they are read when /metrics is scraped, from the
gate's queues and the engine scraper (gauges that always show the present, at no cost per request).

/metrics needs no key on the gateway port: scrapers (Prometheus, the agent of a monitoring stack)
rarely hold a bearer token, and the text carries model names, replica ids and counts only — no
key, prompt or address, and tenants' names only where the operator asks for tokens per tenant
(gateway.tenant_metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.gateway.contract import RequestRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

# Whole-request latency of LLM calls: tens of ms for an embedding up to minutes for a long answer.
# The time to first token a request should not exceed (gateway.ttft_target in server.yaml);
# each one above it counts as an SLO violation.
TTFT_TARGET = 2.0
DURATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The model label comes from the client's body. Past this many distinct values further ones are
# counted as OTHER_MODEL, so that no client can grow the exposition without bound.
MAX_MODEL_LABELS = 256
# Waits in the admission queue: nothing for a free replica, up to a cold start of minutes.
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Tenants are the operator's (not the clients'), but bounded all the same.
MAX_TENANT_LABELS = 1024
# Requests with no model, or one the gateway does not serve (400 or 404 before any routing).
NO_MODEL = "-"
OTHER_MODEL = "other"
# The answer was cut after it began (engine failed, or client left): no status describes it.
INCOMPLETE = "incomplete"


class QueueDepths(Protocol):
    """server.gate.ControlPlaneGate, as seen here."""

    def queue_depths(self) -> Mapping[str, Mapping[int, int]]: ...


class EngineSamples(Protocol):
    """server.scrape.EngineScraper, as seen here: samples with model, running, waiting, saturation."""

    def snapshot(self) -> Mapping[str, Any]: ...


class GatewayMetrics:
    def __init__(
        self,
        *,
        gate: QueueDepths | None = None,
        engines: EngineSamples | None = None,
        ttft_target: float = TTFT_TARGET,
        ttft_targets: Callable[[str], float | None] | None = None,
        tenants: bool = False,
    ) -> None:
        self._ttft_target = ttft_target
        # Tokens per tenant (gateway.tenant_metrics): off unless asked for, since /metrics needs
        # no key and tenants' names would be anyone's to read who can reach the port.
        self._count_tenants = tenants
        # A model's own target (its profile's ttft_target), when it has one.
        self._ttft_targets = ttft_targets
        # A registry of its own: tests (and two gateways in one process) do not share counters.
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "llmgw_requests", "Model requests answered, by model and HTTP status",
            ["model", "status"], registry=self.registry,
        )  # fmt: skip
        self._duration = Histogram(
            "llmgw_request_duration_seconds", "Time from request to the answer's end, by model",
            ["model"], buckets=DURATION_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tokens = Counter(
            "llmgw_tokens", "Tokens the engines reported, by model and direction (prompt or completion)",
            ["model", "direction"], registry=self.registry,
        )  # fmt: skip
        self._upstream_errors = Counter(
            "llmgw_upstream_errors", "Requests an engine failed: unreachable (502), timed out (504) or 5xx",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self._ttft = Histogram(
            "llmgw_time_to_first_token_seconds", "Time from request to a stream's first token, by model",
            ["model"], buckets=DURATION_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._slo_violations = Counter(
            "llmgw_ttft_slo_violations", "Requests whose first token took longer than the target, by model",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self._replica_requests = Counter(
            "llmgw_replica_requests", "Model requests sent to each replica, by model and replica",
            ["model", "replica"], registry=self.registry,
        )  # fmt: skip
        self._routing = Counter(
            "llmgw_routing_decisions",
            "Replica choices, by model, policy and outcome (affinity: the prompt's own replica; "
            "spilled: another, for load; no-key: nothing to key on)",
            ["model", "policy", "outcome"], registry=self.registry,
        )  # fmt: skip
        self._queue_wait = Histogram(
            "llmgw_queue_wait_seconds", "Time requests waited in the admission queue, by model",
            ["model"], buckets=QUEUE_WAIT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tenant_tokens = Counter(
            "llmgw_tenant_tokens", "Tokens the engines reported, by tenant and direction (prompt or completion)",
            ["tenant", "direction"], registry=self.registry,
        )  # fmt: skip
        self._by_tenant: dict[str, tuple[Any, Any]] = {}
        # Client connections: open now, and accepted since start (kept by gateway.http).
        self._answer: Callable[[], bytes] | None = None
        self.connections_open = 0
        self.connections_accepted = 0
        # Refused at once for want of room (the process's or the peer's cap).
        self.connections_refused = 0
        self.registry.register(_LiveGauges(gate, engines, self))
        self._by_replica: dict[tuple[str, str], Any] = {}
        self._by_route: dict[tuple[str, str, str], Any] = {}
        self._models: dict[str | None, str] = {None: NO_MODEL}
        self._by_status: dict[tuple[str, int, bool], Any] = {}
        self._by_model: dict[str, tuple[Any, Any, Any, Any]] = {}

    def on_done(self, record: RequestRecord) -> None:
        """Count one finished request (the relay's on_done hook): O(1), never raises on odd input."""
        model = self._model_label(record)
        status = record.status
        key = (model, status, record.completed)
        counter = self._by_status.get(key)
        if counter is None:
            label = str(status) if record.completed else INCOMPLETE
            counter = self._by_status[key] = self._requests.labels(model, label)
        counter.inc()
        children = self._by_model.get(model)
        if children is None:
            children = self._by_model[model] = (
                self._duration.labels(model),
                self._tokens.labels(model, "prompt"),
                self._tokens.labels(model, "completion"),
                self._upstream_errors.labels(model),
                self._ttft.labels(model),
                self._slo_violations.labels(model),
            )
        duration, prompt, completion, upstream_errors, ttft, violations = children
        duration.observe(max(0.0, record.finished - record.started))
        if record.upstream is not None and record.upstream.replica:
            replica_key = (model, record.upstream.replica)
            sent = self._by_replica.get(replica_key)
            if sent is None:
                sent = self._by_replica[replica_key] = self._replica_requests.labels(*replica_key)
            sent.inc()
        if record.usage is not None:
            prompt.inc(record.usage.prompt_tokens)
            completion.inc(record.usage.completion_tokens)
        if status in (502, 504) or record.upstream is not None and status >= 500:
            upstream_errors.inc()
        # Streams only: a non-streaming answer's first byte is its last, and counting it as a
        # first token made every long plain request an SLO violation.
        if record.stream and record.first_byte is not None:
            waited = record.first_byte - record.started
            ttft.observe(waited)
            own = self._ttft_targets(model) if self._ttft_targets is not None else None
            if waited > (own or self._ttft_target):
                violations.inc()

    def on_route(self, model: str, policy: str, outcome: str) -> None:
        """The gate chose a replica for a request (model is a served one: bounded)."""
        key = (model, policy, outcome)
        counter = self._by_route.get(key)
        if counter is None:
            counter = self._by_route[key] = self._routing.labels(*key)
        counter.inc()

    def on_usage(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request's usage, as the gate settled it for its tenant."""
        if not self._count_tenants:
            return
        children = self._by_tenant.get(tenant)
        if children is None:
            if len(self._by_tenant) >= MAX_TENANT_LABELS:
                tenant = OTHER_MODEL  # "other": the table stays bounded
                children = self._by_tenant.get(tenant)
            if children is None:
                children = self._by_tenant[tenant] = (
                    self._tenant_tokens.labels(tenant, "prompt"),
                    self._tenant_tokens.labels(tenant, "completion"),
                )
        children[0].inc(prompt_tokens)
        children[1].inc(completion_tokens)

    def on_queue_wait(self, model: str, seconds: float) -> None:
        """A request left the admission queue: let through, timed out, or its client gone."""
        self._queue_wait.labels(model).observe(max(0.0, seconds))

    def _model_label(self, record: RequestRecord) -> str:
        # A 404 with a model means the model is not served: its name is the client's invention.
        name = record.model if record.status != 404 else None
        label = self._models.get(name)
        if label is not None:
            return label
        if len(self._models) > MAX_MODEL_LABELS:
            return OTHER_MODEL  # not remembered either: the table stays bounded
        self._models[name] = name
        return name

    def exposition(self) -> bytes:
        """The /metrics answer: this registry's, unless answer_with() handed it to a wider view."""
        return self._answer() if self._answer is not None else generate_latest(self.registry)

    def answer_with(self, answer: Callable[[], bytes]) -> None:
        """/metrics answers with ``answer()`` instead: a gateway worker answers for its siblings
        too (server.worker_metrics)."""
        self._answer = answer


class _LiveGauges:
    """Gauges read at scrape time: the admission queues and the engines' load."""

    def __init__(
        self, gate: QueueDepths | None, engines: EngineSamples | None, owner: GatewayMetrics
    ) -> None:
        self._gate = gate
        self._engines = engines
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[Metric]:
        queue = GaugeMetricFamily(
            "llmgw_queue_depth", "Requests waiting for room at the gateway, by model and band",
            labels=["model", "band"],
        )  # fmt: skip
        if self._gate is not None:
            for model, bands in sorted(self._gate.queue_depths().items()):
                for band, depth in sorted(bands.items()):
                    queue.add_metric([model, str(band)], depth)
        running = _engine_family("running", "Requests the engine is generating")
        waiting = _engine_family("waiting", "Requests the engine queued for lack of room")
        saturation = _engine_family("saturation", "Engine fill, 0 idle to 1 full (KV cache or slots)")
        if self._engines is not None:
            for replica, sample in sorted(self._engines.snapshot().items()):
                labels = [replica, sample.model]
                running.add_metric(labels, sample.running)
                waiting.add_metric(labels, sample.waiting)
                if sample.saturation is not None:  # unknown is left out, not shown as 0
                    saturation.add_metric(labels, sample.saturation)
        connections = GaugeMetricFamily("llmgw_gateway_connections", "Client connections open at the gateway")
        connections.add_metric([], self._owner.connections_open)
        accepted = CounterMetricFamily(
            "llmgw_gateway_connections_accepted", "Client connections the gateway accepted"
        )
        accepted.add_metric([], self._owner.connections_accepted)
        refused = CounterMetricFamily(
            "llmgw_gateway_connections_refused",
            "Client connections the gateway refused at once: its connection cap, or the peer's, was reached",
        )
        refused.add_metric([], self._owner.connections_refused)
        return [queue, running, waiting, saturation, connections, accepted, refused]


def _engine_family(what: str, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"llmgw_engine_{what}", f"{help_text}, by replica", labels=["replica", "model"])


def traffic_totals(registry: Any) -> tuple[float, float, float]:
    """Requests answered, those that failed (5xx or cut off), and TTFT SLO violations, summed
    over models from a gateway's prometheus registry (GatewayMetrics.registry)."""
    requests = errors = violations = 0.0
    for family in registry.collect():
        if family.name == "llmgw_requests":
            for sample in family.samples:
                if sample.name != "llmgw_requests_total":
                    continue
                requests += sample.value
                status = sample.labels.get("status", "")
                if not status.isdigit() or int(status) >= 500:
                    errors += sample.value
        elif family.name == "llmgw_ttft_slo_violations":
            violations += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return requests, errors, violations
