"""The multi-rank fake engine keeps llmgw honest only if it refuses what is wrong: each broken
promise makes it exit 2 naming the variable or flag, rank 0 serves no HTTP before its worker
joined, and ranks exit when a peer goes away. On loopback (interface lo holds 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from llmgw.core.engines.sglang import LAUNCH_PROGRAM
from tests.helpers import TESTS
from tests.procs import Proc, wait_until

pytestmark = pytest.mark.slow

FAKE = TESTS / "fake_multirank_engine.py"
GOOD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "NCCL_SOCKET_IFNAME": "=lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "FAKE_ENGINE_EXPECT_IB_HCA": "=mlx5_0",
    "FAKE_ENGINE_EXPECT_IB_GID_INDEX": "3",
    "NCCL_IB_HCA": "=mlx5_0",
    "NCCL_IB_GID_INDEX": "3",
    "FAKE_ENGINE_JOIN_TIMEOUT": "30",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def vllm_rank(rank: int, port: int, master_port: int) -> list[str]:
    argv = [sys.executable, str(FAKE), "serve", "/m", "--served-model-name", "big", "--host", "0.0.0.0"]
    argv += ["--port", str(port), "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    argv += ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(master_port)]
    return argv + (["--headless"] if rank else [])


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status
    except OSError:
        return None


def refused(argv: list[str], **env: str) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, **GOOD_ENV, **env}
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def test_rank_0_serves_once_its_worker_joined_and_exits_when_it_goes(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    leader = Proc(vllm_rank(0, port, master), tmp_path / "rank0.log", env=GOOD_ENV)
    worker = None
    try:
        wait_until(lambda: "waits for 1 workers" in leader.output(), "rank 0 to listen", proc=leader)
        assert health(port) is None  # no HTTP before every worker is there
        worker = Proc(vllm_rank(1, port + 1, master), tmp_path / "rank1.log", env=GOOD_ENV)
        wait_until(lambda: health(port) == 200, "rank 0 to serve", proc=leader)
        assert "joined 127.0.0.1" in worker.output() and "serving HTTP" not in worker.output()
        worker.kill9()
        assert leader.popen.wait(timeout=30) == 1
        assert "went away" in leader.output()
    finally:
        leader.stop()
        if worker is not None:
            worker.stop()


def test_a_worker_exits_when_its_master_goes(tmp_path: Path) -> None:
    port, master = free_port(), free_port()
    leader = Proc(vllm_rank(0, port, master), tmp_path / "rank0.log", env=GOOD_ENV)
    worker = Proc(vllm_rank(1, port + 1, master), tmp_path / "rank1.log", env=GOOD_ENV)
    try:
        wait_until(lambda: health(port) == 200, "rank 0 to serve", proc=leader)
        os.killpg(leader.pid, signal.SIGKILL)
        assert worker.popen.wait(timeout=30) == 1
        assert "master went away" in worker.output()
    finally:
        leader.stop()
        worker.stop()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"NCCL_SOCKET_IFNAME": "lo"}, "NCCL_SOCKET_IFNAME is 'lo', expected '=lo'"),
        ({"GLOO_SOCKET_IFNAME": "eth0"}, "GLOO_SOCKET_IFNAME is 'eth0', expected 'lo'"),
        ({"VLLM_HOST_IP": "10.9.9.9"}, "VLLM_HOST_IP is '10.9.9.9'"),
        ({"NCCL_IB_GID_INDEX": "1"}, "NCCL_IB_GID_INDEX is '1', expected '3'"),
        ({"NCCL_IB_HCA": "mlx5_0"}, "NCCL_IB_HCA is 'mlx5_0', expected '=mlx5_0'"),
        ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES='0' gives 1 GPUs"),
    ],
)
def test_a_broken_promise_is_named(env: dict[str, str], named: str) -> None:
    assert named in refused(vllm_rank(0, free_port(), free_port()), **env)


def test_flags_that_break_the_rank_contract_are_named() -> None:
    port, master = free_port(), free_port()
    not_headless = vllm_rank(1, port, master)[:-1]
    assert "rank 1 is not headless" in refused(not_headless)
    outside = vllm_rank(0, port, master)
    outside[outside.index("--node-rank") + 1] = "2"
    assert "--node-rank 2 is not a rank of --nnodes 2" in refused(outside)
    elsewhere = vllm_rank(0, port, master)
    elsewhere[elsewhere.index("--master-addr") + 1] = "10.9.9.9"
    assert "no interface of this node holds 10.9.9.9" in refused(elsewhere)
    # SGLang as llmgw starts it (its launch program), handed a key on a rank that serves no HTTP.
    sglang = [sys.executable, str(FAKE), "-c", LAUNCH_PROGRAM, "--node-rank", "1", "--nnodes", "2"]
    sglang += ["--dist-init-addr", f"127.0.0.1:{master}", "--tp-size", "4"]
    assert "--api-key given to a rank that serves no HTTP" in refused(sglang, LLMGW_ENGINE_KEY="k")
    ray_worker = [sys.executable, str(FAKE), "start", "--address", f"127.0.0.1:{master}"]
    assert "without --block" in refused(ray_worker + ["--node-ip-address", "127.0.0.1"])
    assert "its own address 127.0.0.1 as the head's" in refused(
        ray_worker + ["--node-ip-address", "127.0.0.1", "--block"]
    )
