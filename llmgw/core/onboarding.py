"""``ctl node add``'s decisions: what a node needs to run the agent, and which steps get it there.

The shell (:mod:`llmgw.ctl.node_add`) runs one read-only probe on the node over SSH; this module
parses what it printed into :class:`NodeFacts`, and :func:`plan` compares those facts with what the
node should have (:class:`Wanted`) and returns every step, each saying whether it changes
anything. A second run finds everything as wanted and plans no change, which is what makes the
command idempotent: nothing is re-copied, no user re-made, the agent not restarted.

Every step is a shell script run as root on the node; what it writes arrives on its stdin (so the
join token never appears in any process's argv, locally or on the node). ``Layout.root`` prefixes
every path, so a test can install into a directory instead of a machine's real /etc.
"""

from __future__ import annotations

import json
import shlex
import struct

import attrs

ENGINE_USER = "llmgw-engine"
# The device nodes of GPUs belong to these groups: video (NVIDIA's /dev/nvidia*, when the driver's
# udev rules say so) and render (/dev/dri/renderD*, which AMD's ROCm and Intel need). A missing
# group is made as a system group: the udev rules of a driver installed later then grant the user
# access without running node add again.
ENGINE_GROUPS = ("video", "render")
UNIT_NAME = "llmgw-agent.service"
# The link port a server listens on unless its server.yaml says otherwise.
DEFAULT_LINK_PORT = 7070

# Suffix of the file a step writes before renaming it over the real one: a node never sees half a
# binary or half a config, even when the connection drops mid-copy.
_PARTIAL = ".llmgw-new"


@attrs.frozen
class Platform:
    """What ``uname -s -m`` says, normalised: ("Linux", "x86_64"), ("Linux", "aarch64")."""

    system: str
    machine: str

    def __str__(self) -> str:
        return f"{self.system} {self.machine}"


# uname -m and the names binaries are built under differ between systems for the same machine.
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def normalise_platform(system: str, machine: str) -> Platform:
    machine = machine.strip().lower()
    return Platform(system.strip().capitalize(), _MACHINE_ALIASES.get(machine, machine))


# ELF e_machine values (the ELF specification's registry) of the machines llmgw builds for.
_ELF_MACHINES = {0x3E: "x86_64", 0xB7: "aarch64", 0x03: "i386", 0xF3: "riscv64", 0x15: "ppc64"}
# ELF EI_OSABI: 0 (System V) is what Linux toolchains write; 3 is GNU/Linux.
_ELF_LINUX_ABIS = {0, 3}
# Mach-O's 64-bit magic as the file's first four bytes (little-endian), and its CPU types.
_MACHO_64 = b"\xcf\xfa\xed\xfe"
_MACHO_CPUS = {0x01000007: "x86_64", 0x0100000C: "aarch64"}
# Enough of a file to read either header.
HEADER_BYTES = 64


def executable_platform(header: bytes) -> Platform | None:
    """The platform an executable was built for, from its first bytes; None when it is not a
    native executable (a script, a text file, a truncated binary)."""
    if header[:4] == b"\x7fELF" and len(header) >= 20:
        little = header[5] == 1
        (machine,) = struct.unpack("<H" if little else ">H", header[18:20])
        if header[7] not in _ELF_LINUX_ABIS or machine not in _ELF_MACHINES:
            return None
        return Platform("Linux", _ELF_MACHINES[machine])
    if header[:4] == _MACHO_64 and len(header) >= 8:
        (cpu,) = struct.unpack("<I", header[4:8])
        return Platform("Darwin", _MACHO_CPUS[cpu]) if cpu in _MACHO_CPUS else None
    return None


class NoBinary(Exception):
    """No frozen binary for the node's platform; the message lists what there is."""


def choose_binary(node: Platform, candidates: dict[str, Platform | None], where: str) -> str:
    """The name of the candidate built for ``node``; ``candidates`` maps each file's name to the
    platform its header says (None: not a native executable). Raises NoBinary saying why not."""
    matching = sorted(name for name, platform in candidates.items() if platform == node)
    if matching:
        # llmgw-linux-x86_64 over a plain llmgw when both match: the named one was built for it.
        return max(matching, key=lambda name: (name != "llmgw", name))
    if not candidates:
        found = "none at all"
    else:
        found = ", ".join(
            f"{name} ({platform or 'not a native executable'})"
            for name, platform in sorted(candidates.items())
        )
    raise NoBinary(
        f"no llmgw binary for {node} in {where} (found: {found}); build one on a {node} machine with "
        f"scripts/build-binary.sh and put it there as llmgw-{node.system.lower()}-{node.machine}"
    )


