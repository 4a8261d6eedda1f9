"""The gateway's request spans, with the SDK's in-memory exporter: a real relay and the control
plane's gate over real sockets to fake engines on 127.0.0.1. Which spans, their parents, their
attributes (GenAI conventions), a client's traceparent continued to the engine, failures marked,
the failed kept at a ratio of zero, and nothing secret or from the prompt in any span."""

from __future__ import annotations

import json

import attrs
import pytest
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from llmgw import tracing
from llmgw.core.quota import Limits
from llmgw.gateway import Upstream, serve_gateway
from llmgw.server.gate import ControlPlaneGate
from llmgw.server.routing import Route, Routes
from tests.gateway.test_gateway_relay import ENGINE_KEY, Client, FakeEngine, Gateway, streaming_reply

SECRET = "sk-llmgw-tracing-test-secret"
LIMITED = "sk-llmgw-limited-secret"
PROMPT = "the secret recipe for sourdough"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@attrs.frozen
class Key:
    id: str
    tenant: str
    models: tuple[str, ...] = ()
    band: int = 0
    limits: Limits | None = None


class Directory:
    def __init__(self) -> None:
        self.keys = {SECRET: Key("key-a", "acme"), LIMITED: Key("key-b", "bravo", limits=Limits(rpm=1))}

    def authenticate(self, secret: str):
        return self.keys.get(secret)

    def tenant(self, name: str):
        return None


class Replicas:
    """Router for the relay and route source for the gate: model "m" on these upstreams."""

    def __init__(self, upstreams: list[Upstream], policy: str = "least-loaded") -> None:
        self.table = Routes(
            policy=policy,
            replicas=tuple(Route(replica=u.replica, upstream=u, slots=4, load=None) for u in upstreams),
        )

    def models(self):
        return ["m"]

    def parent(self, name: str):
        return None

    def ready_upstreams(self, model: str):
        return [r.upstream for r in self.table.replicas] if model == "m" else None

    def routes(self, model: str):
        return self.table if model == "m" else None


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "llmgw-gateway-test", batch=False)
    yield exporter
    tracing.shutdown()


async def start(nursery, router: Replicas, gate: ControlPlaneGate) -> Gateway:
    gateway = Gateway()
    gateway.port = await nursery.start(
        lambda task_status: serve_gateway(
            router,
            "127.0.0.1",
            0,
            gate=gate,
            on_done=gateway._records_in.send_nowait,
            task_status=task_status,
        )
    )
    return gateway


def body(stream: bool = False) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": stream,
        "max_tokens": 7,
    }


def headers(secret: str = SECRET, traceparent: str | None = TRACEPARENT) -> list:
    found = [(b"authorization", f"Bearer {secret}".encode())]
    if traceparent is not None:
        found.append((b"traceparent", traceparent.encode()))
    return found


def named(exporter: InMemorySpanExporter, trace_id: int | None = None) -> dict[str, list]:
    by_name: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        if trace_id is None or s.context.trace_id == trace_id:
            by_name.setdefault(s.name, []).append(s)
    return by_name


def everything_said(exporter: InMemorySpanExporter) -> str:
    """Every name, attribute, event and status of every span, as text to search for secrets."""
    parts = []
    for s in exporter.get_finished_spans():
        parts += [s.name, json.dumps(dict(s.attributes), default=str), str(s.status.description)]
        parts += [e.name + json.dumps(dict(e.attributes or {}), default=str) for e in s.events]
    return "\n".join(parts)


def upstream_of(engine_upstream: Upstream, replica: str) -> Upstream:
    return Upstream(engine_upstream.host, engine_upstream.port, engine_upstream.engine_key, replica)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_request_is_one_trace_from_the_client_through_the_gate_to_the_engine(nursery, spans, stream):
    engines = [FakeEngine(streaming_reply() if stream else None) for _ in range(2)]
    upstreams = [upstream_of(await e.start(nursery), f"r{i}") for i, e in enumerate(engines)]
    gateway = await start(nursery, Replicas(upstreams), ControlPlaneGate(Directory(), Replicas(upstreams)))
    status, _ = await gateway.call("POST", "/v1/chat/completions", body(stream), headers())
    assert status == 200
    await gateway.record()
    by_name = named(spans, int(CLIENT_TRACE, 16))
    [root] = by_name["chat m"]
    # The client's trace continues: the request's span is a child of the client's.
    assert root.parent.is_remote and root.parent.span_id == int(CLIENT_SPAN, 16)
    assert root.kind is SpanKind.SERVER
    a = root.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == (
        "chat",
        "m",
        7,
    )
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (3, 5)
    assert (a["http.response.status_code"], a["llmgw.tenant"], a["llmgw.key_id"]) == (200, "acme", "key-a")
    assert a["llmgw.stream"] is stream and a["llmgw.replica"] in ("r0", "r1")
    assert [e.name for e in root.events] == ["first_byte"]
    assert root.start_time <= root.events[0].timestamp <= root.end_time
    assert root.status.status_code is StatusCode.UNSET
    for child in (
        "gateway.authenticate",
        "gateway.quota",
        "gateway.admission",
        "gateway.upstream",
        "gateway.relay",
    ):
        [span] = by_name[child]
        assert span.parent.span_id == root.context.span_id, child
    admission = by_name["gateway.admission"][0].attributes
    assert admission["llmgw.route.policy"] == "least-loaded"
    assert admission["llmgw.route.replica"] == a["llmgw.replica"]
    assert admission["llmgw.route.outcome"]
    upstream = by_name["gateway.upstream"][0]
    assert upstream.kind is SpanKind.CLIENT
    assert upstream.attributes["llmgw.replica"] == a["llmgw.replica"]
    assert upstream.attributes["server.port"] in (u.port for u in upstreams)
    # The relay's span ends with the answer: after the head came, before the request's end.
    relay = by_name["gateway.relay"][0]
    assert upstream.end_time <= relay.end_time <= root.end_time
    # The engine was handed the trace too, as a child of the gateway's attempt.
    [seen] = [s for e in engines for s in e.seen]
    assert seen.headers[b"traceparent"].decode() == f"00-{CLIENT_TRACE}-{upstream.context.span_id:016x}-01"
    assert seen.headers[b"authorization"] == f"Bearer {ENGINE_KEY}".encode()
    said = everything_said(spans)
    for secret in (SECRET, ENGINE_KEY, PROMPT, "sourdough"):
        assert secret not in said


