#!/usr/bin/env bash
# Config scale, measured: one `portcullis apply` of a file with N routes (default 10,000,
# plus their backends and a listener), its time through the CLI and the Raft commit, the
# time until the proxy serves the new version, and the proxy's resident memory before and
# after. The control plane and the proxy run as separate processes on 127.0.0.1.
#
#   loadtest/scale-bench.sh [ROUTES]       e.g. loadtest/scale-bench.sh 10000
set -euo pipefail
cd "$(dirname "$0")/.."
routes=${1:-10000}
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cargo build --release --locked -p portcullis
bin=$PWD/target/release/portcullis
admin=17170 metrics=17172 proxy_admin=17171 gateway=18180 upstream=19101

"$bin" echo --listen 127.0.0.1:$upstream --name scale 2>"$work/echo.log" & pids+=($!)
PORTCULLIS_LOG=warn "$bin" controlplane --listen 127.0.0.1:$admin --metrics-listen 127.0.0.1:$metrics \
    --data-dir "$work/cp" >"$work/cp.log" 2>&1 & pids+=($!)
PORTCULLIS_LOG=warn "$bin" proxy --controlplane 127.0.0.1:$admin --id scale --admin-listen 127.0.0.1:$proxy_admin \
    >"$work/proxy.log" 2>&1 & proxy_pid=$!; pids+=($proxy_pid)

python3 - "$routes" "$gateway" "$upstream" >"$work/config.yaml" <<'PY'
import sys
routes, gateway, upstream = int(sys.argv[1]), sys.argv[2], sys.argv[3]
backends = max(1, routes // 100)
head = "apiVersion: portcullis.dev/v1alpha1\n"
out = [head + f"kind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {gateway}}}\n"]
for b in range(backends):
    out.append(head + f"kind: Backend\nmetadata: {{name: b{b}}}\nspec: {{endpoints: ['127.0.0.1:{upstream}']}}\n")
for r in range(routes):
    out.append(head + f"kind: Route\nmetadata: {{name: r{r}}}\nspec: {{listeners: [web], hostnames: [h{r % 50}.example.com], "
               f"matches: [{{path: {{prefix: /svc/{r}}}}}], backends: [{{name: b{r % backends}}}]}}\n")
sys.stdout.write("---\n".join(out))
PY
objects=$(grep -c '^kind:' "$work/config.yaml")

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
version() { curl -fsS "http://127.0.0.1:$proxy_admin/status" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"] or 0)' 2>/dev/null || echo 0; }

for _ in $(seq 100); do "$bin" status --controlplane 127.0.0.1:$admin >/dev/null 2>&1 && break; sleep 0.1; done
# A first, tiny version so the proxy is up and measured with a config.
printf 'apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: web}\nspec: {address: 127.0.0.1, port: %s}\n' $gateway >"$work/small.yaml"
"$bin" apply -f "$work/small.yaml" --controlplane 127.0.0.1:$admin >/dev/null
for _ in $(seq 100); do [ "$(version)" != 0 ] && break; sleep 0.1; done
before_version=$(version)
rss_before=$(rss_kib $proxy_pid)

start=$(date +%s.%N)
"$bin" apply -f "$work/config.yaml" --controlplane 127.0.0.1:$admin >"$work/apply.out"
applied=$(date +%s.%N)
for _ in $(seq 600); do [ "$(version)" -gt "$before_version" ] && break; sleep 0.05; done
served=$(date +%s.%N)
rss_after=$(rss_kib $proxy_pid)
# One more route on top: the cost of a small change to a large config.
printf 'apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: one-more}\nspec: {listeners: [web], matches: [{path: {prefix: /one-more}}], backends: [{name: b0}]}\n' >"$work/one.yaml"
large_version=$(version)
one_start=$(date +%s.%N)
"$bin" apply -f "$work/one.yaml" --controlplane 127.0.0.1:$admin >/dev/null
one_applied=$(date +%s.%N)
for _ in $(seq 600); do [ "$(version)" -gt "$large_version" ] && break; sleep 0.05; done
one_served=$(date +%s.%N)
middle=$((routes / 2))
status=$(curl -s -o /dev/null -w '%{http_code}' -H "host: h$((middle % 50)).example.com" "http://127.0.0.1:$gateway/svc/$middle/x")

python3 - "$routes" "$objects" "$start" "$applied" "$served" "$rss_before" "$rss_after" "$status" "$(wc -c <"$work/config.yaml")" \
    "$one_start" "$one_applied" "$one_served" <<'PY'
import sys
routes, objects = int(sys.argv[1]), int(sys.argv[2])
start, applied, served = map(float, sys.argv[3:6])
rss_before, rss_after, status, size = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], int(sys.argv[9])
one_start, one_applied, one_served = map(float, sys.argv[10:13])
print(f"| routes | objects | file | apply (CLI → committed) | apply → proxy serving | proxy RSS before | proxy RSS after | request to route {routes // 2} | one more route: committed / serving |")
print("|---|---|---|---|---|---|---|---|---|")
print(f"| {routes:,} | {objects:,} | {size / 1e6:.1f} MB | {applied - start:.2f} s | {served - applied:.2f} s | "
      f"{rss_before / 1024:.1f} MiB | {rss_after / 1024:.1f} MiB | {status} | "
      f"{one_applied - one_start:.2f} s / {one_served - one_applied:.2f} s |")
PY
