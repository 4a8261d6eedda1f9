"""Converting a trained adapter to GGUF with the installed llama.cpp's own conversion code.

llama.cpp loads adapters as GGUF (``--lora``); its ``convert_lora_to_gguf.py`` knows how each
architecture's tensors are named there, so we run it rather than rewrite it. It imports ``gguf``
from the ``gguf-py`` directory beside it (unless NO_LOCAL_GGUF is set) and, in current versions,
its model classes from the ``conversion`` package beside it (older ones: from
``convert_hf_to_gguf.py``). Pure helpers: the agent runs the argv as the engines' user.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# f32 keeps the adapter exactly as trained; adapters are small, so the size does not matter.
OUTTYPE = "f32"


def find_converter(configured: str | None) -> Path | None:
    """The configured ``convert_lora_to_gguf.py`` when it is usable here, else None.

    Usable: the file exists, ``gguf-py/gguf`` sits beside it, and so does the code it takes its
    model classes from (the ``conversion`` package, or ``convert_hf_to_gguf.py`` in older trees).
    """
    if not configured:
        return None
    script = Path(configured)
    if not script.is_absolute() or not script.is_file():
        return None
    beside = script.parent
    if not (beside / "gguf-py" / "gguf").is_dir():
        return None
    if not ((beside / "conversion").is_dir() or (beside / "convert_hf_to_gguf.py").is_file()):
        return None
    return script


def convert_argv(python: str, script: Path, adapter_dir: Path, base_dir: Path, outfile: Path) -> list[str]:
    """The converter's command line. ``--base`` is always given: without it the converter reads the
    base from the adapter's config, a training-time path or a hub id that means nothing here."""
    return [
        python,
        str(script),
        "--base",
        str(base_dir),
        "--outfile",
        str(outfile),
        "--outtype",
        OUTTYPE,
        str(adapter_dir),
    ]


def converter_env(script: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the converter: ``base`` (default: nothing) with the ``gguf-py`` beside
    the script first on PYTHONPATH, NO_LOCAL_GGUF removed (it would make the script skip that
    gguf-py for whatever ``gguf`` is installed), and the model hub switched off."""
    env = dict(base or {})
    env.pop("NO_LOCAL_GGUF", None)
    gguf_py = str(script.parent / "gguf-py")
    env["PYTHONPATH"] = ":".join(filter(None, [gguf_py, env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    # The converter's directory belongs to whoever installed llama.cpp: no __pycache__ there.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env
