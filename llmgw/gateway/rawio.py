"""Socket reads and writes for the relay's hot path, without trio's per-call bookkeeping.

trio's SocketStream wraps every call in a conflict detector and an error translator, and after a
call that did not block it yields to the scheduler anyway ("always look like we blocked"). On a
stream that relays a token per read, that bookkeeping cost more than the read. Here a read or a
write goes straight to the non-blocking socket, and waits through trio only when the socket
would block, which is also where cancellation is delivered. A write yields afterwards (the peer's
answer is what comes next) unless it is one of a stream's chunks; a streak of calls that never
blocked yields once in a while, so one busy connection cannot starve the others or outlive a
cancel.
"""

from __future__ import annotations

import os

import trio

# Calls in a row that did not block before one yields to the scheduler.
MAX_STREAK = 16


class RawSocket:
    """A SocketStream's socket, read and written directly. Errors become BrokenResourceError, as
    from the stream itself; the stream stays the owner (closing it closes this)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._socket = stream.socket
        self._streak = 0

    async def receive(self, size: int) -> bytes:
        """Up to `size` bytes; b"" once the peer closed."""
        await self._pace()
        while True:
            try:
                return os.read(self._socket.fileno(), size)
            except BlockingIOError:
                self._streak = 0
                await trio.lowlevel.wait_readable(self._socket)
            except OSError as error:
                raise trio.BrokenResourceError(f"socket read failed: {error}") from error

    async def send_all(self, data: bytes, *, pause: bool = True) -> None:
        """Writes all of `data`. With `pause`, yields afterwards (see below); a stream's chunks
        are written without, since what follows them is the next chunk, not an answer."""
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                try:
                    sent += os.write(self._socket.fileno(), view[sent:])
                except BlockingIOError:
                    self._streak = 0
                    await trio.lowlevel.wait_writable(self._socket)
                except OSError as error:
                    raise trio.BrokenResourceError(f"socket write failed: {error}") from error
        if pause:
            # The peer gets to answer before this task reads again, so that read finds the
            # answer there instead of registering a wait for it. Only after a request: after each
            # streamed chunk the pause cost more than the wait it saved.
            self._streak = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._pace()

    async def _pace(self) -> None:
        self._streak += 1
        if self._streak >= MAX_STREAK:
            self._streak = 0
            await trio.lowlevel.checkpoint()
