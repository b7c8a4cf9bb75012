#!/usr/bin/env bash
# Pod-signal freshness and cost through real processes: simulated vLLM pods
# (`portcullis sim vllm`, one process), a control plane that reads their `/metrics` and
# replicates the readings through its signals Raft group, and two proxies that receive them.
#
# Measured (signals-bench/measure.py), for each pod count in PODS:
# - freshness: a pod's `vllm:num_requests_waiting` goes 0 → 1 (two requests sent straight to a
#   pod that runs one at a time); the time until *both* proxies' pickers hold the new value
#   (polled on their admin port, `/signals?pool=`), over TRIALS changes;
# - cost over a steady WINDOW: control-plane, proxy and simulator CPU, signals-log entries/s and
#   bytes/s, batches sent to proxies, config-log index and data-dir size before and after.
#
# usage: loadtest/signals-bench.sh [OUT_FILE]   (default docs/benchmarks/signals.json)
# env:   PODS ("8 512")  POOL_SIZE (64)  TRIALS (100)  WINDOW (20 s)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-docs/benchmarks/signals.json}
PODS=${PODS:-"8 512"}
POOL_SIZE=${POOL_SIZE:-64}
TRIALS=${TRIALS:-100}
WINDOW=${WINDOW:-20}

cargo build --release -p portcullis
BIN=target/release/portcullis
WORK=$(mktemp -d -t portcullis-signals-bench.XXXXXX)
cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

# shellcheck source=loadtest/ports.sh
source loadtest/ports.sh

# One seat per pod: a second request waits, so the queue length is what the test sets.
python3 - loadtest/profiles/qwen3-32b-tp2-h100.json "$WORK/profile.json" <<'PY'
import json, sys
profile = json.load(open(sys.argv[1]))
profile["name"] = "single-seat"
profile["max_num_seqs"] = 1
json.dump(profile, open(sys.argv[2], "w"))
PY

RESULTS=()
for pods in $PODS; do
    run="$WORK/$pods"
    mkdir -p "$run"
    first=$(free_ports "$pods")
    cp=$(free_port); metrics=$(free_port); admin_a=$(free_port); admin_b=$(free_port)
    "$BIN" sim vllm --pods "$pods" --port "$first" --profile "$WORK/profile.json" >"$run/sim.log" 2>&1 &
    sim_pid=$!
    PORTCULLIS_LOG=warn "$BIN" controlplane --listen "127.0.0.1:$cp" --data-dir "$run/data" \
        --metrics-listen "127.0.0.1:$metrics" >"$run/cp.log" 2>&1 &
    cp_pid=$!
    for admin in $admin_a $admin_b; do
        PORTCULLIS_LOG=warn "$BIN" proxy --id "proxy-$admin" --controlplane "http://127.0.0.1:$cp" \
            --admin-listen "127.0.0.1:$admin" >"$run/proxy-$admin.log" 2>&1 &
    done
    proxy_pids="$(jobs -p | tail -2 | tr '\n' ' ')"
    for _ in $(seq 100); do "$BIN" status --controlplane "127.0.0.1:$cp" >/dev/null 2>&1 && break; sleep 0.1; done
    python3 - "$pods" "$first" "$POOL_SIZE" >"$run/pools.yaml" <<'PY'
import sys
pods, first, size = map(int, sys.argv[1:])
for pool, start in enumerate(range(0, pods, size)):
    endpoints = ", ".join(f"'127.0.0.1:{first + i}'" for i in range(start, min(start + size, pods)))
    print(f"---\napiVersion: portcullis.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: pool-{pool}}}\n"
          f"spec: {{endpoints: [{endpoints}], models: [{{name: Qwen/Qwen3-32B}}]}}")
PY
    "$BIN" apply -f "$run/pools.yaml" --controlplane "127.0.0.1:$cp" >/dev/null
    python3 loadtest/signals-bench/measure.py --pods "$pods" --first-port "$first" --pool-size "$POOL_SIZE" \
        --controlplane-metrics "$metrics" --controlplane-pid "$cp_pid" --data-dir "$run/data" \
        --proxies "$admin_a,$admin_b" --proxy-pids "$proxy_pids" --sim-pid "$sim_pid" \
        --trials "$TRIALS" --window "$WINDOW" >"$run/result.json"
    cat "$run/result.json"
    RESULTS+=("$run/result.json")
    kill $(jobs -p) 2>/dev/null || true
    wait 2>/dev/null || true
done
mkdir -p "$(dirname "$OUT")"
python3 -c 'import json,sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1],"w"), indent=2)' "$OUT" "${RESULTS[@]}"
echo "wrote $OUT"
