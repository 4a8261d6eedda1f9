"""Relaying streamed answers without a trip through the scheduler per chunk.

An engine writes a token at a time. Relayed by the request's own task, every token cost a turn of
trio's scheduler: the task is woken, reads, writes, reads again to find the socket drained, and
registers its wait anew (trio's epoll registrations are one-shot, so that is a syscall too). Here
one task, the pump, relays every stream of the process. The engines' sockets sit in an epoll set
of the pump's own, registered once and level-triggered, and trio waits on that set's descriptor.
One wake-up drains every stream that has bytes, and a chunk costs a read, the usage scan and a
write; while chunks come thick and fast, a wake-up waits a moment for more (see LINGER).
Measured with scripts/bench_relay.py over the session's runs, CPU µs per chunk, a task per stream
against the pump: 64 streams fed a decode step at a time, 56-79 against 23-45; events that each
arrive alone, 46-83 against 45-77 (this VM's wake-ups are dear: a bare byte relay pays ~20).

The request's task keeps what is per request: it hands its stream over, waits for it to end or
to fall silent past the timeout, and tidies up whatever the outcome. All the pump does to a stream
is synchronous, so neither task ever sees a stream half-way through a step.

Linux only (epoll); elsewhere the relay keeps a task per stream (see `StreamPump.available`).
"""

from __future__ import annotations

import logging
import os
import select

import trio

from llmgw.gateway.engine_http import RECEIVE_SIZE, EngineConnection, EngineFailed
from llmgw.gateway.usage_scan import StreamUsage

log = logging.getLogger(__name__)

# Ready sockets taken per wake-up; more wait for the next turn, after the other tasks had theirs.
MAX_EVENTS = 256
# When a look finds several sockets ready, chunks are coming faster than the pump wakes for them:
# the next wake waits this long before it looks, so that what comes meanwhile leaves together, a
# read and a write for several chunks of a stream. It stops as soon as a look finds a single socket
# ready, so sparse streams rarely pay for it; it delays a token by at most this. It pays most
# when an engine sends back to back, and was not seen to cost when tokens arrive apart
# (scripts/bench_relay.py measures both paces).
LINGER = 0.0002


class EngineBroke(Exception):
    """The engine failed mid-answer: closed early, or sent what is not HTTP."""


class ClientGone(Exception):
    """The client connection failed under a write: nobody is left to relay to."""


class PumpedStream:
    """One streamed answer: an engine's SSE body passed on to a client, event by event.

    `head` is the client's response head, already framed; it leaves with the first body bytes.
    `chunked` says how the body is framed to the client: chunks for HTTP/1.1, bare bytes up to the
    close for HTTP/1.0 (what the head announced).
    """

    def __init__(
        self, engine: EngineConnection, client: int, events: StreamUsage, *, head: bytes, chunked: bool
    ) -> None:
        self.engine = engine
        self.engine_fd = engine.fileno()
        self.client = client  # the client socket's descriptor
        self.events = events
        self.chunked = chunked
        self._out = head  # framed bytes the client's socket has not taken yet
        self.last_read = trio.current_time()
        self.first_byte: float | None = None  # when the first body bytes were handed to the client
        self.ended = False  # the engine's answer is complete
        self.failure: Exception | None = None  # EngineBroke or ClientGone, once finished
        self.done = trio.Event()
        self.watching_client: bool | None = None  # which socket the pump watches (None: neither yet)

    @property
    def blocked(self) -> bool:
        """Whether bytes wait for the client's socket to have room."""
        return bool(self._out)

    def take(self, now: float) -> None:
        """Passes on whatever the engine's connection has parsed (its answer may have come in whole
        with the head), then writes as much as the client takes."""
        self._pass_on(self.engine.take_body(), now)
        self.flush()

    def read(self, now: float) -> None:
        """One read from the engine (its socket is readable), passed on to the client."""
        try:
            data = os.read(self.engine_fd, RECEIVE_SIZE)
        except BlockingIOError:
            return
        except OSError as error:
            raise EngineBroke(f"engine read failed: {error}") from error
        self.last_read = now
        try:
            self.engine.feed(data)
        except EngineFailed as error:
            raise EngineBroke(str(error)) from error
        self.take(now)

    def flush(self) -> None:
        """Writes what is pending until done or the client's socket is full."""
        while self._out:
            try:
                sent = os.write(self.client, self._out)
            except BlockingIOError:
                return
            except OSError as error:
                raise ClientGone(f"client write failed: {error}") from error
            self._out = self._out[sent:]

    def _pass_on(self, body: bytes, now: float) -> None:
        data = self.events.feed(body) if body else b""
        if self.engine.complete:
            self.ended = True
            data += self.events.flush()
        if data:
            if self.first_byte is None:
                self.first_byte = now
            self._out += b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data


