"""Measures pod-signal freshness and cost for loadtest/signals-bench.sh (standard library only).

Freshness: send two requests straight to a pod that runs one at a time, so its
`vllm:num_requests_waiting` goes 0 -> 1 the moment the second arrives; poll every proxy's
`/signals?pool=` until each holds waiting >= 1 for that pod. The figure is the time from the
second request leaving this script to the slower proxy showing it (polling every ~2 ms).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import time
import urllib.request

TICKS = os.sysconf("SC_CLK_TCK")


def get(port, path, timeout=2.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return response.read().decode()


def metric(port, name):
    total = 0.0
    for line in get(port, "/metrics").splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def du(path):
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0])


def pod_signals(admin, pool, endpoint):
    report = json.loads(get(admin, f"/signals?pool={pool}"))
    return report["pools"].get(pool, {}).get("endpoints", {}).get(endpoint, {}).get("signals")


def all_fresh(admins, pools):
    for admin in admins:
        report = json.loads(get(admin, "/signals"))["pools"]
        for pool, endpoints in pools.items():
            for endpoint in endpoints:
                signals = report.get(pool, {}).get("endpoints", {}).get(endpoint, {}).get("signals")
                if not signals or not signals["fresh"]:
                    return False
    return True


def send_request(port, max_tokens):
    body = json.dumps({"model": "Qwen/Qwen3-32B", "prompt": "signal", "max_tokens": max_tokens}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: pod\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main():
    parser = argparse.ArgumentParser()
    for flag in ["pods", "first-port", "pool-size", "controlplane-metrics", "controlplane-pid", "sim-pid", "trials", "window"]:
        parser.add_argument(f"--{flag}", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--proxies", required=True)
    parser.add_argument("--proxy-pids", required=True)
    args = parser.parse_args()
    admins = [int(port) for port in args.proxies.split(",")]
    proxy_pids = [int(pid) for pid in args.proxy_pids.split()]
    pools = {}
    for index in range(args.pods):
        pools.setdefault(f"pool-{index // args.pool_size}", []).append(f"127.0.0.1:{args.first_port + index}")

    deadline = time.time() + 60
    while not all_fresh(admins, pools):
        if time.time() > deadline:
            raise SystemExit("signals never became fresh on every proxy")
        time.sleep(0.2)

    # Steady state: every pod idle, read every interval.
    cp = args.controlplane_metrics

    def sample():
        return {
            "entries": metric(cp, "portcullis_signals_entries_total"),
            "bytes": metric(cp, "portcullis_signals_entry_bytes_total"),
            "scrapes": metric(cp, "portcullis_signals_scrapes_total"),
            "scrape_errors": metric(cp, 'portcullis_signals_scrapes_total{result="error"}'),
            "batches": metric(cp, "portcullis_signals_batches_sent_total"),
            "config_log": metric(cp, "portcullis_raft_last_log_index"),
            "disk": du(args.data_dir),
            "cp_cpu": cpu_seconds(args.controlplane_pid),
            "proxy_cpu": [cpu_seconds(pid) for pid in proxy_pids],
            "sim_cpu": cpu_seconds(args.sim_pid),
        }

    before = sample()
    started = time.time()
    time.sleep(args.window)
    elapsed = time.time() - started
    after = sample()
    rate = lambda key: (after[key] - before[key]) / elapsed

    # Freshness: a different pod each trial (a pod's queue drains only as its requests run).
    latencies = []
    for trial in range(args.trials):
        index = (trial * 7919) % args.pods if args.pods > args.trials else trial % args.pods
        port = args.first_port + index
        pool, endpoint = f"pool-{index // args.pool_size}", f"127.0.0.1:{port}"
        # Wait for an empty queue (the previous trial on this pod has drained).
        while any((pod_signals(admin, pool, endpoint) or {}).get("waiting", 1) != 0 for admin in admins):
            time.sleep(0.05)
        running = send_request(port, 20)
        time.sleep(0.05)
        queued = send_request(port, 20)
        sent = time.perf_counter()
        seen = {}
        while len(seen) < len(admins):
            for admin in admins:
                if admin not in seen and (pod_signals(admin, pool, endpoint) or {}).get("waiting", 0) >= 1:
                    seen[admin] = time.perf_counter() - sent
            if time.perf_counter() - sent > 10:
                raise SystemExit(f"pod {endpoint}: the queue never reached the proxies")
            time.sleep(0.002)
        latencies.append(max(seen.values()) * 1000)
        running.close()
        queued.close()

    print(json.dumps({
        "pods": args.pods,
        "pools": len(pools),
        "proxies": len(admins),
        "window_s": round(elapsed, 1),
        "freshness_ms": {
            "trials": len(latencies),
            "p50": round(statistics.median(latencies), 1),
            "p90": round(percentile(latencies, 0.90), 1),
            "p99": round(percentile(latencies, 0.99), 1),
            "max": round(max(latencies), 1),
        },
        "scrapes_per_s": round(rate("scrapes"), 1),
        "scrape_errors_per_s": round(rate("scrape_errors"), 1),
        "signal_entries_per_s": round(rate("entries"), 1),
        "signal_bytes_per_s": round(rate("bytes")),
        "signal_bytes_per_entry": round((after["bytes"] - before["bytes"]) / max(1, after["entries"] - before["entries"])),
        "batches_to_proxies_per_s": round(rate("batches"), 1),
        "controlplane_cpu_cores": round(rate("cp_cpu"), 3),
        "proxy_cpu_cores": [round((a - b) / elapsed, 3) for a, b in zip(after["proxy_cpu"], before["proxy_cpu"])],
        "simulator_cpu_cores": round(rate("sim_cpu"), 3),
        "config_log_entries_added": after["config_log"] - before["config_log"],
        "data_dir_bytes_before": before["disk"],
        "data_dir_bytes_after": after["disk"],
    }, indent=2))


if __name__ == "__main__":
    main()
