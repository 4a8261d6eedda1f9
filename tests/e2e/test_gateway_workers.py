"""Gateway workers, as a user runs them: the real server, agent and llama.cpp replica.

- The server killed with -9 under a bounded load and started again: no request fails, no usage
  record is lost, the engine never restarts and the new server adopts the worker (same pid).
- A worker killed with -9: the server starts it again, and it serves. With two, the clients whose
  connections the other worker holds see nothing of it.
- Two workers on one port: a quota holds across both, and whichever answers /metrics shows both.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_routing_processes import MODEL, Fleet, alive, chat, metric_samples, profile
from tests.procs import Server, wait_until, write_yaml

pytestmark = pytest.mark.slow

CLIENTS = 3
REQUESTS_EACH = 12


def worker_state(fleet: Fleet) -> dict:
    return json.loads((fleet.server.data_dir / "workers" / "w0.state.json").read_text())


def all_worker_states(fleet: Fleet) -> dict[str, dict]:
    """Each worker's pid and start time, by id: the same after a restart means adopted."""
    states = {}
    for path in sorted((fleet.server.data_dir / "workers").glob("*.state.json")):
        state = json.loads(path.read_text())
        states[state["id"]] = {"pid": state["pid"], "start_time": state["start_time"]}
    return states


def usage_requests(fleet: Fleet) -> int:
    rows = fleet.server.admin("GET", "/admin/v1/usage?by=tenant")["usage"]
    return sum(row["requests"] for row in rows)


@pytest.fixture(scope="module")
def real_parts():
    from tests.real_parts import require_llama_server, require_smollm2

    return require_llama_server(), require_smollm2()


@pytest.mark.parametrize("count", [1, 2])
def test_a_server_killed_under_load_costs_no_request_and_no_usage_record(real_parts, tmp_path, count):
    """One worker, and two sharing leased quotas and slots: every worker serves on alone."""
    name = "smollm2-cpu"
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)}, gateway={"workers": count})
    try:
        fleet.start()
        (replica,) = fleet.wait_ready(name, 1)
        engine = fleet.engine_process(replica)
        before = all_worker_states(fleet)
        assert len(before) == count
        status, body = chat(fleet, "Before the load: say hello.")
        assert status == 200, body

        results: list[tuple[int | str, str]] = []
        lock = threading.Lock()
        started = threading.Barrier(CLIENTS + 1)

        def client(index: int) -> None:
            started.wait()
            for n in range(REQUESTS_EACH):
                try:
                    outcome = chat(fleet, f"Client {index}, request {n}: say hello.")
                except (OSError, ValueError) as exc:
                    outcome = (type(exc).__name__, str(exc))
                with lock:
                    results.append(outcome)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        started.wait()
        wait_until(lambda: len(results) >= CLIENTS, "the load to be under way", deadline=120)
        fleet.server.proc.kill9()
        during = len(results)
        time.sleep(1.0)  # a second with no control plane at all; the worker serves on
        fleet.server.start()  # same config, data dir and ports: it adopts the worker
        for thread in threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in threads), "a client did not finish in time"

        assert len(results) == CLIENTS * REQUESTS_EACH
        failed = [outcome for outcome in results if outcome[0] != 200]
        assert not failed, f"{failed}\n{fleet.logs()}"
        assert len(results) > during, "no request was answered after the kill"
        assert all_worker_states(fleet) == before, "not adopted"
        assert all(alive(w["pid"], w["start_time"]) for w in before.values())
        assert fleet.engine_process(replica) == engine
        # Every answered request has its record: the journal survived the server's death.
        answered = len(results) + 1
        wait_until(lambda: usage_requests(fleet) == answered, f"{answered} usage records", deadline=60)
        time.sleep(1.5)  # the shipper runs every 0.5 s: none is shipped twice either
        assert usage_requests(fleet) == answered
    finally:
        fleet.stop()


def test_a_killed_worker_is_started_again_and_serves(real_parts, tmp_path):
    name = "smollm2-cpu"
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)})
    try:
        fleet.start()
        fleet.wait_ready(name, 1)
        first = worker_state(fleet)
        os.kill(first["pid"], signal.SIGKILL)
        wait_until(
            lambda: worker_state(fleet)["pid"] != first["pid"],
            "a new worker",
            deadline=60,
            proc=fleet.server.proc,
        )

        def serves() -> bool:
            try:
                return chat(fleet, "After the worker's death: say hello.")[0] == 200
            except OSError:
                return False

        wait_until(serves, "the new worker to answer", deadline=60, proc=fleet.server.proc)
    finally:
        fleet.stop()


