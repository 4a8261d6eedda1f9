"""One HTTP/2 connection carrying one long-lived, full-duplex stream of link messages.

Both ends use this class: the agent as the client (it opens the stream with a POST), the server as
the listener (it answers the POST with 200 and keeps the stream open). Messages then flow both
ways as DATA frames on that one stream, framed as newline-delimited JSON (:mod:`.codec`).

Three rules shape the code; each was a bug in the spike that preceded it:

- The read loop never blocks on anything but the socket. It only feeds bytes to ``h2`` and parks
  decoded messages in the inbox. Flow-control credit for a message is returned when the
  *consumer* takes it from the inbox, so a slow consumer slows the peer down through HTTP/2
  instead of growing our memory: the inbox is bounded by the stream window.
- Only the writer task touches the socket's send side. Everything else mutates the ``h2`` state
  machine (synchronous, so atomic between checkpoints in trio) and kicks the writer. A peer that
  stops reading can then stall our writer, but never our reader.
- One send lock per stream, so that a message split across flow-control windows is never
  interleaved with another one.

Errors of one connection end that connection: ``run`` returns after recording why, and every
waiter sees :class:`LinkClosed`. Nothing propagates to the listener that accepted it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from llmgw.wire.codec import FramingError, LineDecoder, encode
from llmgw.wire.messages import Message

log = logging.getLogger(__name__)

LINK_PATH = "/llmgw/link/v1"
READ_SIZE = 64 * 1024
# The per-stream receive window we advertise. Bounds how many unread bytes a peer can park in our
# inbox; large enough that a burst of status reports does not stall on WINDOW_UPDATE round trips.
STREAM_WINDOW = 1024 * 1024
# A refusal body (401 JSON) is small; never buffer more than this from a non-200 answer.
MAX_REFUSAL_BODY = 16 * 1024
# How long a polite close waits for its last frames to leave before dropping the socket.
CLOSE_GRACE = 1.0


class LinkClosed(Exception):
    """The link ended; ``str()`` says why."""


class LinkRefused(Exception):
    """The server answered the link request with an error status (e.g. a wrong join token)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Signal:
    """Wakes every waiter; waiters re-check their condition in a loop (no lost wake-ups in trio,
    because checking and parking happen without a checkpoint in between)."""

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()

    def fire(self) -> None:
        self._lot.unpark_all()

    async def wait(self) -> None:
        await self._lot.park()


