"""The node's cache of fetched weights: downloads, checksums, resumes, shares and removes them.

The rules (paths, resume decisions, eviction) are :mod:`llmgw.core.weights`; this is the I/O.

- ``<cache_dir>/<key>/<file>`` is a complete, verified copy: it only ever appears by a rename of
  the download once its sha256 matched, so an engine is never given half a file.
- ``<cache_dir>/<key>/.partial-<file>`` is a download in progress or interrupted (the agent died,
  the shard was stopped, the connection dropped): the next fetch continues it with an HTTP Range
  request, after hashing what is there.
- ``<cache_dir>/<key>/.last-used``: its mtime is when a shard last used the copy; the sweep removes
  a copy no running shard uses once that is ``max_idle`` ago.
- One fetch per key at a time (a lock per key): replicas of one model on this node wait for the
  same download and then share the copy.

HTTP is the standard library's urllib in a worker thread (a download is one long sequential read;
nothing else here needs an HTTP client), which checks for the shard's cancellation between chunks
and reports progress back to trio. Redirects are followed for http(s) only.

Who may read a copy: like stored adapters, the engines' user through its group (directory 0750,
file 0640, owned by root) when the agent switches user; 0700/0600 otherwise.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from llmgw import __version__
from llmgw.agent import runas
from llmgw.core import weights as rules
from llmgw.core.shard import ShardSpec

log = logging.getLogger(__name__)

LAST_USED = ".last-used"
# One read from the socket: large enough that a fast link is not syscall-bound, small enough that
# a stop is noticed at once and progress moves smoothly.
CHUNK = 1024 * 1024
# A server that sends nothing for this long is given up on for this attempt (then resumed).
READ_TIMEOUT = 60.0
# Attempts of one fetch, each resuming where the last stopped; then the shard fails.
MAX_ATTEMPTS = 5
# Between attempts: this, doubling.
RETRY_DELAY = 1.0
# The hub's metadata: for a file kept in LFS, the sha256 of its bytes (Hugging Face and its
# mirrors send it on resolve/ answers).
CHECKSUM_HEADERS = ("X-Linked-Etag", "ETag")


class FetchFailed(Exception):
    """The weights could not be fetched or did not match; the text is the shard's reason."""


class _Retry(Exception):
    """This attempt ended early (a dropped connection); the next one resumes."""


def http_opener() -> urllib.request.OpenerDirector:
    # Only what a weights download needs: no file:// or ftp:// (a redirect cannot lead there).
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(),
        urllib.request.HTTPDefaultErrorHandler(),
    ):
        opener.add_handler(handler)
    return opener


