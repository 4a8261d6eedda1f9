"""The user engines run as: an unprivileged one when the agent is root and that user exists.

An engine runs model code from the internet (custom modelling files, tokenizer code) and serves
a port on every address of the node; as root, a flaw in either is the whole node. ``llmgw ctl node
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


def resolve(run_as: str | None, work_dir: Path) -> tuple[EngineUser, str]:
    """The user engines run as, and why it is not ``run_as`` ("" when it is)."""
    own = pwd.getpwuid(os.geteuid())
    if run_as is None or run_as == own.pw_name:
        return _user(own, work_dir, switch=False), ""
    if os.geteuid() != 0:
        return _user(own, work_dir, switch=False), (
            f"the agent is not root, so engines run as its own user {own.pw_name!r}, not {run_as!r}"
        )
    try:
        entry = pwd.getpwnam(run_as)
    except KeyError:
        return _user(own, work_dir, switch=False), (
            f"there is no user {run_as!r} on this node, so engines run as root "
            f"(`llmgw ctl node add` makes it, or: useradd --system --user-group -G video,render {run_as})"
        )
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
