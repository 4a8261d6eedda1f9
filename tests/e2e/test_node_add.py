"""``llmgw ctl node add`` against real sshd servers: two nodes, each a network namespace of its own.

ctl runs in the server's namespace and onboards each node over SSH with a key the test made; the
node's "machine" is a directory (``--root``) so that nothing lands in this machine's /etc. systemd
cannot run here, so the unit is checked with ``systemd-analyze verify`` and the agent is started
the way the unit starts it: its ExecStart line, the frozen binary node add copied. ctl waits for
the node to register with the real server; a second run changes nothing and says so.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.fleet import LINK_PORT, SERVER_ADDRESS, SIMULATED, Fleet, require_netns
from tests.helpers import PROJECT_ROOT
from tests.procs import DEADLINE, Proc, llmgw_command, wait_until
from tests.sshd import Sshd, require_sshd

pytestmark = pytest.mark.slow

BINARY = PROJECT_ROOT / "dist" / "llmgw"
NODES = ("node-a", "node-b")
# Copying ~45 MiB over SSH and unpacking the frozen binary at the agent's first start, on a loaded
# 2-core machine.
ADD_DEADLINE = 240.0


@pytest.fixture
def binary() -> Path:
    if not BINARY.exists():
        if os.environ.get("LLMGW_REQUIRE_BINARY") == "1":
            pytest.fail("dist/llmgw missing: run scripts/build-binary.sh", pytrace=False)
        pytest.skip("dist/llmgw missing: run scripts/build-binary.sh")
    return BINARY


def make_root(root: Path) -> None:
    """A machine's user and group databases: root only, and a video group but no render group
    (as on a node without an AMD or Intel GPU driver), so node add makes one and reuses the other."""
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\nvideo:x:44:\n")
    for name, text in (("shadow", "root:*:19000:0:99999:7:::\n"), ("gshadow", "root:*::\nvideo:!::\n")):
        (etc / name).write_text(text)
        (etc / name).chmod(0o600)


def snapshot(root: Path) -> dict[str, tuple[int, int, float]]:
    """Every file and directory under ``root``: (inode, mode, mtime). A rewritten file is a new
    inode (steps rename a new file over the old), a chmod a new mode."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        found[str(path.relative_to(root))] = (info.st_ino, info.st_mode, info.st_mtime)
    return found


def unit_exec_start(unit: Path) -> list[str]:
    lines = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, unit.read_text()
    return shlex.split(lines[0].removeprefix("ExecStart="))


