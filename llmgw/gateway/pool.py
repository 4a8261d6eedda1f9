"""Keep-alive connections to one upstream engine.

Idle connections are bounded: past the bound a finished connection is closed rather than kept, so
a burst does not leave hundreds of sockets open on the engine. A connection is only put back when
both sides ended their message cleanly; anything that failed, or was cut short, is closed.
"""

from __future__ import annotations

import select

import trio

from llmgw.gateway.engine_http import EngineConnection

MAX_IDLE_PER_UPSTREAM = 64


class UpstreamPool:
    def __init__(self, host: str, port: int, *, max_idle: int = MAX_IDLE_PER_UPSTREAM) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self._idle: list[EngineConnection] = []
        self.opened = 0  # connections made, for tests and benchmarks to see reuse

    async def acquire(self) -> EngineConnection:
        """An idle connection, or a new one; a failed connect raises OSError."""
        while self._idle:
            # Last in, first out: the most recently used connection is the least likely to have
            # hit the engine's idle timeout.
            connection = self._idle.pop()
            if _quiet(connection):
                return connection
            await connection.aclose()
        return await self.connect()

    async def connect(self) -> EngineConnection:
        """A new connection (OSError if the engine cannot be reached)."""
        stream = await trio.open_tcp_stream(self.host, self.port)
        self.opened += 1
        return EngineConnection(stream)

    async def release(self, connection: EngineConnection) -> None:
        if connection.reusable() and len(self._idle) < self.max_idle:
            connection.next_cycle()
            self._idle.append(connection)
        else:
            await connection.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.aclose()


def _quiet(connection: EngineConnection) -> bool:
    """Whether an idle connection has nothing to read. An engine says nothing on an idle
    connection unless it closed it, and a request sent on a closed one would fail after it may
    have reached the engine, where it cannot be retried; so a readable one is dropped instead."""
    readable, _, _ = select.select([connection.stream.socket.fileno()], [], [], 0)
    return not readable
