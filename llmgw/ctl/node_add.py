"""``llmgw ctl node add HOST``: onboard a node over SSH, then wait until its agent registers.

It runs the system ``ssh`` client rather than an SSH library (paramiko, asyncssh): the operator's
own ``~/.ssh/config``, agent, known_hosts, ProxyJump and hardware keys then apply as they do to
every other ssh they run, with nothing to configure twice and no new dependency in the binary.
Each step is one ``ssh HOST <script>``; what a step writes (the binary, agent.yaml, the join
token, the unit) goes on the connection's stdin, so the token is never in an argv on either side.

What the steps are is decided by :mod:`llmgw.core.onboarding` from one read-only probe; here are
only the SSH calls, the local files and the wait for the agent.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.config import NODE_NAME, NODE_NAME_RULE
from llmgw.core import onboarding
from llmgw.core.onboarding import Layout, NoBinary, ProbeError, Step, Wanted, WantedFile
from llmgw.ctl.client import CtlError
from llmgw.ctl.context import resolve
from llmgw.ctl.subcommand import ClientFactory, add

JOIN_TOKEN_ENV = "LLMGW_JOIN_TOKEN"
# Where a server keeps its join token by default (server.yaml's data_dir): found when ctl runs on
# the server's own machine.
DEFAULT_JOIN_TOKEN = Path.home() / ".local/share/llmgw/server/join-token"
# A probe or a small step over SSH; the binary's copy gets longer (COPY_TIMEOUT).
SSH_TIMEOUT = 60.0
# Tens of MiB over a slow link to a far node.
COPY_TIMEOUT = 900.0
# An agent registers within seconds of starting; a first start also unpacks the binary.
DEFAULT_WAIT = 120.0
POLL_INTERVAL = 0.5

DESCRIPTION = """\
Onboards HOST over SSH: copies the llmgw binary built for its platform, makes the llmgw-engine
user (groups video and render, a 0700 home), writes /etc/llmgw/agent.yaml and the join token
(0600, root), installs and starts the systemd unit llmgw-agent.service, and waits until the
node registers with the server. Running it again changes only what differs, and says so.

