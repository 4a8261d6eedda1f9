"""Weights a node fetches itself: where they come from, where they live, when they go.

A model's ``path`` in the catalog is either weights already on the node, an ``http(s)://`` URL,
or a hub reference ``hf://<org>/<repo>[@<revision>]/<file>`` resolved against the mirror endpoint
the agent is configured with (``weights.mirror``; the layout is the Hugging Face hub's,
``<mirror>/<org>/<repo>/resolve/<revision>/<file>``, which hub mirrors serve too). A fetched
model is one file (a .gguf): a directory of shards would need the mirror's listing API.

The rules here are pure: the shell (:mod:`llmgw.agent.weights`) downloads, hashes and removes.

- Cache layout: ``<cache_dir>/<key>/<file>``; the key is the sha256 the catalog names, so one copy
  serves every replica of every profile that names the same bytes, and the path an engine is given
  is known before the download starts. Without a catalog sha256 (a hub reference, checked against
  the mirror's own metadata) the key is derived from the URL.
- Resume: a partial download continues with ``Range: bytes=<have>-``; :func:`judge_response` says
  what a server's answer means for the bytes already on disk.
- Eviction: :func:`to_evict` picks the entries no running shard uses and that have not been used
  for ``max_idle`` seconds.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable
from pathlib import PurePath
from urllib.parse import unquote, urlsplit, urlunsplit

import attrs

HUB_SCHEME = "hf://"
URL_SCHEMES = ("http://", "https://")
DEFAULT_REVISION = "main"
SHA256 = re.compile(r"[0-9a-f]{64}")
# A URL-derived key is marked so that it can never be taken for a checksum-named one.
URL_KEY_PREFIX = "url-"
URL_KEY_DIGITS = 32
PARTIAL_PREFIX = ".partial-"
_HUB = re.compile(r"(?P<org>[A-Za-z0-9][\w.-]*)/(?P<repo>[\w.-]+)(?:@(?P<rev>[\w./-]+?))?/(?P<file>.+)")
_CONTENT_RANGE = re.compile(r"bytes (?:(?P<start>\d+)-(?P<end>\d+)|\*)/(?P<total>\d+|\*)")


class WeightsError(ValueError):
    """A model path that cannot be fetched; the text names the path and what is wrong."""


def is_remote(path: str) -> bool:
    """Whether ``path`` names weights the node has to fetch (a URL or a hub reference)."""
    return path.startswith((*URL_SCHEMES, HUB_SCHEME))


def sha256_problem(value: str | None) -> str | None:
    """Why ``value`` cannot be a model's sha256; None when it can (or is unset)."""
    if value is None or SHA256.fullmatch(value):
        return None
    return f"expected 64 lowercase hex digits (sha256sum's output), got {value!r}"


def path_problem(path: str, sha256: str | None) -> str | None:
    """Why a remote ``path`` cannot be fetched as the catalog states it; None when it can.

    A URL needs the catalog's sha256: the node must be able to tell the bytes it got are the
    ones meant. A hub reference may leave it to the mirror's metadata.
    """
    if not is_remote(path):
        return None
    try:
        file_name(path)
        if path.startswith(HUB_SCHEME):
            source_url(path, "mirror")  # the reference's shape; the mirror is the node's
    except WeightsError as exc:
        return str(exc)
    if path.startswith(URL_SCHEMES) and sha256 is None:
        return f"a URL ({shown_url(path)}) needs sha256: the node checks what it downloads"
    return None


def source_url(path: str, mirror: str | None) -> str:
    """The URL to download ``path`` from (a URL is its own source)."""
    if path.startswith(URL_SCHEMES):
        return path
    if not path.startswith(HUB_SCHEME):
        raise WeightsError(f"{path!r} is not a URL or a hub reference")
    match = _HUB.fullmatch(path.removeprefix(HUB_SCHEME))
    if match is None:
        raise WeightsError(f"{path!r}: expected {HUB_SCHEME}<org>/<repo>[@<revision>]/<file>")
    if not mirror:
        raise WeightsError(f"{path!r} is a hub reference, and this node has no weights.mirror set")
    revision = match["rev"] or DEFAULT_REVISION
    return f"{mirror.rstrip('/')}/{match['org']}/{match['repo']}/resolve/{revision}/{match['file']}"


def file_name(path: str) -> str:
    """The file's name in the cache: the last part of the URL's path, which must be a plain name."""
    if path.startswith(HUB_SCHEME):
        last = path.rsplit("/", 1)[-1]
    else:
        last = unquote(urlsplit(path).path.rsplit("/", 1)[-1])
    if not last or last in (".", "..") or "/" in last or "\0" in last or last.startswith(PARTIAL_PREFIX):
        raise WeightsError(f"{shown_url(path)}: the URL does not end in a file name")
    return last


