#!/usr/bin/env bash
# The control plane's config fan-out, measured: a 3-node cluster on 127.0.0.1 (fsync on, as
# always), 1,000 subscribers of the real config stream in 10 shards, a config of 10,000 routes,
# then writes that each change one route (open loop, then closed loop). See
# loadtest/src/fanout.rs for what is measured; the report is JSON.
#
#   loadtest/fanout-bench.sh [SUBSCRIBERS] [ROUTES] [REPORT] [PLOT_DIR]
#
# PORTCULLIS_BIN=path runs that binary (control plane and load generator both) instead of
# building this checkout: to compare two builds in one session, run them alternately.
set -euo pipefail
bin=${PORTCULLIS_BIN:+$(realpath "$PORTCULLIS_BIN")}
cd "$(dirname "$0")/.."
subscribers=${1:-1000}
routes=${2:-10000}
report=${3:-docs/benchmarks/fanout.json}
plots=${4:-docs/benchmarks/fanout}
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
# Every subscriber holds a connection, and each node serves a third of them.
ulimit -n "$(ulimit -Hn)"

if [ -z "$bin" ]; then
    cargo build --release --locked -p portcullis
    bin=$PWD/target/release/portcullis
fi
[ -x "$bin" ] || { echo "error: $bin is not an executable" >&2; exit 1; }
nodes=(127.0.0.1:17371 127.0.0.1:17372 127.0.0.1:17373)
node_pids=()
for id in 1 2 3; do
    args=(controlplane --node-id "$id" --listen "${nodes[$((id - 1))]}" --data-dir "$work/node-$id"
        --metrics-listen "127.0.0.1:$((17380 + id))")
    [ "$id" -gt 1 ] && args+=(--join)
    PORTCULLIS_LOG=warn "$bin" "${args[@]}" >"$work/node-$id.log" 2>&1 &
    pids+=($!) node_pids+=($!)
done
for _ in $(seq 100); do "$bin" status --controlplane "${nodes[0]}" >/dev/null 2>&1 && break; sleep 0.1; done
for id in 2 3; do
    # A joining node must be listening before it is added (it may start after node 1 answers).
    port=${nodes[$((id - 1))]##*:}
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        kill -0 "${node_pids[$((id - 1))]}" 2>/dev/null || break
        sleep 0.1
    done
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || {
        echo "error: node $id is not listening on $port after 10 s; its log:" >&2
        cat "$work/node-$id.log" >&2
        exit 1
    }
    "$bin" cluster add --node-id "$id" --address "${nodes[$((id - 1))]}" --controlplane "${nodes[0]}" >/dev/null
done

all=$(IFS=,; echo "${nodes[*]}")
controlplane_pids=$(IFS=,; echo "${node_pids[*]}")
"$bin" fanout-bench --controlplane "$all" --pids "$controlplane_pids" \
    --subscribers "$subscribers" --routes "$routes" --report "$report" --plot-dir "$plots"
echo "report written to $report" >&2
