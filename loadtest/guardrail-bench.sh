#!/usr/bin/env bash
# Guardrails, measured: `portcullis loadtest` calling Portcullis' MCP test server directly, through
# an McpBackend route without a guardrail, and through routes whose calls an argument check
# guards (the reference checker over gRPC, two replicas; the built-in pattern guard), one run,
# side by side, every process on 127.0.0.1. Then a failover run: closed-loop calls through the
# checked route while one of the two checker replicas is killed (SIGKILL) halfway.
# Prints markdown tables (latencies in ms; "added" is against the direct path at the same
# percentile) and keeps the loadtest reports, with latency and failures over time
# (latency_over_time.svg, failures_over_time.svg), in $OUT (default results/guardrail-bench).
#
#   loadtest/guardrail-bench.sh [SECONDS_PER_STAGE] [CLIENTS]      e.g. loadtest/guardrail-bench.sh 10 1
set -euo pipefail
cd "$(dirname "$0")/.."
source loadtest/ports.sh
seconds=${1:-10}
clients=${2:-1}
out=${OUT:-results/guardrail-bench}
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

server=$(free_port) replica_a=$(free_port) replica_b=$(free_port)
"$bin" mcp-server --listen 127.0.0.1:$server --tools 8 >"$work/mcp.log" 2>&1 & pids+=($!)
"$bin" guardrail-server --listen 127.0.0.1:$replica_a >"$work/replica-a.log" 2>&1 & pids+=($!)
"$bin" guardrail-server --listen 127.0.0.1:$replica_b >"$work/replica-b.log" 2>&1 & replica_b_pid=$! pids+=($!)

header="apiVersion: portcullis.dev/v1alpha1"
config=$work/config.yaml
: >"$config"
declare -A gateway_port
# A Listener, McpBackend and Route named NAME in front of the MCP test server.
add_route() {
    local name=$1
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
  servers: [{name: s, url: 'http://127.0.0.1:$server/mcp'}]
---
$header
kind: Route
metadata: {name: $name}
spec: {listeners: [$name], backends: [{kind: McpBackend, name: $name}]}
---
EOF
}
add_route plain
add_route checked
add_route builtin
cat >>"$config" <<EOF
$header
kind: Guardrail
metadata: {name: checked}
spec:
  targetRefs: [{kind: McpBackend, name: checked}]
  phases: [McpRequest]
  names: [echo]
  timeout: 200ms
  service:
    replicas: ['127.0.0.1:$replica_a', '127.0.0.1:$replica_b']
    healthInterval: 200ms
---
$header
kind: Guardrail
metadata: {name: builtin}
spec:
  targetRefs: [{kind: McpBackend, name: builtin}]
  phases: [McpRequest]
  names: [echo]
  builtin:
    deny: [{pattern: '(?i)drop\\s+table', reason: no SQL}]
---
EOF

for _ in $(seq 100); do "$bin" status --controlplane 127.0.0.1:$admin >/dev/null 2>&1 && break; sleep 0.1; done
"$bin" apply -f "$config" --controlplane 127.0.0.1:$admin >/dev/null
for _ in $(seq 200); do
    curl -fsS "http://127.0.0.1:$proxy_admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
sleep 1

# run NAME STAGES TARGET... (each "label=port"); prints the report's rows.
run() {
    local name=$1 stages=$2
    shift 2
    {
        echo "api: {type: mcp, era: modern, operation: tools_call, tool: echo, connection: reuse}"
        echo "targets:"
        for target in "$@"; do
            echo "  - {name: ${target%%=*}, url: 'http://127.0.0.1:${target#*=}/mcp'}"
        done
        echo "load: {type: closed_loop, stages: [$stages]}"
        echo "request_timeout: 10s"
    } >"$work/$name.yaml"
    "$bin" loadtest -f "$work/$name.yaml" --output-dir "$out/$name" >"$work/$name.out" 2>&1
    python3 - "$out/$name/report.csv" "$name" <<'PY'
import csv, sys
ms = lambda v: f"{float(v) * 1000:.3f}" if v not in ("", None) else ""
for row in csv.DictReader(open(sys.argv[1])):
    print(f"| {sys.argv[2]} | {row['target']} | {float(row['requests_per_sec']):.0f} | {ms(row['e2e_p50'])} | "
          f"{ms(row['e2e_p99'])} | {ms(row['added_p50_s'])} | {ms(row['added_p99_s'])} | {int(row['failures'])} |")
PY
}

echo "| case | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | failures |"
echo "|---|---|---|---|---|---|---|---|"
run call "{clients: $clients, duration: ${seconds}s}" \
    direct=$server gateway=${gateway_port[plain]} checked=${gateway_port[checked]} builtin=${gateway_port[builtin]}

# Failover: the checked route alone, one replica killed halfway through.
( sleep "$(python3 -c "print($seconds / 2)")"; kill -9 "$replica_b_pid" ) &
run failover "{clients: $clients, duration: ${seconds}s}" checked=${gateway_port[checked]}
echo
python3 - "$out/failover/report.json" <<'PY'
import json, sys, statistics
stage = json.load(open(sys.argv[1]))["targets"][0]["stages"][0]
slices = [s for s in stage["timeline"] if s["requests"]]
p99s = [s["p99"] * 1000 for s in slices]
worst = max(slices, key=lambda s: s["p99"])
print(f"failover: {stage['load_summary']['count']} calls, {stage['failures']['count']} failed; "
      f"slice p99 median {statistics.median(p99s):.3f} ms, worst {worst['p99'] * 1000:.3f} ms "
      f"(slice at {worst['at']:.2f} s of {stage['duration']:.1f} s; replica killed at {stage['duration'] / 2:.1f} s)")
PY
