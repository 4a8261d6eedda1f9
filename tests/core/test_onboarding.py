"""core/onboarding: which binary a node gets, what the probe says, and which steps node add takes."""

from __future__ import annotations

import hashlib
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import parse_agent_config
from llmgw.core import onboarding
from llmgw.core.onboarding import (
    ENGINE_USER,
    FileFacts,
    Layout,
    NoBinary,
    NodeFacts,
    Platform,
    ProbeError,
    Wanted,
    WantedFile,
    as_root,
    choose_binary,
    executable_platform,
    normalise_platform,
    parse_probe,
    plan,
    probe_script,
)

LINUX_X86 = Platform("Linux", "x86_64")
DEFAULT_LAYOUT = Layout()


def elf(machine: int, *, little: bool = True, abi: int = 0) -> bytes:
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[4] = 2
    header[5] = 1 if little else 2
    header[7] = abi
    header[18:20] = machine.to_bytes(2, "little" if little else "big")
    return bytes(header)


def test_executable_headers_say_their_platform():
    assert executable_platform(elf(0x3E)) == LINUX_X86
    assert executable_platform(elf(0xB7, abi=3)) == Platform("Linux", "aarch64")
    assert executable_platform(elf(0x15, little=False)) == Platform("Linux", "ppc64")
    macho = b"\xcf\xfa\xed\xfe" + (0x0100000C).to_bytes(4, "little") + bytes(56)
    assert executable_platform(macho) == Platform("Darwin", "aarch64")
    # Not native executables: a script, a FreeBSD ELF, an unknown machine, a truncated header.
    assert executable_platform(b"#!/bin/sh\nexec python3 -m llmgw\n") is None
    assert executable_platform(elf(0x3E, abi=9)) is None
    assert executable_platform(elf(0x9999)) is None
    assert executable_platform(b"\x7fELF\x02\x01") is None


def test_uname_names_are_normalised():
    assert normalise_platform("Linux", "x86_64\n") == LINUX_X86
    assert normalise_platform("linux", "amd64") == LINUX_X86
    assert normalise_platform("Darwin", "arm64") == Platform("Darwin", "aarch64")


def test_the_binary_built_for_the_node_is_chosen_and_its_absence_explained():
    arm = Platform("Linux", "aarch64")
    candidates = {
        "llmgw": LINUX_X86,
        "llmgw-linux-x86_64": LINUX_X86,
        "llmgw-linux-aarch64": arm,
        "llmgw-x": None,
    }
    assert choose_binary(LINUX_X86, candidates, "dist") == "llmgw-linux-x86_64"
    assert choose_binary(arm, candidates, "dist") == "llmgw-linux-aarch64"
    assert choose_binary(LINUX_X86, {"llmgw": LINUX_X86}, "dist") == "llmgw"
    with pytest.raises(NoBinary) as refused:
        choose_binary(Platform("Linux", "riscv64"), candidates, "dist")
    message = str(refused.value)
    assert "no llmgw binary for Linux riscv64 in dist" in message
    assert "llmgw-linux-aarch64 (Linux aarch64)" in message and "llmgw-x (not a native executable)" in message
    assert "llmgw-linux-riscv64" in message  # the name to build it under
    with pytest.raises(NoBinary, match="none at all"):
        choose_binary(LINUX_X86, {}, "dist")


# --- plan ---------------------------------------------------------------------------------------


def wanted(layout: Layout = DEFAULT_LAYOUT) -> Wanted:
    def file(path: str, mode: int, content: str) -> WantedFile:
        return WantedFile(path=path, sha256=hashlib.sha256(content.encode()).hexdigest(), size=len(content),
                          mode=mode, content=content, says=content)  # fmt: skip

    return Wanted(
        node_name="gpu-1",
        layout=layout,
        files=(
            file(layout.binary, 0o755, "binary"),
            file(layout.config, 0o600, "config"),
            file(layout.join_token, 0o600, "token"),
            file(layout.unit, 0o644, "unit"),
        ),
    )


def as_wanted(want: Wanted, **changes) -> NodeFacts:
    facts = dict(
        platform=LINUX_X86,
        uid=0,
        hostname="gpu-1",
        systemd=True,
        files=tuple(FileFacts(sha256=f.sha256, mode=f.mode, owner="0:0") for f in want.files),
        user_groups=frozenset(onboarding.ENGINE_GROUPS),
        user_ids="998:997",
        groups=frozenset(onboarding.ENGINE_GROUPS),
        home=FileFacts(sha256="", mode=0o700, owner="998:997"),
        enabled=True,
        active=True,
    )
    return NodeFacts(**{**facts, **changes})


def changing(steps) -> list[str]:
    return [step.says for step in steps if step.changes]