class H2Link:
    def __init__(self, transport: trio.abc.Stream, *, client_side: bool, peer: str = "") -> None:
        self.peer = peer
        self._transport = transport
        self._conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=client_side, header_encoding="utf-8")
        )
        self._stream_id: int | None = None  # the one message stream, once opened/accepted
        self._request: tuple[int, dict[str, str]] | None = None  # server: the request headers
        self._response: tuple[int, dict[str, str]] | None = None  # client: the answer headers
        self._refusal_body = bytearray()
        self._decoder = LineDecoder()
        self._partial_credited = 0  # credit already returned for the unfinished line
        # Server: what the peer sent before its link request was accepted (the join token checked)
        # stays bytes, undecoded and uncredited — the stream's window bounds it — until then.
        self._accepted = client_side
        self._early = bytearray()
        self._inbox: collections.deque[tuple[Message, int]] = collections.deque()
        self._stream_ended = False
        self._closed_reason: str | None = None
        self._changed = _Signal()  # inbox, stream state, windows or closure changed
        self._kick_writer = trio.Event()
        self._send_lock = trio.Lock()
        self._writer_busy = False
        self._writer_running = False
        self.last_heard = trio.current_time()  # trio clock: when bytes last arrived

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def closed_reason(self) -> str:
        return self._closed_reason or ""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reads and writes until the connection ends. Never raises for the connection's own
        errors (they are recorded as the closed reason); only cancellation propagates."""
        self._conn.initiate_connection()
        self._conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW})
        self._conn.increment_flow_control_window(STREAM_WINDOW)
        self._kick()
        try:
            async with trio.open_nursery() as nursery:

                async def until_error(loop) -> None:
                    # Errors are caught here, inside each task, so that the nursery never wraps
                    # them in an ExceptionGroup; either loop ending ends the other one.
                    try:
                        await loop()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        self._close(f"connection error: {_describe(exc)}")
                    except (h2.exceptions.ProtocolError, FramingError) as exc:
                        self._close(f"protocol error: {exc}")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_error, self._write_loop)
                task_status.started()
                await until_error(self._read_loop)
        finally:
            self._close("connection closed")
            with trio.CancelScope(shield=True):
                await self._transport.aclose()

    async def aclose(self, reason: str = "closed") -> None:
        """Ends the stream and the connection politely (bounded wait), then drops the socket."""
        if self.closed:
            return
        try:
            if self._stream_id is not None and not self._stream_ended:
                self._conn.end_stream(self._stream_id)
            self._conn.close_connection()
            self._kick()
        except h2.exceptions.ProtocolError:
            pass
        with trio.move_on_after(CLOSE_GRACE):
            if self._writer_running:
                while self._writer_busy or self._kick_writer.is_set():
                    await self._changed.wait()
            else:
                # The writer is gone (its nursery was cancelled): the socket is ours to use.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await self._transport.send_all(self._conn.data_to_send())
        self._close(reason)
        await self._transport.aclose()

    async def close_when_silent(self, window: float) -> None:
        """Closes the link once nothing has arrived for ``window`` seconds: the peer died without
        closing its socket (power loss, a cable, a half-open connection)."""
        while (deadline := self.last_heard + window) >= trio.current_time():  # noqa: ASYNC110 (moving deadline)
            await trio.sleep_until(deadline + 0.001)
        await self.aclose(f"nothing heard for {window:.1f}s")

    def _close(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        self._changed.fire()

    # --- opening the message stream ------------------------------------------------------------

    async def open_stream(self, headers: dict[str, str], *, authority: str, scheme: str = "http") -> None:
        """Client: POST the link path and wait for the answer. Raises LinkRefused on non-200."""
        stream_id = self._conn.get_next_available_stream_id()
        request = [
            (":method", "POST"),
            (":scheme", scheme),
            (":authority", authority),
            (":path", LINK_PATH),
            ("content-type", "application/x-ndjson"),
            *headers.items(),
        ]
        self._conn.send_headers(stream_id, request)
        self._stream_id = stream_id
        self._kick()
        while self._response is None:
            self._check_open()
            await self._changed.wait()
        status, _ = self._response
        if status != 200:
            while not self._stream_ended and not self.closed:
                await self._changed.wait()
            raise LinkRefused(status, _refusal_message(status, bytes(self._refusal_body)))

    async def accept_stream(self) -> dict[str, str]:
        """Server: wait for the link request and return its headers (answer with ``respond``)."""
        while self._request is None:
            self._check_open()
            await self._changed.wait()
        return self._request[1]

    async def respond(self, status: int, error: str | None = None) -> None:
        """Server: 200 keeps the stream open for messages; anything else ends it with an
        OpenAI-style JSON error body and closes the connection."""
        assert self._request is not None
        stream_id = self._request[0]
        if status == 200:
            self._conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/x-ndjson")])
            self._accepted = True
            early, self._early = bytes(self._early), bytearray()
            try:
                self._take(stream_id, early)
            except FramingError as exc:
                self._close(f"protocol error: {exc}")
            self._kick()
            self._changed.fire()
            return
        body = json.dumps({"error": {"message": error or "refused", "code": status}}).encode()
        self._conn.send_headers(stream_id, [(":status", str(status)), ("content-type", "application/json")])
        self._conn.send_data(stream_id, body, end_stream=True)
        self._stream_ended = True
        await self.aclose(error or f"refused with {status}")

    # --- messages ------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        data = encode(message)
        async with self._send_lock:
            view = memoryview(data)
            while view:
                self._check_open()
                assert self._stream_id is not None
                window = min(
                    self._conn.local_flow_control_window(self._stream_id), self._conn.max_outbound_frame_size
                )
                if window <= 0:
                    await self._changed.wait()
                    continue
                chunk, view = view[:window], view[window:]
                try:
                    self._conn.send_data(self._stream_id, bytes(chunk))
                except h2.exceptions.ProtocolError as exc:
                    # The connection or stream ended under us (GOAWAY, reset) before we noticed.
                    self._close(f"cannot send: {exc}")
                    raise LinkClosed(self.closed_reason) from None
                self._kick()

    async def receive(self) -> Message:
        """The next message; raises LinkClosed once the peer ended the stream or the link broke."""
        while not self._inbox:
            if self._stream_ended:
                raise LinkClosed("the peer ended the stream")
            self._check_open()
            await self._changed.wait()
        message, size = self._inbox.popleft()
        # Return the credit now that the consumer has the message (see the module docstring).
        if size and self._stream_id is not None and not self.closed:
            try:
                self._conn.acknowledge_received_data(size, self._stream_id)
                self._kick()
            except h2.exceptions.StreamClosedError:
                pass
        return message

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise LinkClosed(self._closed_reason)

    # --- the two loops -------------------------------------------------------------------------

    def _kick(self) -> None:
        self._kick_writer.set()

    async def _write_loop(self) -> None:
        self._writer_running = True
        try:
            await self._write_forever()
        finally:
            self._writer_running = False

    async def _write_forever(self) -> None:
        while True:
            await self._kick_writer.wait()
            # A new event first: a kick that arrives while we send is seen on the next turn.
            self._kick_writer = trio.Event()
            data = self._conn.data_to_send()
            if data:
                self._writer_busy = True
                try:
                    await self._transport.send_all(data)
                finally:
                    self._writer_busy = False
                    self._changed.fire()

    async def _read_loop(self) -> None:
        while True:
            data = await self._transport.receive_some(READ_SIZE)
            if not data:
                self._close("the peer closed the connection")
                return
            self.last_heard = trio.current_time()
            for event in self._conn.receive_data(data):
                self._on_event(event)
            self._kick()
            self._changed.fire()
            if self.closed:
                return

    def _on_event(self, event: h2.events.Event) -> None:
        match event:
            case h2.events.RequestReceived(stream_id=sid, headers=headers):
                if self._request is None:
                    self._request = (sid, dict(headers))
                    self._stream_id = sid
                else:
                    # One stream per connection: a second one is a confused or hostile peer.
                    self._conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            case h2.events.ResponseReceived(stream_id=sid, headers=headers) if sid == self._stream_id:
                fields = dict(headers)
                self._response = (int(fields.get(":status", "0")), fields)
            case h2.events.DataReceived(stream_id=sid, data=data, flow_controlled_length=length):
                self._on_data(sid, data, length)
            case h2.events.StreamEnded(stream_id=sid) if sid == self._stream_id:
                self._stream_ended = True
            case h2.events.StreamReset(stream_id=sid) if sid == self._stream_id:
                self._close("the peer reset the stream")
            case h2.events.ConnectionTerminated(additional_data=extra):
                detail = f": {extra.decode(errors='replace')}" if extra else ""
                self._close(f"the peer ended the connection{detail}")

    def _on_data(self, stream_id: int, data: bytes, flow_controlled_length: int) -> None:
        padding = flow_controlled_length - len(data)
        if stream_id != self._stream_id or (self._response is not None and self._response[0] != 200):
            # A refusal body (client side) or data on a stream we do not use: take it, credit it.
            if len(self._refusal_body) < MAX_REFUSAL_BODY:
                self._refusal_body += data[: MAX_REFUSAL_BODY - len(self._refusal_body)]
            self._conn.acknowledge_received_data(flow_controlled_length, stream_id)
            return
        if padding:
            self._conn.acknowledge_received_data(padding, stream_id)
        if not self._accepted:
            self._early += data
            return
        self._take(stream_id, data)

    def _take(self, stream_id: int, data: bytes) -> None:
        """Decodes the stream's bytes into the inbox, crediting what the consumer need not wait for."""
        credit_now = 0
        for message, size in self._decoder.feed_sized(data):
            # Part of this line may have been credited while it was still arriving.
            owed, self._partial_credited = size - self._partial_credited, 0
            if message is None:  # a blank line: nothing for the consumer
                credit_now += owed
            else:
                self._inbox.append((message, owed))
        # Bytes of a message still arriving are credited at once: a message larger than the
        # window could never finish otherwise. The decoder bounds them (MAX_MESSAGE_BYTES).
        credit_now += self._decoder.buffered - self._partial_credited
        self._partial_credited = self._decoder.buffered
        if credit_now:
            self._conn.acknowledge_received_data(credit_now, stream_id)


def _describe(exc: BaseException) -> str:
    """The first non-empty message down an exception's causes: trio wraps a TLS failure such as
    CERTIFICATE_VERIFY_FAILED in a BrokenResourceError whose own message is empty."""
    seen: BaseException | None = exc
    while seen is not None:
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def _refusal_message(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").strip() or f"HTTP {status}"


__all__ = ["H2Link", "LINK_PATH", "LinkClosed", "LinkRefused"]
