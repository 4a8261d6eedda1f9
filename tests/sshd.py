"""A real OpenSSH server (Debian's openssh-server) for tests, in a network namespace of theirs.

Each test makes its own keys: a host key for the server, a client key it authorises for root, and
an ssh_config naming both, with the host key pinned in a known_hosts file (StrictHostKeyChecking
yes: the test connects the way a careful operator does, never accepting an unknown key). sshd runs
in the foreground as the test's child, its log in a file, stopped by pid.

``require_sshd()`` skips without sshd, or fails where LLMGW_REQUIRE_SSHD=1 (scripts/test.sh), so
the tests that need it never silently vanish.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.procs import Proc, wait_until

REQUIRE_ENV = "LLMGW_REQUIRE_SSHD"
SSHD = Path("/usr/sbin/sshd")
# Debian's unit makes this (RuntimeDirectory=sshd): sshd refuses to start without it.
PRIVSEP_DIR = Path("/run/sshd")


def sshd_missing() -> str:
    if not SSHD.exists():
        return f"no {SSHD} (Debian's openssh-server)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "no ssh / ssh-keygen (Debian's openssh-client)"
    if os.geteuid() != 0:
        return "sshd for root logins needs root"
    return ""


def require_sshd() -> None:
    why = sshd_missing()
    if not why:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
    pytest.skip(why)


def keygen(path: Path) -> str:
    """A new ed25519 key pair at ``path`` (and .pub), without a passphrase; the public key."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text().strip()


class Sshd:
    """sshd listening on ``address`` inside ``namespace``, letting in root with the test's key.

    ``alias`` is the name ssh connects to (``ssh -F config alias``)."""

    def __init__(self, directory: Path, namespace: str, address: str, alias: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        self.directory = directory
        self.namespace = namespace
        self.address = address
        self.alias = alias
        self.host_key = directory / "host_key"
        self.client_key = directory / "client_key"
        host_public = keygen(self.host_key)
        client_public = keygen(self.client_key)
        (directory / "authorized_keys").write_text(client_public + "\n")
        (directory / "known_hosts").write_text(f"{address} {host_public}\n")
        (directory / "sshd_config").write_text(
            f"ListenAddress {address}:22\n"
            f"HostKey {self.host_key}\n"
            f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
            f"PidFile {directory / 'sshd.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            # No PAM: the container has no login stack configured for sessions; keys are enough.
            "UsePAM no\n"
            # The test's directories are under /tmp: the owner checks are about real homes.
            "StrictModes no\n"
            "LogLevel VERBOSE\n"
        )
        self.config = directory / "ssh_config"
        self.config.write_text(
            f"Host {alias}\n"
            f"  HostName {address}\n"
            "  User root\n"
            f"  IdentityFile {self.client_key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {directory / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n"
            "  ConnectTimeout 20\n"
        )
        self.proc: Proc | None = None

    def start(self) -> Sshd:
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        self.proc = Proc(
            [
                "ip",
                "netns",
                "exec",
                self.namespace,
                str(SSHD),
                "-D",
                "-e",
                "-f",
                str(self.directory / "sshd_config"),
            ],
            self.directory / "sshd.log",
        )
        wait_until(
            lambda: "Server listening" in self.proc.output(), f"sshd on {self.address}", proc=self.proc
        )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def ssh(self, command: str, namespace: str) -> subprocess.CompletedProcess:
        """``command`` on the server as root, from ``namespace``."""
        return subprocess.run(
            ["ip", "netns", "exec", namespace, "ssh", "-F", str(self.config), self.alias, command],
            capture_output=True,
            text=True,
            timeout=60,
        )
