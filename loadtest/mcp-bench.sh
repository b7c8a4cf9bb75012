#!/usr/bin/env bash
# The MCP hop, measured: `portcullis loadtest` against Portcullis' MCP test server directly
# and through an McpBackend route, one run, side by side, every process on 127.0.0.1.
#   - tools/call (get-sum), upstream delay 0/10/200 ms, pooled connections; and with a new
#     connection per call (delay 0); each also through a plain Backend route (the HTTP hop
#     without MCP);
#   - tools/list with 8/100/500 tools (session-based era): direct; through the gateway (every list asked of the
#     server); reused (listTtl); reused and filtered by an McpAuthorization keeping one tool.
# Prints one markdown table per part (latencies in ms; "added" is gateway minus direct at
# the same percentile) and keeps the loadtest reports in $OUT (default results/mcp-bench).
#
#   loadtest/mcp-bench.sh [SECONDS_PER_STAGE] [CLIENTS]      e.g. loadtest/mcp-bench.sh 10 1
set -euo pipefail
cd "$(dirname "$0")/.."
source loadtest/ports.sh
seconds=${1:-10}
clients=${2:-1}
out=${OUT:-results/mcp-bench}
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$out"

cargo build --release --locked -p portcullis
bin=$PWD/target/release/portcullis
admin=$(free_port) metrics=$(free_port) proxy_admin=$(free_port)
PORTCULLIS_LOG=warn "$bin" controlplane --listen 127.0.0.1:$admin --metrics-listen 127.0.0.1:$metrics \
    --data-dir "$work/cp" >"$work/cp.log" 2>&1 & pids+=($!)
PORTCULLIS_LOG=warn "$bin" proxy --controlplane 127.0.0.1:$admin --id bench --admin-listen 127.0.0.1:$proxy_admin \
    >"$work/proxy.log" 2>&1 & pids+=($!)

header="apiVersion: portcullis.dev/v1alpha1"
config=$work/config.yaml
: >"$config"
# One MCP test server, McpBackend, Listener and Route per case: name, server flags, extra
# McpServer fields. Sets the case's server and gateway ports.
declare -A server_port gateway_port
# A Listener, McpBackend and Route named NAME, fronting the server on SERVER_PORT with the
# extra server fields EXTRA; sets gateway_port[NAME].
add_route() {
    local name=$1 port=$2 extra=$3
    gateway_port[$name]=$(free_port)
    cat >>"$config" <<EOF
$header
kind: Listener
metadata: {name: $name}
spec: {address: 127.0.0.1, port: ${gateway_port[$name]}}
---
$header
kind: McpBackend
metadata: {name: $name}
spec:
  servers: [{name: s, url: 'http://127.0.0.1:$port/mcp'$extra}]
---
$header
kind: Route
metadata: {name: $name}
spec: {listeners: [$name], backends: [{kind: McpBackend, name: $name}]}
---
EOF
}
# One MCP test server per case, with its route; server flags.
add_case() {
    local name=$1 flags=$2
    server_port[$name]=$(free_port)
    # shellcheck disable=SC2086
    "$bin" mcp-server --listen 127.0.0.1:${server_port[$name]} $flags >"$work/$name.log" 2>&1 & pids+=($!)
    add_route "$name" "${server_port[$name]}" ""
}
# The same server behind a plain Backend route too: the HTTP hop without MCP, the floor of
# what the MCP hop can cost.
declare -A plain_port
add_plain() {
    local name=$1 port=$2
    plain_port[$name]=$(free_port)
    cat >>"$config" <<EOF
$header
kind: Listener
metadata: {name: $name-plain}
spec: {address: 127.0.0.1, port: ${plain_port[$name]}}
---
$header
kind: Backend
metadata: {name: $name-plain}
spec: {endpoints: ['127.0.0.1:$port']}
---
$header
kind: Route
metadata: {name: $name-plain}
spec: {listeners: [$name-plain], backends: [{kind: Backend, name: $name-plain}]}
---
EOF
}
for delay in 0 10 200; do
    add_case "call-$delay" "--tools 8 --delay-ms $delay"
    add_plain "call-$delay" "${server_port[call-$delay]}"
done
for tools in 8 100 500; do
    add_case "list-$tools" "--tools $tools"
    # The reused cases front the same server as list-$tools.
    add_route "list-$tools-cached" "${server_port[list-$tools]}" ", listTtl: 1h"
    add_route "list-$tools-filtered" "${server_port[list-$tools]}" ", listTtl: 1h"
    cat >>"$config" <<EOF
$header
kind: McpAuthorization
metadata: {name: list-$tools-one-tool}
spec:
  targetRefs: [{kind: McpBackend, name: list-$tools-filtered}]
  allow: ['mcp.tool.name == "echo"']
---
EOF
done

for _ in $(seq 100); do "$bin" status --controlplane 127.0.0.1:$admin >/dev/null 2>&1 && break; sleep 0.1; done
"$bin" apply -f "$config" --controlplane 127.0.0.1:$admin >/dev/null
for _ in $(seq 200); do
    curl -fsS "http://127.0.0.1:$proxy_admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
sleep 1

# run NAME OPERATION_FIELDS TARGET... (each "label=port"); prints the report's rows.
run() {
    local name=$1 api=$2
    shift 2
    {
        echo "api: {type: mcp, $api}"
        echo "targets:"
        for target in "$@"; do
            echo "  - {name: ${target%%=*}, url: 'http://127.0.0.1:${target#*=}/mcp'}"
        done
        echo "load: {type: closed_loop, stages: [{clients: $clients, duration: ${seconds}s}]}"
        echo "request_timeout: 10s"
    } >"$work/$name.yaml"
    "$bin" loadtest -f "$work/$name.yaml" --output-dir "$out/$name" >"$work/$name.out" 2>&1
    python3 - "$out/$name/report.csv" "$name" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
ms = lambda v: f"{float(v) * 1000:.3f}" if v not in ("", None) else ""
for row in rows:
    failures = int(row["failures"])
    print(f"| {sys.argv[2]} | {row['target']} | {float(row['requests_per_sec']):.0f} | {ms(row['e2e_p50'])} | "
          f"{ms(row['e2e_p99'])} | {ms(row['added_p50_s'])} | {ms(row['added_p99_s'])} | {failures} |")
PY
}

echo "| case | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | failures |"
echo "|---|---|---|---|---|---|---|---|"
for delay in 0 10 200; do
    run "call-$delay" "era: modern, operation: tools_call, tool: get-sum, connection: reuse" \
        direct=${server_port[call-$delay]} plain-proxy=${plain_port[call-$delay]} gateway=${gateway_port[call-$delay]}
done
run "call-0-new-connection" "era: modern, operation: tools_call, tool: get-sum, connection: per_call" \
    direct=${server_port[call-0]} plain-proxy=${plain_port[call-0]} gateway=${gateway_port[call-0]}
for tools in 8 100 500; do
    # Session-based: the test server's 2026-07-28 lists say `ttlMs: 0`, which forbids reuse.
    run "list-$tools" "era: legacy, operation: tools_list, connection: reuse" \
        direct=${server_port[list-$tools]} gateway=${gateway_port[list-$tools]} \
        reused=${gateway_port[list-$tools-cached]} reused-one-tool=${gateway_port[list-$tools-filtered]}
done