def test_a_node_as_wanted_plans_no_change():
    steps = plan(as_wanted(wanted()), wanted())
    assert changing(steps) == []
    assert all(step.script == "" for step in steps)
    assert [step.says.split(":")[0] for step in steps] == [
        "binary", "config", "token", "unit", "groups", "user", "home", "service", "service",
    ]  # fmt: skip


def test_a_bare_node_gets_every_step_and_a_start():
    want = wanted()
    facts = as_wanted(want, files=(FileFacts(sha256=None),) * 4, user_groups=None, user_ids=None,
                      groups=frozenset({"video"}), home=FileFacts(sha256=None), enabled=False, active=False)  # fmt: skip
    steps = plan(facts, want)
    says = changing(steps)
    assert len(says) == 9, says
    assert "groups: create render" in says[4] and "video" not in says[4].split("create")[1]
    assert "useradd --system --user-group" in steps[5].script and "--groups video,render" in steps[5].script
    assert "--prefix" not in steps[5].script
    assert steps[-1].script == "systemctl daemon-reload\nsystemctl start llmgw-agent.service\n"
    # What a step writes goes on its stdin: the script names the content, never carries it.
    for step, content in zip(steps[:4], ("binary", "config", "token", "unit"), strict=True):
        assert (
            step.stdin == content and f"cat > {want.files[steps.index(step)].path}.llmgw-new" in step.script
        )


def test_a_changed_file_on_a_running_node_restarts_the_agent_and_nothing_else():
    want = wanted()
    files = list(as_wanted(want).files)
    files[1] = FileFacts(sha256="0" * 64, mode=0o600, owner="0:0")
    steps = plan(as_wanted(want, files=tuple(files)), want)
    assert len(changing(steps)) == 2
    assert "replace /etc/llmgw/agent.yaml" in changing(steps)[0]
    assert "systemctl restart llmgw-agent.service" in steps[-1].script


def test_a_wrong_mode_or_owner_is_rewritten_and_said_so():
    want = wanted()
    files = list(as_wanted(want).files)
    files[2] = FileFacts(sha256=want.files[2].sha256, mode=0o644, owner="0:0")
    steps = plan(as_wanted(want, files=tuple(files), active=False), want)
    assert "set owner root:root and mode 0600 of /etc/llmgw/join-token" in changing(steps)[0]


def test_a_user_without_render_is_added_to_it_and_its_home_fixed():
    steps = plan(
        as_wanted(
            wanted(), user_groups=frozenset({"video"}), home=FileFacts(sha256="", mode=0o755, owner="998:997")
        ),
        wanted(),
    )
    says = changing(steps)
    assert says[0] == f"user: add {ENGINE_USER} to render"
    assert steps[5].script == f"usermod --append --groups render {ENGINE_USER}\n"
    assert "home: make" in says[1] and "chmod 0700" in steps[6].script


def test_without_systemd_or_under_a_prefix_the_agent_is_left_to_the_operator():
    for facts, layout in ((as_wanted(wanted(), systemd=False), Layout()), (None, Layout(root="/srv/n1"))):
        want = wanted(layout)
        facts = facts or as_wanted(want, enabled=False)
        last = plan(facts, want)[-1]
        assert last.notice and not last.changes and last.script == ""
        assert f"{layout.binary} agent --config {layout.config}" in last.says


