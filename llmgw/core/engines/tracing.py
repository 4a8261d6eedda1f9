"""An engine's own OpenTelemetry traces, where it makes them: the shard's command line and
environment when the node's agent traces.

vLLM traces each request when started with ``--otlp-traces-endpoint`` (0.33's help lists it), and
continues the ``traceparent`` header the gateway sends it, so a request's trace goes on from the
gateway's attempt into the engine. Its exporter takes the protocol from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (gRPC unless told ``http/protobuf``, whose endpoint it uses
as given: the path ``/v1/traces`` is added here as the agent's own exporter does) and the
collector's headers from ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` — in the environment, since a
command line is readable by every user of the node. vLLM needs the OpenTelemetry SDK in its own
environment for this; without it, it refuses to start, and the shard fails saying so.

An endpoint with credentials in its URL is not passed on (it would be on the command line):
such a node's engines make no traces.

llama.cpp makes no traces; SGLang's (``--enable-trace``) take an endpoint of ``host:port`` over
gRPC only, and are not turned on here.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

import attrs

from llmgw.core.shard import Command, LaunchPlan

ENGINE_SERVICE_NAMES = {"vllm": "vllm"}


@attrs.frozen
class EngineTracing:
    """The agent's tracing block, as an engine needs it."""

    endpoint: str  # the OTLP collector's URL
    protocol: str = "http/protobuf"  # or grpc
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)  # secrets: never logged


def traced_plan(plan: LaunchPlan, engine: str, tracing: EngineTracing | None) -> LaunchPlan:
    """``plan`` with the engine's own tracing on, where the engine traces; as it is otherwise."""
    if tracing is None or engine not in ENGINE_SERVICE_NAMES:
        return plan
    if "@" in tracing.endpoint.split("://", 1)[-1].split("/", 1)[0]:
        return plan  # user:password@host: not for a command line
    return attrs.evolve(plan, commands=tuple(_traced(c, engine, tracing) for c in plan.commands))


def _traced(command: Command, engine: str, tracing: EngineTracing) -> Command:
    if not command.serves_http:
        return command  # a headless rank or a Ray sidecar: requests are traced where they arrive
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": tracing.protocol,
        "OTEL_SERVICE_NAME": ENGINE_SERVICE_NAMES[engine],
    }
    if tracing.headers:
        # The SDK's format: name=value pairs, comma-separated, values URL-encoded.
        env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = ",".join(
            f"{name}={quote(value, safe='')}" for name, value in tracing.headers.items()
        )
    argv = (*command.argv, "--otlp-traces-endpoint", _endpoint(tracing))
    return attrs.evolve(command, argv=argv, env={**command.env, **env})


def _endpoint(tracing: EngineTracing) -> str:
    endpoint = tracing.endpoint
    if tracing.protocol == "http/protobuf" and "/" not in endpoint.split("://", 1)[-1].rstrip("/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint
