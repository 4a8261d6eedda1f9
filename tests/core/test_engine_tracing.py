"""An engine's own traces (core.engines.tracing): vLLM gets --otlp-traces-endpoint (a flag of its
captured help), the protocol and the collector's headers in its environment (never on the command
line); engines that make no traces, headless ranks and tracing off leave the plan as it was."""

from __future__ import annotations

import pytest

from llmgw.core import flags
from llmgw.core.engines import build_plan, registry
from llmgw.core.engines.common import EngineBinaries
from llmgw.core.engines.samples import base, two_nodes
from llmgw.core.engines.tracing import EngineTracing, traced_plan
from tests.helpers import TESTS

VLLM_HELP = TESTS / "fixtures" / "engine-help" / "vllm-0.33.0-serve-help.txt"
SECRET = "collector-s3cret value"


def plan(engine: str, **changes: object):
    if engine == "llamacpp":  # a GGUF, its own quantization
        changes = {"model_path": "/models/check.gguf", "dtype": None, "quantization": None, **changes}
    return build_plan(base(engine, **changes), engine_key="k", binaries=EngineBinaries())


def test_vllm_traces_to_the_agents_collector_with_its_headers_in_the_environment() -> None:
    tracing = EngineTracing(endpoint="http://otel:4318", headers={"x-api-key": SECRET})
    [engine] = traced_plan(plan("vllm"), "vllm", tracing).commands
    argv = engine.argv
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://otel:4318/v1/traces"
    assert engine.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert engine.env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "x-api-key=collector-s3cret%20value"
    assert engine.env["OTEL_SERVICE_NAME"] == "vllm"
    assert engine.env["VLLM_API_KEY"] == "k"  # the plan's own environment kept
    assert not any("s3cret" in part for part in argv)
    result = flags.check(
        [argv[registry.ENGINES["vllm"].help.argv_prefix :]], VLLM_HELP.read_text(), engine="vllm"
    )
    assert result.missing == ()


def test_grpc_and_a_path_given_are_passed_as_they_are() -> None:
    for endpoint, protocol in (
        ("http://otel:4317", "grpc"),
        ("https://c.example/otlp/v1/traces", "http/protobuf"),
    ):
        [engine] = traced_plan(plan("vllm"), "vllm", EngineTracing(endpoint, protocol)).commands
        assert engine.argv[engine.argv.index("--otlp-traces-endpoint") + 1] == endpoint
        assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in engine.env


def test_only_the_rank_that_serves_http_traces() -> None:
    tracing = EngineTracing("http://otel:4318")
    binaries = EngineBinaries()
    leader = build_plan(two_nodes("vllm", 0), engine_key="k", binaries=binaries)
    headless = build_plan(two_nodes("vllm", 1), engine_key=None, binaries=binaries)
    assert traced_plan(headless, "vllm", tracing) == headless
    assert "--otlp-traces-endpoint" in traced_plan(leader, "vllm", tracing).commands[-1].argv


@pytest.mark.parametrize("engine", ["llamacpp", "sglang"])
def test_engines_that_make_no_traces_here_and_tracing_off_keep_their_plan(engine: str) -> None:
    original = plan(engine)
    assert traced_plan(original, engine, EngineTracing("http://otel:4318")) == original
    assert traced_plan(plan("vllm"), "vllm", None) == plan("vllm")


def test_an_endpoint_with_credentials_stays_off_the_command_line() -> None:
    original = plan("vllm")
    assert traced_plan(original, "vllm", EngineTracing("http://user:pw@otel:4318")) == original
