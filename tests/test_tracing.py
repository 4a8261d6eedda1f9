"""llmgw.tracing with the SDK's in-memory exporter: off is a no-op, the W3C context round-trips,
sampling keeps failed and slow traces beyond the ratio, logs carry the ids, the config block."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw import tracing
from llmgw.config import ConfigError, TracingConfig, parse_agent_config, parse_server_config


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "llmgw-test", batch=False)
    yield exporter
    tracing.shutdown()


def test_off_every_span_is_the_no_op_and_commands_carry_nothing():
    assert not tracing.enabled()
    assert tracing.setup(TracingConfig(), "server") is False
    with tracing.span("x", {"a": 1}) as s:
        s.set_attribute("b", 2)
        assert s is tracing.NO_SPAN
        assert tracing.inject() == {}
    assert tracing.start("y") is tracing.NO_SPAN


def test_spans_nest_and_a_carrier_continues_the_trace(spans):
    with tracing.span("pass", {"llmgw.profile": "chat"}) as outer:
        with tracing.span("place"):
            carrier = tracing.inject()
    assert carrier["traceparent"].startswith("00-")
    # What the agent does with a command's trace: its span is a child of the sender's.
    with tracing.span("agent.start_shard", parent=carrier) as remote:
        pass
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert by_name["place"].parent.span_id == outer.get_span_context().span_id
    assert by_name["agent.start_shard"].parent.span_id == by_name["place"].context.span_id
    assert by_name["agent.start_shard"].parent.is_remote
    assert remote.get_span_context().trace_id == outer.get_span_context().trace_id
    assert by_name["pass"].attributes["llmgw.profile"] == "chat"
    assert by_name["pass"].resource.attributes["service.name"] == "llmgw-test"


def test_an_exception_marks_the_span_failed_and_a_long_span_ends_when_told(spans):
    with pytest.raises(ValueError), tracing.span("boom"):
        raise ValueError("no room")
    long = tracing.start("shard.start")
    with tracing.use(long), tracing.span("engine.launch"):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["boom", "engine.launch"]
    tracing.end(long, error="the engine exited")
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert finished["boom"].status.description == "ValueError: no room"
    assert finished["shard.start"].status.description == "the engine exited"
    assert finished["engine.launch"].parent.span_id == finished["shard.start"].context.span_id


def test_a_ratio_of_zero_still_keeps_failed_and_slow_traces_whole():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "t", ratio=0.0, keep_slower_than=3600.0, batch=False)
    try:
        with tracing.span("plain"), tracing.span("child"):
            pass
        assert exporter.get_finished_spans() == ()  # recorded, then dropped with its root
        with tracing.span("failing"), tracing.span("child") as child:
            tracing.fail(child, "engine 500")
        kept = exporter.get_finished_spans()
        assert sorted(s.name for s in kept) == ["child", "failing"]
        assert all(s.context.trace_flags.sampled for s in kept)
        # A span of a kept trace that ends after its root is kept too.
        exporter.clear()
        root = tracing.start("pass")
        later = tracing.start("shard.start", parent=root)
        tracing.end(root, error="unplaceable")
        tracing.end(later)
        assert sorted(s.name for s in exporter.get_finished_spans()) == ["pass", "shard.start"]
    finally:
        tracing.shutdown()
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "t", ratio=0.0, keep_slower_than=0.0, batch=False)
    try:
        with tracing.span("slow"):
            pass
        assert [s.name for s in exporter.get_finished_spans()] == ["slow"]
    finally:
        tracing.shutdown()


def test_the_ratio_is_by_trace_id_so_every_process_agrees():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "t", ratio=0.5, keep_slower_than=3600.0, batch=False)
    try:
        for _ in range(400):
            with tracing.span("r"):
                pass
        kept = exporter.get_finished_spans()
        assert 120 < len(kept) < 280  # about half, by id
        bound = round(0.5 * 2**64)
        assert all(s.context.trace_id & (2**64 - 1) < bound for s in kept)
    finally:
        tracing.shutdown()


def test_logs_carry_the_trace_and_span_ids_when_on(spans, caplog):
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        tracing.install(spans, "t", batch=False)  # wraps the handlers present
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
        assert handler.format(record) == "hello"  # no span, no ids
        with tracing.span("s") as s:
            ctx = s.get_span_context()
            assert handler.format(record) == f"hello trace_id={ctx.trace_id:032x} span_id={ctx.span_id:016x}"
    finally:
        root.removeHandler(handler)


def test_the_tracing_block_is_the_same_in_both_files_and_names_its_bad_values():
    text = (
        "tracing:\n  endpoint: http://127.0.0.1:4318\n  protocol: grpc\n  headers: {x-api-key: s3cret}\n"
        "  sample_ratio: 0.25\n  keep_slower_than: 2s\n  service_name: gw\n"
        "  resource_attributes: {deployment.environment: prod}\n"
    )
    server, agent = parse_server_config(text).tracing, parse_agent_config(text).tracing
    assert server == agent
    assert (server.protocol, server.sample_ratio, server.keep_slower_than) == ("grpc", 0.25, 2.0)
    assert server.resource_attributes == {"deployment.environment": "prod"}
    assert "s3cret" not in repr(server)  # headers are secrets
    for bad, message in [
        ("sample_ratio: 1.5", "tracing.sample_ratio: expected a number from 0 to 1, got 1.5"),
        ("protocol: udp", 'tracing.protocol: expected one of http/protobuf, grpc, got "udp"'),
        ("endpoint: ftp://x", "tracing.endpoint: expected an http:// or https:// URL"),
        ("headers: {x-api-key: 7}", "tracing.headers: expected a string for every name"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_server_config(f"tracing:\n  {bad}\n")
        assert message in str(caught.value)
        assert "s3cret" not in str(caught.value)


def test_setup_reaches_an_http_exporter_with_the_path_added_and_logs_no_header(caplog):
    config = TracingConfig(endpoint="http://127.0.0.1:1", headers={"x-api-key": "s3cret"})
    assert tracing._exporter(config)._endpoint == "http://127.0.0.1:1/v1/traces"
    assert tracing._exporter(TracingConfig(endpoint="http://c:4318/otlp/v1/traces"))._endpoint.endswith(
        "/otlp/v1/traces"
    )
    caplog.set_level(logging.INFO, logger="llmgw.tracing")
    try:
        assert tracing.setup(config, "agent")  # no span: the shutdown has nothing to send
    finally:
        tracing.shutdown()
    assert "127.0.0.1:1" in caplog.text and "llmgw-agent" in caplog.text
    assert "s3cret" not in caplog.text
