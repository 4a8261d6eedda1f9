"""The agent link over TLS: a server certificate, agents verifying it against a CA file."""

from __future__ import annotations

import logging
import random
import ssl
import subprocess
from pathlib import Path

import pytest
import trio

from llmgw.agent.link import AgentLink
from llmgw.agent.run import client_ssl_context
from llmgw.config import parse_agent_config, parse_server_config
from llmgw.core.liveness import Liveness
from llmgw.server import tokens
from llmgw.server.link import LinkListener
from llmgw.server.nodes import NodeRegistry
from llmgw.server.run import _server_ssl_context
from llmgw.server.store import open_store
from llmgw.wire.messages import Ping
from tests.helpers import fake_inventory, wait_for

TOKEN = "join-secret"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it: (ca, cert, key)."""
    directory.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", "server.key", "-out", "server.csr", cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=directory)  # fmt: skip
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    return make_pki(base / "good", "llmgw"), make_pki(base / "other", "someone else")


def agent(name: str, port: int, context: ssl.SSLContext | None) -> AgentLink:
    return AgentLink(
        node=name,
        host="127.0.0.1",
        port=port,
        join_token=TOKEN,
        discover=lambda _address: fake_inventory(name),
        ssl_context=context,
        initial_delay=0.05,
        max_delay=0.2,
        rng=random.Random(0),
    )


async def test_agents_register_over_tls_and_wrong_ca_or_plaintext_never_do(tmp_path, pki, caplog):
    caplog.set_level(logging.WARNING)
    (ca, cert, key), (other_ca, _, _) = pki
    server_config = parse_server_config(f"link:\n  tls:\n    cert_file: {cert}\n    key_file: {key}\n")
    good_context = client_ssl_context(parse_agent_config(f"server:\n  ca_file: {ca}\n"))
    wrong_context = client_ssl_context(parse_agent_config(f"server:\n  ca_file: {other_ca}\n"))

    store = await open_store(tmp_path)
    registry = NodeRegistry(store, Liveness(interval=0.5, missed=4))
    listener = LinkListener(
        registry, tokens.digest(TOKEN), handshake_timeout=2.0, ssl_context=_server_ssl_context(server_config)
    )
    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(listener.serve, "127.0.0.1", 0)
            port = listeners[0].transport_listener.socket.getsockname()[1]
            secure = agent("secure", port, good_context)
            mistrusting = agent("mistrusting", port, wrong_context)
            plaintext = agent("plaintext", port, None)
            for link in (secure, mistrusting, plaintext):
                nursery.start_soon(link.run)

            await wait_for(
                lambda: (n := registry.get("secure")) is not None and n.connected, "TLS registration"
            )
            with trio.fail_after(10):
                reply = await registry.call("secure", Ping(id=0, payload="over tls"))
            assert reply.payload == "over tls"
            assert secure.connected

            # Both others keep failing: one does not trust the server, the other speaks cleartext.
            def failures(word: str) -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if "down" in r.getMessage() and word in r.getMessage()
                ]

            await wait_for(lambda: failures("CERTIFICATE_VERIFY_FAILED"), "the wrong CA to be refused")
            assert secure.registrations == 1
            await wait_for(lambda: len(failures("")) >= 4, "several failed attempts")
            assert registry.get("mistrusting") is None and mistrusting.registrations == 0
            assert registry.get("plaintext") is None and plaintext.registrations == 0
            nursery.cancel_scope.cancel()
    finally:
        await store.aclose()
