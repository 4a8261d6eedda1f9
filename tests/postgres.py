"""A throwaway PostgreSQL cluster for the tests: initdb and pg_ctl in a temporary directory, on a
loopback port, run as an unprivileged user (initdb refuses root), stopped and removed afterwards.

Nothing here uses a server someone else started. Without PostgreSQL's binaries the tests that need
one skip, or fail under ``LLMGW_REQUIRE_POSTGRES=1`` (scripts/test.sh), so they never silently vanish.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import attrs
import pytest

REQUIRE_ENV = "LLMGW_REQUIRE_POSTGRES"
# The cluster's owner when the tests run as root (as they do in CI).
PG_USER = "llmgw-test-pg"
SUPERUSER = "llmgw"
START_TIMEOUT_S = 60


def bin_dir() -> Path | None:
    """Debian's newest /usr/lib/postgresql/<v>/bin, else wherever initdb is on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def unavailable(why: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.define
class Cluster:
    directory: Path
    bin: Path
    port: int
    password: str
    as_user: dict
    databases: int = 0

    def url(self, database: str) -> str:
        """Without the password: it goes beside the URL, as the server takes it."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        self.databases += 1
        name = f"t{self.databases}"
        with psycopg.connect(self.url("postgres"), password=self.password, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def stop(self) -> None:
        try:
            subprocess.run(
                [self.bin / "pg_ctl", "-D", self.directory / "data", "-m", "immediate", "-w", "stop"],
                check=False,
                capture_output=True,
                timeout=START_TIMEOUT_S,
                **self.as_user,
            )
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


def _owner() -> dict:
    """subprocess arguments that run a command as the cluster's owner."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PG_USER], check=True)
        entry = pwd.getpwnam(PG_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def start_cluster() -> Cluster:
    """Starts a cluster or skips (fails under LLMGW_REQUIRE_POSTGRES=1) saying what is missing."""
    bin = bin_dir()
    if bin is None or not (bin / "pg_ctl").exists():
        unavailable("PostgreSQL's initdb and pg_ctl are not installed (Debian: apt-get install postgresql)")
    as_user = _owner()
    directory = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    try:
        password = secrets.token_urlsafe(18)
        pwfile = directory / "pwfile"
        pwfile.write_text(password + "\n")
        if as_user:
            os.chown(directory, as_user["user"], as_user["group"])
            os.chown(pwfile, as_user["user"], as_user["group"])
        pwfile.chmod(0o600)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        subprocess.run(
            [bin / "initdb", "-D", directory / "data", "-U", SUPERUSER, f"--pwfile={pwfile}",
             "--auth=scram-sha-256", "-E", "UTF8"],
            check=True, capture_output=True, cwd=directory, env=env, timeout=120, **as_user,
        )  # fmt: skip
        pwfile.unlink()
        attempts = 5  # a port taken between the probe and the start: try another
        for _ in range(attempts):
            port = _free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={directory} "
                "-c fsync=off -c max_connections=200"  # a throwaway cluster: speed over durability
            )
            started = subprocess.run(
                [bin / "pg_ctl", "-D", directory / "data", "-o", options, "-l", directory / "log",
                 "-w", "-t", str(START_TIMEOUT_S), "start"],
                capture_output=True, cwd=directory, env=env, timeout=START_TIMEOUT_S + 10, **as_user,
            )  # fmt: skip
            if started.returncode == 0:
                return Cluster(directory, bin, port, password, as_user)
        log = (directory / "log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"pg_ctl start failed {attempts} times: {started.stderr!r}\n{log}")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
