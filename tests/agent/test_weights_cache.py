"""The agent's weights cache against a real HTTP server on 127.0.0.1 (tests/weights_server.py).

The file is random bytes made by the test (a few MiB: the rules do not depend on the size); the
SmolLM2 GGUF goes the same way end to end in tests/e2e/test_weights_fetch.py.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import trio

from llmgw.agent.weights import CHUNK, LAST_USED, FetchFailed, WeightsCache
from llmgw.core.shard import ShardSpec
from tests.weights_server import FileServer

SIZE = 5 * CHUNK + 12345  # several chunks, and not a whole number of them


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "served"
    root.mkdir()
    data = os.urandom(SIZE)
    (root / "model.gguf").write_bytes(data)
    return root, hashlib.sha256(data).hexdigest()


@pytest.fixture
def server(payload):
    with FileServer(payload[0]) as running:
        yield running


def spec(path: str, sha256: str | None) -> ShardSpec:
    return ShardSpec(
        shard_id="r1-s0",
        replica_id="r1",
        model="m",
        model_path=path,
        model_sha256=sha256,
        engine="llamacpp",
        port=1,
    )


def cache(tmp_path: Path, **options) -> WeightsCache:
    return WeightsCache(tmp_path / "cache", work_dir=tmp_path, run_as=None, **options)


async def test_a_download_is_checked_placed_and_reported(tmp_path, payload, server) -> None:
    root, sha = payload
    weights = cache(tmp_path)
    progress: list[str] = []
    path = await weights.fetch(spec(server.url("model.gguf"), sha), progress.append)
    assert (
        path
        == tmp_path / "cache" / sha / "model.gguf"
        == weights.local_path(spec(server.url("x"), sha)).parent / "model.gguf"
    )
    assert path.read_bytes() == (root / "model.gguf").read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert {p.name for p in path.parent.iterdir()} == {LAST_USED, "model.gguf"}  # no partial left
    assert progress[0].startswith("fetching weights: 1.0 of 5.0 MiB (19%)")
    assert [s.range for s in server.seen] == [None]


async def test_replicas_share_one_copy_and_one_download(tmp_path, payload, server) -> None:
    _root, sha = payload
    weights = cache(tmp_path)
    paths: list[Path] = []

    async def one() -> None:
        paths.append(await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: None))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert len(set(paths)) == 1
    # A later replica, even of another URL of the same bytes, finds the copy.
    await weights.fetch(spec(server.url("model.gguf") + "?mirror=2", sha), lambda _text: None)
    assert len(server.seen) == 1


async def test_a_cut_download_is_resumed_with_a_range_request(tmp_path, payload, server) -> None:
    _root, sha = payload
    half = SIZE // 2
    server.cut_after = half
    path = await cache(tmp_path, retry_delay=0.01).fetch(
        spec(server.url("model.gguf"), sha), lambda _text: None
    )
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert [(s.range, s.status) for s in server.seen] == [(None, 200), (f"bytes={half}-", 206)]
    assert sum(s.sent for s in server.seen) == SIZE  # nothing fetched twice


async def test_a_stopped_download_resumes_at_the_next_start(tmp_path, payload, server) -> None:
    _root, sha = payload
    weights = cache(tmp_path)
    with trio.CancelScope() as scope:
        # The shard is stopped as soon as the first megabyte has arrived.
        await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: scope.cancel())
    assert scope.cancelled_caught
    partial = tmp_path / "cache" / sha / ".partial-model.gguf"
    kept = partial.stat().st_size
    assert 0 < kept < SIZE and not weights.local_path(spec(server.url("model.gguf"), sha)).exists()
    path = await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: None)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert server.seen[-1].range == f"bytes={kept}-" and not partial.exists()


async def test_a_wrong_checksum_fails_with_the_reason_and_keeps_nothing(tmp_path, payload, server) -> None:
    _root, sha = payload
    wrong = "0" * 64
    with pytest.raises(FetchFailed) as failed:
        await cache(tmp_path).fetch(spec(server.url("model.gguf"), wrong), lambda _text: None)
    assert str(failed.value) == (
        f"weights from {server.url('model.gguf')}: sha256 {sha} does not match the catalog's {wrong}; nothing kept"
    )
    assert list((tmp_path / "cache").iterdir()) == []


async def test_a_partial_of_other_bytes_is_not_trusted(tmp_path, payload, server) -> None:
    """Resumed onto bytes that were not the file's, the checksum fails; nothing is kept, so the
    next start downloads the whole file afresh."""
    _root, sha = payload
    weights = cache(tmp_path)
    entry = tmp_path / "cache" / sha
    entry.mkdir(parents=True)
    (entry / ".partial-model.gguf").write_bytes(b"x" * 1000)
    with pytest.raises(FetchFailed, match="does not match the catalog's"):
        await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: None)
    assert not entry.exists()
    path = await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: None)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert [s.range for s in server.seen] == ["bytes=1000-", None]


async def test_a_complete_partial_is_verified_without_downloading_again(tmp_path, payload, server) -> None:
    root, sha = payload
    entry = tmp_path / "cache" / sha
    entry.mkdir(parents=True)
    (entry / ".partial-model.gguf").write_bytes((root / "model.gguf").read_bytes())
    path = await cache(tmp_path).fetch(spec(server.url("model.gguf"), sha), lambda _text: None)
    assert path.is_file() and [(s.range, s.status, s.sent) for s in server.seen] == [
        (f"bytes={SIZE}-", 416, 0)
    ]


async def test_hub_references_use_the_mirror_and_its_checksum(tmp_path, payload) -> None:
    root, sha = payload
    hub = root / "org" / "repo" / "resolve" / "main"
    hub.mkdir(parents=True)
    (root / "model.gguf").rename(hub / "model.gguf")
    # The mirror's metadata is the checksum when the catalog has none.
    with FileServer(root, extra_headers={"X-Linked-Etag": f'"{sha}"'}) as mirror:
        weights = cache(tmp_path, mirror=f"http://127.0.0.1:{mirror.port}/files/")
        path = await weights.fetch(spec("hf://org/repo/model.gguf", None), lambda _text: None)
        assert [s.path for s in mirror.seen] == ["/files/org/repo/resolve/main/model.gguf"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha and path.parent.name.startswith("url-")
        with pytest.raises(FetchFailed, match="HTTP 404"):
            await weights.fetch(spec("hf://org/repo@v2/model.gguf", None), lambda _text: None)
    wrong = "1" * 64
    with FileServer(root, extra_headers={"X-Linked-Etag": wrong}) as mirror:
        weights = cache(tmp_path / "other", mirror=f"http://127.0.0.1:{mirror.port}/files")
        with pytest.raises(
            FetchFailed, match=f"sha256 {sha} does not match the mirror's {wrong}; nothing kept"
        ):
            await weights.fetch(spec("hf://org/repo/model.gguf", None), lambda _text: None)
    # Without any checksum: refused, and nothing kept.
    with FileServer(root) as mirror:
        weights = cache(tmp_path / "third", mirror=f"http://127.0.0.1:{mirror.port}/files")
        with pytest.raises(FetchFailed, match="no sha256 to check them against"):
            await weights.fetch(spec("hf://org/repo/model.gguf", None), lambda _text: None)
        assert list((tmp_path / "third" / "cache").iterdir()) == []
    with pytest.raises(FetchFailed, match="no weights.mirror set"):
        await cache(tmp_path).fetch(spec("hf://org/repo/model.gguf", None), lambda _text: None)


async def test_an_unreachable_server_fails_after_bounded_attempts(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    with pytest.raises(
        FetchFailed, match=r"gave up after 5 attempts \(cannot reach http://127.0.0.1:\d+/m.gguf"
    ):
        await cache(tmp_path, retry_delay=0.01).fetch(
            spec(f"http://127.0.0.1:{port}/m.gguf", "a" * 64), lambda _: None
        )


async def test_sweep_removes_only_idle_unused_copies(tmp_path, payload, server) -> None:
    _root, sha = payload
    now = [0.0]
    weights = cache(tmp_path, max_idle=100.0, clock=lambda: now[0])
    path = await weights.fetch(spec(server.url("model.gguf"), sha), lambda _text: None)
    other = tmp_path / "cache" / ("c" * 64)
    other.mkdir()
    (other / LAST_USED).touch()
    used = (path.parent / LAST_USED).stat().st_mtime
    now[0] = used + 50
    assert await weights.sweep(in_use=()) == []
    now[0] = used + 1000
    # In use: kept (and its last use is now); the other copy goes.
    os.utime(other / LAST_USED, (used, used))
    assert await weights.sweep(in_use={sha}) == ["c" * 64]
    assert path.exists() and not other.exists()
    now[0] = (path.parent / LAST_USED).stat().st_mtime + 1000
    assert await weights.sweep(in_use=()) == [sha]
    assert list((tmp_path / "cache").iterdir()) == []
