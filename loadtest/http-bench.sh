#!/usr/bin/env bash
# Plain-HTTP benchmark: Portcullis against nginx as a reverse proxy, both in front of the
# same origin, measured with wrk in one run, interleaved round by round.
#
#   loadtest/http-bench.sh [DURATION] [ROUNDS]        e.g. loadtest/http-bench.sh 5s 3
#
# Starts, all on 127.0.0.1:
#   origin      nginx, 1 worker, answers every request with the 2-byte body "ok"
#   nginx       nginx, 1 worker, reverse proxy to the origin over a keep-alive upstream pool
#               (keepalive 64, keepalive_requests 1000000, HTTP/1.1, Connection "")
#   portcullis  a control plane and a proxy with one Listener/Backend/Route to the origin
#               (metrics on, as always)
#   portcullis-logged  a second proxy of the same control plane, its own listener, with
#               the JSON access log on (every request, written to a file)
#   floor       `portcullis forward-floor`: a reference forwarder, not a proxy (no routing,
#               limits, timeouts or telemetry), one pass per request in the client
#               connection's task (httparse); the least a tokio HTTP/1.1 proxy does
#   floor-hyper the same with hyper's HTTP/1 server and client connections instead: the two
#               hyper dispatchers Portcullis has, with nothing of Portcullis between them
#   portcullis-baseline  only with BASELINE_BIN: a third proxy of the same control plane, its
#               own listener, run from another build, so that two builds are compared round by
#               round in one run rather than across runs on a machine whose speed drifts. The
#               two proxies' places can differ too: run again with the builds swapped.
# then, for each connection count (32 and 256) and each round, runs
#   wrk -t$WRK_THREADS -c$CONNS -d$DURATION --latency
# against each target (direct, the origin itself; nginx; the proxies; the floors), each second
# round in the reverse order of the round before, the order rotated by one place every two
# rounds, and prints per connection count a markdown table: median req/s over the rounds
# (min–max), median p50/p99, errors, and req/s (and p99) as a ratio of nginx's and direct's,
# and the CPU time per request of the process serving each target (read from /proc/<pid>/stat
# around each wrk run: the proxy, not the origin behind it; for direct, the origin), and the
# proxies' as a ratio of nginx's. On loopback the kernel's receive work for a write is charged
# to the writer, so a process's figure includes some of its peers' TCP processing, alike for
# each proxy.
#
# Environment:
#   WRK_THREADS=2              wrk threads (-t). The issue's figures are presumably -t2; on
#                              2 cores wrk, proxy and origin all share the same CPUs.
#   CONNECTIONS="32 256"       connection counts (-c), one table each
#   WARMUP=1s                  one unrecorded wrk run per target and connection count before
#                              round 1 (fills connection pools); WARMUP=0 skips it
#   BENCH_JSON=path            also write every round's figures and the summary as JSON
#   BENCH_RAW=dir              keep the raw wrk outputs (and CPU tick counts) in dir (default:
#                              deleted on exit)
#   PORTCULLIS_EXTRA_ARGS=...  appended to every `portcullis proxy` command
#   SKIP_PORTCULLIS=1          no cargo build, no Portcullis: origin and nginx only
#   SKIP_BUILD=1               use the existing target/release/portcullis
#   BASELINE_BIN=path          another build of portcullis, run as portcullis-baseline: the
#                              binary itself (its CPU time is read from its process), speaking
#                              the protocol of this build's control plane
#   TARGETS="nginx portcullis" measure only these targets (space-separated), in this order
#                              (default: all started)
#
# Needs wrk, nginx (Debian: nginx-light), pgrep (procps) and python3; installs the first three
# with apt-get when they are missing and the script runs as root. Everything stops on exit.
set -euo pipefail
# Resolved before the cd below, so that a path relative to the caller's directory works.
baseline_bin=
if [ -n "${BASELINE_BIN:-}" ]; then
    [ "${SKIP_PORTCULLIS:-0}" != 1 ] || { echo "BASELINE_BIN needs Portcullis: unset SKIP_PORTCULLIS" >&2; exit 1; }
    baseline_bin=$(realpath "$BASELINE_BIN")
    [ -f "$baseline_bin" ] && [ -x "$baseline_bin" ] || { echo "BASELINE_BIN: $BASELINE_BIN is not an executable file" >&2; exit 1; }
    # Taken now: the report names the build that ran, even if the file is replaced meanwhile.
    baseline_sha256=$(sha256sum <"$baseline_bin" | cut -d' ' -f1)
