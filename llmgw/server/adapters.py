"""Delivering stored adapters to nodes, before a shard that serves one starts there.

A profile may name an adapter the server keeps (``source``); its engine loads it at start, from
files on its node. Before the StartShard, the replica manager has the node get them:

1. PutAdapter (the manifest: each file's name, size and sha256). The agent answers "present"
   and where its copy is when it holds exactly those files (then nothing else is sent), or "send".
2. AdapterPiece messages, each file in order, cut as a job's upload is
   (:mod:`llmgw.wire.pieces`); the link's flow control paces them to the agent's disk.
3. AdapterDone, answered ok (with where the copy is) only once every file verified and the copy
   is in place.

All three on one session: pieces sent on a newer link would continue nothing there, so a link
that ends midway fails the delivery (and with it the start, which the reconciler retries).
Deliveries of one adapter to one node are serialized: the second finds it present.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import trio

from llmgw.core.training import FileDigest
from llmgw.server.nodes import Session
from llmgw.wire.h2link import LinkClosed
from llmgw.wire.messages import AdapterDone, AdapterPiece, CommandResult, PutAdapter
from llmgw.wire.pieces import iter_pieces

log = logging.getLogger(__name__)

# PutAdapter is answered after a few stats; AdapterDone after a rename (the pieces were written
# as they came). One not answered in this long is stuck.
COMMAND_TIMEOUT = 30.0
# The slowest transfer still taken for progress: a delivery of N bytes may take this long plus
# N at this rate before it is abandoned (heartbeats keep a link up whose stream is stalled).
BASE_TIMEOUT = 60.0
MIN_BYTES_PER_SECOND = 4 * 1024 * 1024


class DeliveryFailed(Exception):
    """The node did not get the adapter; the message says why."""


def delivery_timeout(files: tuple[FileDigest, ...]) -> float:
    return BASE_TIMEOUT + sum(f.size for f in files) / MIN_BYTES_PER_SECOND


class AdapterDelivery:
    """Sends stored adapters' files to nodes. ``session_of`` gives a node's live link (None when
    it has none); ``file_of`` the path of one of a stored adapter's files on the server."""

    def __init__(
        self,
        session_of: Callable[[str], Session | None],
        file_of: Callable[[str, str], Path],
    ) -> None:
        self._session_of = session_of
        self._file_of = file_of
        self._locks: dict[tuple[str, str], trio.Lock] = {}
        self.sent = 0  # deliveries that sent files (not "present"): tests, logs

    async def ensure(self, node: str, name: str, files: tuple[FileDigest, ...]) -> str:
        """Returns once ``node`` holds stored adapter ``name``'s ``files``: the copy's directory
        on the node ('' from an agent that does not say); raises DeliveryFailed. Bound it with
        the caller's deadline (see :func:`delivery_timeout`)."""
        key = (node, name)
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                return await self._deliver(node, name, files)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(key, None)

    async def _deliver(self, node: str, name: str, files: tuple[FileDigest, ...]) -> str:
        session = self._session_of(node)
        if session is None:
            raise DeliveryFailed(f"adapter {name}: node {node} is not connected")
        try:
            reply = await _command(session, node, PutAdapter(id=0, name=name, files=files))
            word, _, where = reply.partition(" ")
            if word == "present":
                return where
            log.info(
                "adapter %s: sending %s to node %s",
                name,
                ", ".join(f"{f.name} ({f.size} B)" for f in files),
                node,
            )
            for digest in files:
                await self._send_file(session, name, digest)
            where = await _command(session, node, AdapterDone(id=0, name=name))
        except LinkClosed as e:
            raise DeliveryFailed(
                f"adapter {name}: the link to node {node} ended during delivery: {e}"
            ) from None
        self.sent += 1
        log.info("adapter %s: node %s holds it", name, node)
        return where

    async def _send_file(self, session: Session, name: str, digest: FileDigest) -> None:
        path = self._file_of(name, digest.name)
        try:
            fileobj = await trio.to_thread.run_sync(open, path, "rb")
        except OSError as e:
            raise DeliveryFailed(
                f"adapter {name}: the server cannot read {path}: {e.strerror or e}"
            ) from None
        try:
            size = os.fstat(fileobj.fileno()).st_size
            if size != digest.size:
                # Caught here rather than by the agent: the stored copy itself is damaged.
                raise DeliveryFailed(
                    f"adapter {name}: the server's {path} is {size} bytes, the store says {digest.size}"
                )
            pieces = iter_pieces(name, digest.name, fileobj)
            while (piece := await trio.to_thread.run_sync(next, pieces, None)) is not None:
                await session.send(
                    AdapterPiece(
                        name=name,
                        file=piece.file,
                        index=piece.index,
                        count=piece.count,
                        data=piece.data,
                        sha256=piece.sha256,
                    )
                )
        finally:
            fileobj.close()


async def _command(session: Session, node: str, command: PutAdapter | AdapterDone) -> str:
    """The agent's answer to ``command`` when ok; raises DeliveryFailed with its reason."""
    what = f"adapter {command.name}: node {node}"
    try:
        with trio.fail_after(COMMAND_TIMEOUT):
            reply = await session.call(command)
    except trio.TooSlowError:
        raise DeliveryFailed(
            f"{what} did not answer {type(command).__name__} within {COMMAND_TIMEOUT:g} s"
        ) from None
    if not isinstance(reply, CommandResult):
        raise DeliveryFailed(f"{what} answered {type(command).__name__} with a {type(reply).__name__}")
    if not reply.ok:
        raise DeliveryFailed(f"{what} refused it: {reply.message}")
    return reply.message
