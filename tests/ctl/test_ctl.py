"""ctl without a server: where it finds server and token, how it renders, how it fails."""

from __future__ import annotations

import argparse
import io
import json
import socket
import stat
from pathlib import Path

import pytest
from rich.console import Console

from llmgw.ctl import commands, render
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.commands import add_ctl_parser
from llmgw.ctl.context import DEFAULT_SERVER, resolve, save_context

NOW = 1_700_000_000.0


def gpu(index: int, gpu_class: str, total: int, used: int, problems: tuple[str, ...] = ()) -> dict:
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA L40S",
        "gpu_class": gpu_class,
        "memory_total_mib": total,
        "memory_used_mib": used,
        "compute_capability": "8.9",
        "ecc_uncorrected": 0,
        "foreign_processes": [],
        "problems": list(problems),
    }


def node(
    name: str, *, state="online", connected=True, gpus=(), fabric="", last_seen=NOW - 2, available=0
) -> dict:
    return {
        "name": name,
        "state": state,
        "connected": connected,
        "agent_version": "0.1.0",
        "first_seen": NOW - 3600,
        "last_seen": last_seen,
        "state_since": NOW - 3600,
        "inventory": {
            "hostname": name,
            "cpu_count": 16,
            "memory_total_mib": 65_536,
            "memory_available_mib": available,
            "gpus": list(gpus),
            "ib_ports": [],
            "fabric": fabric,
            "mgmt_interface": "eth0",
            "mgmt_address": "10.0.0.1",
            "gpu_note": "",
        },
    }


