"""Fixtures shared by several test files."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess

import pytest

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
