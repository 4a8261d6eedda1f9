"""server.yaml / agent.yaml parsing: defaults, value types, and one-line errors naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from llmgw.config import (
    Address,
    AgentConfig,
    ConfigError,
    ServerConfig,
    ServerTls,
    default_home,
    load_agent_config,
    load_server_config,
    parse_agent_config,
    parse_catalog_file,
    parse_duration,
    parse_server_config,
    structure_catalog,
)
from llmgw.core.catalog import Model, Profile
from llmgw.core.listener_limits import ListenerLimits
from llmgw.core.shard import Adapter

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Pins the home-dependent defaults so no test depends on the machine's environment."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("LLMGW_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    return home


def server_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_server_config(text)
    message = str(info.value)
    assert "\n" not in message
    return message


def agent_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_agent_config(text)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- defaults ----------------------------------------------------------------------------------


def test_server_defaults(home: Path) -> None:
    config = ServerConfig()
    assert config.data_dir == home / ".local/share/llmgw/server"
    assert config.log_level == "info"
    assert str(config.link.listen) == "127.0.0.1:7070"
    assert config.link.join_token_file is None
    assert config.link.heartbeat_interval == 5.0
    assert config.link.missed_heartbeats == 3
    assert config.link.handshake_timeout == 10.0
    assert config.link.tls is None
    assert str(config.admin.listen) == "127.0.0.1:7071"
    assert config.admin.token_file is None
    assert config.join_token_path == home / ".local/share/llmgw/server/join-token"
    assert config.admin_token_path == home / ".local/share/llmgw/server/admin-token"


def test_agent_defaults(home: Path) -> None:
    config = AgentConfig()
    assert config.node_name is None
    assert config.work_dir == home / ".local/share/llmgw/agent"
    assert config.log_level == "info"
    assert config.fabric is None
    assert str(config.server.address) == "127.0.0.1:7070"
    assert config.server.join_token_file is None
    assert config.server.ca_file is None
    assert config.server.server_name is None
    assert config.reconnect.initial_delay == 0.5
    assert config.reconnect.max_delay == 30.0
    assert config.discovery.simulate is None  # the real hardware


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_file_means_defaults(text: str) -> None:
    assert parse_server_config(text) == ServerConfig()
    assert parse_agent_config(text) == AgentConfig()


@pytest.mark.parametrize("text", ["link:\n", "link: {}\nadmin:\n", "link:\n  # listen: x\n"])
def test_empty_section_means_defaults(text: str) -> None:
    assert parse_server_config(text) == ServerConfig()


def test_load_none_reads_no_file() -> None:
    assert load_server_config(None) == ServerConfig()
    assert load_agent_config(None) == AgentConfig()


def test_tls_null_is_allowed() -> None:
    assert parse_server_config("link:\n  tls: null\n").link.tls is None


# --- the examples ------------------------------------------------------------------------------


def test_examples_equal_the_defaults() -> None:
    assert load_server_config(EXAMPLES / "server.yaml") == ServerConfig()
    assert load_agent_config(EXAMPLES / "agent.yaml") == AgentConfig()


def option_paths(cls: type, prefix: str = "") -> list[str]:
    paths = []
    for field in attrs.fields(cls):
        paths.append(prefix + field.name)
        # Sections are attrs classes, possibly optional; Address is a value, not a section.
        nested = [t for t in (field.type, *getattr(field.type, "__args__", ())) if attrs.has(t)]
        if nested and nested[0] is not Address:
            paths += option_paths(nested[0], prefix + field.name + ".")
    return paths


@pytest.mark.parametrize(
    ("cls", "example"), [(ServerConfig, "server.yaml"), (AgentConfig, "agent.yaml")], ids=["server", "agent"]
)
def test_examples_mention_every_option(cls: type, example: str) -> None:
    attrs.resolve_types(cls)
    text = (EXAMPLES / example).read_text()
    for path in option_paths(cls):
        leaf = path.rpartition(".")[2]
        # As a key, commented out or not.
        assert re.search(rf"^[ #]*{leaf}:", text, re.M), f"{example} lacks {path}"


# --- a full file -------------------------------------------------------------------------------


def test_server_full_file(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "server.yaml"
    path.parent.mkdir()
    path.write_text(
        "data_dir: /var/lib/llmgw\n"
        "log_level: DEBUG\n"
        "link:\n"
        "  listen: '[::]:0'\n"
        "  join_token_file: secrets/join\n"
        "  heartbeat_interval: 250ms\n"
        "  missed_heartbeats: 5\n"
        "  handshake_timeout: 2m\n"
        "  tls:\n"
        "    cert_file: tls/server.crt\n"
        "    key_file: /etc/tls/server.key\n"
        "admin:\n"
        "  listen: 0.0.0.0:9000\n"
        "  token_file: admin.token\n"
        "gateway:\n"
        "  queue_timeout: 5m\n"
    )
    config = load_server_config(path)
    etc = path.parent
    assert config.data_dir == Path("/var/lib/llmgw")
    assert config.log_level == "debug"
    assert config.link.listen == Address(host="::", port=0)
    assert config.link.join_token_file == etc / "secrets/join"
    assert config.link.heartbeat_interval == 0.25
    assert config.link.missed_heartbeats == 5
    assert config.link.handshake_timeout == 120.0
    assert config.link.tls == ServerTls(
        cert_file=etc / "tls/server.crt", key_file=Path("/etc/tls/server.key")
    )
    assert config.admin.listen == Address(host="0.0.0.0", port=9000)
    assert config.gateway.queue_timeout == 300.0
    assert config.join_token_path == etc / "secrets/join"
    assert config.admin_token_path == etc / "admin.token"


def test_agent_full_file(tmp_path: Path) -> None:
    config = parse_agent_config(
        "node_name: gpu-01.rack3\n"
        "work_dir: work\n"
        "log_level: warning\n"
        "fabric: ib-east\n"
        "server:\n"
        "  address: cp.example.com:7070\n"
        "  join_token_file: token\n"
        "  ca_file: ca.pem\n"
        "  server_name: cp.internal\n"
        "reconnect:\n"
        "  initial_delay: 1\n"
        "  max_delay: 1h\n"
        "discovery:\n"
        "  simulate: sim/gpus.yaml\n",
        base_dir=tmp_path,
    )
    assert config.node_name == "gpu-01.rack3"
    assert config.work_dir == tmp_path / "work"
    assert config.log_level == "warning"
    assert config.fabric == "ib-east"
    assert config.server.address == Address(host="cp.example.com", port=7070)
    assert config.server.join_token_file == tmp_path / "token"
    assert config.server.ca_file == tmp_path / "ca.pem"
    assert config.server.server_name == "cp.internal"
    assert config.reconnect.initial_delay == 1.0
    assert config.reconnect.max_delay == 3600.0
    assert config.discovery.simulate == tmp_path / "sim/gpus.yaml"


# --- paths -------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf/agent.yaml").write_text("work_dir: ../state\n")
    monkeypatch.chdir(tmp_path)
    # A relative path to the file itself still anchors at the file's directory, not the cwd.
    config = load_agent_config(Path("conf/agent.yaml"))
    assert config.work_dir == tmp_path / "conf/../state"


def test_relative_paths_resolve_against_cwd_without_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_server_config("data_dir: state\n").data_dir == tmp_path / "state"


def test_tilde_is_expanded(home: Path) -> None:
    config = parse_server_config("data_dir: ~/llmgw\nadmin:\n  token_file: ~/admin\n")
    assert config.data_dir == home / "llmgw"
    assert config.admin_token_path == home / "admin"
    assert (
        parse_agent_config("discovery:\n  simulate: ~/gpus.yaml\n").discovery.simulate == home / "gpus.yaml"
    )


def test_simulate_path_resolves_against_agent_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf/agent.yaml").write_text("discovery:\n  simulate: gpus.yaml\n")
    monkeypatch.chdir(tmp_path)
    assert load_agent_config(Path("conf/agent.yaml")).discovery.simulate == tmp_path / "conf/gpus.yaml"


def test_token_paths_follow_data_dir(tmp_path: Path) -> None:
    config = parse_server_config("data_dir: /srv/llmgw\n")
    assert config.join_token_path == Path("/srv/llmgw/join-token")
    assert config.admin_token_path == Path("/srv/llmgw/admin-token")


# --- default_home ------------------------------------------------------------------------------


def test_default_home_prefers_llmgw_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMGW_HOME", str(tmp_path / "gw"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_home() == tmp_path / "gw"
    assert ServerConfig().data_dir == tmp_path / "gw/server"
    assert AgentConfig().work_dir == tmp_path / "gw/agent"


def test_default_home_relative_llmgw_home_is_made_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMGW_HOME", "gw")
    assert default_home() == tmp_path / "gw"


def test_default_home_uses_xdg_data_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_home() == tmp_path / "xdg/llmgw"


@pytest.mark.parametrize("xdg", ["", "relative/dir"])
def test_default_home_ignores_empty_or_relative_xdg(
    monkeypatch: pytest.MonkeyPatch, home: Path, xdg: str
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", xdg)
    assert default_home() == home / ".local/share/llmgw"


def test_default_home_falls_back_to_local_share(home: Path) -> None:
    assert default_home() == home / ".local/share/llmgw"


# --- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:7070", "127.0.0.1", 7070),
        ("localhost:0", "localhost", 0),
        ("cp.example.com:65535", "cp.example.com", 65535),
        ("[::1]:7070", "::1", 7070),
        ("[fe80::1:2]:80", "fe80::1:2", 80),
        ("[::]:0", "::", 0),
    ],
)
def test_address_parse_and_round_trip(text: str, host: str, port: int) -> None:
    address = Address.parse(text)
    assert address == Address(host=host, port=port)
    assert str(address) == text
    assert Address.parse(str(address)) == address
    assert parse_server_config(f"link:\n  listen: '{text}'\n").link.listen == address


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("foo", 'expected host:port, got "foo"'),
        ("foo:", 'expected host:port, got "foo:"'),
        (":7070", 'expected host:port, got ":7070"'),
        ("host:http", 'expected host:port, got "host:http"'),
        ("host:-1", 'expected host:port, got "host:-1"'),
        ("two words:80", 'expected host:port, got "two words:80"'),
        ("host:70000", 'expected host:port with a port from 0 to 65535, got "host:70000"'),
        ("host:123456", 'expected host:port, got "host:123456"'),
        ("::1:7070", 'expected host:port (an IPv6 host goes in brackets, like [::1]:7070), got "::1:7070"'),
        ("[::1]", 'expected host:port (an IPv6 host goes in brackets, like [::1]:7070), got "[::1]"'),
        ("[nothex]:80", 'expected [ipv6]:port, got "[nothex]:80"'),
        ("[1.2.3.4]:80", 'expected [ipv6]:port, got "[1.2.3.4]:80"'),
        (7070, "expected host:port, got 7070"),
        (["a", 1], "expected host:port, got a list"),
        (None, "expected host:port, got null"),
    ],
)
def test_bad_address(value: object, message: str) -> None:
    yaml_value = f"'{value}'" if isinstance(value, str) else ("null" if value is None else value)
    assert agent_error(f"server:\n  address: {yaml_value}\n") == f"agent.yaml: server.address: {message}"
    with pytest.raises(ValueError, match=re.escape(message)):
        Address.parse(value)


def test_bad_address_message_from_the_brief() -> None:
    assert (
        agent_error("server:\n  address: foo\n")
        == 'agent.yaml: server.address: expected host:port, got "foo"'
    )
    assert (
        server_error("admin:\n  listen: foo\n") == 'server.yaml: admin.listen: expected host:port, got "foo"'
    )


# --- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5", 5.0),
        ("2.5", 2.5),
        ("0.1", 0.1),
        ("'2.5'", 2.5),
        ("250ms", 0.25),
        ("5s", 5.0),
        ("'.5s'", 0.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1.5h", 5400.0),
        ("'10 s'", 10.0),
    ],
)
def test_duration(value: str, seconds: float) -> None:
    config = parse_server_config(f"link:\n  heartbeat_interval: {value}\n")
    assert config.link.heartbeat_interval == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ("fast", '"fast"'),
        ("5 minutes", '"5 minutes"'),
        ("5d", '"5d"'),
        ("-1s", '"-1s"'),
        ("''", '""'),
        ("true", "true"),
        ("[5]", "a list"),
        ("{s: 5}", "a mapping"),
        ("null", "null"),
    ],
)
def test_bad_duration(value: str, got: str) -> None:
    assert server_error(f"link:\n  heartbeat_interval: {value}\n") == (
        f"server.yaml: link.heartbeat_interval: expected a duration like 5s, 500ms or 2.5, got {got}"
    )


@pytest.mark.parametrize(
    ("value", "got"), [("0", "0"), ("-3", "-3"), ("0ms", '"0ms"'), ("-0.5", "-0.5"), (".inf", "inf")]
)
def test_duration_must_be_positive(value: str, got: str) -> None:
    assert server_error(f"link:\n  handshake_timeout: {value}\n") == (
        f"server.yaml: link.handshake_timeout: expected a duration > 0, got {got}"
    )


def test_parse_duration_is_public() -> None:
    assert parse_duration("750ms") == 0.75
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("link:\n  heartbeat_interval: x\n", "link.heartbeat_interval"),
        ("link:\n  handshake_timeout: x\n", "link.handshake_timeout"),
        ("gateway:\n  queue_timeout: x\n", "gateway.queue_timeout"),
    ],
)
def test_every_server_duration_is_checked(text: str, key: str) -> None:
    assert server_error(text).startswith(f"server.yaml: {key}: expected a duration")


@pytest.mark.parametrize("field", ["initial_delay", "max_delay"])
def test_every_agent_duration_is_checked(field: str) -> None:
    assert agent_error(f"reconnect:\n  {field}: x\n").startswith(
        f"agent.yaml: reconnect.{field}: expected a duration"
    )


def test_max_delay_below_initial_delay() -> None:
    assert agent_error("reconnect:\n  initial_delay: 5s\n  max_delay: 1s\n") == (
        "agent.yaml: reconnect.max_delay: expected a duration >= initial_delay (5s), got 1s"
    )


def test_max_delay_below_the_default_initial_delay() -> None:
    assert agent_error("reconnect:\n  max_delay: 100ms\n") == (
        "agent.yaml: reconnect.max_delay: expected a duration >= initial_delay (0.5s), got 0.1s"
    )


def test_max_delay_equal_to_initial_delay_is_fine() -> None:
    assert parse_agent_config("reconnect:\n  initial_delay: 2s\n  max_delay: 2\n").reconnect.max_delay == 2.0


# --- integers, strings, paths, enums -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ("0", "0"),
        ("-1", "-1"),
        ("'3'", '"3"'),
        ("2.5", "2.5"),
        ("3.0", "3.0"),
        ("true", "true"),
        ("three", '"three"'),
    ],
)
def test_bad_missed_heartbeats(value: str, got: str) -> None:
    assert server_error(f"link:\n  missed_heartbeats: {value}\n") == (
        f"server.yaml: link.missed_heartbeats: expected an integer >= 1, got {got}"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fabric: 5\n", "agent.yaml: fabric: expected a string, got 5"),
        (
            "engines:\n  stop_shards_on_exit: 1\n",
            "agent.yaml: engines.stop_shards_on_exit: expected true or false, got 1",
        ),
        (
            "engines:\n  leader_wait: soon\n",
            'agent.yaml: engines.leader_wait: expected a duration like 5s, 500ms or 2.5, got "soon"',
        ),
        ("fabric: [a]\n", "agent.yaml: fabric: expected a string, got a list"),
        ("server:\n  server_name: true\n", "agent.yaml: server.server_name: expected a string, got true"),
        ("work_dir: 5\n", "agent.yaml: work_dir: expected a path, got 5"),
        ("work_dir: ''\n", 'agent.yaml: work_dir: expected a path, got ""'),
        ("server:\n  ca_file: {a: 1}\n", "agent.yaml: server.ca_file: expected a path, got a mapping"),
        ("server:\n  join_token_file: 1\n", "agent.yaml: server.join_token_file: expected a path, got 1"),
        ("server: 5\n", "agent.yaml: server: expected a mapping of options, got 5"),
        ("reconnect: [1, 2]\n", "agent.yaml: reconnect: expected a mapping of options, got a list"),
        ("discovery: 5\n", "agent.yaml: discovery: expected a mapping of options, got 5"),
        ("discovery:\n  simulate: 5\n", "agent.yaml: discovery.simulate: expected a path, got 5"),
        ("discovery:\n  simulate: ''\n", 'agent.yaml: discovery.simulate: expected a path, got ""'),
        ("discovery:\n  simulate: [a.yaml]\n", "agent.yaml: discovery.simulate: expected a path, got a list"),
    ],
)
def test_agent_wrong_types(text: str, message: str) -> None:
    assert agent_error(text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data_dir: [a]\n", "server.yaml: data_dir: expected a path, got a list"),
        ("log_level: 5\n", "server.yaml: log_level: expected one of debug, info, warning, error, got 5"),
        ("link: fast\n", 'server.yaml: link: expected a mapping of options, got "fast"'),
        ("admin: true\n", "server.yaml: admin: expected a mapping of options, got true"),
        ("link:\n  tls: yes\n", "server.yaml: link.tls: expected a mapping of options, got true"),
        ("link:\n  tls: {cert_file: a}\n", "server.yaml: link.tls.key_file: required option is missing"),
        ("link:\n  tls: {}\n", "server.yaml: link.tls.cert_file: required option is missing"),
        (
            "link:\n  tls: {cert_file: a, key_file: 7}\n",
            "server.yaml: link.tls.key_file: expected a path, got 7",
        ),
        (
            "link:\n  join_token_file: false\n",
            "server.yaml: link.join_token_file: expected a path, got false",
        ),
        ("admin:\n  token_file: 1.5\n", "server.yaml: admin.token_file: expected a path, got 1.5"),
    ],
)
def test_server_wrong_types(text: str, message: str) -> None:
    assert server_error(text) == message


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error", "WARNING", "Info"])
def test_log_level(level: str) -> None:
    assert parse_server_config(f"log_level: {level}\n").log_level == level.lower()
    assert parse_agent_config(f"log_level: {level}\n").log_level == level.lower()


@pytest.mark.parametrize(
    ("value", "got"), [("verbose", '"verbose"'), ("warn", '"warn"'), ("''", '""'), ("null", "null")]
)
def test_bad_log_level(value: str, got: str) -> None:
    expected = f"expected one of debug, info, warning, error, got {got}"
    assert server_error(f"log_level: {value}\n") == f"server.yaml: log_level: {expected}"
    assert agent_error(f"log_level: {value}\n") == f"agent.yaml: log_level: {expected}"


@pytest.mark.parametrize("name", ["a", "0", "gpu-01", "n1.rack2", "a" * 63, "x-y.z-9"])
def test_node_name(name: str) -> None:
    assert parse_agent_config(f"node_name: '{name}'\n").node_name == name


NODE_NAME_RULE = (
    "expected a node name (lowercase letters, digits, '-' and '.'; starting and ending with a letter or digit;"
    " at most 63 characters)"
)


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ("'Node1'", '"Node1"'),
        ("'a_b'", '"a_b"'),
        ("'-a'", '"-a"'),
        ("'a-'", '"a-"'),
        ("'a.'", '"a."'),
        ("''", '""'),
        ("'gpu 1'", '"gpu 1"'),
        (f"'{'a' * 64}'", f'"{"a" * 64}"'),
        ("7", "7"),
    ],
)
def test_bad_node_name(value: str, got: str) -> None:
    assert agent_error(f"node_name: {value}\n") == f"agent.yaml: node_name: {NODE_NAME_RULE}, got {got}"


# --- unknown keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "admin:\n  lisen: 127.0.0.1:1\n",
            "server.yaml: admin.lisen: unknown key (expected one of: listen, token_file, tls)",
        ),
        (
            "datadir: /x\n",
            "server.yaml: datadir: unknown key (expected one of: data_dir, log_level, store, store_password_file, link, admin, gateway, reconcile, tracing, ha, models, profiles)",
        ),
        (
            "link:\n  heartbeat: 5s\n",
            "server.yaml: link.heartbeat: unknown key (expected one of: listen, join_token_file,"
            " heartbeat_interval, missed_heartbeats, handshake_timeout, tls)",
        ),
        (
            "link:\n  tls: {cert_file: a, key_file: b, ca_file: c}\n",
            "server.yaml: link.tls.ca_file: unknown key (expected one of: cert_file, key_file)",
        ),
        (
            "1: x\n",
            "server.yaml: 1: unknown key (expected one of: data_dir, log_level, store, store_password_file, link, admin, gateway, reconcile, tracing, ha, models, profiles)",
        ),
    ],
)
def test_server_unknown_key(text: str, message: str) -> None:
    assert server_error(text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: gpu1\n",
            "agent.yaml: name: unknown key (expected one of: node_name, work_dir, log_level, fabric, server, reconnect, engines, discovery, weights, tracing)",
        ),
        (
            "server:\n  adress: h:1\n",
            "agent.yaml: server.adress: unknown key (expected one of: address, addresses, join_token_file, ca_file, server_name)",
        ),
        (
            "reconnect:\n  max: 5s\n",
            "agent.yaml: reconnect.max: unknown key (expected one of: initial_delay, max_delay)",
        ),
        (
            "discovery:\n  simulated: gpus.yaml\n",
            "agent.yaml: discovery.simulated: unknown key (expected one of: simulate)",
        ),
    ],
)
def test_agent_unknown_key(text: str, message: str) -> None:
    assert agent_error(text) == message


def test_server_options_do_not_belong_in_agent_yaml() -> None:
    assert agent_error("link:\n  listen: h:1\n").startswith("agent.yaml: link: unknown key")


# --- only the first problem in the file is reported ---------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "log_level: loud\nlink:\n  missed_heartbeats: 0\n",
            'server.yaml: log_level: expected one of debug, info, warning, error, got "loud"',
        ),
        (
            "link:\n  missed_heartbeats: 0\nlog_level: loud\n",
            "server.yaml: link.missed_heartbeats: expected an integer >= 1, got 0",
        ),
        (
            "admin:\n  bogus: 1\n  listen: x\n",
            "server.yaml: admin.bogus: unknown key (expected one of: listen, token_file, tls)",
        ),
        (
            "admin:\n  listen: x\n  bogus: 1\n",
            'server.yaml: admin.listen: expected host:port, got "x"',
        ),
        (
            "link:\n  listen: x\n  tls: {key_file: k}\n",
            'server.yaml: link.listen: expected host:port, got "x"',
        ),
        # A missing option has no place in the file; it counts as coming after its section's keys.
        (
            "link:\n  tls: {key_file: 5}\n",
            "server.yaml: link.tls.key_file: expected a path, got 5",
        ),
        (
            "zz: 1\nyy: 2\n",
            "server.yaml: zz: unknown key (expected one of: data_dir, log_level, store, store_password_file, link, admin, gateway, reconcile, tracing, ha, models, profiles)",
        ),
    ],
)
def test_first_problem_in_document_order(text: str, message: str) -> None:
    assert server_error(text) == message


# --- the file as a whole -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("log_level: info\nlink: listen: x\n", "server.yaml: line 2: mapping values are not allowed here"),
        (
            "link:\n  listen: [a,\n",
            "server.yaml: line 3: while parsing a flow node, expected the node content, but found '<stream end>'",
        ),
        (
            "link:\n  listen: 'x\n",
            "server.yaml: line 3: while scanning a quoted scalar, found unexpected end of stream",
        ),
        (
            "a: 1\n---\nb: 2\n",
            "server.yaml: line 2: expected a single document in the stream, but found another document",
        ),
    ],
)
def test_yaml_syntax_error(text: str, message: str) -> None:
    assert server_error(text) == message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "42\n", "[1, 2]\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    assert server_error(text) == "server.yaml: expected a mapping of options at the top level"
    assert agent_error(text) == "agent.yaml: expected a mapping of options at the top level"


def test_display_name_is_used(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^custom\.yaml: log_level: "):
        parse_server_config("log_level: 1\n", name="custom.yaml")
    path = tmp_path / "prod-agent.yaml"
    path.write_text("fabric: 1\n")
    with pytest.raises(ConfigError, match=r"^prod-agent\.yaml: fabric: expected a string, got 1$"):
        load_agent_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_server_config(tmp_path / "nowhere" / "server.yaml")
    assert str(info.value) == "server.yaml: no such file"
    with pytest.raises(ConfigError, match=r"^my-agent\.yaml: no such file$"):
        load_agent_config(tmp_path / "my-agent.yaml")


def test_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").mkdir()
    with pytest.raises(ConfigError) as info:
        load_server_config(tmp_path / "server.yaml")
    assert str(info.value) == "server.yaml: cannot read: Is a directory"


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_bytes(b"log_level: \xff\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value) == "server.yaml: not UTF-8 text (byte 11)"


def test_empty_file_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("")
    assert load_server_config(path) == ServerConfig()


def test_config_error_fields() -> None:
    with pytest.raises(ConfigError) as info:
        parse_server_config("link:\n  missed_heartbeats: 0\n")
    assert (info.value.name, info.value.key) == ("server.yaml", "link.missed_heartbeats")
    assert info.value.problem == "expected an integer >= 1, got 0"


# --- the catalog sections ----------------------------------------------------------------------

CATALOG = """\
models:
  smollm2-135m: {path: /models/SmolLM2-135M-Instruct.Q4_1.gguf, format: gguf}
  org/qwen: {path: Qwen/Qwen2.5-7B-Instruct, format: safetensors}
