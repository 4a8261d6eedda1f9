"""`llmgw server store copy --to postgresql://...`: its parser and its run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

COPY_HELP = """\
Copies every table of this server's store (the one its --config names: SQLite in
data_dir by default) into the PostgreSQL database --to names: catalog, tenants, key
digests, usage, jobs, adapters and their files' bytes, nodes and the secret engine
keys are derived from (so engines started before the move still accept the gateway's
keys). Each table is then read back from both and its row count and checksum compared.
An adapter whose files are only in data_dir/adapters (kept by an older llmgw) is first
put into the source store, its files checked against their sha256.

Stop the server first: rows it writes during the copy fail the verification.

The target's password never goes on the command line (every user can read it):
  --to-password-file FILE, else $LLMGW_TARGET_STORE_PASSWORD, else libpq's ~/.pgpass.

Then set `store: postgresql://...` (and store_password_file) in server.yaml and start
the server again.

  llmgw server store copy --config server.yaml --to postgresql://llmgw@db:5432/llmgw
"""

TARGET_PASSWORD_ENV = "LLMGW_TARGET_STORE_PASSWORD"


def add_store_parser(server_actions: argparse._SubParsersAction) -> None:
    store = server_actions.add_parser(
        "store", help="operations on the server's store", description="Operations on the server's store."
    )
    actions = store.add_subparsers(dest="store_action", metavar="{copy}")
    actions.required = True
    copy = actions.add_parser(
        "copy",
        help="copy the whole store into a PostgreSQL database, verified",
        description=COPY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    copy.add_argument(
        "--config",
        dest="store_config",
        type=Path,
        metavar="FILE",
        help="the server's server.yaml (the source)",
    )
    copy.add_argument("--to", required=True, metavar="URL", help="postgresql://user@host:port/database")
    copy.add_argument("--to-password-file", type=Path, metavar="FILE", help="the target's password")
    copy.add_argument("--force", action="store_true", help="replace what the target already holds")
    copy.set_defaults(func=run_copy_command)


def run_copy_command(args: argparse.Namespace) -> int:
    from llmgw.config import ConfigError, load_server_config
    from llmgw.server.store import StoreError

    try:
        config = load_server_config(args.store_config or getattr(args, "config", None))
        return trio.run(_copy, config, args)
    except (ConfigError, StoreError) as e:
        print(f"llmgw server store copy: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


async def _copy(config, args: argparse.Namespace) -> int:
    from llmgw.server.store import StoreError, open_store, read_password
    from llmgw.server.store.copy import PAGE_ROWS, copy_store
    from llmgw.server.store.postgres import describe, has_password
    from llmgw.server.store.rows import TABLES_BY_NAME
    from llmgw.server.store.sqlite import DB_FILENAME

    url = args.to
    if not url.startswith(("postgresql://", "postgres://")):
        raise StoreError("--to: expected a postgresql:// URL")
    target_where = describe(url)
    if has_password(url):
        raise StoreError(
            f"--to {target_where}: the URL carries a password, which every user of this machine can "
            f"read on a command line; give it with --to-password-file or ${TARGET_PASSWORD_ENV}"
        )
    if config.store is None and not (config.data_dir / DB_FILENAME).exists():
        raise StoreError(f"no store to copy: {config.data_dir / DB_FILENAME} does not exist")
    if config.store is not None and describe(config.store) == target_where:
        raise StoreError(f"--to {target_where} is the store the config already uses")

    def progress(table: str, done: int, total: int) -> None:
        # A line per page of a table of several (small ones go by too fast to be worth one),
        # about 20 in all for a big one: the adapters' chunks move 8 MiB a page.
        page = min(PAGE_ROWS, TABLES_BY_NAME[table].page_rows)
        every = max(1, total // page // 20)
        if total > page and (done == total or (done // page) % every == 0):
            print(f"  {table}: {done}/{total} rows", file=sys.stderr, flush=True)

    source = await open_store(config.data_dir, config.store, read_password(config.store_password_file))
    try:
        # Adapters kept before the store held their files' bytes: into the source first, so
        # that they are copied and checksummed like every other row.
        for problem in await _adapters_into_source(source, config.data_dir):
            print(f"warning: {problem}", file=sys.stderr, flush=True)
        target = await open_store(
            config.data_dir, url, read_password(args.to_password_file, TARGET_PASSWORD_ENV)
        )
        try:
            print(f"copying {source.where} to {target.where}", file=sys.stderr, flush=True)
            copied = await copy_store(source, target, force=args.force, progress=progress)
        finally:
            await target.aclose()
    finally:
        await source.aclose()
    for table in copied:
        print(f"{table.table:16} {table.rows:>10} rows  sha256-sum {table.checksum[:16]}")
    print(f"verified: {len(copied)} tables, {sum(t.rows for t in copied)} rows, counts and checksums equal")
    return 0


async def _adapters_into_source(source, data_dir: Path) -> list[str]:
    import json

    from llmgw.core.training import FileDigest
    from llmgw.server.store import adapter_files

    adapters = [
        (row.name, tuple(FileDigest(**f) for f in json.loads(row.files)))
        for row in await source.list_adapters()
    ]
    return await adapter_files.reconcile(source, data_dir / "adapters", adapters, write_files=False)