NODES = [
    node(
        "gpu-1",
        gpus=[gpu(0, "l40s-45g", 46_068, 1_024), gpu(1, "l40s-45g", 46_068, 46_068)],
        fabric="ib-a",
    ),
    node("cpu-1", available=13_517, last_seen=NOW - 300),
    node(
        "gpu-2",
        state="lost",
        connected=False,
        gpus=[gpu(0, "h100-80g", 81_559, 0, problems=("ecc-uncorrected",)), gpu(1, "h100-80g", 81_559, 0)],
        last_seen=NOW - 7200,
    ),
]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmgw")
    add_ctl_parser(parser.add_subparsers(dest="role", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def context_file(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "config" / "llmgw" / "context.json"
    monkeypatch.setenv("LLMGW_CONTEXT", str(path))
    monkeypatch.delenv("LLMGW_SERVER", raising=False)
    monkeypatch.delenv("LLMGW_TOKEN", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- context ----------------------------------------------------------------------------------


def test_nothing_configured_gives_the_default_server_and_no_token(context_file: Path):
    context = resolve(None, None)
    assert (context.server, context.token) == (DEFAULT_SERVER, None)


def test_flags_beat_environment_beat_file(context_file: Path, monkeypatch):
    save_context("http://from-file:1", "file-token")
    assert resolve(None, None).server == "http://from-file:1"
    assert (resolve(None, None).token, resolve(None, None).source) == ("file-token", str(context_file))

    monkeypatch.setenv("LLMGW_SERVER", "http://from-env:2")
    monkeypatch.setenv("LLMGW_TOKEN", "env-token")
    context = resolve(None, None)
    assert (context.server, context.token, context.source) == (
        "http://from-env:2",
        "env-token",
        "$LLMGW_TOKEN",
    )

    context = resolve("http://from-flag:3/", "flag-token")
    assert (context.server, context.token, context.source) == ("http://from-flag:3", "flag-token", "--token")


def test_server_and_token_are_resolved_separately(context_file: Path, monkeypatch):
    save_context("http://from-file:1", "file-token")
    monkeypatch.setenv("LLMGW_SERVER", "from-env:2")
    context = resolve(None, None)
    assert (context.server, context.server_source) == ("http://from-env:2", "$LLMGW_SERVER")
    assert (context.token, context.source) == ("file-token", str(context_file))


def test_context_file_is_private(context_file: Path):
    save_context("http://10.0.0.5:7071", "secret")
    assert stat.S_IMODE(context_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(context_file.parent.stat().st_mode) == 0o700
    assert json.loads(context_file.read_text()) == {"server": "http://10.0.0.5:7071", "token": "secret"}
    # Overwriting leaves no temporary file behind.
    save_context("http://10.0.0.6:7071", "secret2")
    assert [p.name for p in context_file.parent.iterdir()] == ["context.json"]


def test_bad_context_file_names_the_file(context_file: Path):
    context_file.parent.mkdir(parents=True)
    context_file.write_text("{not json")
    with pytest.raises(CtlError, match=f"{context_file}.*not valid JSON"):
        resolve(None, None)
    # Both flags given: the file is not needed, so it does not stand in the way.
    assert resolve("http://x:1", "t").token == "t"

    context_file.write_text('["a list"]')
    with pytest.raises(CtlError, match=str(context_file)):
        resolve(None, None)


def test_context_set_reads_the_token_from_a_file_and_show_never_prints_it(context_file, tmp_path, capsys):
    token_file = tmp_path / "admin-token"
    token_file.write_text("very-secret\n")
    args = parse(["ctl", "context", "set", "--server", "http://head:7071", "--token-file", str(token_file)])
    assert args.func(args) == 0
    assert json.loads(context_file.read_text()) == {"server": "http://head:7071", "token": "very-secret"}

    args = parse(["ctl", "context", "show"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "http://head:7071" in out and str(context_file) in out
    assert "very-secret" not in out


def test_context_set_with_an_empty_token_file_fails(context_file, tmp_path, capsys):
    token_file = tmp_path / "admin-token"
    token_file.write_text("\n")
    args = parse(["ctl", "context", "set", "--server", "http://head:7071", "--token-file", str(token_file)])
    assert args.func(args) == 1
    assert capsys.readouterr().err == f"error: no token in {token_file}\n"
    assert not context_file.exists()


def test_context_set_refuses_a_token_in_argv():
    with pytest.raises(SystemExit):
        parse(["ctl", "context", "set", "--server", "http://head:7071", "--token", "secret"])


# --- rendering --------------------------------------------------------------------------------


def test_nodes_table():
    console = Console(record=True, width=140)
    console.print(render.nodes_table(NODES, NOW))
    lines = console.export_text().splitlines()
    assert lines[0].split() == ["NAME", "STATE", "GPUS", "FREE", "FABRIC", "HEARTBEAT", "VERSION"]
    assert lines[1].split() == [
        "gpu-1",
        "online",
        "2×",
        "l40s-45g",
        "44.0",
        "GiB",
        "ib-a",
        "2s",
        "ago",
        "0.1.0",
    ]
    assert lines[2].split() == ["cpu-1", "online", "cpu", "13.2", "GiB", "-", "5m", "ago", "0.1.0"]
    assert lines[3].split() == [
        "gpu-2", "lost", "2×", "h100-80g", "(1", "unhealthy)", "159.3", "GiB", "-", "2h", "ago", "0.1.0"
    ]  # fmt: skip


def test_online_node_without_a_link_says_so():
    console = Console(record=True, width=140)
    console.print(render.nodes_table([node("gpu-3", connected=False)], NOW))
    assert "online (no link)" in console.export_text()


def test_state_is_coloured_only_on_a_terminal():
    table = render.nodes_table(NODES, NOW)
    plain = io.StringIO()
    Console(file=plain, width=140).print(table)
    assert "\x1b[" not in plain.getvalue()
    coloured = io.StringIO()
    Console(file=coloured, width=140, force_terminal=True).print(table)
    assert "\x1b[32monline" in coloured.getvalue()


def test_no_color_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert render.make_console().no_color


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s ago"), (59, "59s ago"), (61, "1m ago"), (3 * 86400, "3d ago"), (-4, "0s ago")]
)
def test_age(seconds, text):
    assert render.age(seconds) == text


def test_node_show_renders_the_inventory(monkeypatch):
    console = Console(record=True, width=140)
    render.render_node(NODES[0], NOW, console)
    text = console.export_text()
    assert text.startswith("gpu-1  online  heartbeat 2s ago  agent 0.1.0")
    assert "l40s-45g" in text


def simulated(entry: dict) -> dict:
    return {**entry, "inventory": {**entry["inventory"], "simulated": True}}


def test_nodes_table_marks_simulated_gpus():
    console = Console(record=True, width=140)
    console.print(render.nodes_table([simulated(NODES[0]), simulated(NODES[1]), NODES[2]], NOW))
    lines = console.export_text().splitlines()
    assert lines[1].split()[:5] == ["gpu-1", "online", "2×", "l40s-45g", "(simulated)"]
    assert lines[2].split()[:4] == ["cpu-1", "online", "cpu", "(simulated)"]
    # Real hardware, and an older server's answer without the field: no marker.
    assert "(simulated)" not in lines[3]


def test_node_show_says_the_gpus_are_simulated():
    console = Console(record=True, width=140)
    render.render_node(simulated(NODES[0]), NOW, console)
    text = console.export_text()
    assert text.startswith("gpu-1  online  heartbeat 2s ago  agent 0.1.0  simulated GPUs")
    assert "GPUs (simulated)" in text
    console = Console(record=True, width=140)
    render.render_node(NODES[0], NOW, console)
    assert "simulated" not in console.export_text()


# --- commands against a fake client -------------------------------------------------------------


class FakeClient:
    answers = {"/admin/v1/nodes": {"nodes": NODES}, "/admin/v1/nodes/gpu-1": NODES[0]}

    def __init__(self, server: str, token: str | None) -> None:
        pass

    def get(self, path: str):
        return self.answers[path]

    def post(self, path: str, body=None):
        return {"node": "gpu-1", "rtt_ms": 1.25, "payload_ok": True}


@pytest.mark.parametrize("argv", [["ctl", "--json", "nodes"], ["ctl", "nodes", "--json"]])
def test_nodes_json_is_the_api_answer(argv, context_file, monkeypatch, capsys):
    monkeypatch.setattr(commands, "AdminClient", FakeClient)
    args = parse([*argv[:1], "--token", "t", *argv[1:]])
    assert args.func(args) == 0
    assert capsys.readouterr().out == json.dumps({"nodes": NODES}, indent=2) + "\n"


def test_nodes_table_output_has_no_colour_when_piped(context_file, monkeypatch, capsys):
    monkeypatch.setattr(commands, "AdminClient", FakeClient)
    args = parse(["ctl", "--token", "t", "nodes"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "gpu-1" in out and "\x1b[" not in out


def test_node_ping_prints_the_round_trip(context_file, monkeypatch, capsys):
    monkeypatch.setattr(commands, "AdminClient", FakeClient)
    args = parse(["ctl", "--token", "t", "node", "ping", "gpu-1"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == "gpu-1: answered in 1.2 ms\n"


def test_missing_token_is_reported_before_any_request(context_file, capsys):
    args = parse(["ctl", "nodes"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no admin token") and "LLMGW_TOKEN" in err


# --- client failures ----------------------------------------------------------------------------


def test_connection_refused_says_what_to_do():
    server = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(CtlError) as error:
        AdminClient(server, "t").get("/admin/v1/nodes")
    assert str(error.value) == (
        f"cannot reach the llmgw server at {server}: is `llmgw server` running? (set --server or LLMGW_SERVER)"
    )


def test_command_error_goes_to_stderr_with_exit_1(context_file, capsys):
    args = parse(["ctl", "--server", f"127.0.0.1:{closed_port()}", "--token", "t", "nodes"])
    assert args.func(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: cannot reach the llmgw server at http://127.0.0.1:")


# --- the catalog --------------------------------------------------------------------------------


def profile(name: str, **options) -> dict:
    return {
        "name": name,
        "model": "smollm2-135m",
        "engine": "llamacpp",
        "gpu_class": None,
        "gpus_per_node": 0,
        "nodes": 1,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "memory_mib": 1024,
        "cpu_cores": 2,
        "min_replicas": 1,
        "max_replicas": 1,
        "band": 0,
        "source": "config",
        "updated": NOW,
        **options,
    }


MODELS = [
    {
        "name": "org/qwen",
        "path": "Qwen/Qwen2.5-72B-Instruct",
        "format": "safetensors",
        "source": "api",
        "updated": NOW,
        "used_by": ["qwen-h100", "qwen-l40s"],
    },
    {"name": "unused", "path": "/m/u.gguf", "format": "gguf", "source": "api", "updated": NOW, "used_by": []},
]
PROFILES = [
    profile(
        "qwen-h100",
        model="org/qwen",
        engine="vllm",
        gpu_class="h100-80g",
        gpus_per_node=2,
        nodes=2,
        tensor_parallel=2,
        pipeline_parallel=2,
        memory_mib=70_000,
        min_replicas=0,
        max_replicas=3,
        band=10,
        source="api",
        routing="least-loaded",
        scale={"wanted": 0, "reason": "down to 0: no request for 900 s", "waiting": 3},
    ),
    profile("smollm2-cpu", memory_mib=1536),  # as a server before `scale` lists it
]


def table_lines(table) -> list[list[str]]:
    console = Console(record=True, width=200)
    console.print(table)
    return [line.split() for line in console.export_text().splitlines()]


def test_models_table():
    assert table_lines(render.models_table(MODELS)) == [
        ["NAME", "FORMAT", "PATH", "PROFILES", "SOURCE"],
        ["org/qwen", "safetensors", "Qwen/Qwen2.5-72B-Instruct", "qwen-h100,", "qwen-l40s", "api"],
        ["unused", "gguf", "/m/u.gguf", "-", "api"],
    ]


def test_profiles_table():
    assert table_lines(render.profiles_table(PROFILES)) == [
        ["NAME", "MODEL", "ENGINE", "ON", "TP×PP", "REPLICAS", "WANT", "WAIT", "ROUTING", "BAND", "SOURCE", "SCALING"],
        ["qwen-h100", "org/qwen", "vllm", "2×", "h100-80g", "×", "2", "nodes", "2×2", "0–3", "0", "3", "least-loaded",
         "10", "api", "down", "to", "0:", "no", "request", "for", "900", "s"],
        ["smollm2-cpu", "smollm2-135m", "llamacpp", "cpu", "1.5", "GiB", "1×1", "1–1", "-", "0", "-", "0", "config",
         "-"],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"gpu_class": "l40s-45g", "gpus_per_node": 1}, "1× l40s-45g"),
        ({"gpu_class": "h100-80g", "gpus_per_node": 8, "nodes": 4}, "8× h100-80g × 4 nodes"),
        ({"memory_mib": 4096}, "cpu 4 GiB"),
        ({"memory_mib": 1000}, "cpu 1.0 GiB"),
    ],
)
def test_profile_on(options: dict, text: str):
    assert render.profile_on(profile("p", **options)) == text


class CatalogClient:
    """Answers like the admin API, and remembers what was sent."""

    sent: list[tuple[str, str, object]] = []
    refusal: str | None = None

    def __init__(self, server: str, token: str | None) -> None:
        pass

    def get(self, path: str):
        return {
            "/admin/v1/models": {"models": MODELS},
            "/admin/v1/profiles": {"profiles": PROFILES},
            "/admin/v1/replicas": {"replicas": []},
        }[path]

    def post(self, path: str, body=None):
        self.sent.append(("POST", path, body))
        if self.refusal:
            raise CtlError(self.refusal)
        if path == "/admin/v1/catalog":
            changes = [{"kind": "model", "name": m["name"], "change": "unchanged"} for m in body["models"]]
            return {
                "changes": changes
                + [{"kind": "profile", "name": p["name"], "change": "created"} for p in body["profiles"]]
            }
        return {**PROFILES[0], "min_replicas": 2, "max_replicas": 2}

    def delete(self, path: str):
        self.sent.append(("DELETE", path, None))
        return {"deleted": {"kind": "model", "name": "org/qwen"}}


@pytest.fixture
def catalog_client(context_file, monkeypatch):
    monkeypatch.setattr(commands, "AdminClient", CatalogClient)
    monkeypatch.setattr(CatalogClient, "sent", [])
    monkeypatch.setattr(CatalogClient, "refusal", None)
    return CatalogClient


def run(argv: list[str]) -> int:
    args = parse(["ctl", "--token", "t", *argv])
    return args.func(args)


def test_models_and_profiles_tables_and_json(catalog_client, capsys):
    assert run(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "FORMAT", "PATH", "PROFILES", "SOURCE"]
    assert "\x1b[" not in out
    assert run(["profiles"]) == 0
    assert "2× h100-80g × 2 nodes" in capsys.readouterr().out
    assert run(["profiles", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"profiles": PROFILES}


def test_replicas_say_why_a_profile_has_none_and_who_waits(catalog_client, capsys):
    assert run(["replicas"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "qwen-h100: no replica — down to 0: no request for 900 s; 3 requests waiting",
        "smollm2-cpu: no replica",
    ]


def test_empty_listings_say_how_to_fill_them(catalog_client, monkeypatch, capsys):
    monkeypatch.setattr(CatalogClient, "get", lambda self, path: {"models": []})
    assert run(["models"]) == 0
    assert capsys.readouterr().out == (
        "no models in the catalog: declare them in server.yaml, or add them with `llmgw ctl apply -f FILE`\n"
    )


CATALOG_FILE = """\
models:
  org/qwen: {path: Qwen/Qwen2.5-72B-Instruct, format: safetensors}
profiles:
  qwen-h100:
    model: org/qwen
    engine: vllm
    gpu_class: h100-80g
    gpus_per_node: 2
    tensor_parallel: 2
    memory_mib: 70000
    startup_timeout: 20m
"""


def test_apply_sends_the_file_as_named_entries_and_prints_what_changed(catalog_client, tmp_path, capsys):
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG_FILE)
    assert run(["apply", "-f", str(path)]) == 0
    assert capsys.readouterr().out == "model org/qwen: unchanged\nprofile qwen-h100: created\n"
    [(method, url, body)] = catalog_client.sent
    assert (method, url) == ("POST", "/admin/v1/catalog")
    assert body["models"] == [
        {"name": "org/qwen", "path": "Qwen/Qwen2.5-72B-Instruct", "format": "safetensors", "sha256": None}
    ]
    [sent] = body["profiles"]
    assert (sent["name"], sent["tensor_parallel"], sent["startup_timeout"], sent["flags"]) == (
        "qwen-h100",
        2,
        1200.0,
        [],
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("profiles:\n  p:\n    memory_mib: lots\n", 'profiles.p.memory_mib: expected an integer, got "lots"'),
        (
            "profiles: [\n",
            "line 2: while parsing a flow node, expected the node content, but found '<stream end>'",
        ),
        ("nodes: {}\n", "nodes: unknown key (expected one of: models, profiles)"),
        ("models: {}\n", "no models or profiles to apply"),
    ],
)
def test_apply_reports_a_bad_file_before_sending_it(catalog_client, tmp_path, capsys, text, error):
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    assert run(["apply", "-f", str(path)]) == 1
    assert capsys.readouterr().err == f"error: {path}: {error}\n"
    assert catalog_client.sent == []


def test_apply_prints_the_servers_problems_one_per_line(catalog_client, tmp_path, capsys):
    catalog_client.refusal = (
        "server answered 400: nothing was applied:\n"
        "  profiles.qwen-h100.model: no model named 'org/qwen' in the catalog\n"
        "  profiles.qwen-h100.memory_mib: must be at least 1, not 0"
    )
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG_FILE)
    assert run(["apply", "-f", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: server answered 400: nothing was applied:",
        "  profiles.qwen-h100.model: no model named 'org/qwen' in the catalog",
        "  profiles.qwen-h100.memory_mib: must be at least 1, not 0",
    ]


def test_apply_of_a_missing_file(catalog_client, tmp_path, capsys):
    assert run(["apply", "-f", str(tmp_path / "nope.yaml")]) == 1
    assert (
        capsys.readouterr().err == f"error: cannot read {tmp_path / 'nope.yaml'}: No such file or directory\n"
    )


@pytest.mark.parametrize(
    ("argv", "body"),
    [
        (["--replicas", "2"], {"replicas": 2}),
        (["--min", "1", "--max", "4"], {"min_replicas": 1, "max_replicas": 4}),
        (["--max", "4"], {"max_replicas": 4}),
    ],
)
def test_scale_sends_the_bounds(catalog_client, capsys, argv, body):
    assert run(["scale", "org/x", *argv]) == 0
    assert catalog_client.sent == [("POST", "/admin/v1/profiles/org%2Fx/scale", body)]
    assert capsys.readouterr().out == "profile qwen-h100: 2–2 replicas\n"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([], "give --replicas N, or --min N and/or --max M"),
        (["--replicas", "2", "--min", "1"], "give --replicas N, or --min N and/or --max M, not both"),
    ],
)
def test_scale_needs_one_way_of_saying_it(catalog_client, capsys, argv, error):
    assert run(["scale", "p", *argv]) == 1
    assert capsys.readouterr().err == f"error: {error}\n"
    assert catalog_client.sent == []


def test_delete(catalog_client, capsys):
    assert run(["delete", "model", "org/qwen"]) == 0
    assert catalog_client.sent == [("DELETE", "/admin/v1/models/org%2Fqwen", None)]
    assert capsys.readouterr().out == "model org/qwen: deleted\n"
    assert run(["delete", "profile", "p", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": {"kind": "model", "name": "org/qwen"}}
    with pytest.raises(SystemExit):
        parse(["ctl", "delete", "adapter", "x"])


# --- tenants, api keys and usage ----------------------------------------------------------------

NOV1 = 1_793_534_400.0  # 2026-11-01 12:00 UTC

TENANTS = [
    {"name": "acme", "limits": {"rpm": 60, "tpm": 100_000, "tpd": None}, "created": NOV1, "active_keys": 2},
    {"name": "beta", "limits": {"rpm": None, "tpm": None, "tpd": None}, "created": NOV1, "active_keys": 0},
]
KEYS = [
    {
        "id": "k-3f9a2c1d",
        "tenant": "acme",
        "models": ["org/qwen", "smollm2"],
        "band": 1,
        "limits": {"rpm": None, "tpm": 5_000, "tpd": None},
        "created": NOV1,
        "revoked": None,
    },
    {
        "id": "k-00c0ffee",
        "tenant": "acme",
        "models": [],
        "band": 0,
        "limits": None,
        "created": NOV1,
        "revoked": NOV1 + 90,
    },
]
SECRET = "llmgw-k-3f9a2c1d-s3cr3t"
USAGE = {
    "by": ["tenant", "day"],
    "since": None,
    "until": None,
    "usage": [
        {
            "tenant": "acme",
            "day": "2026-11-01",
            "requests": 1200,
            "prompt_tokens": 30_000,
            "completion_tokens": 12_000,
            "total_tokens": 42_000,
            "errors": 3,
            "avg_latency_ms": 412.4,
        }
    ],
}


class TenantClient:
    """Answers like the admin API's tenant, key and usage endpoints, and remembers what was sent."""

    sent: list[tuple[str, str, object]] = []

    def __init__(self, server: str, token: str | None) -> None:
        pass

    def get(self, path: str):
        self.sent.append(("GET", path, None))
        if path.startswith("/admin/v1/usage"):
            return USAGE
        return {"/admin/v1/tenants": {"tenants": TENANTS}}.get(path, {"keys": KEYS})

    def post(self, path: str, body=None):
        self.sent.append(("POST", path, body))
        if path == "/admin/v1/keys":
            return {**KEYS[0], "secret": SECRET}
        return TENANTS[0]

    def delete(self, path: str):
        self.sent.append(("DELETE", path, None))
        if path.startswith("/admin/v1/keys/"):
            return KEYS[1]
        return {"deleted": {"tenant": "beta"}}


@pytest.fixture
def tenant_client(context_file, monkeypatch):
    monkeypatch.setattr(commands, "AdminClient", TenantClient)
    monkeypatch.setattr(TenantClient, "sent", [])
    return TenantClient


def test_tenants_table():
    assert table_lines(render.tenants_table(TENANTS, NOW)) == [
        ["NAME", "LIMITS", "KEYS", "CREATED"],
        ["acme", "rpm", "60,", "tpm", "100,000", "2", "2026-11-01", "12:00"],
        ["beta", "unlimited", "0", "2026-11-01", "12:00"],
    ]


def test_keys_table():
    assert table_lines(render.keys_table(KEYS, NOW)) == [
        ["ID", "TENANT", "MODELS", "BAND", "LIMITS", "CREATED", "REVOKED"],
        ["k-3f9a2c1d", "acme", "org/qwen,", "smollm2", "1", "tpm", "5,000", "2026-11-01", "12:00", "-"],
        ["k-00c0ffee", "acme", "all", "0", "-", "2026-11-01", "12:00", "2026-11-01", "12:01"],
    ]


def test_usage_table():
    assert table_lines(render.usage_table(USAGE["by"], USAGE["usage"])) == [
        ["TENANT", "DAY", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL", "ERRORS", "AVG", "LATENCY"],
        ["acme", "2026-11-01", "1,200", "30,000", "12,000", "42,000", "3", "412", "ms"],
    ]


def test_tenant_commands_send_the_limits(tenant_client, capsys):
    assert run(["tenant", "create", "acme", "--rpm", "60", "--tpm", "100000"]) == 0
    assert capsys.readouterr().out == "tenant acme: created (rpm 60, tpm 100,000)\n"
    assert run(["tenant", "limits", "acme", "--tpd", "9"]) == 0
    assert run(["tenant", "delete", "beta"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "tenant beta: deleted"
    assert tenant_client.sent == [
        ("POST", "/admin/v1/tenants", {"name": "acme", "limits": {"rpm": 60, "tpm": 100_000, "tpd": None}}),
        ("POST", "/admin/v1/tenants/acme/limits", {"rpm": None, "tpm": None, "tpd": 9}),
        ("DELETE", "/admin/v1/tenants/beta", None),
    ]
    assert run(["tenants"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["NAME", "LIMITS", "KEYS", "CREATED"]
    assert run(["tenants", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tenants": TENANTS}


def test_keys_create_prints_the_secret_once_with_a_warning(tenant_client, capsys):
    assert (
        run(
            ["keys", "create", "--tenant", "acme", "--model", "org/qwen", "--model", "smollm2", "--band", "1"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out == f"api key k-3f9a2c1d for tenant acme: created\n{SECRET}\n"
    assert err == "warning: this secret will not be shown again; give it to the client now\n"
    assert tenant_client.sent == [
        (
            "POST",
            "/admin/v1/keys",
            {"tenant": "acme", "models": ["org/qwen", "smollm2"], "band": 1, "limits": None},
        )
    ]
    assert run(["keys", "create", "--tenant", "acme", "--tpm", "5000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["secret"] == SECRET
    assert tenant_client.sent[-1][2] == {
        "tenant": "acme",
        "models": [],
        "band": 0,
        "limits": {"rpm": None, "tpm": 5000, "tpd": None},
    }
    with pytest.raises(SystemExit):
        parse(["ctl", "keys", "create"])  # --tenant is required


def test_keys_list_and_revoke(tenant_client, capsys):
    assert run(["keys", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["ID", "TENANT", "MODELS", "BAND", "LIMITS", "CREATED", "REVOKED"]
    assert SECRET not in out
    assert run(["keys", "revoke", "k-00c0ffee"]) == 0
    assert capsys.readouterr().out == "api key k-00c0ffee: revoked\n"
    assert run(["keys", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"keys": KEYS}
    assert tenant_client.sent == [
        ("GET", "/admin/v1/keys?tenant=acme", None),
        ("DELETE", "/admin/v1/keys/k-00c0ffee", None),
        ("GET", "/admin/v1/keys", None),
    ]


def test_usage_sends_its_query_and_prints_a_table(tenant_client, capsys):
    assert run(["usage", "--by", "tenant,day", "--since", "2026-11-01"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["acme", "2026-11-01", "1,200"]
    assert run(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == USAGE
    assert tenant_client.sent == [
        ("GET", "/admin/v1/usage?by=tenant%2Cday&since=2026-11-01", None),
        ("GET", "/admin/v1/usage?by=tenant%2Cmodel%2Cday", None),
    ]


def test_empty_tenants_and_usage_say_so(tenant_client, monkeypatch, capsys):
    monkeypatch.setattr(TenantClient, "get", lambda self, path: {"tenants": [], "usage": [], "by": []})
    assert run(["tenants"]) == 0
    assert run(["usage"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "no tenants: make one with `llmgw ctl tenant create NAME`",
        "no usage recorded in that time",
    ]
