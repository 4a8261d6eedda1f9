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


__all__ = ["llamacpp_build_dir", "newest_first", "variant_problem", "version_numbers", "version_problem"]
