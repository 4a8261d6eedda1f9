#!/usr/bin/env bash
# Runs every check llmgw has: lint, format, the frozen binary build, then the whole test suite.
# Works on a fresh machine (it makes .venv first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_venv

echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

echo "==> frozen binary (dist/llmgw)"
scripts/build-binary.sh

echo "==> pytest"
LLMGW_REQUIRE_BINARY=1 .venv/bin/python -m pytest -q "$@"
