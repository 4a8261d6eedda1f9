"""Engine flags against the engine's own ``--help``: which flags llmgw emits that an engine lacks.

Pure: help texts and argvs come in as values and ``ctl engine-check`` runs the engines, so the
decisions are tested on captured help texts without vLLM, SGLang or a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs

from llmgw.core.engines import DEFAULT_BINARIES, ENGINES, EngineBinaries, HelpCheck, build_plan, get
from llmgw.core.shard import ShardSpec

# An option token: a dash or two, then a name that ends in a letter or digit. Neither a word
# character nor a dash may touch it on either side, so "--port" is not found in "--port-range".
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*(?<=[A-Za-z0-9]))(?![\w-])")
# Where a definition line's option list ends: a run of spaces before the description.
_DESCRIPTION = re.compile(r"\s{2,}(?=[^\s-])")

# Per engine (its descriptor's HelpCheck): the argv tokens before the engine's own options, and
# the fewest help lines of a help that was not cut. A llama.cpp help cut to 400 of its lines once
# reported five live flags as missing; each minimum is about four fifths of what the release
# llmgw's builders follow prints, so a release that trims its help a little does not warn, and a
# cut one does.
# How an engine's help is asked for: wide enough that no option list wraps onto a line of its own,
# no escape codes among the flags (ctl engine-check, and the agent's check of a new install).
HELP_ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
ENGINE_ARGV_PREFIX = {name: engine.help.argv_prefix for name, engine in ENGINES.items()}
MIN_HELP_LINES = {name: engine.help.min_help_lines for name, engine in ENGINES.items()}


@attrs.frozen(kw_only=True)
class CheckResult:
    missing: tuple[str, ...]  # flags the argvs use that the help does not define, in first-use order
    truncated_warning: str | None  # set when the help is shorter than the engine's usual one

    @property
    def ok(self) -> bool:
        return not self.missing


@attrs.frozen(kw_only=True)
class CheckedCommand:
    """One engine command of a widest plan: which shard it comes from, and its engine options."""

    label: str  # e.g. "vLLM mp 2 nodes, rank 1 (headless)"
    options: tuple[str, ...]  # argv after ENGINE_ARGV_PREFIX


def help_flags(help_text: str) -> frozenset[str]:
    """The options a help text defines: the tokens at the head of each line starting with '-'.

    Prose mentioning a flag does not count: "--foo was removed" must not make --foo look alive.
    """
    flags: set[str] = set()
    for line in help_text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("-"):
            flags.update(OPTION.findall(_DESCRIPTION.split(stripped, maxsplit=1)[0]))
    return frozenset(flags)


def argv_flags(argv: Iterable[str]) -> list[str]:
    """The flags an argv uses, in order, each once; ``--x=y`` counts as ``--x``.

    Tokens that are not options (values, paths, "-1") are skipped.
    """
    flags: list[str] = []
    for token in argv:
        name = token.split("=", 1)[0]
        if OPTION.fullmatch(name) and name not in flags:
            flags.append(name)
    return flags


def install_problem(result: CheckResult, missing_users: dict[str, list[str]]) -> str | None:
    """Why a newly installed engine should not serve (flags llmgw gives it that its help lacks),
    or None. A help that looks truncated proves nothing missing, so it passes (with its warning
    logged by the caller)."""
    if result.ok or result.truncated_warning is not None:
        return None
    named = ", ".join(f"{flag} ({'; '.join(missing_users.get(flag, []))})" for flag in result.missing)
    return f"its help lacks flags llmgw gives it: {named}"


def check(argv_list: Iterable[Sequence[str]], help_text: str, *, engine: str) -> CheckResult:
    """Every flag of ``argv_list`` (engine options, without the engine's argv prefix) against
    ``engine``'s help text."""
    defined = help_flags(help_text)
    missing: list[str] = []
    for argv in argv_list:
        missing += [flag for flag in argv_flags(argv) if flag not in defined and flag not in missing]
    return CheckResult(missing=tuple(missing), truncated_warning=truncation_warning(help_text, engine))


def truncation_warning(help_text: str, engine: str) -> str | None:
    lines = len(help_text.splitlines())
    check = get(engine).help
    if lines >= check.min_help_lines:
        return None
    return (
        f"the help has {lines} lines, fewer than the {check.min_help_lines} expected: it looks truncated, "
        f"so flags reported missing may be there{check.truncation_hint}"
    )


# --- the widest commands llmgw produces ------------------------------------------------------------

# A key is given so that every option that comes with one is emitted.
_KEY = "engine-check-placeholder-key"


def widest_specs() -> dict[str, tuple[tuple[str, ShardSpec], ...]]:
    """Per engine, the shards whose commands together use every flag llmgw can emit.

    Multi-node included: a flag only a second node uses is the one nobody sees go missing.
    """
    return {name: engine.help.widest_specs for name, engine in ENGINES.items()}


def widest_commands(
    engine: str, binaries: EngineBinaries | None = None, check: HelpCheck | None = None
) -> tuple[CheckedCommand, ...]:
    """The engine commands of ``widest_specs()[engine]`` (of ``check``'s, a variant's, when
    given), built by the same builders the agent runs.

    Only commands named "engine" are the engine's: a Ray worker node runs `ray start` alone, whose
    flags are Ray's, not vLLM's.
    """
    binaries = binaries or DEFAULT_BINARIES
    check = check or get(engine).help
    prefix = check.argv_prefix
    commands = []
    for label, spec in check.widest_specs:
        plan = build_plan(spec, engine_key=_KEY, binaries=binaries)
        commands += [
            CheckedCommand(
                label=label, options=(*c.argv[prefix:], *(check.launch_options if c.serves_http else ()))
            )
            for c in plan.commands
            if c.name == "engine"
        ]
    return tuple(commands)


def users_of(flag: str, commands: Iterable[CheckedCommand]) -> list[str]:
    """The labels of the commands that use ``flag``."""
    return [c.label for c in commands if flag in argv_flags(c.options)]
