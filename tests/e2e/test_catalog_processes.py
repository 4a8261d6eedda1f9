"""The catalog through real processes: server.yaml's entries, ctl's, and a server restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.procs import Server, write_yaml

pytestmark = pytest.mark.slow

SERVER_CATALOG = {
    "models": {"smollm2-135m": {"path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "format": "gguf"}},
    "profiles": {
        "smollm2-cpu": {
            "model": "smollm2-135m",
            "engine": "llamacpp",
            "gpu_class": None,
            "memory_mib": 1024,
            "cpu_cores": 2,
        }
    },
}
APPLIED_CATALOG = {
    "models": {"org/qwen": {"path": "Qwen/Qwen2.5-7B-Instruct", "format": "safetensors"}},
    "profiles": {
        "qwen-l40s": {
            "model": "org/qwen",
            "engine": "vllm",
            "gpu_class": "l40s-45g",
            "gpus_per_node": 2,
            "tensor_parallel": 2,
            "memory_mib": 40000,
            "max_replicas": 3,
            "startup_timeout": "15m",
        }
    },
}


def server_with_catalog(tmp_path: Path) -> Server:
    server = Server(tmp_path)
    write_yaml(server.config, {**yaml.safe_load(server.config.read_text()), **SERVER_CATALOG})
    return server


def ok(server: Server, *args: str) -> str:
    result = server.ctl(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def profile_sources(server: Server) -> dict[str, str]:
    return {p["name"]: p["source"] for p in json.loads(ok(server, "profiles", "--json"))["profiles"]}


def test_catalog_from_server_yaml_and_ctl_survives_a_restart(tmp_path: Path):
    server = server_with_catalog(tmp_path).start()
    try:
        assert profile_sources(server) == {"smollm2-cpu": "config"}

        catalog_file = write_yaml(tmp_path / "catalog.yaml", APPLIED_CATALOG)
        assert (
            ok(server, "apply", "-f", str(catalog_file))
            == "model org/qwen: created\nprofile qwen-l40s: created\n"
        )
        assert profile_sources(server) == {"qwen-l40s": "api", "smollm2-cpu": "config"}

        assert server.proc.stop() == 0  # SIGTERM: a clean stop
        server.start()
        assert profile_sources(server) == {"qwen-l40s": "api", "smollm2-cpu": "config"}
        models = {m["name"]: m for m in json.loads(ok(server, "models", "--json"))["models"]}
        assert (models["org/qwen"]["source"], models["org/qwen"]["used_by"]) == ("api", ["qwen-l40s"])
        listing = ok(server, "profiles")
        assert "2× l40s-45g" in listing and "cpu 1 GiB" in listing

        assert ok(server, "delete", "profile", "qwen-l40s") == "profile qwen-l40s: deleted\n"
        refused = server.ctl("delete", "profile", "smollm2-cpu")
        assert refused.returncode == 1
        assert refused.stderr == (
            'error: server answered 409: profile "smollm2-cpu" is declared in server.yaml; '
            "remove it there and restart the server\n"
        )
        assert profile_sources(server) == {"smollm2-cpu": "config"}
    finally:
        server.proc.stop()