# --- where things go on the node ---------------------------------------------------------------


@attrs.frozen
class Layout:
    """The paths node add writes on a node, under ``root`` ("/" on a real node)."""

    root: str = "/"

    def path(self, absolute: str) -> str:
        return absolute if self.root in ("", "/") else self.root.rstrip("/") + absolute

    @property
    def binary(self) -> str:
        return self.path("/usr/local/bin/llmgw")

    @property
    def config_dir(self) -> str:
        return self.path("/etc/llmgw")

    @property
    def config(self) -> str:
        return self.path("/etc/llmgw/agent.yaml")

    @property
    def join_token(self) -> str:
        return self.path("/etc/llmgw/join-token")

    @property
    def unit(self) -> str:
        return self.path(f"/etc/systemd/system/{UNIT_NAME}")

    @property
    def work_dir(self) -> str:
        return self.path("/var/lib/llmgw/agent")

    @property
    def engine_home(self) -> str:
        # The directory the agent gives engines as HOME (runas.prepare_home): the user's home too,
        # so that a shell as the user (sudo -u llmgw-engine) sees the engines' caches.
        return f"{self.work_dir}/home/{ENGINE_USER}"

    @property
    def prefixed(self) -> bool:
        return self.root not in ("", "/")

    def exec_start(self) -> list[str]:
        return [self.binary, "agent", "--config", self.config]


def _yaml_string(value: str) -> str:
    # A JSON string is a YAML flow scalar: quoting a name or path this way is always safe.
    return json.dumps(value)


def agent_yaml(node_name: str, server_addresses: list[str], layout: Layout) -> str:
    """agent.yaml for the node. The token is in its own file: this one may be shown and copied.
    Several addresses: servers sharing one store, each of which the agent links to."""
    if len(server_addresses) == 1:
        servers = f"  address: {_yaml_string(server_addresses[0])}\n"
    else:
        servers = "  addresses:\n" + "".join(f"    - {_yaml_string(a)}\n" for a in server_addresses)
    return (
        "# Written by `llmgw ctl node add`; running it again replaces this file.\n"
        f"node_name: {_yaml_string(node_name)}\n"
        f"work_dir: {_yaml_string(layout.work_dir)}\n"
        "server:\n"
        f"{servers}"
        f"  join_token_file: {_yaml_string(layout.join_token)}\n"
        "engines:\n"
        f"  run_as: {_yaml_string(ENGINE_USER)}\n"
        # Engines outlive the agent: a restart of the unit adopts them instead of reloading models.
        "  stop_shards_on_exit: false\n"
    )


