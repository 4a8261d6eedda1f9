"""The admin API and the status pages over HTTPS (server.yaml `admin.tls`), on a real server
process: `ctl` reaches it by an https:// URL trusting the operator's CA (SSL_CERT_FILE), plain
HTTP is not served on the port, and the status pages' session cookie is Secure."""

from __future__ import annotations

import http.client
import os
import ssl
import subprocess
import urllib.parse

import pytest
import yaml

from tests.procs import Server, llmgw_command, write_yaml
from tests.wire.test_tls import make_pki

pytestmark = pytest.mark.slow


def test_the_admin_api_and_pages_serve_https_and_the_session_cookie_is_secure(tmp_path):
    ca, cert, key = make_pki(tmp_path / "pki", "llmgw")
    server = Server(tmp_path)
    config = yaml.safe_load(server.config.read_text())
    config["admin"]["tls"] = {"cert_file": str(cert), "key_file": str(key)}
    write_yaml(server.config, config)
    server.start()
    try:
        host, _, port = server.endpoints["admin"].rpartition(":")
        token = (server.data_dir / "admin-token").read_text().strip()
        assert f"admin API on https://{server.endpoints['admin']}" in server.proc.output()

        env = {
            **os.environ,
            "LLMGW_SERVER": f"https://{server.endpoints['admin']}",
            "LLMGW_TOKEN": token,
            "LLMGW_CONTEXT": str(tmp_path / "no-context.json"),
            "SSL_CERT_FILE": str(ca),
        }
        shown = subprocess.run(
            [*llmgw_command(), "ctl", "nodes"], capture_output=True, text=True, timeout=60, env=env
        )
        assert shown.returncode == 0, shown.stderr

        plain = http.client.HTTPConnection(host, int(port), timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/healthz")
            plain.getresponse().read()
        plain.close()

        trusted = ssl.create_default_context(cafile=str(ca))
        pages = http.client.HTTPSConnection(host, int(port), timeout=10, context=trusted)
        pages.request(
            "POST",
            "/login",
            body=urllib.parse.urlencode({"token": token}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        answer = pages.getresponse()
        answer.read()
        cookie = answer.getheader("Set-Cookie") or ""
        assert answer.status == 303 and "Secure" in cookie and "HttpOnly" in cookie, (answer.status, cookie)
        pages.close()
    finally:
        server.proc.stop()
