"""The adapters' files in the store (store/adapter_files.py), on both backends: put in chunks,
written back only when they match the manifest, and reconciled with a data_dir either way."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from llmgw.core.training import FileDigest
from llmgw.server.store import AdapterRow, JobRow
from llmgw.server.store import adapter_files as af

FILES = {"adapter.gguf": os.urandom(2500), "adapter_config.json": b'{"r": 8}', "empty.bin": b""}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # 2500 bytes in chunks of 1000, two per transaction: several chunks and several writes.
    monkeypatch.setattr(af, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(af, "CHUNKS_PER_WRITE", 2)


def manifest(files: dict[str, bytes]) -> tuple[FileDigest, ...]:
    return tuple(
        FileDigest(name=name, size=len(d), sha256=hashlib.sha256(d).hexdigest()) for name, d in files.items()
    )


def write_dir(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


async def keep(store, name: str, staged: str = "") -> None:
    await store.finish_job(
        JobRow(f"j-{name}", "n1", "Succeeded", 1.0, "{}"),
        AdapterRow(name, "m", f"j-{name}", 1.0, "[]", 1),
        staged,
    )


async def test_files_go_in_chunks_and_come_back_verified_into_an_empty_dir(open_test_store, tmp_path):
    store = await open_test_store()
    try:
        write_dir(tmp_path / "made", FILES)
        staged = af.job_staging("j-qa")
        await af.put_files(store, staged, tmp_path / "made", manifest(FILES))
        await keep(store, "qa", staged)
        sizes = await store.stored_file_sizes()
        assert sizes == {("qa", "adapter.gguf"): (3, 2500), ("qa", "adapter_config.json"): (1, 8)}

        target = tmp_path / "elsewhere" / "adapters" / "qa"
        await af.materialize(store, "qa", manifest(FILES), target, tmp_path / "elsewhere" / "scratch")
        assert {p.name: p.read_bytes() for p in target.iterdir()} == FILES
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in target.iterdir())
        assert not (tmp_path / "elsewhere" / "scratch").exists()
    finally:
        await store.aclose()


async def test_bytes_that_do_not_match_the_manifest_are_never_written_into_place(open_test_store, tmp_path):
    store = await open_test_store()
    try:
        files = {"adapter.gguf": FILES["adapter.gguf"]}
        write_dir(tmp_path / "made", files)
        await af.put_files(store, "qa", tmp_path / "made", manifest(files))
        await keep(store, "qa")
        # One byte changed in the middle chunk: same size, another sha256.
        chunks = await store.read_chunks("qa", "adapter.gguf", 0, 10)
        await store.delete_chunks("qa")
        bad = bytearray(chunks[1][1])
        bad[0] ^= 0xFF
        await store.put_chunks("qa", "adapter.gguf", 0, [chunks[0][1], bytes(bad), chunks[2][1]])
        target = tmp_path / "adapters" / "qa"
        with pytest.raises(af.AdapterFilesError, match="manifest says 2500 bytes"):
            await af.materialize(store, "qa", manifest(files), target, tmp_path / "scratch")
        assert not target.exists() and not (tmp_path / "scratch").exists()

        # A missing chunk is named.
        await store.delete_chunks("qa")
        await store.put_chunks("qa", "adapter.gguf", 0, [chunks[0][1]])
        await store.put_chunks("qa", "adapter.gguf", 2, [chunks[2][1]])
        with pytest.raises(af.AdapterFilesError, match="chunk 1 is missing"):
            await af.materialize(store, "qa", manifest(files), target, tmp_path / "scratch")
        assert not target.exists()
    finally:
        await store.aclose()


async def test_a_file_unlike_its_manifest_is_not_put_and_leaves_nothing_staged(open_test_store, tmp_path):
    store = await open_test_store()
    try:
        write_dir(tmp_path / "made", FILES)
        wrong = manifest({**FILES, "adapter_config.json": b'{"r": 9}'})
        with pytest.raises(af.AdapterFilesError, match="adapter_config.json is 8 bytes"):
            await af.put_files(store, "staged", tmp_path / "made", wrong)
        assert await store.stored_file_sizes() == {}
    finally:
        await store.aclose()


async def test_reconcile_fills_whichever_side_lacks_the_files_and_reports_what_neither_has(
    open_test_store, tmp_path
):
    store = await open_test_store()
    adapters_dir = tmp_path / "adapters"
    try:
        other = {"adapter.gguf": os.urandom(1500)}
        # disk-only: kept before the store held bytes; store-only: this data_dir never had it.
        write_dir(adapters_dir / "disk-only", FILES)
        write_dir(tmp_path / "made", other)
        await af.put_files(store, "store-only", tmp_path / "made", manifest(other))
        # damaged: on disk, the size right but not the content; nowhere: in no place at all.
        damaged = {"adapter.gguf": b"\x00" * 2500}
        write_dir(adapters_dir / "damaged", damaged)
        for name in ("disk-only", "store-only", "damaged", "nowhere"):
            await keep(store, name)
        adapters = [
            ("disk-only", manifest(FILES)),
            ("store-only", manifest(other)),
            ("damaged", manifest({"adapter.gguf": FILES["adapter.gguf"]})),
            ("nowhere", manifest(other)),
        ]

        problems = await af.reconcile(store, adapters_dir, adapters)

        assert len(problems) == 2
        assert problems[0].startswith("adapter damaged: ") and "manifest says 2500 bytes" in problems[0]
        assert problems[1].startswith("adapter nowhere: its files are neither in the store")
        sizes = await store.stored_file_sizes()
        assert {k for k in sizes} == {
            ("disk-only", "adapter.gguf"),
            ("disk-only", "adapter_config.json"),
            ("store-only", "adapter.gguf"),
        }  # nothing staged left, none of the damaged one's bytes
        assert (adapters_dir / "store-only" / "adapter.gguf").read_bytes() == other["adapter.gguf"]
        written = tmp_path / "again" / "disk-only"
        await af.materialize(store, "disk-only", manifest(FILES), written, tmp_path / "scratch")
        assert {p.name: p.read_bytes() for p in written.iterdir()} == FILES

        # The second time there is nothing to do; a copy's source is only ever filled, not written.
        assert await af.reconcile(store, adapters_dir, adapters[:2]) == []
        os.remove(adapters_dir / "store-only" / "adapter.gguf")
        assert await af.reconcile(store, adapters_dir, adapters[:2], write_files=False) == []
        assert not (adapters_dir / "store-only" / "adapter.gguf").exists()
    finally:
        await store.aclose()


async def test_staged_chunks_no_adapter_names_are_removed(open_test_store, tmp_path):
    store = await open_test_store()
    try:
        await store.put_chunks(af.job_staging("j-dead"), "adapter.gguf", 0, [b"x"])
        await store.put_chunks("qa", "adapter.gguf", 0, [b"y"])
        await keep(store, "qa")
        assert await store.delete_unlisted_chunks() == 1
        assert list(await store.stored_file_sizes()) == [("qa", "adapter.gguf")]
    finally:
        await store.aclose()