def unit_text(node_name: str, layout: Layout) -> str:
    """The systemd unit running the agent."""
    exec_start = " ".join(_systemd_quote(arg) for arg in layout.exec_start())
    return (
        "# Written by `llmgw ctl node add`; running it again replaces this file.\n"
        "[Unit]\n"
        f"Description=llmgw agent of node {node_name}\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=exec\n"
        f"ExecStart={exec_start}\n"
        "Restart=always\n"
        "RestartSec=2\n"
        # systemd.kill(5): with KillMode=process a stop signals the main process (the agent) only,
        # and the engines it started stay in the unit's cgroup, serving; the next agent adopts
        # them. The default (control-group) would kill every engine on a restart of the unit.
        "KillMode=process\n"
        # Engines need many open files (sockets, model shards) and the agent's limit is theirs.
        "LimitNOFILE=1048576\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def _systemd_quote(arg: str) -> str:
    # systemd splits ExecStart like a shell but takes only double quotes and backslash escapes.
    if arg and all(c.isalnum() or c in "/._-+=:@" for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --- what the node has --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WantedFile:
    """A file node add writes: its content goes on the step's stdin (``content`` names which)."""

    path: str
    sha256: str
    size: int
    mode: int  # 0o755, 0o600, ...
    content: str  # "binary", "config", "token", "unit": which bytes the shell sends
    says: str  # what it is, for the step's line


@attrs.frozen(kw_only=True)
class Wanted:
    node_name: str
    layout: Layout
    files: tuple[WantedFile, ...]


@attrs.frozen(kw_only=True)
class FileFacts:
    sha256: str | None  # None: the file is missing
    mode: int | None = None
    owner: str | None = None  # numeric, "0:0"


@attrs.frozen(kw_only=True)
class NodeFacts:
    platform: Platform
    uid: int  # of the SSH user: steps run through sudo when it is not 0
    hostname: str
    systemd: bool  # systemd runs the node (/run/systemd/system exists)
    files: tuple[FileFacts, ...]  # in the order of Wanted.files
    user_groups: frozenset[str] | None  # the engine user's supplementary groups; None: no user
    user_ids: str | None  # the engine user's "uid:gid"; None: no user
    groups: frozenset[str]  # which of ENGINE_GROUPS exist
    home: FileFacts  # sha256 is "" for a directory that exists
    enabled: bool
    active: bool


def probe_script(wanted_paths: list[str], layout: Layout) -> str:
    """A read-only script printing the facts :func:`parse_probe` reads, one per line."""
    q = shlex.quote
    root = q(layout.root or "/")
    lines = [
        'echo "uname $(uname -s) $(uname -m)"',
        'echo "uid $(id -u)"',
        'echo "hostname $(hostname)"',
        'if [ -d /run/systemd/system ]; then echo "systemd yes"; else echo "systemd no"; fi',
    ]
    for index, path in enumerate(wanted_paths):
        lines.append(
            f"if [ -f {q(path)} ]; then echo \"file {index} $(sha256sum < {q(path)} | cut -d' ' -f1)"
            f' $(stat -c %a:%u:%g {q(path)})"; else echo "file {index} - -"; fi'
        )
    # The user and group databases of the layout's root: its files when prefixed (useradd
    # --prefix edits them), the name service otherwise (which also sees LDAP's users).
    passwd, group = _databases(layout)
    lines += [
        f'entry=$({passwd}); if [ -n "$entry" ]; then echo "user $(echo "$entry" | cut -d: -f3,4)";'
        ' else echo "user -"; fi',
        f'{group} | while IFS=: read -r name _ _ members; do echo "group $name $members"; done',
        f'if [ -d {q(layout.engine_home)} ]; then echo "home $(stat -c %a:%u:%g {q(layout.engine_home)})";'
        ' else echo "home -"; fi',
        f'if systemctl --root={root} is-enabled {UNIT_NAME} >/dev/null 2>&1; then echo "enabled yes";'
        ' else echo "enabled no"; fi',
        f'if [ -d /run/systemd/system ] && systemctl is-active --quiet {UNIT_NAME}; then echo "active yes";'
        ' else echo "active no"; fi',
    ]
    return "\n".join(lines) + "\n"


class ProbeError(ValueError):
    """The probe's output is not what the script prints: the node's shell is not a POSIX one, or
    a command the probe needs is missing."""


def _databases(layout: Layout) -> tuple[str, str]:
    """Commands printing the engine user's passwd line and the engine groups' lines: the layout's
    own files when prefixed (useradd --prefix edits those), else the name service (which also
    sees users from LDAP)."""
    q = shlex.quote
    if layout.prefixed:
        return (
            f"grep '^{ENGINE_USER}:' {q(layout.path('/etc/passwd'))}",
            f"grep -E '^({'|'.join(ENGINE_GROUPS)}):' {q(layout.path('/etc/group'))}",
        )
    return f"getent passwd {ENGINE_USER}", f"getent group {' '.join(ENGINE_GROUPS)}"


def parse_probe(text: str, file_count: int) -> NodeFacts:
    values: dict[str, list[str]] = {}
    files: dict[int, FileFacts] = {}
    groups: set[str] = set()
    members: set[str] = set()
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "file":
            index, sha, owner_mode = (rest.split() + ["-", "-"])[:3]
            files[int(index)] = _file_facts(sha, owner_mode)
        elif word == "group":
            name, _, listed = rest.partition(" ")
            groups.add(name)
            if ENGINE_USER in listed.strip().split(","):
                members.add(name)
        else:
            values[word] = rest.split()
    missing = [key for key in ("uname", "uid", "hostname", "systemd", "user", "home", "enabled", "active")
               if key not in values]  # fmt: skip
    if missing or len(values["uname"]) != 2 or sorted(files) != list(range(file_count)):
        raise ProbeError(
            f"the node's answer to the probe lacks {', '.join(missing) or 'file lines'}:\n{text}"
        )
    home = values["home"]
    return NodeFacts(
        platform=normalise_platform(*values["uname"]),
        uid=int(values["uid"][0]),
        hostname=values["hostname"][0] if values["hostname"] else "",
        systemd=values["systemd"] == ["yes"],
        files=tuple(files[i] for i in range(file_count)),
        user_groups=frozenset(members) if values["user"] != ["-"] else None,
        user_ids=values["user"][0] if values["user"] != ["-"] else None,
        groups=frozenset(groups),
        home=_file_facts("" if home != ["-"] else "-", home[0] if home != ["-"] else "-"),
        enabled=values["enabled"] == ["yes"],
        active=values["active"] == ["yes"],
    )


def _file_facts(sha: str, mode_owner: str) -> FileFacts:
    if sha == "-":
        return FileFacts(sha256=None)
    mode, _, owner = mode_owner.partition(":")
    return FileFacts(sha256=sha, mode=int(mode, 8), owner=owner)


# --- the steps ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Step:
    says: str  # what the step does (or found), for the operator
    script: str  # run as root on the node; "" for a step with nothing to run
    stdin: str | None = None  # which content goes on its stdin (WantedFile.content)
    changes: bool  # False: already as wanted, nothing runs
    # Something the operator has to do (nothing here can), shown as a note rather than "ok".
    notice: bool = False
    starts_agent: bool = False  # it starts or restarts the agent


def plan(facts: NodeFacts, wanted: Wanted) -> list[Step]:
    """Every step, in order; a step that ``changes`` nothing has nothing to run."""
    layout = wanted.layout
    steps: list[Step] = []
    for want, have in zip(wanted.files, facts.files, strict=True):
        steps.append(_file_step(want, have))
    steps += _user_steps(facts, layout)
    changed_files = any(step.changes for step in steps)
    steps += _service_steps(facts, layout, changed=changed_files)
    return steps


def _file_step(want: WantedFile, have: FileFacts) -> Step:
    mode = f"{want.mode:04o}"
    if have.sha256 == want.sha256 and have.mode == want.mode and have.owner == "0:0":
        return Step(says=f"{want.says}: {want.path} already as wanted", script="", changes=False)
    q = shlex.quote
    directory = want.path.rsplit("/", 1)[0] or "/"
    partial = q(want.path + _PARTIAL)
    script = "\n".join(
        [
            "set -e",
            # Directories as a distribution makes them (/usr/local/bin, /etc/systemd/system must
            # stay readable); the file private until its mode is set.
            f"(umask 022 && mkdir -p {q(directory)})",
            "umask 077",
            f"cat > {partial}",
            f"chown root:root {partial}",
            f"chmod {mode} {partial}",
            f"mv -f {partial} {q(want.path)}",
        ]
    )
    if have.sha256 is None:
        verb = "write"
    elif have.sha256 == want.sha256:
        verb = f"set owner root:root and mode {mode} of"
    else:
        verb = "replace"
    return Step(
        says=f"{want.says}: {verb} {want.path} ({mode}, {_size(want.size)})",
        script=script,
        stdin=want.content,
        changes=True,
    )


def _size(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} bytes"


def _user_steps(facts: NodeFacts, layout: Layout) -> list[Step]:
    q = shlex.quote
    prefix = f" --prefix {q(layout.root)}" if layout.prefixed else ""
    steps = []
    missing_groups = [group for group in ENGINE_GROUPS if group not in facts.groups]
    if missing_groups:
        steps.append(
            Step(
                says=f"groups: create {', '.join(missing_groups)} (system groups; GPU device nodes use them)",
                script="set -e\n"
                + "".join(f"groupadd{prefix} --system {group}\n" for group in missing_groups),
                changes=True,
            )
        )
    else:
        steps.append(Step(says=f"groups: {', '.join(ENGINE_GROUPS)} exist", script="", changes=False))
    groups = ",".join(ENGINE_GROUPS)
    home = layout.engine_home
    # The home's path as the user database records it (unprefixed: what the node will see).
    recorded_home = home[len(layout.root.rstrip("/")) :] if layout.prefixed else home
    if facts.user_groups is None:
        steps.append(
            Step(
                says=f"user: create {ENGINE_USER} (system user, groups {groups}, no login shell)",
                script=(
                    f"useradd{prefix} --system --user-group --no-create-home --home-dir {q(recorded_home)}"
                    f" --shell /usr/sbin/nologin --groups {groups} {ENGINE_USER}\n"
                ),
                changes=True,
            )
        )
    elif lacking := [g for g in ENGINE_GROUPS if g not in facts.user_groups]:
        steps.append(
            Step(
                says=f"user: add {ENGINE_USER} to {', '.join(lacking)}",
                script=f"usermod{prefix} --append --groups {','.join(lacking)} {ENGINE_USER}\n",
                changes=True,
            )
        )
    else:
        steps.append(Step(says=f"user: {ENGINE_USER} exists, in {groups}", script="", changes=False))
    if facts.user_ids is not None and facts.home.mode == 0o700 and facts.home.owner == facts.user_ids:
        steps.append(Step(says=f"home: {home} exists, 0700, the user's", script="", changes=False))
    else:
        # Numeric ids from the layout's own user database (a prefixed root's user is not in the
        # node's name service); the user may have been made by the step before this one.
        passwd, _group = _databases(layout)
        ids = f"ids=$({passwd} | cut -d: -f3,4)\n"
        work_dir = layout.work_dir
        steps.append(
            Step(
                says=f"home: make {home} (0700, the user's; the agent's work directory {work_dir} 0711)",
                script=(
                    f"set -e\n{ids}"
                    # 0711: the engine user may cross the work directory to its home, and list
                    # nothing of it (the same modes the agent sets at start).
                    f"mkdir -p {q(home)}\n"
                    f"chmod 0711 {q(work_dir)} {q(work_dir + '/home')}\n"
                    f'chown "$ids" {q(home)}\n'
                    f"chmod 0700 {q(home)}\n"
                ),
                changes=True,
            )
        )
    return steps


def _service_steps(facts: NodeFacts, layout: Layout, *, changed: bool) -> list[Step]:
    root = shlex.quote(layout.root or "/")
    steps = []
    if facts.enabled:
        steps.append(Step(says=f"service: {UNIT_NAME} enabled", script="", changes=False))
    else:
        steps.append(
            Step(
                says=f"service: enable {UNIT_NAME} (started at boot)",
                # --root works without a running systemd: it makes the wants link only.
                script=f"systemctl --root={root} enable {UNIT_NAME}\n",
                changes=True,
            )
        )
    command = " ".join(shlex.quote(arg) for arg in layout.exec_start())
    if not facts.systemd or layout.prefixed:
        why = "systemd is not running there" if not facts.systemd else "the layout is under a prefix"
        steps.append(
            Step(
                says=f"service: cannot start it ({why}): start the agent as the unit does: {command}",
                script="",
                changes=False,
                notice=True,
            )
        )
    elif changed and facts.active:
        steps.append(
            Step(
                says=f"service: restart {UNIT_NAME} to take the new files (engines keep running: KillMode=process)",
                script=f"systemctl daemon-reload\nsystemctl restart {UNIT_NAME}\n",
                changes=True,
                starts_agent=True,
            )
        )
    elif not facts.active:
        steps.append(
            Step(
                says=f"service: start {UNIT_NAME}",
                script=f"systemctl daemon-reload\nsystemctl start {UNIT_NAME}\n",
                changes=True,
                starts_agent=True,
            )
        )
    else:
        steps.append(Step(says=f"service: {UNIT_NAME} running", script="", changes=False))
    return steps


def as_root(script: str) -> str:
    """``script`` run by a root shell on the node: directly as root, else through ``sudo -n`` (no
    password prompt: node add runs unattended, and a prompt would wait forever)."""
    quoted = shlex.quote(script)
    return f'if [ "$(id -u)" -eq 0 ]; then exec sh -c {quoted}; else exec sudo -n sh -c {quoted}; fi'


def restarts_agent(steps: list[Step]) -> bool:
    """Whether the steps restart (or first start) the agent: then its registration must be newer
    than the one seen before, since the old link can still look connected for a moment."""
    return any(step.changes and step.starts_agent for step in steps)


def registered(node: dict | None, before: int | None) -> bool:
    """Whether ``node`` (the admin API's record, None: not known) counts as registered for a run
    that saw ``before`` registrations before restarting the agent (None: it did not restart it).
    A different count, not only a higher one: a server restarted meanwhile counts from zero."""
    if node is None or not node.get("connected"):
        return False
    return before is None or node.get("registrations") != before