def serving_pid(conn: http.client.HTTPConnection, pids: set[int], gateway_port: int) -> int | None:
    """Which of ``pids`` holds the server side of the client's connection ``conn``: the socket in
    /proc/net/tcp whose peer is the client's address, and the process with that socket open."""
    client_port = conn.sock.getsockname()[1]
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == gateway_port and int(remote.split(":")[1], 16) == client_port:
            inode = fields[9]
    if inode is None:
        return None
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
        except OSError:
            continue
    return None


def keep_alive_chat(fleet: Fleet, conn: http.client.HTTPConnection, prompt: str) -> int | str:
    """One request on an open keep-alive connection: its status, or the error that ended it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


def test_a_killed_worker_costs_only_its_own_connections(real_parts, tmp_path):
    """Two workers: kill -9 one while clients on both send requests on keep-alive connections.
    The other's clients see every request answered; the killed one's see their connection end;
    the server starts a new worker, and new connections are served."""
    name = "smollm2-cpu"
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)}, gateway={"workers": 2})
    held: dict[int, list[http.client.HTTPConnection]] = {}
    try:
        fleet.start()
        fleet.wait_ready(name, 1)
        wait_until(
            lambda: len(workers(fleet)) == 2 and all(w["serving"] for w in workers(fleet)),
            "both workers to serve",
            deadline=60,
        )
        states = all_worker_states(fleet)
        pids = {state["pid"] for state in states.values()}
        host, port = fleet.gateway
        # Connections until each worker holds at least two (the kernel hashes them; bounded).
        held.update({pid: [] for pid in pids})
        for n in range(40):
            if all(len(conns) >= 2 for conns in held.values()):
                break
            conn = http.client.HTTPConnection(host, port, timeout=60)
            assert keep_alive_chat(fleet, conn, f"Opening {n}: say hi.") == 200
            pid = serving_pid(conn, pids, port)
            assert pid is not None, "no worker holds the connection"
            held[pid].append(conn)
        assert all(len(conns) >= 2 for conns in held.values()), {p: len(c) for p, c in held.items()}
        victim, survivor = sorted(pids, key=lambda pid: pid != states["w0"]["pid"])

        outcomes: dict[int, list[int | str]] = {victim: [], survivor: []}
        lock = threading.Lock()
        killed = threading.Event()

        def client(pid: int, conn: http.client.HTTPConnection, index: int) -> None:
            for n in range(6):
                outcome = keep_alive_chat(fleet, conn, f"Client {index}, request {n}: say hi.")
                with lock:
                    outcomes[pid].append(outcome)
                if outcome != 200:
                    return  # the connection is gone: this client's next would be a new one
                if n == 1:
                    killed.wait(timeout=60)

        threads = [
            threading.Thread(target=client, args=(pid, conn, i))
            for pid, conns in held.items()
            for i, conn in enumerate(conns)
        ]
        for thread in threads:
            thread.start()
        wait_until(
            lambda: len(outcomes[survivor]) + len(outcomes[victim]) >= len(threads), "the first answers"
        )
        os.kill(victim, signal.SIGKILL)
        killed.set()
        for thread in threads:
            thread.join(timeout=120)
        assert outcomes[survivor] and all(o == 200 for o in outcomes[survivor]), outcomes
        assert any(o != 200 for o in outcomes[victim]), f"the killed worker's clients saw nothing: {outcomes}"

        wait_until(
            lambda: (
                len(found := all_worker_states(fleet)) == 2
                and victim not in {s["pid"] for s in found.values()}
            ),
            "a new worker in the killed one's place",
            deadline=60,
            proc=fleet.server.proc,
        )
        assert survivor in {s["pid"] for s in all_worker_states(fleet).values()}  # never restarted
        wait_until(
            lambda: all(w["serving"] for w in workers(fleet)) and len(workers(fleet)) == 2,
            "both to serve again",
        )
        statuses = [chat(fleet, f"After the kill {n}: say hi.")[0] for n in range(6)]
        assert statuses == [200] * 6, statuses
    finally:
        for conns in held.values():
            for conn in conns:
                conn.close()
        fleet.stop()


def test_workers_serve_on_their_shares_past_a_lease_and_a_silent_one_is_replaced(real_parts, tmp_path):
    """Two workers and a tenant with quotas, so that every admission needs a share. A worker
    stopped with SIGSTOP goes silent: the server kills it after the lease's length and starts
    another. Then the server is killed: long past the lease's length, both workers still serve
    on their last shares."""
    name = "smollm2-cpu"
    ttl = 3.0
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)}, gateway={"workers": 2, "lease_ttl": f"{ttl}s"})
    try:
        fleet.start()
        fleet.wait_ready(name, 1)
        fleet.ctl_ok("tenant", "limits", "routing", "--rpm", "200")

        def both_serve() -> bool:
            return len(workers(fleet)) == 2 and all(w["serving"] for w in workers(fleet))

        wait_until(both_serve, "both workers to serve", deadline=60)
        silent = all_worker_states(fleet)["w1"]["pid"]
        os.kill(silent, signal.SIGSTOP)
        wait_until(
            lambda: all_worker_states(fleet)["w1"]["pid"] != silent,
            "the silent worker to be replaced",
            deadline=60,
            proc=fleet.server.proc,
        )
        assert f"w1 (pid {silent}) has not reported" in fleet.server.proc.output()
        wait_until(both_serve, "both workers to serve again", deadline=60)
        # The new worker's first grant holds no share of the tenant's quota (the gone one's charge
        # and the other's uncut share take it all): within the quota, it waits for the grants
        # that bring its share rather than answer 429.
        answers = [chat(fleet, f"Before the kill {n}: say hi.") for n in range(6)]
        assert [status for status, _ in answers] == [200] * 6, answers

        # With no control plane, shares stay where they are: a worker holding none of the
        # tenant's quota could not admit, nor one holding none of the replica's slots reach it.
        # Idle, they are split evenly; wait for that.
        def both_hold_quota() -> bool:
            return len(workers(fleet)) == 2 and all(
                w["quota_shares"].get("tenant/routing/rpm", 0) > 0 for w in workers(fleet)
            )

        wait_until(both_hold_quota, "both workers to hold a share of the tenant's quota", deadline=60)
        host, port = fleet.gateway
        (replica,) = fleet.replicas(name)

        def both_hold_slots() -> bool:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            held = {
                labels["worker"]: value
                for labels, value in metric_samples(text, "llmgw_gateway_worker_slots")
                if labels.get("replica") == replica["id"]
            }
            return len(held) == 2 and all(value >= 1 for value in held.values())

        wait_until(both_hold_slots, "both workers to hold a slot of the replica", deadline=60)
        before = all_worker_states(fleet)
        fleet.server.proc.kill9()
        killed = time.monotonic()
        wait_until(lambda: time.monotonic() - killed > 2 * ttl + 1, "two leases' length without a server")
        for _ in range(6):  # new connections each: both workers answer
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
        answers = [chat(fleet, f"With no server {n}: say hi.") for n in range(8)]
        assert [status for status, _ in answers] == [200] * 8, answers
        assert all_worker_states(fleet) == before
    finally:
        fleet.stop()


def workers(fleet: Fleet | Server) -> list[dict]:
    server = fleet.server if isinstance(fleet, Fleet) else fleet
    return server.admin("GET", "/admin/v1/workers")["workers"]


def test_two_workers_share_the_port_and_hold_one_quota_between_them(real_parts, tmp_path):
    """Two workers on one port, each admitting against its leased share: a tenant's requests
    per minute hold across both, and both take connections."""
    name = "smollm2-cpu"
    fleet = Fleet(tmp_path, real_parts, {name: profile(name)}, gateway={"workers": 2})
    try:
        fleet.start()
        fleet.wait_ready(name, 1)
        fleet.ctl_ok("tenant", "limits", "routing", "--rpm", "8")
        wait_until(
            lambda: len(workers(fleet)) == 2 and all(w["serving"] for w in workers(fleet)),
            "both workers to serve",
            deadline=60,
        )
        statuses = [chat(fleet, f"Request {n}: say hello.")[0] for n in range(16)]  # a connection each
        answered = statuses.count(200)
        assert set(statuses) <= {200, 429}, statuses
        # Never more than the tenant's 8 a minute, whichever worker each connection reached; at
        # least the first worker's share is used at once.
        assert 1 <= answered <= 8, statuses

        def reported() -> list[int] | None:
            counts = [w["requests"] for w in workers(fleet)]
            return counts if sum(counts) >= len(statuses) else None

        served = wait_until(reported, "the workers to report their requests", deadline=30)
        assert all(n > 0 for n in served), f"one worker took every connection: {served}"
        assert all(w["lease_left"] is not None and w["lease_left"] > 0 for w in workers(fleet))
        listing = fleet.ctl_ok("workers")
        assert "w0" in listing and "w1" in listing and "serving" in listing and "CONNECTIONS" in listing
        # Whichever worker a scrape reaches (a new connection each), /metrics shows both: their
        # pids, and their requests, which add up to what was answered.
        host, port = fleet.gateway
        pids = {str(w["pid"]) for w in workers(fleet)}
        for _ in range(6):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            assert {labels["pid"] for labels, _ in metric_samples(text, "llmgw_gateway_worker_info")} == pids
            by_worker = {
                labels["worker"]
                for labels, _ in metric_samples(text, "llmgw_requests_total")
                if labels.get("model") == MODEL
            }
            assert by_worker == {"w0", "w1"}, text
    finally:
        fleet.stop()


@pytest.mark.parametrize("stop_on_exit", [True, False])
def test_a_graceful_stop_stops_the_workers_only_when_told_to(tmp_path, stop_on_exit):
    """gateway.stop_workers_on_exit: true, they stop with the server; false (the default), they
    serve through the stop and the next server adopts them, same pid."""
    server = Server(tmp_path, gateway={"stop_workers_on_exit": stop_on_exit}).start()
    state = json.loads((server.data_dir / "workers" / "w0.state.json").read_text())
    assert alive(state["pid"], state["start_time"])
    server.proc.stop()
    if stop_on_exit:
        wait_until(lambda: not alive(state["pid"], state["start_time"]), "the worker to stop", deadline=30)
        return
    assert alive(state["pid"], state["start_time"]), "the worker stopped with the server"
    server.start()
    try:
        listing = json.loads(server.ctl("workers", "--json").stdout)["workers"]
        assert [(w["id"], w["pid"], w["adopted"]) for w in listing] == [("w0", state["pid"], True)]
    finally:
        server.proc.stop()


def test_a_worker_left_with_other_settings_is_replaced_not_adopted(tmp_path):
    """A worker an earlier server started with another queue timeout (or share of the quotas)
    would serve with those: the next server replaces it instead of adopting it."""
    server = Server(tmp_path, gateway={"stop_workers_on_exit": False}).start()
    before = json.loads((server.data_dir / "workers" / "w0.state.json").read_text())
    server.proc.stop()
    config = yaml.safe_load(server.config.read_text())
    config["gateway"]["queue_timeout"] = "17s"
    write_yaml(server.config, config)
    server.start()
    try:
        listing = json.loads(server.ctl("workers", "--json").stdout)["workers"]
        assert [w["adopted"] for w in listing] == [False]
        assert listing[0]["pid"] != before["pid"]
        wait_until(
            lambda: not alive(before["pid"], before["start_time"]), "the old worker to stop", deadline=30
        )
        spec = json.loads((server.data_dir / "workers" / "w0.json").read_text())
        assert spec["queue_timeout"] == 17.0
    finally:
        server.proc.stop()


def gateway_health(server: Server) -> int:
    host, port = server.endpoints["gateway"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def test_workers_start_from_a_directory_holding_a_folder_named_llmgw(tmp_path):
    """The server run as its console script from a folder holding one named `llmgw` (a checkout's
    parent, a folder of configs): its workers must import this llmgw, not that folder."""
    here = tmp_path / "configs"
    (here / "llmgw").mkdir(parents=True)
    (here / "llmgw" / "__init__.py").write_text("# not the llmgw package\n")
    script = Path(sys.executable).parent / "llmgw"
    assert script.exists(), f"no console script at {script}: is llmgw installed in this environment?"
    server = Server(tmp_path, gateway={"workers": 2}).start(command=[str(script)], cwd=here)
    try:
        wait_until(
            lambda: len(workers(server)) == 2 and all(w["serving"] for w in workers(server)),
            "both workers to serve",
            deadline=60,
            proc=server.proc,
        )
        assert gateway_health(server) == 200
        assert "ImportError" not in server.proc.output()
    finally:
        server.proc.stop()


def test_a_worker_that_cannot_start_is_an_error_naming_its_last_words(tmp_path):
    """Every worker dies before serving: the server says so as an ERROR quoting the worker's own
    output, /healthz is 503 naming it, and ctl workers shows why."""
    hook = tmp_path / "hook"
    hook.mkdir()
    # Python imports sitecustomize from PYTHONPATH at start: this one ends a worker at once.
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--gateway-worker' in sys.argv:\n"
        "    print('cannot open the widget: no such widget', file=sys.stderr, flush=True)\n"
        "    os._exit(3)\n"
    )
    pythonpath = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    server = Server(tmp_path).start(env={"PYTHONPATH": pythonpath})
    try:
        line = wait_until(
            lambda: next(
                (
                    ln
                    for ln in server.proc.output().splitlines()
                    if "ERROR" in ln and "gateway worker w0" in ln
                ),
                None,
            ),
            "an ERROR naming the worker",
            deadline=60,
            proc=server.proc,
        )
        assert "exited with status 3" in line, line
        assert "cannot open the widget: no such widget" in server.proc.output()
        host = server.endpoints["admin"]
        request = urllib.request.Request(f"http://{host}/healthz")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        assert answer.value.code == 503
        health = json.loads(answer.value.read())
        assert health["status"] == "degraded"
        assert any("w0" in p and "no such widget" in p for p in health["problems"]), health
        listing = server.ctl("workers")
        assert listing.returncode == 0 and "failing" in listing.stdout and "widget" in listing.stdout, listing
        assert gateway_health(server) == 0  # nobody behind the port
    finally:
        server.proc.stop()