fi
cd "$(dirname "$0")/.."

if [ "${SKIP_PORTCULLIS:-0}" != 1 ] && [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p portcullis
fi

duration=${1:-5s}
rounds=${2:-3}
wrk_threads=${WRK_THREADS:-2}
connections=${CONNECTIONS:-32 256}
warmup=${WARMUP:-1s}
# Appended to every `portcullis proxy` command (word-split on purpose)
PORTCULLIS_EXTRA_ARGS=${PORTCULLIS_EXTRA_ARGS:-}
bin=target/release/portcullis
origin=19001 gateway=18080 gateway_logged=18082 gateway_baseline=18083 nginx_port=18081 floor=18090 floor_hyper=18091
admin=17070 proxy_admin=17071 cp_metrics=17072 proxy_admin_logged=17073 proxy_admin_baseline=17074

# --- tools ---------------------------------------------------------------------------------
PATH=$PATH:/usr/sbin:/sbin
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v pgrep >/dev/null 2>&1 || missing+=(procps)
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing ${missing[*]} with apt-get" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "missing: ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
fi
command -v python3 >/dev/null 2>&1 || { echo "python3 is needed to read wrk's output" >&2; exit 1; }
if [ "${SKIP_PORTCULLIS:-0}" != 1 ] && [ ! -x "$bin" ]; then
    echo "$bin not found: build it (cargo build --release -p portcullis) or set SKIP_PORTCULLIS=1" >&2
    exit 1
fi
ulimit -n 65536 2>/dev/null || true

# --- processes -----------------------------------------------------------------------------
work=$(mktemp -d)
chmod 755 "$work" # nginx workers run as nobody when started by root
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ -n "${BENCH_RAW:-}" ] && [ -d "$work/runs" ]; then
        mkdir -p "$BENCH_RAW" && cp "$work"/runs/* "$BENCH_RAW"/ 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Both nginx run in the foreground (daemon off) so that $! is the master and cleanup's kill
# (SIGTERM: fast shutdown) takes its worker down with it.
cat >"$work/origin.conf" <<NGINX
worker_processes 1;
daemon off;
pid $work/origin.pid;
error_log $work/origin-error.log;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:$origin;
        default_type text/plain;
        location / { return 200 "ok"; }
    }
}
NGINX
cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 4096; }
http {
    access_log off;
    # Without this nginx closes each client keep-alive connection after 1,000 requests.
    keepalive_requests 1000000;
    upstream origin {
        server 127.0.0.1:$origin;
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$nginx_port;
        location / {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
NGINX
mkdir -p "$work/origin" "$work/nginx"
nginx -e "$work/origin-error.log" -p "$work/origin" -c "$work/origin.conf" & pids+=($!)
origin_master=$!
nginx -e "$work/nginx-error.log" -p "$work/nginx" -c "$work/nginx.conf" & pids+=($!)
nginx_master=$!

# The process each target's requests cost CPU in: each nginx's one worker; for Portcullis,
# its proxy process (added below).
worker_of() {
    local worker
    for _ in $(seq 50); do
        worker=$(pgrep -P "$1" | head -n 1) || true
        [ -n "$worker" ] && { echo "$worker"; return; }
        sleep 0.1
    done
    echo "nginx (master $1) started no worker process" >&2
    cat "$work"/*-error.log >&2 2>/dev/null || true
    exit 1
}
origin_worker=$(worker_of "$origin_master")
nginx_worker=$(worker_of "$nginx_master")
declare -A serving=([direct]=$origin_worker [nginx]=$nginx_worker)
# User plus system CPU time of a process, all its threads, in clock ticks; nothing once it
# has exited. Counted after the command name, which may hold spaces: utime and stime are then
# the 12th and 13th fields.
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $12 + $13 }' || true; }
clock_ticks=$(getconf CLK_TCK)

targets=(direct nginx)
declare -A url=(
    [direct]="http://127.0.0.1:$origin/bench"
    [nginx]="http://127.0.0.1:$nginx_port/bench"
)

if [ "${SKIP_PORTCULLIS:-0}" != 1 ]; then
    # Proxies of one control plane, each serving its own listener (shards): one as
    # configured by default (metrics on, access log off), one with the access log on too,
    # and with BASELINE_BIN a third, of that build, as configured by default.
    baseline_listener=
    if [ -n "$baseline_bin" ]; then
        baseline_listener=", bench-baseline"
    fi
    cat >"$work/bench.yaml" <<YAML
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: bench, labels: { variant: plain } }
spec: { address: 127.0.0.1, port: $gateway }
---
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: bench-logged, labels: { variant: logged } }
spec: { address: 127.0.0.1, port: $gateway_logged }
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: { name: origin }
spec: { endpoints: ["127.0.0.1:$origin"] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: { name: bench }
spec: { listeners: [bench, bench-logged$baseline_listener], backends: [{ name: origin }] }
YAML
    if [ -n "$baseline_bin" ]; then
        cat >>"$work/bench.yaml" <<YAML
---
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: bench-baseline, labels: { variant: baseline } }
spec: { address: 127.0.0.1, port: $gateway_baseline }
YAML
    fi
    PORTCULLIS_LOG=warn "$bin" controlplane --listen 127.0.0.1:$admin --metrics-listen 127.0.0.1:$cp_metrics \
        --data-dir "$work/data" >"$work/controlplane.log" 2>&1 & pids+=($!)
    # shellcheck disable=SC2086 # PORTCULLIS_EXTRA_ARGS is split into arguments on purpose
    PORTCULLIS_LOG=warn "$bin" proxy --controlplane 127.0.0.1:$admin --id plain --shard variant=plain \
        --admin-listen 127.0.0.1:$proxy_admin $PORTCULLIS_EXTRA_ARGS >"$work/proxy.log" 2>&1 & pids+=($!)
    serving[portcullis]=$!
    # shellcheck disable=SC2086
    PORTCULLIS_LOG=warn "$bin" proxy --controlplane 127.0.0.1:$admin --id logged --shard variant=logged \
        --admin-listen 127.0.0.1:$proxy_admin_logged --access-log "$work/access.log" $PORTCULLIS_EXTRA_ARGS \
        >"$work/proxy-logged.log" 2>&1 & pids+=($!)
    serving[portcullis-logged]=$!
    ready_ports="$proxy_admin $proxy_admin_logged"
    if [ -n "$baseline_bin" ]; then
        # shellcheck disable=SC2086
        PORTCULLIS_LOG=warn "$baseline_bin" proxy --controlplane 127.0.0.1:$admin --id baseline \
            --shard variant=baseline --admin-listen 127.0.0.1:$proxy_admin_baseline $PORTCULLIS_EXTRA_ARGS \
            >"$work/proxy-baseline.log" 2>&1 & pids+=($!)
        serving[portcullis-baseline]=$!
        url[portcullis-baseline]="http://127.0.0.1:$gateway_baseline/bench"
        ready_ports="$ready_ports $proxy_admin_baseline"
    fi
    for _ in $(seq 100); do
        "$bin" apply -f "$work/bench.yaml" --controlplane 127.0.0.1:$admin >/dev/null 2>&1 && break
        sleep 0.1
    done
    targets+=(portcullis portcullis-logged)
    [ -z "$baseline_bin" ] || targets+=(portcullis-baseline)
    url[portcullis]="http://127.0.0.1:$gateway/bench"
    url[portcullis-logged]="http://127.0.0.1:$gateway_logged/bench"
    # The reference forwarders: one thread per core, as the proxy's workers.
    PORTCULLIS_LOG=warn "$bin" forward-floor --listen 127.0.0.1:$floor --upstream 127.0.0.1:$origin \
        --engine one-pass >"$work/floor.log" 2>&1 & pids+=($!)
    serving[floor]=$!
    PORTCULLIS_LOG=warn "$bin" forward-floor --listen 127.0.0.1:$floor_hyper --upstream 127.0.0.1:$origin \
        --engine hyper >"$work/floor-hyper.log" 2>&1 & pids+=($!)
    serving[floor-hyper]=$!
    targets+=(floor floor-hyper)
    url[floor]="http://127.0.0.1:$floor/bench"
    url[floor-hyper]="http://127.0.0.1:$floor_hyper/bench"
    for ready in $ready_ports; do
        for _ in $(seq 100); do
            curl -fsS "http://127.0.0.1:$ready/readyz" >/dev/null 2>&1 && break
            sleep 0.1
        done
    done
fi

if [ -n "${TARGETS+set}" ]; then
    read -r -a wanted <<<"$TARGETS"
    [ ${#wanted[@]} -gt 0 ] || { echo "TARGETS names no target (started: ${targets[*]})" >&2; exit 1; }
    declare -A named=()
    for t in "${wanted[@]}"; do
        [ -n "${url[$t]:-}" ] || { echo "TARGETS: no target $t (started: ${targets[*]})" >&2; exit 1; }
        [ -z "${named[$t]:-}" ] || { echo "TARGETS: $t named twice" >&2; exit 1; }
        named[$t]=1
    done
    targets=("${wanted[@]}")
fi

# Every target must answer "ok" before anything is measured.
for t in "${targets[@]}"; do
    body=
    for _ in $(seq 50); do
        body=$(curl -fsS "${url[$t]}" 2>/dev/null) && [ "$body" = ok ] && break
        sleep 0.1
    done
    if [ "$body" != ok ]; then
        echo "$t (${url[$t]}) does not answer \"ok\"" >&2
        cat "$work"/*-error.log "$work"/*.log 2>/dev/null >&2 || true
        exit 1
    fi
done

# --- load ----------------------------------------------------------------------------------
nginx_version=$( (nginx -v 2>&1 || true) | sed 's/.*nginx\///')
wrk_version=$( (wrk -v 2>&1 || true) | awk 'NR == 1 {print $2}') # wrk -v exits 1
echo "$(nproc) cores; wrk $wrk_version -t$wrk_threads; nginx $nginx_version, origin and proxy 1 worker each;" \
    "Portcullis: one worker thread per core (PORTCULLIS_WORKERS overrides); all share the same cores" >&2
echo "targets: ${targets[*]}; connections: $connections; $rounds rounds × $duration, order rotated every two rounds, every second round reversed" >&2
baseline_meta=()
if [ -n "$baseline_bin" ]; then
    echo "portcullis-baseline: $baseline_bin (sha256 $baseline_sha256)" >&2
    baseline_meta=(baseline_bin "$baseline_bin" baseline_sha256 "$baseline_sha256")
fi
[ -n "$PORTCULLIS_EXTRA_ARGS" ] && echo "portcullis proxy extra args: $PORTCULLIS_EXTRA_ARGS" >&2

mkdir -p "$work/runs"
if [ "$warmup" != 0 ]; then
    for c in $connections; do
        for t in "${targets[@]}"; do
            wrk -t"$wrk_threads" -c"$c" -d"$warmup" "${url[$t]}" >/dev/null
        done
    done
fi
n=${#targets[@]}
for r in $(seq "$rounds"); do
    for c in $connections; do
        for i in $(seq 0 $((n - 1))); do
            # Each second round runs the round before it backwards, so that over each pair of
            # rounds every target follows every other as often as it precedes it; each pair
            # starts one place further round (2 × targets rounds put each target in each place
            # equally often).
            step=$i
            [ $((r % 2)) = 1 ] || step=$((n - 1 - i))
            t=${targets[$(((step + (r - 1) / 2) % n))]}
            echo "round $r/$rounds: $t, $c connections" >&2
            before=$(cpu_ticks "${serving[$t]}")
            wrk -t"$wrk_threads" -c"$c" -d"$duration" --latency "${url[$t]}" >"$work/runs/c${c}_${t}_r${r}.txt"
            after=$(cpu_ticks "${serving[$t]}")
            # A process that exited during the run has no figure (its errors show in wrk's).
            if [ -n "$before" ] && [ -n "$after" ]; then
                echo "$((after - before)) $clock_ticks" >"$work/runs/c${c}_${t}_r${r}.cpu"
            fi
        done
    done
done

targets_csv=$(IFS=,; echo "${targets[*]}")
meta=$(python3 -c 'import json,sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
    date "$(date -u +%FT%TZ)" cores "$(nproc)" wrk "$wrk_version" wrk_threads "$wrk_threads" \
    duration "$duration" rounds "$rounds" nginx "$nginx_version" \
    portcullis_extra_args "$PORTCULLIS_EXTRA_ARGS" "${baseline_meta[@]}")
python3 loadtest/http-bench/wrk_report.py "$work/runs" --targets "$targets_csv" \
    --connections "$(echo $connections | tr ' ' ,)" --meta "$meta" ${BENCH_JSON:+--json "$BENCH_JSON"}
