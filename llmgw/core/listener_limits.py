"""The bounds a gateway listener puts on its clients, with their defaults and why (pure: the
listener, llmgw.gateway.limits, applies them; server.yaml's ``gateway:`` section sets them).

A client on the same network could otherwise hold the process's file descriptors with silent
sockets or its memory with bodies it never pays for.
"""

from __future__ import annotations

import attrs

# The whole request head (line and headers) arrives within this of the connection's start or
# of the request's first byte. Every client sends its head at once; nginx allows 60 s, but a
# slow head is the cheapest way to hold a connection, so it gets less.
HEAD_TIMEOUT = 20.0
# Between requests on a kept-alive connection: nginx's keepalive_timeout. Long enough for a
# client's connection pool to reuse a connection between bursts.
KEEPALIVE_TIMEOUT = 75.0
# A body may take this long, plus its size at BODY_MIN_RATE: a megabyte of context from a slow
# mobile link fits, a body trickled a byte at a time to hold a connection does not.
BODY_TIMEOUT = 30.0
BODY_MIN_RATE = 32 * 1024  # bytes per second, averaged over the whole body
# Chat requests with long contexts run to a few MB of JSON; past this it is a mistake or an attack.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Bodies held by the process at once (read, or being read, until their request ends): bounds the
# memory strangers can make it hold. A thousand 500 KB conversations fit.
MAX_BODY_BYTES_IN_FLIGHT = 512 * 1024 * 1024
# A request whose body does not fit in the budget waits this long for room, then is answered 503:
# room comes back as other requests end, which a short burst outlives.
BODY_BUDGET_WAIT = 5.0
# Connections one peer address may hold. A client's connection pool holds tens; behind a load
# balancer every client has its address, and the operator raises this or turns it off (null).
MAX_CONNECTIONS_PER_PEER = 1024
# With no cap set, connections may use this share of the soft file descriptor limit (each one
# relayed holds an engine connection too), keeping FD_RESERVE for the store, logs and links.
FD_RESERVE = 256
# Never fewer than this, however low the limit: a listener that takes nobody is no use.
MIN_CONNECTIONS = 16
# What an unlimited RLIMIT_NOFILE counts as: past what one process can use anyway.
UNLIMITED_OPEN_FILES = 1 << 20


@attrs.frozen(kw_only=True)
class ListenerLimits:
    head_timeout: float = HEAD_TIMEOUT
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    body_min_rate: int = BODY_MIN_RATE
    max_body_bytes: int = MAX_BODY_BYTES
    max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT
    body_budget_wait: float = BODY_BUDGET_WAIT
    # None: from the file descriptor limit (see connection_cap).
    max_connections: int | None = None
    # None: no cap per peer.
    max_connections_per_peer: int | None = MAX_CONNECTIONS_PER_PEER

    def connection_cap(self, open_files_limit: int) -> int:
        """The cap on connections, given the process's soft limit of open files (RLIMIT_NOFILE;
        negative: unlimited)."""
        if self.max_connections is not None:
            return self.max_connections
        if open_files_limit < 0:
            open_files_limit = UNLIMITED_OPEN_FILES
        return max(MIN_CONNECTIONS, (open_files_limit - FD_RESERVE) // 2)
