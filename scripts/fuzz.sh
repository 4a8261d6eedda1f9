#!/usr/bin/env bash
# The fuzzing properties of the test suite, run longer: the gateway's reading of request bodies and
# the agent link's message decoding (tests/*/test_*_fuzz.py). EXAMPLES per property (default 20000;
# the suite runs 300). Bounded in count: each property stops after that many inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-20000}"
start=$(date +%s)
LLMGW_FUZZ_EXAMPLES="$examples" .venv/bin/python -m pytest -q -p no:cacheprovider \
  --hypothesis-show-statistics tests/gateway/test_request_fuzz.py tests/wire/test_codec_fuzz.py
echo "fuzz: ${examples} inputs per property in $(( $(date +%s) - start )) s"
