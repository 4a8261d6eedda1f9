"""The data plane: an OpenAI-compatible HTTP/1.1 listener that relays requests to engines.

trio + h11 on both sides rather than quart/hypercorn and httpx: a bare trio+h11 relay carries
several times the requests per core of either (DESIGN.md §3 has the comparison).
"""

from llmgw.gateway.contract import Gate, RequestRecord, Router, StaticRouter, Upstream
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.http import MAX_BODY_BYTES, serve_gateway
from llmgw.gateway.relay import UPSTREAM_TIMEOUT
from llmgw.gateway.usage_scan import Usage

__all__ = [
    "MAX_BODY_BYTES",
    "UPSTREAM_TIMEOUT",
    "Gate",
    "GatewayError",
    "RequestRecord",
    "Router",
    "StaticRouter",
    "Upstream",
    "Usage",
    "serve_gateway",
]
