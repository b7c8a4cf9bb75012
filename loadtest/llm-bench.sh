#!/usr/bin/env bash
# The llm-d shared-prefix comparison through real processes: two identical simulated vLLM
# fleets (`portcullis sim vllm`, time-scaled; one per side, so neither side inherits the
# other's warm prefix caches), Portcullis (`portcullis up`: control plane + proxy) serving two
# LLM routes — an InferencePool with the default picker over one fleet, one with
# `picker.strategy: RoundRobin` over the other — and `portcullis loadtest` sending the same
# Poisson stages to both, one after the other, in one run.
#
# usage: loadtest/llm-bench.sh [OUT_DIR]        (default docs/benchmarks/llm-real)
# env:   PODS (4, per fleet)  TIME_SCALE (2)  STAGE_SECONDS (20, simulated)  PROMPT_GROUPS (75)
#        OUTPUT_LEN (1000)  MAX_CONCURRENCY (450)  RATE_SCALE (0.5)
#
# The published run (llm-d/llm-d guides/inference-scheduling) has 8 pods, 150 prompt groups,
# stages up to 60 QPS and 900 requests in flight; the default here keeps its per-pod shape at
# half the size (4 pods, 75 groups, rates × 0.5, 450 in flight) so that a 2-core machine can
# drive it at TIME_SCALE 2: every engine step runs 2× faster, so rates are multiplied and
# stage lengths divided by 2, and measured latencies are simulated seconds ÷ 2.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-docs/benchmarks/llm-real}
PODS=${PODS:-4}
TIME_SCALE=${TIME_SCALE:-2}
STAGE_SECONDS=${STAGE_SECONDS:-20}
PROMPT_GROUPS=${PROMPT_GROUPS:-75}
OUTPUT_LEN=${OUTPUT_LEN:-1000}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-450}
RATE_SCALE=${RATE_SCALE:-0.5}

cargo build --release -p portcullis
BIN=target/release/portcullis
WORK=$(mktemp -d -t portcullis-llm-bench.XXXXXX)
mkdir -p "$OUT"
cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

# shellcheck source=loadtest/ports.sh
source loadtest/ports.sh
PICKER_PODS=$(free_ports "$((2 * PODS + 1))")
RR_PODS=$((PICKER_PODS + PODS + 1))
SCORED=$(free_port); ROUND_ROBIN=$(free_port)
ADMIN=$(free_port); PROXY_ADMIN=$(free_port); METRICS=$(free_port)

"$BIN" sim vllm --pods "$PODS" --port "$PICKER_PODS" --time-scale "$TIME_SCALE" >"$WORK/sim-picker.log" 2>&1 &
"$BIN" sim vllm --pods "$PODS" --port "$RR_PODS" --time-scale "$TIME_SCALE" >"$WORK/sim-rr.log" 2>&1 &
endpoints() { python3 -c "print(', '.join(\"'127.0.0.1:%d'\" % ($1 + i) for i in range($PODS)))"; }
cat >"$WORK/gateway.yaml" <<EOF
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: {name: scored}
spec: {address: 127.0.0.1, port: $SCORED}
---
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: {name: round-robin}
spec: {address: 127.0.0.1, port: $ROUND_ROBIN}
---
apiVersion: portcullis.dev/v1alpha1
kind: InferencePool
metadata: {name: picker}
spec: {endpoints: [$(endpoints "$PICKER_PODS")], models: [{name: Qwen/Qwen3-32B}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: InferencePool
metadata: {name: round-robin}
spec: {endpoints: [$(endpoints "$RR_PODS")], models: [{name: Qwen/Qwen3-32B}], picker: {strategy: RoundRobin}}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {name: picker}
spec: {listeners: [scored], backends: [{kind: InferencePool, name: picker}], timeout: 600s, limits: {bodyIdleTimeout: 600s}}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {name: round-robin}
spec: {listeners: [round-robin], backends: [{kind: InferencePool, name: round-robin}], timeout: 600s, limits: {bodyIdleTimeout: 600s}}
EOF
"$BIN" up -f "$WORK/gateway.yaml" --data-dir "$WORK/data" --admin-listen "127.0.0.1:$ADMIN" \
    --proxy-admin-listen "127.0.0.1:$PROXY_ADMIN" --metrics-listen "127.0.0.1:$METRICS" >"$WORK/up.log" 2>&1 &
for _ in $(seq 100); do
    curl -sf "127.0.0.1:$PROXY_ADMIN/readyz" >/dev/null && curl -sf "127.0.0.1:$PICKER_PODS/health" >/dev/null \
        && curl -sf "127.0.0.1:$RR_PODS/health" >/dev/null && break
    sleep 0.2
done
curl -sf "127.0.0.1:$PROXY_ADMIN/readyz" >/dev/null || { cat "$WORK"/*.log; exit 1; }

python3 - "$WORK/scenario.yaml" <<EOF
import sys
rates = [15, 3, 10, 15, 20, 22, 25, 30, 35, 40, 43, 46, 49, 52, 55, 57, 60]
f, scale, stage = $TIME_SCALE, $RATE_SCALE, $STAGE_SECONDS
stages = "\n".join(f"    - {{rate: {r * scale * f:g}, duration: {stage / f:g}s}}" for r in rates)
open(sys.argv[1], "w").write(f"""api: {{type: completion, streaming: true}}
model: Qwen/Qwen3-32B
targets:
  - {{name: round-robin, url: "http://127.0.0.1:$ROUND_ROBIN"}}
  - {{name: picker, url: "http://127.0.0.1:$SCORED"}}
data:
  type: shared_prefix
  num_groups: $PROMPT_GROUPS
  num_prompts_per_group: 5
  system_prompt_len: 6000
  question_len: 1200
  output_len: $OUTPUT_LEN
load:
  type: poisson
  stages:
{stages}
  max_concurrency: $MAX_CONCURRENCY
  seed: 1
request_timeout: 600s
""")
EOF
sed -e "s/127.0.0.1:$ROUND_ROBIN/ROUND_ROBIN_LISTENER/" -e "s/127.0.0.1:$SCORED/PICKER_LISTENER/" \
    "$WORK/scenario.yaml" >"$OUT/scenario.yaml"
"$BIN" loadtest -f "$WORK/scenario.yaml" --output-dir "$OUT" --no-progress
curl -s "127.0.0.1:$PROXY_ADMIN/metrics" | grep -E '^portcullis_proxy_(policy_decisions|gen_ai_requests)_total' >"$OUT/proxy-metrics.txt" || true
echo "report: $OUT/report.json, $OUT/report.csv, charts in $OUT"
