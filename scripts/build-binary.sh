#!/usr/bin/env bash
# Builds the one-file executable dist/llmgw from build/llmgw.spec.
set -euo pipefail

# Run from the repository root whatever the caller's directory: the spec and the work paths
# below are relative to it.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -x .venv/bin/pyinstaller ]]; then
    pyinstaller=.venv/bin/pyinstaller
else
    pyinstaller=pyinstaller
fi

# --clean: a stale analysis cache in build/work can hide a newly missing module.
"$pyinstaller" --noconfirm --clean --workpath build/work --distpath dist build/llmgw.spec

binary=dist/llmgw
# stat's size flag differs between GNU (Linux) and BSD (macOS); wc -c works on both.
size=$(wc -c <"$binary" | tr -d ' ')
echo "built $binary: $size bytes ($((size / 1024 / 1024)) MiB)"
"$binary" --version
