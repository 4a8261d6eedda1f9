"""The user engines run as: an unprivileged one when the agent is root; root only when asked.

An engine runs model code from the internet (custom modelling files, tokenizer code) and serves
a port on the node's network; as root, a flaw in either is the whole node. ``llmgw ctl node
add`` makes the user, in the video and render groups so that it can open the GPUs.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import attrs


@attrs.frozen(kw_only=True)
class EngineUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, from the group database
    home: Path  # <work_dir>/home/<name>: working directory, HOME and cache of the engines
    switch: bool  # whether processes change to this user (it is not the agent's own)

    def credentials(self) -> dict[str, object]:
        """subprocess.Popen's arguments that make the child this user."""
        if not self.switch:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


class NoEngineUser(OSError):
    """``run_as`` names a user this node lacks. Nothing starts: the engine would run as root, which
    only ``run_as: root`` (or null) asks for. An OSError, as the other ways preparing to run a
    process fails, so every caller's handling of those takes it too."""


def resolve(run_as: str | None, work_dir: Path) -> tuple[EngineUser, str]:
    """The user engines run as, and a note to log: why it is not ``run_as``, or that it is root
    ("" otherwise). Raises NoEngineUser for a user the node lacks."""
    own = pwd.getpwuid(os.geteuid())
    if os.geteuid() != 0:
        note = (
            ""
            if run_as in (None, own.pw_name)
            else (f"the agent is not root, so engines run as its own user {own.pw_name!r}, not {run_as!r}")
        )
        return _user(own, work_dir, switch=False), note
    if run_as is None or run_as == own.pw_name:
        return _user(own, work_dir, switch=False), (
            f"engines run as root (engines.run_as: {run_as or 'null'}): a flaw in an engine, or in "
            "code a model brings, is then the whole node's"
        )
    try:
        entry = pwd.getpwnam(run_as)
    except KeyError:
        raise NoEngineUser(
            f"there is no user {run_as!r} on this node, and engines run as root only where "
            f"engines.run_as says root: make the user (`llmgw ctl node add` does, or: useradd "
            f"--system --user-group -G video,render {run_as})"
        ) from None
    return _user(entry, work_dir, switch=True), ""


def _user(entry: pwd.struct_passwd, work_dir: Path, *, switch: bool) -> EngineUser:
    return EngineUser(
        name=entry.pw_name,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        groups=tuple(g for g in os.getgrouplist(entry.pw_name, entry.pw_gid) if g != entry.pw_gid),
        home=work_dir / "home" / entry.pw_name,
        switch=switch,
    )


def prepare_home(user: EngineUser) -> None:
    """Makes the user's home: 0700 and theirs, inside a root-owned directory others may only cross.

    The engine starts there (the working directory is entered before the user changes, so it
    needs no access above it); HOME and XDG_CACHE_HOME reach it by path, which needs the work
    directory to be traversable by the user.
    """
    parent = user.home.parent
    parent.mkdir(parents=True, exist_ok=True)
    os.chmod(parent, 0o711)
    user.home.mkdir(exist_ok=True)
    os.chown(user.home, user.uid, user.gid)
    os.chmod(user.home, 0o700)
