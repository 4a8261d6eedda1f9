"""A small stand-in for a Python engine's package (vllm, sglang), built into a wheelhouse by pip.

vLLM and SGLang are gigabytes of CUDA wheels; what the agent's install of them does (a virtual
environment, pip from a configured wheelhouse or index, the pinned version, the engine's entry
point) does not depend on their size. The stand-in is a real package under the engine's own name
and version, built here with ``pip wheel`` (offline: no build isolation, no index), so pip on the
node resolves ``vllm==0.33.0`` against it as it would against the real one. Its entry points are
the engine's: a ``vllm`` console script, and ``python -m sglang.launch_server``; both print the
real engine's captured help (tests/fixtures/engine-help/, optionally with flags taken out, as a
release that renamed them would) when asked for it, and otherwise run tests/fake_engine.py (the
engines' HTTP surface) with the interpreter of the environment they are installed in (the package carries its own copy, so the environment is all an engine's user needs
to read), and answer ``--version`` with the package's name and version.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import TESTS

FAKE_ENGINE = TESTS / "fake_engine.py"
HELP_TEXTS = {
    "vllm": TESTS / "fixtures" / "engine-help" / "vllm-0.33.0-serve-help.txt",
    "sglang": TESTS / "fixtures" / "engine-help" / "sglang-0.5.23-launch_server-help.txt",
}

_MODULE = '''"""A stand-in for {name} {version}, made by the llmgw tests."""
import os
import sys

VERSION = __version__ = "{version}"
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_ENGINE = os.path.join(HERE, "fake_engine.py")


def main():
    if sys.argv[1:] == ["--version"]:
        print("{name}", VERSION, "stand-in", sys.executable)
        return
    if "--help" in sys.argv or "--help=all" in sys.argv:
        with open(os.path.join(HERE, "help.txt")) as f:
            sys.stdout.write(f.read())
        return
    os.execv(sys.executable, [sys.executable, FAKE_ENGINE, *sys.argv[1:]])
'''


# vLLM's `python -m vllm.entrypoints.openai.api_server`: it imports each --middleware class, as the
# real server does before it serves (so a guard the program did not define fails the start here
# too), then runs the engines' HTTP surface like the console script.
_API_SERVER = """import importlib
import sys

args = sys.argv[1:]
for i, arg in enumerate(args):
    if arg == "--middleware":
        module, _, attr = args[i + 1].rpartition(".")
        getattr(importlib.import_module(module), attr)
from vllm import main

main()
"""


def build_wheel(
    work: Path, name: str, version: str, wheelhouse: Path, *, without_flags: tuple[str, ...] = ()
) -> Path:
    """Builds the stand-in ``name``==``version`` into ``wheelhouse``; returns the wheel. Its help
    is the captured one less every line naming one of ``without_flags``."""
    source = work / f"src-{name}-{version}"
    package = source / name
    package.mkdir(parents=True)
    packages = [name]
    if name == "vllm":
        # The module llmgw's key guard runs the server by (core.engines.vllm.GUARD_PROGRAM).
        server = package / "entrypoints" / "openai"
        server.mkdir(parents=True)
        (package / "entrypoints" / "__init__.py").write_text("")
        (server / "__init__.py").write_text("")
        (server / "api_server.py").write_text(_API_SERVER)
        packages += ["vllm.entrypoints", "vllm.entrypoints.openai"]
    (source / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n'
        "[project]\n"
        f'name = "{name}"\n'
        f'version = "{version}"\n'
        "[project.scripts]\n"
        f'{name} = "{name}:main"\n'
        "[tool.setuptools]\n"
        f"packages = {json.dumps(packages)}\n"
        "[tool.setuptools.package-data]\n"
        f'{name} = ["help.txt"]\n'
    )
    (package / "__init__.py").write_text(_MODULE.format(name=name, version=version))
    shutil.copyfile(FAKE_ENGINE, package / "fake_engine.py")
    lines = HELP_TEXTS[name].read_text().splitlines(keepends=True)
    dropped = [
        line
        for line in lines
        if not any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", line) for f in without_flags)
    ]
    (package / "help.txt").write_text("".join(dropped))
    (package / "launch_server.py").write_text(f"from {name} import main\n\nmain()\n")
    wheelhouse.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheelhouse), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    (wheel,) = wheelhouse.glob(f"{name}-{version}-*.whl")
    return wheel


def venv_python() -> str:
    """The Python nodes make engine environments with: the system one when there is one (as on a
    node), else this test's own."""
    system = Path("/usr/bin/python3")
    return str(system) if system.exists() else sys.executable
