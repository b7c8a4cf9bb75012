#!/usr/bin/env bash
# Plain-HTTP benchmark, in one run: the built-in echo upstream straight, through one
# Portcullis proxy (`portcullis up`), and through nginx as a reference when nginx is
# installed (Debian: `apt-get install nginx-light`). Prints p50/p99 added latency and max
# req/s, each against the direct path measured in the same run.
#
#   loadtest/http-bench.sh [DURATION_PER_PHASE] [ROUNDS]      e.g. loadtest/http-bench.sh 5s 3
#
# Everything listens on 127.0.0.1 and stops when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-5s}
rounds=${2:-3}
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cargo build --release --locked -p portcullis
bin=target/release/portcullis
upstream=19001 gateway=18080 nginx_port=18081 admin=17070 proxy_admin=17071

"$bin" echo --listen 127.0.0.1:$upstream --name bench 2>"$work/echo.log" & pids+=($!)
cat >"$work/bench.yaml" <<YAML
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: bench }
spec: { address: 127.0.0.1, port: $gateway }
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: { name: echo }
spec: { endpoints: ["127.0.0.1:$upstream"] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: { name: bench }
spec: { listeners: [bench], backends: [{ name: echo }] }
YAML
PORTCULLIS_LOG=warn "$bin" up -f "$work/bench.yaml" --data-dir "$work/data" \
    --admin-listen 127.0.0.1:$admin --proxy-admin-listen 127.0.0.1:$proxy_admin >"$work/up.log" 2>&1 & pids+=($!)

targets=(--target "direct=http://127.0.0.1:$upstream/bench" --target "portcullis=http://127.0.0.1:$gateway/bench")
if command -v nginx >/dev/null 2>&1; then
    cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 1024; }
http {
    access_log off;
    # Without these, nginx closes each keep-alive connection after 1,000 requests and the
    # load generator counts the reconnects as errors.
    keepalive_requests 1000000;
    upstream echo { server 127.0.0.1:$upstream; keepalive 64; keepalive_requests 1000000; }
    server {
        listen 127.0.0.1:$nginx_port;
        location / { proxy_pass http://echo; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
}
NGINX
    nginx -c "$work/nginx.conf" -p "$work"
    targets+=(--target "nginx=http://127.0.0.1:$nginx_port/bench")
else
    echo "nginx not installed: skipping the reference (apt-get install nginx-light)" >&2
fi

for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$proxy_admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
curl -fsS "http://127.0.0.1:$gateway/bench" >/dev/null || { cat "$work/up.log"; exit 1; }

echo "proxy workers: tokio default (2 on 2 cores); nginx: 1 worker; load generator shares the same cores" >&2
"$bin" bench http "${targets[@]}" --duration "$duration" --rounds "$rounds" --json "${BENCH_JSON:-/dev/null}"
