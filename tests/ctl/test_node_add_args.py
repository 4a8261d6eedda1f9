"""`llmgw ctl node add`'s arguments before any SSH: a HOST that ssh would read as an option and a
node name the agent would refuse are errors naming them, and ssh is never run for them. (The whole
onboarding, against real sshd servers, is tests/e2e/test_node_add.py.)"""

from __future__ import annotations

import argparse
import subprocess

import pytest

from llmgw.ctl import node_add
from llmgw.ctl.client import CtlError
from llmgw.ctl.commands import add_ctl_parser


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmgw")
    add_ctl_parser(parser.add_subparsers(dest="role", required=True))
    return parser.parse_args(["ctl", "node", "add", *argv])


@pytest.fixture
def ssh_runs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    runs: list[list[str]] = []

    def run(command, **kwargs):
        runs.append(command)
        return subprocess.CompletedProcess(command, 1, b"", b"stand-in: no host")

    monkeypatch.setattr(node_add.subprocess, "run", run)
    return runs


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("-oProxyCommand=touch /tmp/pwned",), "begins with '-': ssh would read it as an option"),
        (("node-a", "--name", "Node_A"), "--name: 'Node_A' is not a node name (lowercase letters"),
        (("node-a", "--name=-x"), "--name: '-x' is not a node name"),
    ],
)
def test_a_host_or_name_that_cannot_be_used_is_refused_before_ssh_runs(
    argv, says, ssh_runs, tmp_path, capsys
):
    token = tmp_path / "join-token"
    token.write_text("t" * 32 + "\n")
    args = parse(*argv, "--join-token-file", str(token))
    assert args.func(args) != 0
    assert says in capsys.readouterr().err
    assert ssh_runs == []


def test_ssh_is_given_the_host_after_a_double_dash(ssh_runs):
    with pytest.raises(CtlError):
        node_add.Ssh("user@node-a", None).run("true")
    (command,) = ssh_runs
    assert command[command.index("--") + 1] == "user@node-a" and command.index("--") < len(command) - 2
