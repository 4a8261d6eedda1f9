"""Benchmark of moving adapters with the store: `llmgw server store copy` of a SQLite store
keeping --adapters adapters of --mib MiB each (their files only in data_dir, as an older llmgw
kept them: the copy first puts them into the source, sha256-checked), into a throwaway
PostgreSQL cluster (tests/postgres.py, fsync off); then the files written back from PostgreSQL
into an empty data_dir, as a server on the new store does at start. Prints MiB/s of each.

    .venv/bin/python scripts/bench_store_copy.py                 # 2 adapters of 64 MiB
    .venv/bin/python scripts/bench_store_copy.py --mib 8         # a smoke run

The cluster and the temporary directory are removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.core.training import FileDigest  # noqa: E402
from llmgw.server.store import AdapterRow, JobRow, adapter_files, open_store  # noqa: E402
from tests.postgres import start_cluster  # noqa: E402


async def make_source(data_dir: Path, adapters: int, mib: int) -> list[tuple[str, tuple[FileDigest, ...]]]:
    store = await open_store(data_dir)
    made = []
    try:
        for i in range(adapters):
            name = f"qa-{i}"
            directory = data_dir / "adapters" / name
            directory.mkdir(parents=True)
            data = os.urandom(mib << 20)
            (directory / "adapter.gguf").write_bytes(data)
            files = (
                FileDigest(name="adapter.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest()),
            )
            manifest = json.dumps([attrs.asdict(f) for f in files])
            row = AdapterRow(name, "m", f"j-{i}", 1.0, manifest, 1)
            await store.finish_job(JobRow(f"j-{i}", "n1", "Succeeded", 1.0, "{}"), row)
            made.append((name, files))
    finally:
        await store.aclose()
    return made


async def write_back(url: str, password: str, target_dir: Path, adapters) -> None:
    store = await open_store(target_dir, url, password)
    try:
        problems = await adapter_files.reconcile(store, target_dir / "adapters", adapters)
        assert not problems, problems
    finally:
        await store.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    total_mib = args.adapters * args.mib
    work = Path(tempfile.mkdtemp(prefix="bench-store-copy-"))
    cluster = start_cluster()
    try:
        source_dir = work / "old"
        adapters = trio.run(make_source, source_dir, args.adapters, args.mib)
        config = work / "server.yaml"
        config.write_text(f"data_dir: {source_dir}\n")
        url = cluster.url(cluster.create_database())
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "server", "store", "copy", "--config", str(config), "--to", url],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "LLMGW_TARGET_STORE_PASSWORD": cluster.password},
        )
        copy_s = time.monotonic() - began
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        began = time.monotonic()
        trio.run(write_back, url, cluster.password, work / "new", adapters)
        back_s = time.monotonic() - began
        print(f"adapters: {args.adapters} x {args.mib} MiB = {total_mib} MiB")
        print(f"store copy (into the source, copy, verify): {copy_s:.2f} s, {total_mib / copy_s:.1f} MiB/s")
        print(
            f"written back from PostgreSQL (sha256-checked): {back_s:.2f} s, {total_mib / back_s:.1f} MiB/s"
        )
        return 0
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