@given(
    st.lists(st.sampled_from(["missing", "content", "mode", "owner", "ok"]), min_size=4, max_size=4),
    st.sampled_from(["none", "lacking", "ok"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_plan_changes_exactly_what_differs(files, user, group_render, enabled, active):
    want = wanted()
    ok = as_wanted(want)

    def file_facts(kind: str, have: FileFacts) -> FileFacts:
        return {
            "missing": FileFacts(sha256=None),
            "content": FileFacts(sha256="f" * 64, mode=have.mode, owner="0:0"),
            "mode": FileFacts(sha256=have.sha256, mode=0o666, owner="0:0"),
            "owner": FileFacts(sha256=have.sha256, mode=have.mode, owner="1000:1000"),
            "ok": have,
        }[kind]

    facts = as_wanted(
        want,
        files=tuple(file_facts(kind, have) for kind, have in zip(files, ok.files, strict=True)),
        user_groups=None if user == "none" else frozenset({"video"}) if user == "lacking" else ok.user_groups,
        user_ids=None if user == "none" else ok.user_ids,
        groups=ok.groups if group_render else frozenset({"video"}),
        enabled=enabled,
        active=active,
    )
    steps = plan(facts, want)
    differs = [kind != "ok" for kind in files] + [not group_render, user != "ok", user == "none", not enabled]
    assert [step.changes for step in steps[:8]] == differs
    # Any file or user change restarts a running agent (it reads both at start); a stopped one starts.
    anything = any(differs[:7]) or not active
    assert steps[8].changes == anything
    assert all(bool(step.script) == step.changes for step in steps)


# --- the probe, run here by a real shell against a prefixed layout -----------------------------


def test_the_probe_script_reads_a_layout_and_parse_probe_reads_its_answer(tmp_path):
    layout = Layout(root=str(tmp_path))
    (tmp_path / "etc/llmgw").mkdir(parents=True)
    (tmp_path / "etc/passwd").write_text(
        f"root:x:0:0::/root:/bin/sh\n{ENGINE_USER}:x:990:991::/h:/bin/false\n"
    )
    (tmp_path / "etc/group").write_text(f"video:x:44:{ENGINE_USER},someone\nrender:x:105:\n")
    (tmp_path / "etc/llmgw/agent.yaml").write_text("x")
    (tmp_path / "etc/llmgw/agent.yaml").chmod(0o640)
    paths = [layout.binary, layout.config]
    answer = subprocess.run(
        ["sh", "-c", as_root(probe_script(paths, layout))], capture_output=True, text=True
    )
    assert answer.returncode == 0, answer.stderr
    facts = parse_probe(answer.stdout, len(paths))
    assert facts.uid == 0 and facts.hostname
    assert facts.files[0] == FileFacts(sha256=None)
    assert facts.files[1] == FileFacts(sha256=hashlib.sha256(b"x").hexdigest(), mode=0o640, owner="0:0")
    assert facts.user_ids == "990:991"
    assert facts.user_groups == frozenset({"video"}) and facts.groups == frozenset({"video", "render"})
    assert facts.home == FileFacts(sha256=None) and not facts.enabled and not facts.active


def test_an_answer_that_is_not_the_probes_is_refused():
    with pytest.raises(ProbeError, match="lacks"):
        parse_probe("This account is currently not available.\n", 4)


def test_as_root_keeps_a_script_with_quotes_intact(tmp_path):
    target = tmp_path / "it's here"
    script = f"printf '%s' \"a'b\" > '{str(target).replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}'"
    result = subprocess.run(["sh", "-c", as_root(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert target.read_text() == "a'b"


def test_agent_yaml_and_unit_quote_names_and_paths():
    layout = Layout(root="/srv/my node")
    text = onboarding.agent_yaml("gpu-7", ["10.0.0.5:7070"], layout)
    assert '"/srv/my node/etc/llmgw/join-token"' in text
    # What the agent reads back: one server, or every server sharing a store.
    config = parse_agent_config(text)
    assert (
        config.node_name == "gpu-7"
        and str(config.server.join_token_file) == "/srv/my node/etc/llmgw/join-token"
    )
    assert [str(a) for a in config.server.all_addresses] == ["10.0.0.5:7070"]
    assert config.engines.run_as == "llmgw-engine" and config.engines.stop_shards_on_exit is False
    both = parse_agent_config(onboarding.agent_yaml("gpu-7", ["10.0.0.5:7070", "10.0.0.6:7070"], layout))
    assert [str(a) for a in both.server.all_addresses] == ["10.0.0.5:7070", "10.0.0.6:7070"]
    assert 'node_name: "gpu \\"7\\""' in onboarding.agent_yaml('gpu "7"', ["h:1"], layout)
    unit = onboarding.unit_text("gpu-7", layout)
    assert (
        'ExecStart="/srv/my node/usr/local/bin/llmgw" agent --config "/srv/my node/etc/llmgw/agent.yaml"'
        in unit
    )
    assert "KillMode=process" in unit and "Restart=always" in unit


def test_after_a_restart_only_a_newer_registration_counts():
    from llmgw.core.onboarding import registered, restarts_agent

    want = wanted()
    files = list(as_wanted(want).files)
    files[1] = FileFacts(sha256="0" * 64, mode=0o600, owner="0:0")
    assert restarts_agent(plan(as_wanted(want, files=tuple(files)), want))
    assert restarts_agent(plan(as_wanted(want, active=False), want))  # a first start
    assert not restarts_agent(plan(as_wanted(want), want))
    assert not restarts_agent(plan(as_wanted(want, enabled=False), want))  # enabling only
    assert not restarts_agent(plan(as_wanted(want, systemd=False, files=tuple(files)), want))
    old_link = {"connected": True, "registrations": 3}
    assert registered(old_link, None)  # nothing restarted: connected is enough
    assert not registered(old_link, 3)  # the link from before the restart
    assert registered({"connected": True, "registrations": 4}, 3)
    assert registered({"connected": True, "registrations": 1}, 3)  # the server restarted meanwhile
    assert registered({"connected": True, "registrations": 1}, -1)  # unknown before
    assert not registered({"connected": False, "registrations": 4}, 3)
    assert not registered(None, None)