SSH runs as the system `ssh` client with your own configuration (keys, agent, known_hosts);
steps run as root, through `sudo -n` when the SSH user is not root. The join token is read from
--join-token-file, else $LLMGW_JOIN_TOKEN, else the server's default file on this machine, and
is sent over the SSH connection's stdin, never on a command line.
"""


def add_parser(node_commands, client: ClientFactory) -> None:
    parser = add(
        node_commands, "add", "onboard a node over SSH and wait until it registers", _node_add, client
    )
    parser.description = DESCRIPTION
    parser.add_argument(
        "host", metavar="HOST", help="what `ssh` connects to: a name, user@host, a config alias"
    )
    parser.add_argument("--name", help="the node's name (default: its hostname, lowercased)")
    parser.add_argument(
        "--server-address",
        metavar="HOST:PORT",
        action="append",
        help="the server's link address as the node reaches it (default: the admin API's host, port 7070);"
        " again for each server sharing the store",
    )
    parser.add_argument(
        "--join-token-file", type=Path, metavar="FILE", help="the server's join-token file (see above)"
    )
    parser.add_argument(
        "--binaries",
        type=Path,
        metavar="DIR",
        help="where the frozen binaries are: llmgw and llmgw-<os>-<machine> files, chosen by their headers"
        " (default: the running llmgw's directory when it is the frozen binary, else ./dist)",
    )
    parser.add_argument("--ssh-config", type=Path, metavar="FILE", help="an ssh_config file for `ssh -F`")
    parser.add_argument(
        "--dry-run", action="store_true", help="print every step and its script; change nothing"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT,
        metavar="SECONDS",
        help=f"how long to wait for the node to register (default {DEFAULT_WAIT:g}; 0: do not wait)",
    )
    # For tests: installs under a directory of the node instead of its real /etc and /usr.
    parser.add_argument("--root", default="/", help=argparse.SUPPRESS)


def _node_add(args: argparse.Namespace, client: ClientFactory) -> int:
    if args.host.startswith("-"):
        # ssh is also given "--" before it; refused here all the same, with a clearer message.
        raise CtlError(f"HOST {args.host!r} begins with '-': ssh would read it as an option")
    if args.name is not None:
        _check_name(args.name, "--name")
    layout = Layout(root=args.root)
    token = _join_token(args.join_token_file)
    ssh = Ssh(args.host, args.ssh_config)
    paths = [layout.binary, layout.config, layout.join_token, layout.unit]
    try:
        facts = onboarding.parse_probe(ssh.run(onboarding.probe_script(paths, layout)), len(paths))
    except ProbeError as e:
        raise CtlError(f"{args.host}: {e}") from None
    binary = _binary_for(facts.platform, args.binaries)
    name = args.name or facts.hostname.lower()
    if not name:
        raise CtlError(f"{args.host} reports no hostname: give the node's name with --name")
    if args.name is None:
        _check_name(name, f"{args.host}'s hostname (give another with --name)")
    context = resolve(args.server, args.token)
    server_addresses = args.server_address or [
        f"{urlsplit(context.server).hostname}:{onboarding.DEFAULT_LINK_PORT}"
    ]
    contents = {
        "config": onboarding.agent_yaml(name, server_addresses, layout).encode(),
        "token": (token + "\n").encode(),
        "unit": onboarding.unit_text(name, layout).encode(),
    }
    binary_sha, binary_size = _file_digest(binary)
    wanted = Wanted(
        node_name=name,
        layout=layout,
        files=(
            WantedFile(
                path=layout.binary,
                sha256=binary_sha,
                size=binary_size,
                mode=0o755,
                content="binary",
                says=f"binary ({binary.name}, {facts.platform})",
            ),  # fmt: skip
            _wanted(layout.config, contents["config"], 0o600, "config", "agent.yaml"),
            _wanted(layout.join_token, contents["token"], 0o600, "token", "join token"),
            _wanted(layout.unit, contents["unit"], 0o644, "unit", "systemd unit"),
        ),
    )
    steps = onboarding.plan(facts, wanted)
    print(
        f"node {name} ({args.host}, {facts.platform}){': dry run, nothing is changed' if args.dry_run else ''}"
    )
    changes = [step for step in steps if step.changes]
    before = None
    if not args.dry_run and args.wait > 0 and onboarding.restarts_agent(steps):
        before = _registrations(client(args), name)
    for step in steps:
        mark = (
            ("would change" if args.dry_run else "change")
            if step.changes
            else "note"
            if step.notice
            else "ok"
        )
        print(f"  [{mark}] {step.says}", flush=True)
        if args.dry_run and step.script:
            print("".join(f"      {line}\n" for line in step.script.splitlines()), end="")
        if step.changes and not args.dry_run:
            _apply(ssh, step, binary, contents)
    if args.dry_run:
        print(
            f"{len(changes)} step(s) would change {args.host}"
            if changes
            else f"nothing would change on {args.host}"
        )
        return 0
    if changes:
        print(f"{len(changes)} step(s) changed {args.host}")
    else:
        print(f"nothing changed: {args.host} already has everything node add installs")
    if args.wait > 0:
        _wait_registered(client(args), name, args.wait, args.host, before)
    return 0


def _wanted(path: str, content: bytes, mode: int, label: str, says: str) -> WantedFile:
    return WantedFile(
        path=path,
        sha256=hashlib.sha256(content).hexdigest(),
        size=len(content),
        mode=mode,
        content=label,
        says=says,
    )


def _join_token(path: Path | None) -> str:
    if path is None and (token := os.environ.get(JOIN_TOKEN_ENV, "").strip()):
        return token
    path = path or DEFAULT_JOIN_TOKEN
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise CtlError(
            f"cannot read the join token from {path}: {e.strerror}; give the server's "
            f"<data_dir>/join-token with --join-token-file, or set ${JOIN_TOKEN_ENV}"
        ) from None
    if not token:
        raise CtlError(f"{path} is empty: it should hold the server's join token")
    return token


def _binary_for(platform: onboarding.Platform, directory: Path | None) -> Path:
    if directory is None:
        frozen = getattr(sys, "frozen", False)
        directory = Path(sys.executable).parent if frozen else Path("dist")
    candidates: dict[str, onboarding.Platform | None] = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError as e:
        raise CtlError(
            f"cannot list the binaries in {directory}: {e.strerror}; give their directory with --binaries"
        ) from None
    for entry in entries:
        if entry.is_file() and (entry.name == "llmgw" or entry.name.startswith("llmgw-")):
            with open(entry, "rb") as f:
                candidates[entry.name] = onboarding.executable_platform(f.read(onboarding.HEADER_BYTES))
    try:
        return directory / onboarding.choose_binary(platform, candidates, str(directory))
    except NoBinary as e:
        raise CtlError(str(e)) from None


def _file_digest(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _apply(ssh: Ssh, step: Step, binary: Path, contents: dict[str, bytes]) -> None:
    if step.stdin == "binary":
        with open(binary, "rb") as f:
            ssh.run(step.script, stdin=f, timeout=COPY_TIMEOUT, what=step.says)
    else:
        ssh.run(step.script, stdin=contents.get(step.stdin or "", b""), what=step.says)


def _registrations(client, name: str) -> int:
    """The node's registrations so far (-1: the server does not know it yet)."""
    nodes = {node["name"]: node for node in client.get("/admin/v1/nodes")["nodes"]}
    return nodes[name].get("registrations", -1) if name in nodes else -1