profiles:
  smollm2-cpu:
    model: smollm2-135m
    engine: llamacpp
    gpu_class: null
    memory_mib: 1024
    cpu_cores: 2
  qwen-h100:
    model: org/qwen
    engine: vllm
    gpu_class: h100-80g
    gpus_per_node: 2
    nodes: 2
    tensor_parallel: 2
    pipeline_parallel: 2
    memory_mib: 70000
    flags: [--enable-prefix-caching]
    adapters:
      - {name: sql, path: /adapters/sql}
      - {name: support, source: support-bot}
    max_replicas: 3
    band: -1
    startup_timeout: 15m
    spread: true
    routing: least-loaded
    scale_to_zero_after: 30m
"""


def test_catalog_sections() -> None:
    config = parse_server_config(CATALOG)
    assert config.models == (
        Model(name="smollm2-135m", path="/models/SmolLM2-135M-Instruct.Q4_1.gguf", format="gguf"),
        Model(name="org/qwen", path="Qwen/Qwen2.5-7B-Instruct", format="safetensors"),
    )
    cpu, gpu = config.profiles
    assert cpu == Profile(
        name="smollm2-cpu",
        model="smollm2-135m",
        engine="llamacpp",
        gpu_class=None,
        memory_mib=1024,
        cpu_cores=2,
    )
    assert (gpu.name, gpu.gpus_per_node, gpu.nodes, gpu.tensor_parallel, gpu.pipeline_parallel) == (
        "qwen-h100", 2, 2, 2, 2
    )  # fmt: skip
    assert gpu.flags == ("--enable-prefix-caching",)
    # A path on the nodes, or an adapter the server keeps and delivers.
    assert gpu.adapters == (
        Adapter(name="sql", path="/adapters/sql"),
        Adapter(name="support", source="support-bot"),
    )
    assert (gpu.max_replicas, gpu.band, gpu.startup_timeout, gpu.spread) == (3, -1, 900.0, True)
    assert (gpu.routing, gpu.scale_to_zero_after) == ("least-loaded", 1800.0)
    assert (cpu.routing, cpu.routing_load_factor, cpu.scale_to_zero_after) == ("prefix", 1.25, 900.0)


@pytest.mark.parametrize("text", ["models:\nprofiles:\n", "models: {}\nprofiles: {}\n"])
def test_empty_catalog_sections(text: str) -> None:
    assert parse_server_config(text) == ServerConfig()


PROFILE = (
    "profiles:\n  chat:\n    model: m\n    engine: vllm\n    gpu_class: l40s-45g\n    gpus_per_node: 1\n"
)
MODEL = "models:\n  m: {path: org/m, format: safetensors}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # The shape of the sections.
        ("models: [a]\n", "server.yaml: models: expected a mapping of model names to their options, got a list"),
        ("profiles: chat\n", 'server.yaml: profiles: expected a mapping of profile names to their options, got "chat"'),
        ("models:\n  m: 5\n", "server.yaml: models.m: expected a mapping of options, got 5"),
        ("models:\n  7: {path: a.gguf, format: gguf}\n", "server.yaml: models.7: expected a name (a string), got 7"),
        (
            "models:\n  m: {name: m, path: a.gguf, format: gguf}\n",
            "server.yaml: models.m.name: unknown key: an entry's name is its key in models",
        ),
        # Unknown and missing keys.
        (
            "models:\n  m: {path: a.gguf, fmt: gguf}\n",
            "server.yaml: models.m.fmt: unknown key (expected one of: path, format, sha256)",
        ),
        ("models:\n  m: {path: a.gguf}\n", "server.yaml: models.m.format: required option is missing"),
        (MODEL + PROFILE + "    gpus: 2\n", "server.yaml: profiles.chat.gpus: unknown key (expected one of: model, "
         "engine, gpu_class, engine_version, gpus_per_node, nodes, tensor_parallel, pipeline_parallel, memory_mib, cpu_cores, "
         "launcher, flags, adapters, max_loaded_adapters, max_lora_rank, ctx_size, parallel, dtype, quantization, min_replicas, max_replicas, band, "
         "startup_timeout, ttft_target, spread, routing, routing_load_factor, routing_prefix_chars, "
         "scale_to_zero_after)"),
        (MODEL + PROFILE, "server.yaml: profiles.chat.memory_mib: required option is missing"),
        (
            MODEL + "profiles:\n  chat: {model: m, engine: llamacpp, memory_mib: 1}\n",
            "server.yaml: profiles.chat.gpu_class: required option is missing",
        ),
        # Wrong types.
        (MODEL + PROFILE + "    memory_mib: 1.5\n", "server.yaml: profiles.chat.memory_mib: expected an integer, got 1.5"),
        (MODEL + PROFILE + "    memory_mib: '100'\n", 'server.yaml: profiles.chat.memory_mib: expected an integer, got "100"'),
        (MODEL + PROFILE + "    memory_mib: true\n", "server.yaml: profiles.chat.memory_mib: expected an integer, got true"),
        (MODEL + PROFILE + "    memory_mib: 1\n    ctx_size: big\n",
         'server.yaml: profiles.chat.ctx_size: expected an integer, got "big"'),
        (MODEL + PROFILE + "    memory_mib: 1\n    engine: 3\n", "server.yaml: profiles.chat.engine: expected a string, got 3"),
        (MODEL + PROFILE + "    memory_mib: 1\n    spread: yes please\n",
         'server.yaml: profiles.chat.spread: expected true or false, got "yes please"'),
        (MODEL + PROFILE + "    memory_mib: 1\n    flags: --enforce-eager\n",
         'server.yaml: profiles.chat.flags: expected a list, got "--enforce-eager"'),
        (MODEL + PROFILE + "    memory_mib: 1\n    flags: [--a, 2]\n",
         "server.yaml: profiles.chat.flags[1]: expected a string, got 2"),
        (MODEL + PROFILE + "    memory_mib: 1\n    adapters: [{name: a}]\n",
         "server.yaml: profiles.chat.adapters[0].path: set path (files on the node) or source (a stored adapter)"),
        (MODEL + PROFILE + "    memory_mib: 1\n    adapters: [{name: a, path: b, rank: 8}]\n",
         "server.yaml: profiles.chat.adapters[0].rank: unknown key (expected one of: name, path, source, files)"),
        (MODEL + PROFILE + "    memory_mib: 1\n    adapters: [{name: a, path: b, source: c}]\n",
         "server.yaml: profiles.chat.adapters[0]: set path (files on the node) or source (a stored adapter), not both"),
        (MODEL + PROFILE + "    memory_mib: 1\n    adapters: [{name: a, source: C!}]\n",
         "server.yaml: profiles.chat.adapters[0].source: 'C!' is not an adapter name"),
        (MODEL + PROFILE + "    memory_mib: 1\n    startup_timeout: soon\n",
         'server.yaml: profiles.chat.startup_timeout: expected a duration like 5s, 500ms or 2.5, got "soon"'),
        (MODEL + PROFILE + "    memory_mib: 1\n    startup_timeout: 0s\n",
         'server.yaml: profiles.chat.startup_timeout: expected a duration > 0, got "0s"'),
        # The catalog's own rules, at the key that holds the mistake.
        (PROFILE + "    memory_mib: 1\n", "server.yaml: profiles.chat.model: no model named 'm' in the catalog"),
        (MODEL + PROFILE + "    memory_mib: 0\n", "server.yaml: profiles.chat.memory_mib: must be at least 1, not 0"),
        (MODEL + PROFILE + "    memory_mib: 1\n    tensor_parallel: 0\n",
         "server.yaml: profiles.chat.tensor_parallel: must be at least 1, not 0"),
        (MODEL + PROFILE + "    memory_mib: 1\n    min_replicas: 3\n",
         "server.yaml: profiles.chat.min_replicas: 3 is above max_replicas 1"),
        ("models:\n  m: {path: org/m, format: onnx}\n",
         "server.yaml: models.m.format: 'onnx' is not one of gguf, safetensors"),
        ("models:\n  m.v2: {path: m.bin, format: gguf}\n",
         "server.yaml: models.m.v2.path: a gguf model is one .gguf file, and 'm.bin' is not one"),
        ("models:\n  my model: {path: m.gguf, format: gguf}\n",
         "server.yaml: models.my model: expected a name of letters, digits and . _ : @ + / -, starting with a "
         "letter or digit, at most 128 characters, got 'my model'"),
    ],
)  # fmt: skip
def test_catalog_errors(text: str, message: str) -> None:
    assert server_error(text) == message


def test_catalog_errors_come_in_document_order() -> None:
    # The profile comes first in the file, so its mistake is the one reported.
    text = PROFILE + "    memory_mib: 0\n" + "models:\n  m: {path: m.bin, format: gguf}\n"
    assert server_error(text) == "server.yaml: profiles.chat.memory_mib: must be at least 1, not 0"


def test_catalog_error_fields() -> None:
    with pytest.raises(ConfigError) as info:
        parse_server_config(MODEL + PROFILE + "    memory_mib: 1\n    nodes: -2\n")
    assert (info.value.key, info.value.problem) == ("profiles.chat.nodes", "must be at least 1, not -2")


def catalog_example() -> str:
    """The commented-out catalog of examples/server.yaml, uncommented."""
    lines = (EXAMPLES / "server.yaml").read_text().splitlines()
    start = lines.index("# models:")
    block = [line for line in lines[start:] if line.startswith("#")]
    return "\n".join(
        line.removeprefix("#").removeprefix(" ") for line in block if not line.startswith("# Profiles:")
    )


def test_the_catalog_example_is_a_valid_catalog() -> None:
    config = parse_server_config(catalog_example())
    assert [model.name for model in config.models] == ["smollm2-135m", "qwen2.5-72b-instruct"]
    assert [profile.name for profile in config.profiles] == ["smollm2-cpu", "qwen-72b-h100"]


@pytest.mark.parametrize("cls", [Model, Profile])
def test_the_catalog_example_shows_every_option(cls: type) -> None:
    example = catalog_example()
    for field in attrs.fields(cls):
        if field.name != "name":  # an entry's key
            assert re.search(rf"^ *{field.name}:", example, re.M), f"server.yaml's example lacks {field.name}"


def test_catalog_file() -> None:
    catalog = parse_catalog_file(CATALOG, "catalog.yaml")
    assert [p.name for p in catalog.profiles] == ["smollm2-cpu", "qwen-h100"]
    # Alone, a profile may use a model the server already has: the server judges that.
    assert parse_catalog_file(PROFILE + "    memory_mib: 1\n", "c.yaml").profiles[0].model == "m"
    with pytest.raises(
        ConfigError, match=r"^c\.yaml: link: unknown key \(expected one of: models, profiles\)$"
    ):
        parse_catalog_file("link: {}\n", "c.yaml")


def test_structure_catalog_reports_every_problem_by_name_or_place() -> None:
    models, profiles, problems = structure_catalog(
        {
            "models": [{"name": "m", "path": "m.gguf", "format": "gguf"}, {"path": "x"}, "m2"],
            "profiles": [{"name": "p", "model": "m", "engine": 1, "gpu_class": None, "memory_mib": "1"}],
            "nodes": [],
        }
    )
    assert models == (Model(name="m", path="m.gguf", format="gguf"),)
    assert profiles == ()
    assert problems == [
        "nodes: unknown key (expected one of: models, profiles)",
        "models[1].name: expected the entry's name, got null",
        'models[2]: expected a mapping of options, got "m2"',
        "profiles.p.engine: expected a string, got 1",
        'profiles.p.memory_mib: expected an integer, got "1"',
    ]
    assert structure_catalog({"profiles": {"p": {}}})[2] == [
        "profiles: expected a list of entries, got a mapping"
    ]
    assert structure_catalog([1])[2] == ["expected a JSON object with models and profiles, got a list"]


def test_gateway_workers_default_to_one_per_core_this_server_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert parse_server_config("gateway: {}").gateway.workers == 3
    assert parse_server_config("gateway: {workers: auto}").gateway.workers == 3
    assert parse_server_config("gateway: {workers: 0}").gateway.workers == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(1000)))
    assert parse_server_config("gateway: {workers: auto}").gateway.workers == 256
    for bad, said in (("many", 'got "many"'), ("true", "got true"), ("-1", "got -1"), ("257", "got 257")):
        with pytest.raises(ConfigError, match=f"gateway.workers: .*{said}"):
            parse_server_config(f"gateway: {{workers: {bad}}}")


def test_the_gateway_listeners_bounds_are_read_and_a_bad_one_is_named() -> None:
    config = parse_server_config(
        "gateway: {head_timeout: 10s, keepalive_timeout: 1m, max_connections: 5000,"
        " max_connections_per_peer: null, max_body_bytes_in_flight: 1048576}"
    )
    limits = config.gateway.listener_limits()
    assert (limits.head_timeout, limits.keepalive_timeout) == (10.0, 60.0)
    assert (limits.max_connections, limits.max_connections_per_peer) == (5000, None)
    assert limits.max_body_bytes_in_flight == 1048576
    assert parse_server_config("gateway: {}").gateway.listener_limits() == ListenerLimits()
    for field, bad in [("max_connections", "0"), ("body_min_rate", "fast"), ("head_timeout", "-1")]:
        with pytest.raises(ConfigError, match=f"gateway.{field}: "):
            parse_server_config(f"gateway: {{{field}: {bad}}}")
