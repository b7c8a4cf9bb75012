#!/usr/bin/env python3
"""Summarise the wrk runs of loadtest/http-bench.sh (standard library only).

    wrk_report.py RUNS_DIR --targets direct,nginx,portcullis --connections 32,256 [--json OUT]

RUNS_DIR holds one wrk output per run, named c<CONNECTIONS>_<TARGET>_r<ROUND>.txt (wrk run
with --latency), and beside it, where measured, c<CONNECTIONS>_<TARGET>_r<ROUND>.cpu: the CPU
clock ticks the target's serving process used during the run and the ticks per second. Prints
one markdown table per connection count: median req/s over the rounds (and min-max), median
p50/p99 in ms, errors, the req/s ratio to nginx and to direct, and the median CPU time per
request with its ratio to nginx's. With --json, also writes every round's figures and the
summary there.
"""

import argparse
import json
import os
import re
import statistics
import sys

UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
LAT_RE = re.compile(r"^\s*(50|75|90|99)(?:\.0+)?%\s+([0-9.]+)(us|ms|s|m|h)\s*$")
RPS_RE = re.compile(r"^Requests/sec:\s+([0-9.]+)")
REQS_RE = re.compile(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h)")
SOCK_RE = re.compile(
    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
NON2XX_RE = re.compile(r"Non-2xx or 3xx responses: (\d+)")
NAME_RE = re.compile(r"^c(\d+)_(.+)_r(\d+)\.txt$")


def parse_wrk(text):
    """One wrk --latency output -> dict (latencies in ms); raises ValueError if incomplete."""
    out = {"latency_ms": {}, "socket_errors": {"connect": 0, "read": 0, "write": 0,
                                                 "timeout": 0}, "non_2xx_3xx": 0}
    for line in text.splitlines():
        m = LAT_RE.match(line)
        if m:
            out["latency_ms"]["p" + m.group(1)] = round(float(m.group(2)) * UNIT_MS[m.group(3)], 4)
            continue
        m = RPS_RE.match(line)
        if m:
            out["rps"] = float(m.group(1))
            continue
        m = REQS_RE.match(line)
        if m:
            out["requests"] = int(m.group(1))
            out["seconds"] = round(float(m.group(2)) * UNIT_MS[m.group(3)] / 1e3, 4)
            continue
        m = SOCK_RE.search(line)
        if m:
            out["socket_errors"] = dict(zip(("connect", "read", "write", "timeout"),
                                            map(int, m.groups())))
            continue
        m = NON2XX_RE.search(line)
        if m:
            out["non_2xx_3xx"] = int(m.group(1))
    if "rps" not in out or "p50" not in out["latency_ms"] or "p99" not in out["latency_ms"]:
        raise ValueError("no Requests/sec or latency distribution (was wrk run with --latency?)")
    out["errors"] = sum(out["socket_errors"].values()) + out["non_2xx_3xx"]
    return out


def read_cpu(path):
    """CPU seconds from a .cpu file next to a wrk output, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            ticks, per_second = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    if ticks < 0 or per_second <= 0:
        return None
    return ticks / per_second


def fmt_int(x):
    return f"{x:,.0f}"


def fmt_ms(x):
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def fmt_cpu(summary, rounds):
    """Median CPU µs per request, saying so when fewer rounds than the others have a figure."""
    x = summary["cpu_us_per_request_median"]
    if x is None:
        return "—"
    cpu_rounds = summary["cpu_rounds"]
    return f"{x:.1f}" if cpu_rounds == rounds else f"{x:.1f} ({cpu_rounds} of {rounds} rounds)"


def fmt_ratio(x):
    return "—" if x is None else f"{x:.2f}×"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs_dir")
    ap.add_argument("--targets", required=True)
    ap.add_argument("--connections", required=True)
    ap.add_argument("--json")
    ap.add_argument("--meta", default="{}", help="JSON object copied into the JSON output")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    conns = [int(c) for c in args.connections.split(",") if c]

    runs = {}  # (conns, target) -> [(round, parsed)]
    bad = 0
    for name in sorted(os.listdir(args.runs_dir)):
        m = NAME_RE.match(name)
        if not m:
            continue
        c, target, rnd = int(m.group(1)), m.group(2), int(m.group(3))
        with open(os.path.join(args.runs_dir, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        try:
            parsed = parse_wrk(text)
        except ValueError as e:
            print(f"{name}: {e}\n{text}", file=sys.stderr)
            bad += 1
            continue
        parsed["cpu_seconds"] = read_cpu(os.path.join(args.runs_dir, name[:-len(".txt")] + ".cpu"))
        requests = parsed.get("requests", 0)
        parsed["cpu_us_per_request"] = (parsed["cpu_seconds"] * 1e6 / requests
                                        if parsed["cpu_seconds"] is not None and requests > 0
                                        else None)
        runs.setdefault((c, target), []).append((rnd, parsed))

    report = {"meta": json.loads(args.meta), "results": {}}
    for c in conns:
        summary = {}
        for t in targets:
            rs = sorted(runs.get((c, t), []), key=lambda r: r[0])
            if not rs:
                continue
            rps = [r["rps"] for _, r in rs]
            summary[t] = {
                "rounds": [dict(round=rnd, **r) for rnd, r in rs],
                "rps_median": statistics.median(rps),
                "rps_min": min(rps),
                "rps_max": max(rps),
                "p50_ms_median": statistics.median(r["latency_ms"]["p50"] for _, r in rs),
                "p99_ms_median": statistics.median(r["latency_ms"]["p99"] for _, r in rs),
                "errors": sum(r["errors"] for _, r in rs),
            }
            cpu = [r["cpu_us_per_request"] for _, r in rs if r["cpu_us_per_request"] is not None]
            summary[t]["cpu_us_per_request_median"] = statistics.median(cpu) if cpu else None
            summary[t]["cpu_rounds"] = len(cpu)
        for t, s in summary.items():
            for ref in ("nginx", "direct"):
                r = summary.get(ref)
                s[f"rps_vs_{ref}"] = s["rps_median"] / r["rps_median"] if r else None
                s[f"p99_vs_{ref}"] = (s["p99_ms_median"] / r["p99_ms_median"]
                                      if r and r["p99_ms_median"] > 0 else None)
            # The origin's cost per request is not a proxy's: no ratio for direct.
            nginx = summary.get("nginx")
            s["cpu_vs_nginx"] = (s["cpu_us_per_request_median"] / nginx["cpu_us_per_request_median"]
                                 if t != "direct" and nginx and nginx["cpu_us_per_request_median"]
                                 and s["cpu_us_per_request_median"] is not None else None)
        report["results"][str(c)] = summary

        n = max((len(s["rounds"]) for s in summary.values()), default=0)
        print(f"\n### {c} connections (median of {n} rounds)\n")
        print("| target | req/s | min–max req/s | p50 ms | p99 ms | errors "
              "| req/s × nginx | p99 × nginx | req/s × direct | CPU µs/request | CPU × nginx |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for t, s in summary.items():
            print(f"| {t} | {fmt_int(s['rps_median'])} "
                  f"| {fmt_int(s['rps_min'])}–{fmt_int(s['rps_max'])} "
                  f"| {fmt_ms(s['p50_ms_median'])} | {fmt_ms(s['p99_ms_median'])} "
                  f"| {s['errors']} | {fmt_ratio(s['rps_vs_nginx'])} "
                  f"| {fmt_ratio(s['p99_vs_nginx'])} | {fmt_ratio(s['rps_vs_direct'])} "
                  f"| {fmt_cpu(s, len(s['rounds']))} | {fmt_ratio(s['cpu_vs_nginx'])} |")

    errors = sum(s["errors"] for by_t in report["results"].values() for s in by_t.values())
    if errors:
        print(f"\nWARNING: {errors} wrk errors (socket errors or non-2xx/3xx answers); "
              "see the raw wrk output.", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
