"""OpenTelemetry traces: the only module that imports opentelemetry (tests/test_layers.py).

Off — ``tracing.endpoint`` null, the default — :func:`span` hands out one shared no-op scope,
:func:`inject` returns ``{}`` (commands carry an empty trace) and nothing is exported; callers on a
hot path test :func:`enabled` first and skip even building attributes.

On, spans go to an OTLP collector (http/protobuf or grpc) in batches, from a background thread.
Sampling: a trace is kept when its trace id falls within ``sample_ratio`` (the same choice in every
process, since it depends on the id alone), or when a parent in another process kept it. Traces the
ratio leaves out are still recorded here, and kept whole when one of their spans failed or their
local root took longer than ``keep_slower_than``: the traces an operator looks for are the failed
and the slow ones, which a plain ratio drops as readily as the rest.

Attributes are what an operator searches by (model, profile, replica, node, tenant); never a key,
a prompt or generated text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
# Traces the ratio left out are held until their local root ends, so that a failure or a slow root
# can still keep them: at most this many traces, of at most this many spans each.
MAX_HELD_TRACES = 2048
MAX_HELD_SPANS = 512
# Traces kept that way, remembered so that their later spans (a shard's start ends long after the
# reconcile pass that began it) are kept too.
MAX_KEPT_TRACES = 1024
SERVICE_NAMES = {"server": "llmgw-server", "agent": "llmgw-agent", "worker": "llmgw-gateway-worker"}

NO_SPAN = trace.INVALID_SPAN  # what every span is when tracing is off: all its methods do nothing


class _State:
    provider: Any = None
    tracer: Any = None


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


# --- setting up ---------------------------------------------------------------------------------


def setup(config: Any, role: str) -> bool:
    """Starts exporting as ``config`` (a config.TracingConfig) says, for ``role`` (server, agent,
    worker); returns whether tracing is on. Off: nothing is imported or started."""
    if config is None or config.endpoint is None:
        return False
    exporter = _exporter(config)
    service = config.service_name or SERVICE_NAMES.get(role, f"llmgw-{role}")
    install(exporter, service, config.sample_ratio, config.keep_slower_than, config.resource_attributes)
    # The endpoint without what a URL may hide in it; the headers never appear.
    shown = config.endpoint.split("://", 1)[-1].rpartition("@")[2]
    log.info("tracing: spans of %s go to %s over %s", service, shown, config.protocol)
    return True


def _exporter(config: Any) -> Any:
    headers = dict(config.headers)
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = config.endpoint
        return GrpcExporter(endpoint=endpoint, headers=headers, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = config.endpoint
    if "/" not in endpoint.split("://", 1)[1].rstrip("/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint, headers=headers)


def install(
    exporter: Any,
    service: str,
    ratio: float = 1.0,
    keep_slower_than: float = 5.0,
    resource_attributes: Mapping[str, str] | None = None,
    *,
    batch: bool = True,
) -> None:
    """Sends spans to ``exporter`` (tests pass the SDK's in-memory one, with ``batch`` False so that
    each span is there as it ends)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased

    shutdown()
    resource = Resource.create({**(resource_attributes or {}), "service.name": service})
    record_only = _RecordOnly()
    sampler = ParentBased(
        root=_RatioOrRecord(ratio),
        remote_parent_not_sampled=record_only,
        local_parent_not_sampled=record_only,
    )
    provider = TracerProvider(resource=resource, sampler=sampler)
    inner = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(_Keeper(inner, keep_slower_than))
    _state.provider = provider
    _state.tracer = provider.get_tracer("llmgw")
    _log_ids_on()


def shutdown() -> None:
    """Exports what is left and turns tracing off."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is not None:
        provider.shutdown()


def flush() -> None:
    if _state.provider is not None:
        _state.provider.force_flush()


# --- sampling -----------------------------------------------------------------------------------


def _samplers():
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased

    class RatioOrRecord(TraceIdRatioBased):
        """The ratio's choice by trace id; what it leaves out is recorded all the same."""

        def should_sample(
            self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
        ):
            result = super().should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
            if result.decision is Decision.DROP:
                return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
            return result

    class RecordOnly(Sampler):
        def should_sample(
            self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
        ):
            parent = trace.get_current_span(parent_context).get_span_context()
            return SamplingResult(
                Decision.RECORD_ONLY, attributes, parent.trace_state if parent.is_valid else None
            )

        def get_description(self) -> str:
            return "RecordOnly"

    return RatioOrRecord, RecordOnly


def _RatioOrRecord(ratio: float) -> Any:  # noqa: N802 - a class made on first use
    return _samplers()[0](ratio)


def _RecordOnly() -> Any:  # noqa: N802
    return _samplers()[1]()


