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