def _wait_registered(client, name: str, wait: float, host: str, before: int | None) -> None:
    print(f"waiting up to {wait:g}s for node {name} to register with the server", flush=True)
    end = time.monotonic() + wait
    while True:
        nodes = {node["name"]: node for node in client.get("/admin/v1/nodes")["nodes"]}
        if onboarding.registered(nodes.get(name), before):
            print(f"node {name} registered: {nodes[name]['state']}")
            return
        if time.monotonic() >= end:
            raise CtlError(
                f"node {name} did not register within {wait:g}s: see the agent's log on {host} "
                f"(journalctl -u {onboarding.UNIT_NAME}), and whether it reaches the server's link address"
            )
        time.sleep(POLL_INTERVAL)


def _check_name(name: str, what: str) -> None:
    """The name goes into the node's agent.yaml, which the agent refuses unless it follows the rule."""
    if not NODE_NAME.fullmatch(name):
        raise CtlError(f"{what}: {name!r} is not {NODE_NAME_RULE}")


class Ssh:
    """``ssh HOST script``, non-interactive (BatchMode: a password prompt would hang node add)."""

    def __init__(self, host: str, config: Path | None) -> None:
        self.host = host
        self._base = ["ssh", "-T", "-o", "BatchMode=yes", *(["-F", str(config)] if config else [])]

    def run(self, script: str, *, stdin=b"", timeout: float = SSH_TIMEOUT, what: str = "the probe") -> str:
        # "--": a HOST beginning with '-' is a destination, never an option (-oProxyCommand=...).
        command = [*self._base, "--", self.host, onboarding.as_root(script)]
        kwargs = {"input": stdin} if isinstance(stdin, bytes) else {"stdin": stdin}
        try:
            result = subprocess.run(command, capture_output=True, timeout=timeout, **kwargs)
        except FileNotFoundError:
            raise CtlError("no `ssh` command on this machine: install the OpenSSH client") from None
        except subprocess.TimeoutExpired:
            raise CtlError(f"{self.host}: {what}: no answer within {timeout:g}s") from None
        if result.returncode != 0:
            detail = result.stderr.decode(errors="replace").strip() or f"exit status {result.returncode}"
            raise CtlError(f"{self.host}: {what} failed: {detail}")
        return result.stdout.decode(errors="replace")