class WeightsCache:
    """The node's fetched weights. ``fetch`` and ``sweep`` run in trio; the rest is plain."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        work_dir: Path,
        mirror: str | None = None,
        max_idle: float = 7 * 24 * 3600.0,
        run_as: str | None = "llmgw-engine",
        clock: Callable[[], float] = time.time,
        retry_delay: float = RETRY_DELAY,
    ) -> None:
        self._retry_delay = retry_delay
        self.cache_dir = cache_dir
        self._work_dir = work_dir
        self._mirror = mirror
        self.max_idle = max_idle
        self._run_as = run_as
        self._clock = clock
        self._locks: dict[str, trio.Lock] = {}
        self._fetching: set[str] = set()
        # Requests sent, by key: what the tests count to see a copy shared and a download resumed.
        self.requests: dict[str, int] = {}

    # --- plain ---------------------------------------------------------------------------------

    def key(self, spec: ShardSpec) -> str | None:
        """The cache key of the shard's weights; None when they are not fetched."""
        if not rules.is_remote(spec.model_path):
            return None
        return rules.cache_key(spec.model_path, spec.model_sha256)

    def local_path(self, spec: ShardSpec) -> Path:
        """Where the shard's weights are once fetched (raises WeightsError)."""
        rules.source_url(spec.model_path, self._mirror)  # a hub reference needs the mirror
        return Path(rules.cached_path(self.cache_dir, spec.model_path, spec.model_sha256))

    # --- trio ----------------------------------------------------------------------------------

    async def fetch(self, spec: ShardSpec, on_progress: Callable[[str], None]) -> Path:
        """The shard's weights, downloaded and checked if not here yet; raises FetchFailed."""
        try:
            url = rules.source_url(spec.model_path, self._mirror)
            final = self.local_path(spec)
        except rules.WeightsError as exc:
            raise FetchFailed(f"weights: {exc}") from None
        key = final.parent.name
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:
            self._fetching.add(key)
            try:
                try:
                    user, _note = runas.resolve(self._run_as, self._work_dir)
                except runas.NoEngineUser as exc:
                    raise FetchFailed(f"weights: {exc}") from None
                return await trio.to_thread.run_sync(
                    self._fetch_blocking, url, final, spec.model_sha256, user, on_progress
                )
            finally:
                self._fetching.discard(key)

    async def sweep(self, in_use: Iterable[str]) -> list[str]:
        """Removes copies no running shard uses (``in_use``: their keys) and none used for
        max_idle; returns the keys removed."""
        busy = set(in_use) | self._fetching
        return await trio.to_thread.run_sync(self._sweep_blocking, busy)

    # --- blocking ------------------------------------------------------------------------------

    def _fetch_blocking(
        self,
        url: str,
        final: Path,
        sha256: str | None,
        user: runas.EngineUser,
        on_progress: Callable[[str], None],
    ) -> Path:
        entry = final.parent
        if final.is_file():
            _touch(entry / LAST_USED)
            return final
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Others may pass through to a copy by its path, not list what the node holds.
        os.chmod(self.cache_dir, 0o711)
        entry.mkdir(mode=0o700, exist_ok=True)
        _touch(entry / LAST_USED)
        partial = entry / (rules.PARTIAL_PREFIX + final.name)
        shown = rules.shown_url(url)
        metadata: str | None = None
        delay = self._retry_delay
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                metadata = self._attempt(url, partial, on_progress) or metadata
                break
            except _Retry as exc:
                if attempt == MAX_ATTEMPTS:
                    raise FetchFailed(
                        f"weights from {shown}: gave up after {MAX_ATTEMPTS} attempts ({exc})"
                    ) from None
                log.warning("weights from %s: attempt %d ended early (%s); resuming", shown, attempt, exc)
                _sleep_unless_cancelled(delay)
                delay *= 2
        digest = _sha256_of(partial)
        expected = sha256 or metadata
        if expected is None:
            shutil.rmtree(entry, ignore_errors=True)
            raise FetchFailed(
                f"weights from {shown}: no sha256 to check them against (set the model's sha256;"
                " the mirror sent none); nothing kept"
            )
        if digest != expected:
            # Keep nothing: a resumed download of wrong bytes would be wrong again.
            shutil.rmtree(entry, ignore_errors=True)
            whose = "the catalog's" if sha256 else "the mirror's"
            raise FetchFailed(
                f"weights from {shown}: sha256 {digest} does not match {whose} {expected}; nothing kept"
            )
        _place(partial, final, user)
        log.info("weights from %s: %d bytes, sha256 %s, at %s", shown, final.stat().st_size, digest, final)
        return final

    def _attempt(self, url: str, partial: Path, on_progress: Callable[[str], None]) -> str | None:
        """One request, appended to ``partial``; returns the mirror's checksum if it sent one."""
        have = partial.stat().st_size if partial.exists() else 0
        headers = {"User-Agent": f"llmgw/{__version__}", **rules.range_header(have)}
        request = urllib.request.Request(url, headers=headers)
        key = partial.parent.name
        self.requests[key] = self.requests.get(key, 0) + 1
        try:
            response = http_opener().open(request, timeout=READ_TIMEOUT)
        except urllib.error.HTTPError as exc:
            response = exc  # 416 and the like are answers to judge, not failures yet
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"cannot reach {rules.shown_url(url)}: {_why(exc)}") from None
        with response:
            length = response.headers.get("Content-Length")
            judgement = rules.judge_response(
                response.status,
                have,
                response.headers.get("Content-Range"),
                int(length) if length and length.isdigit() else None,
            )
            metadata = _mirror_checksum(response.headers)
            if judgement.action == rules.Resume.FAIL:
                raise FetchFailed(f"weights from {rules.shown_url(url)}: {judgement.reason}")
            if judgement.action == rules.Resume.COMPLETE:
                return metadata
            if judgement.action == rules.Resume.RESTART:
                have = 0
                if judgement.reason:
                    # The server did not continue where asked: start over with a plain request.
                    partial.unlink(missing_ok=True)
                    raise _Retry(judgement.reason)
            # The whole file's size: a 206's Content-Range says it, a 200's length is the whole.
            total = judgement.total
            self._stream(response, partial, have, total, on_progress)
            if total is not None and partial.stat().st_size < total:
                raise _Retry(f"the connection ended at {partial.stat().st_size} of {total} bytes")
            return metadata

    def _stream(self, response, partial: Path, have: int, total: int | None, on_progress) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if have else os.O_TRUNC)
        fd = os.open(partial, flags, 0o600)
        done, last_done, last_report = have, have, None
        try:
            while True:
                trio.from_thread.check_cancelled()
                try:
                    chunk = response.read(CHUNK)
                except (OSError, http.client.HTTPException) as exc:
                    raise _Retry(_why(exc)) from None
                if not chunk:
                    return
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
                done += len(chunk)
                now = time.monotonic()
                if rules.progress_due(last_report, now, done, total, last_done):
                    trio.from_thread.run_sync(on_progress, rules.progress_text(done, total))
                    last_report, last_done = now, done
        finally:
            os.close(fd)

    def _sweep_blocking(self, busy: set[str]) -> list[str]:
        if not self.cache_dir.is_dir():
            return []
        now = self._clock()
        entries = []
        for entry in self.cache_dir.iterdir():
            if not entry.is_dir() or entry.is_symlink():
                continue
            if entry.name in busy:
                _touch(entry / LAST_USED)  # in use now is used now
                continue
            try:
                used = (entry / LAST_USED).stat().st_mtime
            except FileNotFoundError:
                used = entry.stat().st_mtime
            entries.append(rules.CacheEntry(key=entry.name, last_used=used))
        removed = rules.to_evict(entries, busy, now, self.max_idle)
        for key in removed:
            log.info("weights %s: unused for %gs, removed", key, self.max_idle)
            shutil.rmtree(self.cache_dir / key, ignore_errors=True)
        return removed


def _mirror_checksum(headers) -> str | None:
    for name in CHECKSUM_HEADERS:
        value = (headers.get(name) or "").strip().removeprefix("W/").strip('"').lower()
        if rules.SHA256.fullmatch(value):
            return value
    return None


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _sleep_unless_cancelled(seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        trio.from_thread.check_cancelled()
        time.sleep(min(left, 0.2))


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            trio.from_thread.check_cancelled()
            digest.update(chunk)
    return digest.hexdigest()


def _touch(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    os.utime(path)


def _place(partial: Path, final: Path, user: runas.EngineUser) -> None:
    """The verified download becomes the copy: readable by the engines' user, renamed in place."""
    switch = user.switch and os.geteuid() == 0
    entry = final.parent
    if switch:
        os.chown(partial, 0, user.gid)
        os.chown(entry, 0, user.gid)
    os.chmod(partial, 0o640 if switch else 0o600)
    os.chmod(entry, 0o750 if switch else 0o700)
    os.rename(partial, final)
