"""`llmgw server`, `llmgw agent` and `llmgw ctl` as real processes: what an operator sees."""

from __future__ import annotations

import stat
import time

import pytest

from tests.procs import Proc, Server, llmgw_command, start_agent, wait_until, write_yaml

pytestmark = pytest.mark.slow

INTERVAL = 0.3
MISSED = 3
WINDOW = INTERVAL * MISSED


def connected(server: Server, *names: str) -> bool:
    nodes = server.nodes()
    return all(name in nodes and nodes[name]["connected"] for name in names)


def test_fleet_survives_agent_kill_and_server_restart(tmp_path):
    server = Server(tmp_path, heartbeat_interval=INTERVAL, missed_heartbeats=MISSED).start()
    agents: dict[str, Proc] = {}
    try:
        for name in ("alpha", "beta"):
            agents[name] = start_agent(tmp_path, server, name)
        wait_until(lambda: connected(server, "alpha", "beta"), "both agents to register", proc=server.proc)

        listing = server.ctl("nodes")
        assert listing.returncode == 0, listing.stderr
        assert "alpha" in listing.stdout and "beta" in listing.stdout and "online" in listing.stdout
        assert "\x1b[" not in listing.stdout  # no colour when piped

        ping = server.ctl("node", "ping", "beta")
        assert ping.returncode == 0, ping.stderr

        # kill -9 of an agent: the node is lost once the liveness window has passed, not before.
        agents["alpha"].kill9()
        killed_at = time.monotonic()
        wait_until(lambda: server.nodes()["alpha"]["state"] == "lost", "alpha to be marked lost")
        took = time.monotonic() - killed_at
        assert took >= WINDOW - INTERVAL, f"marked lost after {took:.2f}s, window is {WINDOW}s"
        assert server.nodes()["beta"]["state"] == "online"

        # kill -9 of the server, then the same server again on the same ports: the agent that is
        # still alive comes back by itself; the lost node is still known, and still lost.
        link_port = int(server.endpoints["link"].rsplit(":", 1)[1])
        admin_port = int(server.endpoints["admin"].rsplit(":", 1)[1])
        server.proc.kill9()
        server = Server(
            tmp_path,
            link_port=link_port,
            admin_port=admin_port,
            heartbeat_interval=INTERVAL,
            missed_heartbeats=MISSED,
        ).start()
        wait_until(lambda: connected(server, "beta"), "beta to reconnect by itself", proc=server.proc)
        # alpha is still known from the store, and lost: either as stored, or — if the kill came
        # before that state was written — once its fresh liveness window after the restart ends.
        assert "alpha" in server.nodes()
        wait_until(lambda: server.nodes()["alpha"]["state"] == "lost", "alpha to be lost after the restart")
        assert agents["beta"].popen.poll() is None
        assert "registered with" in agents["beta"].output()
    finally:
        for proc in agents.values():
            proc.stop()
        if server.proc is not None:
            assert server.proc.stop() in (0, -9)


def test_server_writes_secrets_0600_and_stops_cleanly_on_sigterm(tmp_path):
    server = Server(tmp_path).start()
    for name in ("join-token", "admin-token", "llmgw.db"):
        assert stat.S_IMODE((server.data_dir / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700
    assert server.proc.stop() == 0
    token = (server.data_dir / "join-token").read_text().strip()
    assert token not in server.proc.output()  # secrets never in logs


def test_wrong_join_token_stops_the_agent_with_a_clear_message(tmp_path):
    server = Server(tmp_path).start()
    try:
        bad = tmp_path / "bad-token"
        bad.write_text("nope\n")
        good = start_agent(tmp_path, server, "good")
        wait_until(lambda: connected(server, "good"), "the good agent", proc=server.proc)
        config = write_yaml(
            tmp_path / "intruder.yaml",
            {
                "node_name": "intruder",
                "work_dir": str(tmp_path / "intruder"),
                "server": {"address": server.endpoints["link"], "join_token_file": str(bad)},
            },
        )
        intruder = Proc([*llmgw_command(), "agent", "--config", str(config)], tmp_path / "intruder.log")
        assert intruder.popen.wait(timeout=30) == 3
        assert "join token rejected" in intruder.output()
        assert "wrong join token" in server.proc.output()
        assert connected(server, "good") and "intruder" not in server.nodes()
        good.stop()
    finally:
        server.proc.stop()


@pytest.mark.parametrize(
    ("role", "yaml_text", "message"),
    [
        ("server", "link:\n  listen: foo\n", 'server.yaml: link.listen: expected host:port, got "foo"'),
        ("server", "admin:\n  lisen: 1\n", "server.yaml: admin.lisen: unknown key"),
        ("agent", "server:\n  address: foo\n", 'agent.yaml: server.address: expected host:port, got "foo"'),
        ("agent", "reconnect:\n  max_delay: fast\n", "agent.yaml: reconnect.max_delay: expected a duration"),
    ],
)
def test_config_errors_exit_2_with_one_line(tmp_path, role, yaml_text, message):
    config = tmp_path / f"{role}.yaml"
    config.write_text(yaml_text)
    proc = Proc([*llmgw_command(), role, "--config", str(config)], tmp_path / "out.log")
    assert proc.popen.wait(timeout=30) == 2
    out = proc.output().strip()
    assert message in out
    assert len(out.splitlines()) == 1, out


def test_agent_without_join_token_says_where_to_put_it(tmp_path):
    config = write_yaml(
        tmp_path / "agent.yaml",
        {"work_dir": str(tmp_path / "w"), "server": {"join_token_file": str(tmp_path / "missing")}},
    )
    proc = Proc([*llmgw_command(), "agent", "--config", str(config)], tmp_path / "out.log")
    assert proc.popen.wait(timeout=30) == 2
    assert "join token" in proc.output() and "join_token_file" in proc.output()
