"""Fixtures shared by several test files."""

from __future__ import annotations

import grp
import json
import os
import pwd
import signal
import subprocess
from pathlib import Path

import pytest

from llmgw.procfs import start_time_of

# A real unprivileged user for engines (the tests run as root, as an agent does on a node).
TEST_USER = "llmgw-test-eng"


@pytest.fixture(scope="session")
def engine_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("making a user and switching to it needs root")
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        groups = ["--groups", "video"] if group_exists("video") else []
        subprocess.run(["useradd", "--system", "--no-create-home", *groups, TEST_USER], check=True)
    return TEST_USER


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


# --- stores: every store test runs on both backends ---------------------------------------------

STORE_BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def pg_cluster():
    """One throwaway PostgreSQL cluster for the session (tests/postgres.py); each test that uses it
    gets a database of its own."""
    from tests.postgres import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture(params=STORE_BACKENDS)
def open_test_store(request, tmp_path):
    """An async function opening this test's store: SQLite in tmp_path/data, or a fresh database
    in the session's PostgreSQL cluster; each call opens the same database again."""
    from llmgw.server.store import open_store

    data_dir = tmp_path / "data"
    if request.param == "sqlite":

        async def open_sqlite():
            return await open_store(data_dir)

        return open_sqlite
    cluster = request.getfixturevalue("pg_cluster")
    url = cluster.url(cluster.create_database())

    async def open_postgres():
        return await open_store(data_dir, url, cluster.password)

    open_postgres.url = url
    open_postgres.password = cluster.password
    return open_postgres


@pytest.fixture(autouse=True)
def _no_gateway_worker_outlives_its_test(request):
    """A test's gateway workers (separate sessions, so no group signal reaches them) are stopped
    after it by the pids their state files record, even where its server was killed with -9."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None:
        return
    for state_file in Path(tmp_path).rglob("workers/*.state.json"):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        if start_time_of(state.get("pid", 0)) == state.get("start_time"):  # the same process
            os.kill(state["pid"], signal.SIGKILL)