class StreamPump:
    """Relays the attached streams, one task for all of them. `run` it in a nursery that outlives
    the requests; a stream is `attach`ed by its request's task, which then waits on its `done`
    event and `detach`es it, whatever happened, before closing either socket."""

    def __init__(self, *, linger: float = LINGER) -> None:
        self.linger = linger
        self._epoll = select.epoll()
        # Registered descriptor → its stream: an engine's socket, and its client's while it is full.
        self._streams: dict[int, PumpedStream] = {}
        self._stopped = False

    @staticmethod
    def available() -> bool:
        return hasattr(select, "epoll")

    def attach(self, stream: PumpedStream) -> None:
        """Takes `stream` on: passes on what is already parsed, and watches whichever socket comes
        next. It may finish here (the whole answer came with its head)."""
        if self._stopped:  # a request that got this far as the gateway stops
            self._finish(stream, EngineBroke("the gateway is stopping"))
            return
        self._advance(stream, None, trio.current_time())

    def detach(self, stream: PumpedStream) -> None:
        """Forgets `stream` (done or not): the pump will not touch its sockets again."""
        for fd in (stream.engine_fd, stream.client):
            if self._streams.get(fd) is stream:
                del self._streams[fd]
                self._epoll.unregister(fd)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            task_status.started()
            busy = False
            while True:
                await trio.lowlevel.wait_readable(self._epoll)
                if busy and self.linger:
                    await trio.sleep(self.linger)
                ready = self._epoll.poll(0, MAX_EVENTS)
                busy = len(ready) > 1
                now = trio.current_time()
                for fd, _ in ready:
                    stream = self._streams.get(fd)
                    if stream is not None:  # else detached earlier in this batch
                        self._advance(stream, fd, now)
        finally:
            self._stopped = True
            for stream in set(self._streams.values()):
                self._finish(stream, EngineBroke("the gateway is stopping"))
            self._epoll.close()

    def _advance(self, stream: PumpedStream, ready: int | None, now: float) -> None:
        """One step of `stream` (`ready`: the socket that woke it; None when just attached), then
        watches what it waits for next: the client's socket while that is full (the engine waits
        meanwhile: backpressure), else the engine's."""
        try:
            if ready is None:
                stream.take(now)
            elif ready == stream.client:
                stream.flush()
            else:
                stream.read(now)
        except (EngineBroke, ClientGone) as error:
            self._finish(stream, error)
            return
        except Exception as error:  # a bug: it ends this stream, not the pump and every other one
            log.exception("relaying a stream failed")
            self._finish(stream, EngineBroke(f"the relay failed: {error!r}"))
            return
        if stream.ended and not stream.blocked:
            self._finish(stream, None)
        else:
            self._watch(stream, client=stream.blocked)

    def _watch(self, stream: PumpedStream, *, client: bool) -> None:
        """Level-triggered registrations change only when a stream turns from one socket to the
        other, not per chunk. A descriptor is in `_streams` exactly while it is registered."""
        if stream.watching_client is client:
            return
        engine = stream.engine_fd
        if stream.watching_client is None:
            self._streams[engine] = stream
            self._epoll.register(engine, 0 if client else select.EPOLLIN)
        else:
            self._epoll.modify(engine, 0 if client else select.EPOLLIN)
        if client:
            self._streams[stream.client] = stream
            self._epoll.register(stream.client, select.EPOLLOUT)
        elif stream.watching_client:
            del self._streams[stream.client]
            self._epoll.unregister(stream.client)
        stream.watching_client = client

    def _finish(self, stream: PumpedStream, failure: Exception | None) -> None:
        self.detach(stream)
        stream.failure = failure
        stream.done.set()
