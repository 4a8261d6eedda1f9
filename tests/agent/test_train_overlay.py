"""The pinned peft/accelerate overlay: the probe, the install command, and the judgement."""

from __future__ import annotations

import json
import subprocess
import sys

from llmgw.core.train_overlay import PINS, install_argv, overlay_problems, parse_probe, pins_hash, probe_argv


def test_pins_and_argvs() -> None:
    assert PINS == (("peft", "0.21.2"), ("accelerate", "1.15.0"))
    argv = install_argv("/opt/vllm/bin/python", "/w/train-overlay/abc")
    assert argv[:4] == ["/opt/vllm/bin/python", "-m", "pip", "install"]
    assert {"--no-deps", "--target"} <= set(argv) and argv[argv.index("--only-binary") + 1] == ":all:"
    assert argv[argv.index("--target") + 1] == "/w/train-overlay/abc"
    assert argv[-2:] == ["peft==0.21.2", "accelerate==1.15.0"]
    assert not any("torch" in part for part in argv)
    assert len(pins_hash()) == 16 and pins_hash() != pins_hash((("peft", "0.22.0"), ("accelerate", "1.15.0")))


def test_the_probe_runs_and_says_what_is_missing() -> None:
    fake = (("json", "x"), ("llmgw_no_such_module", "1.0"))
    result = subprocess.run(probe_argv(sys.executable, fake), capture_output=True, text=True, check=True)
    found = parse_probe(result.stdout)
    assert found == {"json": json.__version__, "llmgw_no_such_module": None}
    assert overlay_problems(found, fake) == [
        f"json is {json.__version__} (need x)",
        "llmgw_no_such_module is missing (need 1.0)",
    ]


def test_the_probe_decision() -> None:
    assert overlay_problems({"peft": "0.21.2", "accelerate": "1.15.0"}) == []
    assert overlay_problems({"peft": "0.21.2", "accelerate": "1.14.0"}) == [
        "accelerate is 1.14.0 (need 1.15.0)"
    ]
    assert overlay_problems(None) == ["the probe printed no versions (does this Python run at all?)"]
    assert parse_probe("noise\n") is None and parse_probe("") is None and parse_probe("[1]") is None
    assert parse_probe('warning\n{"peft": "0.21.2", "accelerate": 3}\n') == {
        "peft": "0.21.2",
        "accelerate": None,
    }


# --- the agent's side, with a stand-in Python that plays the probe and pip -----------------------

FAKE_PYTHON = """#!/bin/sh
# Plays `python -c PROBE` and `python -m pip install ... --target DIR pins...`.
if [ "$1" = "-m" ]; then
    echo pip >> "$(dirname "$0")/calls"
    [ -f "$(dirname "$0")/pip-fails" ] && { echo "ERROR: no matching distribution" >&2; exit 1; }
    while [ "$#" -gt 0 ]; do [ "$1" = "--target" ] && target="$2"; shift; done
    touch "$target/peft.py" "$target/accelerate.py"
    exit 0
fi
echo probe >> "$(dirname "$0")/calls"
# The probe: the pins are met only with an installed overlay on PYTHONPATH.
case "$PYTHONPATH" in
    *train-overlay*) [ -f "$PYTHONPATH/peft.py" ] && { echo '{"peft": "0.21.2", "accelerate": "1.15.0"}'; exit 0; } ;;
esac
echo '{"peft": null, "accelerate": "1.15.0"}'
"""


def fake_python(tmp_path):
    path = tmp_path / "bin" / "python"
    path.parent.mkdir()
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def calls(python) -> list[str]:
    calls_file = python.parent / "calls"
    return calls_file.read_text().splitlines() if calls_file.exists() else []


async def test_a_python_without_the_pins_gets_the_overlay_installed_once(tmp_path):
    from llmgw.agent import runas
    from llmgw.agent.train_overlay import Overlay

    python = fake_python(tmp_path)
    user, _ = runas.resolve(None, tmp_path / "work")
    runas.prepare_home(user)
    overlay = Overlay(str(python), tmp_path / "work" / "train-overlay")

    path = await overlay.path(user)
    assert path == str(tmp_path / "work" / "train-overlay" / pins_hash())
    assert sorted(p.name for p in (tmp_path / "work" / "train-overlay").iterdir()) == [
        pins_hash()
    ]  # no .partial
    assert calls(python) == ["probe", "pip", "probe"]

    assert await overlay.path(user) == path  # found once, then remembered
    assert len(calls(python)) == 3


async def test_a_failed_install_fails_with_pips_last_line_and_leaves_nothing_on_the_path(tmp_path):
    import pytest

    from llmgw.agent import runas
    from llmgw.agent.train_overlay import Overlay, OverlayFailed

    python = fake_python(tmp_path)
    (python.parent / "pip-fails").touch()
    user, _ = runas.resolve(None, tmp_path / "work")
    runas.prepare_home(user)
    overlay = Overlay(str(python), tmp_path / "work" / "train-overlay")
    with pytest.raises(
        OverlayFailed, match="cannot install the pinned peft/accelerate .*no matching distribution"
    ):
        await overlay.path(user)
    assert not (tmp_path / "work" / "train-overlay" / pins_hash()).exists()
