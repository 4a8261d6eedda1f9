"""An h11 connection bound to a trio stream: the sans-IO state machine plus the socket it drives.

The gateway's listener uses it (role SERVER), and so do ctl bench and the tests' clients and fake
engines (role CLIENT or SERVER): ask h11 for the next event, read the socket only when it needs
data. The gateway's own connections to engines are :mod:`llmgw.gateway.engine_http`'s.
"""

from __future__ import annotations

import h11
import trio

from llmgw.gateway.rawio import RawSocket

# One receive per read; SSE chunks and request bodies are usually far smaller.
RECEIVE_SIZE = 64 * 1024


class H11Stream:
    def __init__(self, stream: trio.SocketStream, role: type) -> None:
        self.stream = stream
        self._raw = RawSocket(stream)
        self.conn = h11.Connection(role)

    async def send(self, *events: h11.Event, pause: bool = True) -> None:
        """Send `events` in one write: a head, its body and its end cost one syscall, not three.
        `pause=False` for a stream's chunks (see RawSocket.send_all)."""
        data = b"".join(self.conn.send(event) or b"" for event in events)
        if data:
            await self._raw.send_all(data, pause=pause)

    async def next_event(self) -> h11.Event:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            # b"" (the peer closed) becomes ConnectionClosed, or a RemoteProtocolError mid-message.
            data = await self._raw.receive(RECEIVE_SIZE)
            self.conn.receive_data(data)

    async def receive(self) -> None:
        """One read from the socket into the parser (b"": the peer closed), without parsing: for
        waiting on a kept-alive connection until the next request begins."""
        self.conn.receive_data(await self._raw.receive(RECEIVE_SIZE))

    def reusable(self) -> bool:
        """Whether both sides finished their message cleanly, so the connection can carry another."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)
