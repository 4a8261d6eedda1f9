"""`llmgw agent`: discover the node and hold the link to the server.

The supervisor (shards, adoption) joins this nursery in a later step.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
from pathlib import Path

import trio

from llmgw.agent.discovery import discover
from llmgw.agent.link import AgentLink
from llmgw.config import AgentConfig, default_home

log = logging.getLogger(__name__)

JOIN_TOKEN_ENV = "LLMGW_JOIN_TOKEN"


class AgentSetupError(Exception):
    """The agent cannot start as configured (no join token, unreadable CA file...)."""


def node_name(config: AgentConfig) -> str:
    """The configured name, else the host name made into a valid node name."""
    if config.node_name:
        return config.node_name
    name = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip(".-")[:63]
    return name or "node"


def join_token(config: AgentConfig) -> str:
    """From join_token_file, else $LLMGW_JOIN_TOKEN, else the token file of a server running on
    this machine with the default data directory (the single-machine quickstart)."""
    path = config.server.join_token_file
    if path is None:
        if token := os.environ.get(JOIN_TOKEN_ENV, "").strip():
            return token
        path = default_home() / "server" / "join-token"
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise AgentSetupError(
            f"cannot read the join token from {path}: {exc.strerror}. Copy the server's "
            f"<data_dir>/join-token to this node and set server.join_token_file, or set {JOIN_TOKEN_ENV}"
        ) from None
    if not token:
        raise AgentSetupError(f"the join token file {path} is empty")
    return token


def client_ssl_context(config: AgentConfig) -> ssl.SSLContext | None:
    if config.server.ca_file is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(config.server.ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise AgentSetupError(f"cannot load server.ca_file {config.server.ca_file}: {exc}") from None
    context.set_alpn_protocols(["h2"])
    return context


def make_link(config: AgentConfig) -> AgentLink:
    def discover_node(local_address: str):
        return discover(local_address=local_address, fabric_override=config.fabric)

    return AgentLink(
        node=node_name(config),
        host=config.server.address.host,
        port=config.server.address.port,
        join_token=join_token(config),
        discover=discover_node,
        ssl_context=client_ssl_context(config),
        server_name=config.server.server_name,
        initial_delay=config.reconnect.initial_delay,
        max_delay=config.reconnect.max_delay,
    )


async def run_agent(config: AgentConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    config.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    link = make_link(config)
    log.info("llmgw agent %s connecting to %s", link.node, config.server.address)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        task_status.started(link)