def test_node_add_onboards_two_nodes_over_ssh_and_a_second_run_changes_nothing(tmp_path, binary):
    require_netns()
    require_sshd()
    fleet = Fleet(tmp_path, {name: SIMULATED / "l40s-x4-roce.yaml" for name in NODES}, engines={})
    sshds: dict[str, Sshd] = {}
    adds: list[Proc] = []
    try:
        fleet.build()
        fleet.server.start()
        token_file = fleet.server.data_dir / "join-token"
        token = token_file.read_text().strip()
        server_address = f"{SERVER_ADDRESS}:{LINK_PORT}"
        for name, node in fleet.nodes.items():
            sshds[name] = Sshd(tmp_path / f"sshd-{name}", node.namespace, node.address, name).start()
            make_root(tmp_path / f"root-{name}")

        def add_args(name: str, *extra: str) -> list[str]:
            return [
                "node", "add", name, "--name", name,
                "--ssh-config", str(sshds[name].config),
                "--root", str(tmp_path / f"root-{name}"),
                "--join-token-file", str(token_file),
                "--server-address", server_address,
                "--binaries", str(binary.parent),
                *extra,
            ]  # fmt: skip

        # A node whose platform has no binary: refused with the reason, and nothing written.
        other = tmp_path / "other-binaries"
        other.mkdir()
        elf = bytearray(64)
        elf[:8] = b"\x7fELF\x02\x01\x01\x00"
        elf[18:20] = (0xB7).to_bytes(2, "little")  # aarch64
        (other / "llmgw-linux-aarch64").write_bytes(bytes(elf))
        args = add_args("node-b")
        args[args.index("--binaries") + 1] = str(other)
        refused = fleet.server.ctl(*args, timeout=ADD_DEADLINE)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "no llmgw binary for Linux x86_64" in refused.stderr, refused.stderr
        assert "llmgw-linux-aarch64 (Linux aarch64)" in refused.stderr, refused.stderr
        assert sorted(p.name for p in (tmp_path / "root-node-b").iterdir()) == ["etc"]

        # --dry-run: every step with its script, nothing changed, and never the token.
        before = snapshot(tmp_path / "root-node-b")
        dry = fleet.server.ctl(*add_args("node-b", "--dry-run"), timeout=ADD_DEADLINE)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        for expected in ("binary", "agent.yaml", "join token", "systemd unit", "groups: create render",
                         "user: create llmgw-engine", "home: make", "enable llmgw-agent.service",
                         "8 step(s) would change"):  # fmt: skip
            assert expected in dry.stdout, dry.stdout
        assert "useradd --prefix" in dry.stdout and "cat >" in dry.stdout, dry.stdout
        assert token not in dry.stdout + dry.stderr
        assert snapshot(tmp_path / "root-node-b") == before

        # The real thing, on both nodes at once: ctl waits until each node registers.
        for name in NODES:
            adds.append(
                Proc(
                    ["ip", "netns", "exec", fleet.server_ns, *llmgw_command(), "ctl", *add_args(name)],
                    tmp_path / f"add-{name}.log",
                    env=fleet.server.ctl_env,
                )
            )
        for name, proc in zip(NODES, adds, strict=True):
            root = tmp_path / f"root-{name}"
            unit = root / "etc/systemd/system/llmgw-agent.service"
            wait_until(
                lambda proc=proc: "start the agent as the unit does" in proc.output(),
                f"node add of {name} to reach the service step",
                deadline=ADD_DEADLINE,
                proc=proc,
            )
            command = unit_exec_start(unit)
            assert command[0] == str(root / "usr/local/bin/llmgw")
            # As systemd would: root, the unit's command line, a bare environment.
            fleet.nodes[name].agent = Proc(
                ["ip", "netns", "exec", fleet.nodes[name].namespace, "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                 *command],
                tmp_path / f"agent-{name}.log",
            )  # fmt: skip
        for name, proc in zip(NODES, adds, strict=True):
            assert proc.popen.wait(timeout=ADD_DEADLINE) == 0, proc.output() + fleet.logs()
            assert f"node {name} registered" in proc.output(), proc.output()
            assert "8 step(s) changed" in proc.output(), proc.output()
        nodes = fleet.server.nodes()
        assert all(nodes[name]["connected"] for name in NODES), nodes

        for name in NODES:
            root = tmp_path / f"root-{name}"
            check_node_files(root, binary, token)
            verify_unit(root / "etc/systemd/system/llmgw-agent.service")

        # Run again: nothing changes, ctl says so, and the agents are still the ones started.
        for name in NODES:
            before = snapshot(tmp_path / f"root-{name}")
            again = fleet.server.ctl(*add_args(name), timeout=ADD_DEADLINE)
            assert again.returncode == 0, again.stdout + again.stderr
            assert f"nothing changed: {name} already has everything node add installs" in again.stdout
            assert "[change]" not in again.stdout, again.stdout
            assert f"node {name} registered" in again.stdout, again.stdout
            assert snapshot(tmp_path / f"root-{name}") == before
            assert fleet.nodes[name].agent.popen.poll() is None
    finally:
        for proc in adds:
            proc.stop()
        for sshd in sshds.values():
            sshd.stop()
        fleet.close()


def check_node_files(root: Path, binary: Path, token: str) -> None:
    def mode_owner(path: Path) -> tuple[int, int, int]:
        info = path.stat()
        return stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid

    installed = root / "usr/local/bin/llmgw"
    assert installed.read_bytes() == binary.read_bytes()
    assert mode_owner(installed) == (0o755, 0, 0)
    assert (root / "etc/llmgw/join-token").read_text() == token + "\n"
    assert mode_owner(root / "etc/llmgw/join-token") == (0o600, 0, 0)
    assert mode_owner(root / "etc/llmgw/agent.yaml") == (0o600, 0, 0)
    assert token not in (root / "etc/llmgw/agent.yaml").read_text()
    unit_text = (root / "etc/systemd/system/llmgw-agent.service").read_text()
    assert "KillMode=process" in unit_text and "Restart=always" in unit_text
    assert (root / "etc/systemd/system/multi-user.target.wants/llmgw-agent.service").is_symlink()
    # The engine user, in video (which was there) and render (which node add made).
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    user = passwd["llmgw-engine"]
    uid, gid, home = int(user[2]), int(user[3]), user[5]
    assert home == "/var/lib/llmgw/agent/home/llmgw-engine" and user[6] == "/usr/sbin/nologin"
    groups = {line.split(":")[0]: line.split(":") for line in (root / "etc/group").read_text().splitlines()}
    assert groups["video"][2] == "44"
    for group in ("video", "render"):
        assert "llmgw-engine" in groups[group][3].split(","), groups[group]
    assert mode_owner(root / home.lstrip("/")) == (0o700, uid, gid)
    assert mode_owner(root / "var/lib/llmgw/agent")[0] == 0o711
    # Directories made on the way are the usual 0755, the secrets' files alone private.
    for directory in ("usr/local/bin", "etc/llmgw", "etc/systemd/system"):
        assert mode_owner(root / directory)[0] == 0o755, directory


def verify_unit(unit: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        return
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=DEADLINE
    )
    # verify exits 0 even for a line it ignores; what it prints is the finding.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )
