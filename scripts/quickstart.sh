#!/usr/bin/env bash
# Sets this machine up and runs llmgw on it: the server and one local agent, connected.
#
#   scripts/quickstart.sh           run until Ctrl-C (which stops both)
#   scripts/quickstart.sh --check   start, show the node, stop (a smoke test)
#
# Everything lives under $LLMGW_HOME (default: .llmgw/ in this checkout): the server's store and
# secrets, the agent's work directory, the logs. Running it again reuses all of it.
# Ports: $LLMGW_LINK_PORT (agent link, default 7070) and $LLMGW_ADMIN_PORT (admin API, 7071),
# both on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

export LLMGW_HOME=${LLMGW_HOME:-$PWD/.llmgw}
link_port=${LLMGW_LINK_PORT:-7070}
admin_port=${LLMGW_ADMIN_PORT:-7071}

ensure_venv
llmgw=.venv/bin/llmgw
mkdir -p -m 700 "$LLMGW_HOME" "$LLMGW_HOME/logs"

cat > "$LLMGW_HOME/server.yaml" <<YAML
# Written by scripts/quickstart.sh; see examples/server.yaml for every option.
data_dir: $LLMGW_HOME/server
link:
  listen: 127.0.0.1:$link_port
admin:
  listen: 127.0.0.1:$admin_port
YAML
cat > "$LLMGW_HOME/agent.yaml" <<YAML
# Written by scripts/quickstart.sh; see examples/agent.yaml for every option.
work_dir: $LLMGW_HOME/agent
server:
  address: 127.0.0.1:$link_port
  join_token_file: $LLMGW_HOME/server/join-token
YAML

server_pid= agent_pid=
stop() {
  # Stop what this script started, by pid, agent first; wait so nothing outlives us.
  trap - EXIT INT TERM
  for pid in $agent_pid $server_pid; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $agent_pid $server_pid; do
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

if [ $check_only = 1 ]; then
  exit 0
fi
cat <<EOF

llmgw is running. In another shell:
  $llmgw ctl nodes                 the fleet (ctl's context is saved, no flags needed)
  $llmgw ctl node show <name>      one node's GPUs, fabric and health
Press Ctrl-C to stop the server and the agent.
EOF
wait "$server_pid"