def _sampled_copy(span: Any) -> Any:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    ctx = span.context
    return ReadableSpan(
        name=span.name,
        context=SpanContext(
            ctx.trace_id, ctx.span_id, False, TraceFlags(TraceFlags.SAMPLED), ctx.trace_state
        ),
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class _Keeper:
    """A span processor: sampled spans go on at once; the others wait for their local root, and
    go on, marked sampled, when one of them failed or the root was slow (see the module's text)."""

    def __init__(self, inner: Any, keep_slower_than: float) -> None:
        self._inner = inner
        self._slow_ns = int(keep_slower_than * 1e9)
        self._held: OrderedDict[int, list[Any]] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if span.context.trace_flags.sampled:
            self._inner.on_end(span)
            return
        trace_id = span.context.trace_id
        with self._lock:
            if trace_id in self._kept:
                out = [span]
            else:
                held = self._held.setdefault(trace_id, [])
                if len(held) < MAX_HELD_SPANS:
                    held.append(span)
                while len(self._held) > MAX_HELD_TRACES:
                    self._held.popitem(last=False)
                if span.parent is not None and not span.parent.is_remote:
                    return  # not this process's root: wait for it
                spans = self._held.pop(trace_id, [])
                failed = any(s.status.status_code is StatusCode.ERROR for s in spans)
                if not failed and span.end_time - span.start_time < self._slow_ns:
                    return
                self._kept[trace_id] = None
                while len(self._kept) > MAX_KEPT_TRACES:
                    self._kept.popitem(last=False)
                out = spans
        for kept in out:
            self._inner.on_end(_sampled_copy(kept))

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


# --- spans --------------------------------------------------------------------------------------

_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}


class _NoScope:
    __slots__ = ()

    def __enter__(self) -> Any:
        return NO_SPAN

    def __exit__(self, *exc: Any) -> bool:
        return False


_NO_SCOPE = _NoScope()


class _Scope:
    """The span current while the block runs; ended at its end unless ``end`` is False. An
    exception (not a cancellation, which is BaseException) marks it failed."""

    __slots__ = ("span", "_end", "_token")

    def __init__(self, span: Any, end: bool) -> None:
        self.span = span
        self._end = end

    def __enter__(self) -> Any:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: Any, error: Any, _tb: Any) -> bool:
        otel_context.detach(self._token)
        if isinstance(error, Exception):
            fail(self.span, f"{type(error).__name__}: {error}")
        if self._end:
            self.span.end()
        return False


def _parent_context(parent: Any) -> Any:
    """``parent``: None (the current span), a span, or a carrier of W3C headers (a command's trace)."""
    if parent is None:
        return None
    if isinstance(parent, Mapping):
        return _PROPAGATOR.extract(carrier=dict(parent))
    return trace.set_span_in_context(parent)


def start(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: Any = None,
    kind: str = "internal",
    start_time: float | None = None,
) -> Any:
    """A span that outlives the block that began it (a shard's start, until it is ready); end it
    with :func:`end`. ``start_time``: wall-clock seconds it began, when that was earlier. NO_SPAN
    when off."""
    tracer = _state.tracer
    if tracer is None:
        return NO_SPAN
    began = None if start_time is None else int(start_time * 1e9)
    return tracer.start_span(
        name, context=_parent_context(parent), kind=_KINDS[kind], attributes=attributes, start_time=began
    )


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, parent: Any = None, kind: str = "internal"
) -> Any:
    """``with span(...) as s:`` — a span current for the block, ended at its end."""
    if _state.tracer is None:
        return _NO_SCOPE
    return _Scope(start(name, attributes, parent=parent, kind=kind), end=True)


def use(a_span: Any) -> Any:
    """``with use(s):`` — makes a span begun by :func:`start` current for the block, not ending it."""
    if _state.tracer is None or a_span is NO_SPAN:
        return _NO_SCOPE
    return _Scope(a_span, end=False)


def end(a_span: Any, error: str | None = None, end_time: float | None = None) -> None:
    if error is not None:
        fail(a_span, error)
    a_span.end(None if end_time is None else int(end_time * 1e9))


def event(
    a_span: Any, name: str, attributes: Mapping[str, Any] | None = None, at: float | None = None
) -> None:
    """A moment in ``a_span`` (a first byte, a stream's end); ``at``: wall-clock seconds, when
    it was earlier than now."""
    a_span.add_event(name, attributes, None if at is None else int(at * 1e9))


def current() -> Any:
    """The current span (NO_SPAN when there is none, or tracing is off)."""
    return trace.get_current_span() if _state.tracer is not None else NO_SPAN


def fail(a_span: Any, why: str) -> None:
    """Marks ``a_span`` failed; the first reason given stays (it is nearest the cause)."""
    if a_span.is_recording() and a_span.status.status_code is not StatusCode.ERROR:
        a_span.set_status(Status(StatusCode.ERROR, why))


def inject(a_span: Any = None) -> dict[str, str]:
    """The W3C trace context (traceparent, tracestate) of ``a_span`` or the current span, for a
    command or an engine; {} when off."""
    if _state.tracer is None:
        return {}
    carrier: dict[str, str] = {}
    ctx = None if a_span is None else trace.set_span_in_context(a_span)
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def epoch(monotonic: float, now_monotonic: float) -> float:
    """Wall-clock seconds of a moment ``monotonic`` read from a clock that reads ``now_monotonic``
    now: spans are stamped in wall-clock time, the gateway times with trio's clock."""
    return time.time() - (now_monotonic - monotonic)


# --- logs ---------------------------------------------------------------------------------------


class _WithIds(logging.Formatter):
    """The handler's own format, then the current span's ids when there is one."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            text += f" trace_id={ctx.trace_id:032x} span_id={ctx.span_id:016x}"
        return text


def _log_ids_on() -> None:
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _WithIds):
            handler.setFormatter(_WithIds(handler.formatter or logging.Formatter()))
