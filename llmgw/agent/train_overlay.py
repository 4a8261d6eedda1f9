"""The training child's Python, made able to run it: the pinned peft/accelerate overlay.

On the first job the agent asks the configured Python which versions it imports (as the engines'
user, who will run the child). When the pins are met, nothing is added. Otherwise it pip-installs
exactly the pins, without dependencies and wheels only, into ``<root>/<hash of the pins>`` — a
fresh directory renamed into place once complete, so a half-done install is never on a child's
path — and checks again with that directory on PYTHONPATH. The decisions are
:mod:`llmgw.core.train_overlay`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import trio

from llmgw.agent import runas
from llmgw.agent.processes import base_environment, describe_exit
from llmgw.core.train_overlay import install_argv, overlay_problems, parse_probe, pins_hash, probe_argv

log = logging.getLogger(__name__)

# Importing peft imports torch, which on a cold disk takes a while.
PROBE_TIMEOUT = 300.0
INSTALL_TIMEOUT = 900.0
# Only these outside variables reach pip: how this site reaches a package index.
_PIP_ENV = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_CERT",
)


class OverlayFailed(Exception):
    """The child's Python cannot be made to run it; the message says why."""


class Overlay:
    """The PYTHONPATH the training child needs, found (and if need be installed) once."""

    def __init__(self, python: str, root: Path) -> None:
        self._python = python
        self._root = root
        self._path: str | None = None  # "" once the Python needs none; the path once installed
        self._lock = trio.Lock()

    async def path(self, user: runas.EngineUser) -> str:
        """The PYTHONPATH the child needs for the pinned peft/accelerate ("" for none); on first
        use, probes the configured Python and installs the pins into an overlay if it lacks them."""
        async with self._lock:
            if self._path is not None:
                return self._path
            found = await self._probe(user, "")
            if not overlay_problems(found):
                self._path = ""
                return ""
            target = self._root / pins_hash()
            if not target.is_dir():
                log.info(
                    "%s lacks the pinned peft/accelerate (%s); installing them into %s",
                    self._python,
                    "; ".join(overlay_problems(found)),
                    target,
                )
                await self._install(user, target)
            if problems := overlay_problems(await self._probe(user, str(target))):
                raise OverlayFailed(
                    f"{self._python} cannot run the training child, even with the overlay {target}: "
                    f"{'; '.join(problems)}"
                )
            self._path = str(target)
            return self._path

    async def _probe(self, user: runas.EngineUser, pythonpath: str) -> dict[str, str | None] | None:
        env = {**base_environment(user), **({"PYTHONPATH": pythonpath} if pythonpath else {})}
        with trio.move_on_after(PROBE_TIMEOUT):
            try:
                result = await trio.run_process(
                    probe_argv(self._python),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=env,
                    cwd=str(user.home),
                    start_new_session=True,
                    **user.credentials(),
                )
            except OSError as exc:
                raise OverlayFailed(f"cannot run engines.train_python {self._python!r}: {exc}") from None
            return parse_probe(result.stdout.decode(errors="replace"))
        raise OverlayFailed(
            f"{self._python} took longer than {PROBE_TIMEOUT:g}s to import peft and accelerate"
        )

    async def _install(self, user: runas.EngineUser, target: Path) -> None:
        """pip installs the pins as the engines' user into a fresh directory, renamed into place
        once complete: a half-done install is never on a child's path."""
        staging = target.with_name(f"{target.name}.partial")

        def make_staging() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(target.parent, 0o711)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(mode=0o755)
            os.chown(staging, user.uid, user.gid)

        await trio.to_thread.run_sync(make_staging)
        env = {**base_environment(user), **{k: os.environ[k] for k in _PIP_ENV if k in os.environ}}
        with trio.move_on_after(INSTALL_TIMEOUT) as timeout:
            try:
                result = await trio.run_process(
                    install_argv(self._python, str(staging)),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=env,
                    cwd=str(user.home),
                    start_new_session=True,
                    **user.credentials(),
                )
            except OSError as exc:
                raise OverlayFailed(f"cannot run {self._python} -m pip: {exc}") from None
        if timeout.cancelled_caught:
            raise OverlayFailed(
                f"installing the pinned peft/accelerate took longer than {INSTALL_TIMEOUT:g}s"
            )
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else describe_exit(result.returncode)
            raise OverlayFailed(f"cannot install the pinned peft/accelerate into {target}: {last}")
        await trio.to_thread.run_sync(os.rename, staging, target)