def cache_key(path: str, sha256: str | None) -> str:
    """The cache entry's directory name: the checksum, else a digest of the path."""
    if sha256 is not None:
        return sha256
    return URL_KEY_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:URL_KEY_DIGITS]


def cached_path(cache_dir: PurePath, path: str, sha256: str | None) -> PurePath:
    """Where the complete file of ``path`` lives on the node: what the engine is given."""
    return cache_dir / cache_key(path, sha256) / file_name(path)


def partial_path(cache_dir: PurePath, path: str, sha256: str | None) -> PurePath:
    """Where its download in progress lives, beside it: never a name an engine is given."""
    return cache_dir / cache_key(path, sha256) / (PARTIAL_PREFIX + file_name(path))


def shown_url(url: str) -> str:
    """``url`` fit for a log line or a reason: no user:password, no query (tokens ride there)."""
    if not url.startswith(URL_SCHEMES):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def range_header(have: int) -> dict[str, str]:
    """The request headers that ask for the rest of a download of which ``have`` bytes are kept."""
    return {"Range": f"bytes={have}-"} if have > 0 else {}


class Resume(enum.StrEnum):
    APPEND = "append"  # the answer continues the bytes on disk
    RESTART = "restart"  # the answer is the whole file: drop what is on disk, keep the body
    COMPLETE = "complete"  # the server says the bytes on disk are the whole file
    FAIL = "fail"


@attrs.frozen
class Judgement:
    action: Resume
    total: int | None = None  # the whole file's size, when the answer says
    reason: str = ""


def judge_response(status: int, have: int, content_range: str | None, length: int | None) -> Judgement:
    """What an answer to a request made with :func:`range_header` (``have`` bytes on disk) means.

    ``length`` is the answer's Content-Length, ``content_range`` its Content-Range header.
    """
    if status == 200:
        return Judgement(Resume.RESTART, total=length)
    match = _CONTENT_RANGE.fullmatch(content_range.strip()) if content_range else None
    total = int(match["total"]) if match and match["total"] != "*" else None
    if status == 206:
        if match is None or match["start"] is None:
            return Judgement(Resume.FAIL, reason=f"206 with an unreadable Content-Range {content_range!r}")
        if int(match["start"]) != have:
            # Not where we asked: these bytes cannot be appended; start over with a plain request.
            return Judgement(Resume.RESTART, total=None, reason=f"asked from {have}, got {content_range}")
        return Judgement(Resume.APPEND, total=total)
    if status == 416 and have > 0:
        # Past the end: the partial is the whole file if the sizes agree, else not this file at all.
        if total == have:
            return Judgement(Resume.COMPLETE, total=total)
        return Judgement(Resume.RESTART, total=total, reason=f"{have} bytes kept, the file has {total}")
    return Judgement(Resume.FAIL, reason=f"HTTP {status}")


@attrs.frozen
class CacheEntry:
    key: str
    last_used: float  # wall-clock seconds
    size: int = 0


def to_evict(entries: Iterable[CacheEntry], in_use: Iterable[str], now: float, max_idle: float) -> list[str]:
    """The keys of entries no running shard uses and none has used for ``max_idle`` seconds,
    oldest first."""
    busy = set(in_use)
    idle = [e for e in entries if e.key not in busy and now - e.last_used >= max_idle]
    return [e.key for e in sorted(idle, key=lambda e: (e.last_used, e.key))]


# Progress is reported at most this often, and at every whole percent at most: a 100 GB download
# must not flood the link with a status per chunk.
PROGRESS_INTERVAL = 1.0


def progress_due(last_report: float | None, now: float, done: int, total: int | None, last_done: int) -> bool:
    """Whether a progress report is due (``last_report`` None: none was sent yet)."""
    if last_report is None:
        return True
    if now - last_report < PROGRESS_INTERVAL:
        return False
    if total:
        return done * 100 // total != last_done * 100 // total
    return done != last_done


MIB = 1024 * 1024


def progress_text(done: int, total: int | None) -> str:
    """``fetching weights: 47.1 of 98.2 MiB (48%)``: what ctl replicas shows while Starting."""
    if total:
        return f"fetching weights: {done / MIB:.1f} of {total / MIB:.1f} MiB ({done * 100 // total}%)"
    return f"fetching weights: {done / MIB:.1f} MiB"


__all__ = [
    "CacheEntry",
    "Judgement",
    "Resume",
    "WeightsError",
    "cache_key",
    "cached_path",
    "file_name",
    "is_remote",
    "judge_response",
    "partial_path",
    "path_problem",
    "progress_due",
    "progress_text",
    "range_header",
    "sha256_problem",
    "shown_url",
    "source_url",
    "to_evict",
]
