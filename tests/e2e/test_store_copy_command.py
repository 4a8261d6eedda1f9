"""`llmgw server store copy` as an operator runs it: a process, the server's config as the source,
a real PostgreSQL as the target, the password from the environment and never on a line it prints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from llmgw.core import keys
from llmgw.server.store import TenantRow, open_store
from tests.helpers import PROJECT_ROOT

pytestmark = pytest.mark.slow


def run_copy(config, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "server", "store", "copy", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PROJECT_ROOT,
        env={**os.environ, **(env or {})},
    )


async def test_the_command_copies_verifies_and_keeps_the_password_off_its_output(tmp_path, pg_cluster):
    data_dir = tmp_path / "data"
    source = await open_store(data_dir)
    secret = await source.ensure_secret(keys.SECRET_NAME, keys.new_secret, 1.0)
    await source.add_tenant(TenantRow("acme", "{}", 1.0))
    await source.aclose()
    config = tmp_path / "server.yaml"
    config.write_text(f"data_dir: {data_dir}\n")
    url = pg_cluster.url(pg_cluster.create_database())
    env = {"LLMGW_TARGET_STORE_PASSWORD": pg_cluster.password}

    done = await trio.to_thread.run_sync(lambda: run_copy(config, "--to", url, env=env))
    assert done.returncode == 0, done.stderr
    assert "verified: 10 tables" in done.stdout
    assert pg_cluster.password not in done.stdout + done.stderr

    again = await trio.to_thread.run_sync(lambda: run_copy(config, "--to", url, env=env))
    assert again.returncode == 1 and "give --force" in again.stderr

    # A password in the URL (so in argv, readable by every user) is refused, and not echoed.
    with_password = url.replace("llmgw@", f"llmgw:{pg_cluster.password}@")
    refused = await trio.to_thread.run_sync(lambda: run_copy(config, "--to", with_password, "--force"))
    assert refused.returncode == 1 and "--to-password-file" in refused.stderr
    assert pg_cluster.password not in refused.stdout + refused.stderr

    target = await open_store(data_dir, url, pg_cluster.password)
    try:
        assert await target.get_secret(keys.SECRET_NAME) == secret
        assert [t.name for t in await target.list_tenants()] == ["acme"]
    finally:
        await target.aclose()
