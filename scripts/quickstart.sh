#!/usr/bin/env bash
# Sets this machine up and runs llmgw on it: the server, one local agent, and a real model
# (SmolLM2-135M-Instruct on llama.cpp, on the CPU) that the reconciler places from the catalog;
# then it makes an API key and asks the model one question through the OpenAI-compatible gateway.
#
#   scripts/quickstart.sh           run until Ctrl-C (which stops the engine, the agent, the server)
#   scripts/quickstart.sh --check   the same, then stop (a smoke test)
#
# The first run on a machine builds llama.cpp from source (~13 minutes on 2 cores; pip caches it)
# and downloads the model (98 MB). Later runs take seconds.
#
# Everything lives under $LLMGW_HOME (default: .llmgw/ in this checkout): the server's store and
# secrets, the agent's work directory, the model, the logs. Running it again reuses all of it.
# Ports, all on 127.0.0.1: $LLMGW_GATEWAY_PORT (the gateway, default 8080), $LLMGW_LINK_PORT (agent
# link, 7070), $LLMGW_ADMIN_PORT (admin API, 7071); the engine gets one from 20000 up.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

export LLMGW_HOME=${LLMGW_HOME:-$PWD/.llmgw}
link_port=${LLMGW_LINK_PORT:-7070}
admin_port=${LLMGW_ADMIN_PORT:-7071}
gateway_port=${LLMGW_GATEWAY_PORT:-8080}

ensure_venv
llmgw=.venv/bin/llmgw
python=.venv/bin/python
mkdir -p -m 700 "$LLMGW_HOME" "$LLMGW_HOME/logs" "$LLMGW_HOME/models"

echo "==> llama.cpp and the model"
scripts/fetch-test-parts.sh
model=$LLMGW_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$model" ]; then
  ln tests/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf "$model" 2>/dev/null ||
    cp tests/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf "$model"
fi

cat > "$LLMGW_HOME/server.yaml" <<YAML
# Written by scripts/quickstart.sh; see examples/server.yaml for every option.
data_dir: $LLMGW_HOME/server
link:
  listen: 127.0.0.1:$link_port
admin:
  listen: 127.0.0.1:$admin_port
gateway:
  listen: 127.0.0.1:$gateway_port
  stop_workers_on_exit: true   # Ctrl-C stops everything this script started
models:
  smollm2: {path: $model, format: gguf}
profiles:
  smollm2-cpu:
    model: smollm2
    engine: llamacpp
    gpu_class: null   # the CPU
    memory_mib: 512
    cpu_cores: 1
    ctx_size: 2048
    parallel: 2
    min_replicas: 1
    max_replicas: 1
YAML
cat > "$LLMGW_HOME/agent.yaml" <<YAML
# Written by scripts/quickstart.sh; see examples/agent.yaml for every option.
work_dir: $LLMGW_HOME/agent
server:
  address: 127.0.0.1:$link_port
  join_token_file: $LLMGW_HOME/server/join-token
engines:
  stop_shards_on_exit: true   # so that Ctrl-C leaves no engine behind
  # The engine runs as you: the model is in your home, which an engine user could not read.
  # On a real node, engines run as the unprivileged llmgw-engine (ctl node add makes it).
  run_as: null
YAML

server_pid= agent_pid=
stop() {
  # Stop what this script started, by pid, agent first (it stops the engine); wait for both.
  trap - EXIT INT TERM
  for pid in $agent_pid $server_pid; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap stop EXIT
trap 'echo; echo "==> stopping"; stop; exit 130' INT TERM

wait_for() {  # wait_for <seconds> <what> <command...>
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "timed out waiting for $what; logs are in $LLMGW_HOME/logs" >&2
      return 1
    fi
    sleep 0.2
  done
}

echo "==> starting llmgw server (log: $LLMGW_HOME/logs/server.log)"
rm -f "$LLMGW_HOME/server/endpoints.json"
"$llmgw" server --config "$LLMGW_HOME/server.yaml" >>"$LLMGW_HOME/logs/server.log" 2>&1 &
server_pid=$!
wait_for 30 "the server to listen" test -s "$LLMGW_HOME/server/endpoints.json"

"$llmgw" ctl context set --server "http://127.0.0.1:$admin_port" \
  --token-file "$LLMGW_HOME/server/admin-token" >/dev/null

echo "==> starting llmgw agent (log: $LLMGW_HOME/logs/agent.log)"
"$llmgw" agent --config "$LLMGW_HOME/agent.yaml" >>"$LLMGW_HOME/logs/agent.log" 2>&1 &
agent_pid=$!
connected() { "$llmgw" ctl nodes --json | grep -q '"connected": true'; }
wait_for 30 "the agent to register" connected

echo "==> llmgw ctl nodes"
"$llmgw" ctl nodes

echo "==> waiting for the reconciler to place SmolLM2 and the engine to load it"
ready() { "$llmgw" ctl replicas --json | grep -q '"state": "Ready"'; }
wait_for 180 "the SmolLM2 replica to be Ready" ready
"$llmgw" ctl replicas

# An API key for the gateway: made once (the secret is shown only when it is made), kept 0600.
key_file=$LLMGW_HOME/api-key
if [ ! -s "$key_file" ]; then
  "$llmgw" ctl tenant create quickstart >/dev/null 2>&1 || true  # it exists from an earlier run
  (umask 077 && "$llmgw" ctl keys create --tenant quickstart --json 2>/dev/null |
    "$python" -c "import json, sys; print(json.load(sys.stdin)['secret'])" > "$key_file")
fi
gateway=http://127.0.0.1:$gateway_port/v1

echo "==> asking the model through the gateway ($gateway)"
LLMGW_API_KEY=$(cat "$key_file") "$python" - "$gateway" <<'PY'
import json, os, sys, urllib.request

question = "What is the capital of France?"
request = urllib.request.Request(
    f"{sys.argv[1]}/chat/completions",
    data=json.dumps(
        {"model": "smollm2", "max_tokens": 32, "temperature": 0,
         "messages": [{"role": "user", "content": question}]}
    ).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["LLMGW_API_KEY"]},
)
with urllib.request.urlopen(request, timeout=60) as response:
    answer = json.load(response)["choices"][0]["message"]["content"].strip()
print(f"Q: {question}\nA: {answer}")
PY

if [ $check_only = 1 ]; then
  exit 0
fi
cat <<TEXT

llmgw is running with SmolLM2 on this machine's CPU. Call it like OpenAI (your key is in
$key_file):
  curl $gateway/chat/completions -H "Authorization: Bearer \$(cat $key_file)" \\
    -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hello!"}]}'

  from openai import OpenAI
  client = OpenAI(base_url="$gateway", api_key=open("$key_file").read().strip())
  client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hello!"}])

In another shell (ctl's context is saved: no flags needed):
  $llmgw ctl nodes        the fleet          $llmgw ctl replicas     where each replica runs
  $llmgw ctl profiles     the catalog        $llmgw ctl usage        who used what
Press Ctrl-C to stop the engine, the agent and the server.
TEXT
wait "$server_pid"
