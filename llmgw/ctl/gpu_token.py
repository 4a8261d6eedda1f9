"""`ctl engine-check --gpu-token MODEL`: compute one token with llama-server and say where it ran.

At its default verbosity llama.cpp says neither which devices it uses nor where its layers went;
at `-lv 4` it does (`offloaded 25/25 layers to GPU`, `CUDA0 model buffer size = ...`). So this
starts the server for one token at that level, reads its output, and stops it (by process group).
On a machine without a usable GPU it says so: that is an answer, not a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import attrs

# Loading a model onto a GPU can take a while; a token after that is quick.
READY_DEADLINE = 300.0
TOKEN_TIMEOUT = 120.0

_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB")
_NO_GPU = "no usable GPU found"


@attrs.frozen
class Placement:
    """Where llama.cpp put the model, from its own -lv 4 output."""

    offloaded: tuple[int, int] | None  # (layers on GPUs, layers in all), when it said
    buffers: dict[str, float]  # device → MiB of model weights ("CUDA0", "CPU_Mapped", ...)
    no_gpu: bool  # it found no usable GPU

    def describe(self) -> str:
        where = ", ".join(f"{device} {mib:,.0f} MiB" for device, mib in self.buffers.items()) or "-"
        if self.no_gpu:
            return f"no usable GPU: every layer on the CPU (model buffers: {where})"
        if self.offloaded is not None:
            on, total = self.offloaded
            return f"{on} of {total} layers offloaded to GPU (model buffers: {where})"
        return f"llama.cpp did not say where its layers went (model buffers: {where})"


def placement_from_log(text: str) -> Placement:
    """Pure: what llama-server's output at -lv 4 says about where the model went."""
    offloaded = _OFFLOADED.search(text)
    buffers: dict[str, float] = {}
    for device, mib in _BUFFER.findall(text):
        buffers[device] = buffers.get(device, 0.0) + float(mib)
    return Placement(
        offloaded=(int(offloaded[1]), int(offloaded[2])) if offloaded else None,
        buffers=buffers,
        no_gpu=_NO_GPU in text,
    )


def one_token(llama_server: str, model: Path) -> tuple[Placement, str]:
    """Starts llama-server on ``model`` with every layer asked onto the GPU, computes one token,
    stops it; returns where the model went and the token."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="llmgw-gpu-token-") as directory:
        log_path = Path(directory) / "llama-server.log"
        argv = [llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["-ngl", "999", "-lv", "4", "--parallel", "1"]
        with open(log_path, "wb") as log:
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(port, server)
            token = _complete(port)
        finally:
            _stop(server)
        return placement_from_log(log_path.read_text(errors="replace")), token


def _wait_ready(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_DEADLINE
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not ready within {READY_DEADLINE:.0f} s")


def _complete(port: int) -> str:
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=TOKEN_TIMEOUT) as response:
        return json.loads(response.read())["choices"][0]["text"]


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