async def test_without_a_traceparent_a_request_starts_its_own_trace(nursery, spans):
    engine = FakeEngine()
    upstreams = [upstream_of(await engine.start(nursery), "r0")]
    gateway = await start(nursery, Replicas(upstreams), ControlPlaneGate(Directory(), Replicas(upstreams)))
    assert (await gateway.call("POST", "/v1/chat/completions", body(), headers(traceparent=None)))[0] == 200
    await gateway.record()
    [root] = named(spans)["chat m"]
    assert root.parent is None
    assert engine.seen[0].headers[b"traceparent"].decode().split("-")[1] == f"{root.context.trace_id:032x}"


async def test_refusals_and_failures_are_marked_where_they_happened(nursery, spans):
    engine = FakeEngine()
    live = upstream_of(await engine.start(nursery), "r1")
    # A port nothing listens on: the first attempt fails to connect, the second serves.
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        dead = Upstream("127.0.0.1", s.getsockname()[1], ENGINE_KEY, "r0")
    router = Replicas([dead, live], policy="round-robin")
    gateway = await start(nursery, router, ControlPlaneGate(Directory(), router))

    assert (await gateway.call("POST", "/v1/chat/completions", body(), headers("sk-wrong")))[0] == 401
    await gateway.record()
    by_name = named(spans)
    [root] = by_name["chat"]  # refused before the body was read for its model
    assert root.status.status_code is StatusCode.UNSET  # a client's mistake, not the gateway's
    assert root.attributes["http.response.status_code"] == 401
    [auth] = by_name["gateway.authenticate"]
    assert auth.status.status_code is StatusCode.ERROR
    assert "sk-wrong" not in everything_said(spans)

    spans.clear()
    client = await Client.open(gateway.port)
    # Round-robin between the two: one of two requests tries the dead replica first.
    for secret, expected in ((SECRET, 200), (SECRET, 200), (LIMITED, 200), (LIMITED, 429)):
        status, _ = await client.call("POST", "/v1/chat/completions", body(), headers(secret, None))
        assert status == expected  # LIMITED's second is over its one request a minute
        await gateway.record()
    await client.http.aclose()
    by_name = named(spans)
    [refused] = [s for s in by_name["gateway.quota"] if s.status.status_code is StatusCode.ERROR]
    assert "requests-per-minute" in refused.status.description
    attempts = by_name["gateway.upstream"]
    failed = [s for s in attempts if s.status.status_code is StatusCode.ERROR]
    assert {s.attributes["llmgw.replica"] for s in failed} == {"r0"} and failed
    assert failed[0].status.description.startswith("connect:")
    assert [s.attributes["llmgw.replica"] for s in attempts if s not in failed] == ["r1"] * 3
    assert len(engine.seen) == 3 and all(b"traceparent" in s.headers for s in engine.seen)
    # Served after a failed attempt: the request's own span is fine.
    assert all(s.status.status_code is StatusCode.UNSET for s in by_name["chat m"])


async def test_at_a_ratio_of_zero_the_failed_requests_are_kept_and_the_served_dropped(nursery):
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "t", ratio=0.0, keep_slower_than=3600.0, batch=False)
    try:
        engine = FakeEngine()
        served = [upstream_of(await engine.start(nursery), "r0")]
        with trio.socket.socket() as s:
            await s.bind(("127.0.0.1", 0))
            dead = [Upstream("127.0.0.1", s.getsockname()[1], ENGINE_KEY, "r9")]
        for upstreams, status in ((served, 200), (dead, 502)):
            router = Replicas(upstreams)
            gateway = await start(nursery, router, ControlPlaneGate(Directory(), router))
            assert (await gateway.call("POST", "/v1/chat/completions", body(), headers(traceparent=None)))[
                0
            ] == status
            await gateway.record()
        kept = named(exporter)
        [root] = kept["chat m"]
        assert root.attributes["http.response.status_code"] == 502
        assert root.status.status_code is StatusCode.ERROR
        assert {"gateway.authenticate", "gateway.quota", "gateway.admission", "gateway.upstream"} <= set(kept)
        assert all(s.context.trace_id == root.context.trace_id for group in kept.values() for s in group)
    finally:
        tracing.shutdown()


async def test_off_nothing_is_traced_and_the_engine_gets_no_traceparent(nursery):
    assert not tracing.enabled()
    engine = FakeEngine()
    upstreams = [upstream_of(await engine.start(nursery), "r0")]
    gateway = await start(nursery, Replicas(upstreams), ControlPlaneGate(Directory(), Replicas(upstreams)))
    assert (await gateway.call("POST", "/v1/chat/completions", body(True), headers()))[0] == 200
    assert b"traceparent" not in engine.seen[0].headers
