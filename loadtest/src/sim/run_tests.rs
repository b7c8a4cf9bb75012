use std::time::Instant;

use super::*;
use crate::sim::fleet::SignalSpec;
use crate::sim::report::RouterReport;
use crate::sim::router::RouterKind;
use crate::sim::workload::{LoadSpec, WorkloadSpec};
use crate::sim::{report, workload};

/// Mean of `metric` over stages `from..`, i.e. over the saturated part of a ramp. Single
/// stages are noisy: with fixed 1,000-token outputs, completions arrive in waves.
fn mean_from(r: &RouterReport, from: usize, metric: impl Fn(&report::StageReport) -> f64) -> f64 {
    let stages = &r.stages[from..];
    stages.iter().map(metric).sum::<f64>() / stages.len() as f64
}

fn router<'a>(report: &'a report::Report, name: &str) -> &'a RouterReport {
    report.routers.iter().find(|r| r.router == name).unwrap()
}

fn describe(r: &RouterReport, from: usize) -> String {
    let top = r.stages.last().unwrap();
    format!(
        "{:11} top stage: TTFT p50 {:.2}s p99 {:.2}s, E2E p50 {:.1}s, cached {:.2} | stages {from}..: \
         {:.2} req/s, {:.0} out tok/s, ITL {:.3}s | preemptions {}",
        r.router,
        top.ttft.p50,
        top.ttft.p99,
        top.e2e.p50,
        top.cached_token_fraction,
        mean_from(r, from, |s| s.requests_per_s),
        mean_from(r, from, |s| s.output_tokens_per_s),
        mean_from(r, from, |s| s.itl.mean),
        r.pods.iter().map(|p| p.num_preemptions).sum::<u64>(),
    )
}

/// The published llm-d outcome (llm-d/llm-d, `guides/inference-scheduling/README.md`):
/// round-robin collapses (TTFT of tens of seconds) while a prefix-aware router keeps TTFT
/// sub-second and serves ≥ 2× the requests.
fn assert_llm_d_shape(report: &report::Report, from: usize) {
    let (rr, oracle) = (router(report, "round_robin"), router(report, "oracle"));
    eprintln!("{}\n{}", describe(rr, from), describe(oracle, from));
    let (rr_top, oracle_top) = (rr.stages.last().unwrap(), oracle.stages.last().unwrap());
    assert!(
        rr_top.ttft.p50 > 10.0,
        "round-robin should collapse: {:?}",
        rr_top.ttft
    );
    assert!(
        oracle_top.ttft.p50 < 1.0,
        "oracle should stay sub-second: {:?}",
        oracle_top.ttft
    );
    let rps = |r| mean_from(r, from, |s| s.requests_per_s);
    assert!(
        rps(oracle) >= 2.0 * rps(rr),
        "oracle {} vs round-robin {} req/s",
        rps(oracle),
        rps(rr)
    );
    let tps = |r| mean_from(r, from, |s| s.output_tokens_per_s);
    assert!(tps(oracle) >= 2.0 * tps(rr));
    assert!(rr_top.cached_token_fraction < 0.5 && oracle_top.cached_token_fraction > 0.9);
    assert!(report
        .routers
        .iter()
        .all(|r| r.stages.iter().all(|s| s.failures == 0)));
}

/// Shortened calibration that runs by default: the published fleet and prompts, but a 10 s
/// ramp straight to 20 QPS (both routers saturate below that, and every request sent must be
/// served, so a higher rate only lengthens the run) held for 120 s, of which the last 60 s are
/// measured (outputs take ~65 s, so earlier windows are not yet in steady state).
/// Shrinking the fleet instead would not be faithful: with fewer replicas each round-robin
/// replica sees fewer system prompts and caches more of them.
#[test]
fn calibration_shortened() {
    let mut config = VirtualConfig::llm_d_benchmark(Profile::qwen3_32b_tp2_h100().unwrap(), 10.0);
    config.routers = vec![RouterKind::RoundRobin, RouterKind::Oracle];
    config.load.stages = [(4.0, 10.0), (20.0, 60.0), (20.0, 60.0)]
        .iter()
        .map(|&(rate, duration_s)| workload::Stage { rate, duration_s })
        .collect();
    let started = Instant::now();
    let report = run_virtual(&config).unwrap();
    eprintln!("shortened calibration took {:?}", started.elapsed());
    assert_llm_d_shape(&report, 2);
}

/// The full published workload with Portcullis' picker: 8 replicas, 150 × 5 prompts, all 17
/// stage rates up to 60 QPS at 30 s each (the published stages last 20–50 s), signals sampled
/// every 50 ms and delivered 150 ms later. Over the top stages (43–60 QPS, the window the
/// calibration used before the picker existed): at least 95% of the oracle's requests/s (the
/// issue asks 90%) and 2.5× round-robin's (measured 2.62×; the issue asks 2.6×, which even the
/// oracle reaches only in this window, see docs/benchmarks/llm-d-calibration.md), TTFT p50 at
/// the last stage within 2× the oracle's. A few seconds with the simulator optimized (see the
/// workspace's dev profile).
#[test]
fn picker_on_the_llm_d_benchmark() {
    let config = VirtualConfig::llm_d_benchmark(Profile::qwen3_32b_tp2_h100().unwrap(), 30.0);
    let started = Instant::now();
    let report = run_virtual(&config).unwrap();
    eprintln!("llm-d benchmark took {:?}", started.elapsed());
    let from = config.load.stages.iter().position(|s| s.rate >= 43.0).unwrap();
    assert_llm_d_shape(&report, from);
    let (rr, picker, oracle) = (
        router(&report, "round_robin"),
        router(&report, "picker"),
        router(&report, "oracle"),
    );
    eprintln!("{}", describe(picker, from));
    let rps = |r| mean_from(r, from, |s| s.requests_per_s);
    assert!(
        rps(picker) >= 0.95 * rps(oracle),
        "picker {:.2} vs oracle {:.2} req/s",
        rps(picker),
        rps(oracle)
    );
    assert!(
        rps(picker) >= 2.5 * rps(rr),
        "picker {:.2} vs round-robin {:.2} req/s",
        rps(picker),
        rps(rr)
    );
    let ttft_p50 = |r: &RouterReport| r.stages.last().unwrap().ttft.p50;
    assert!(
        ttft_p50(picker) <= 2.0 * ttft_p50(oracle),
        "TTFT p50 picker {:.3}s vs oracle {:.3}s",
        ttft_p50(picker),
        ttft_p50(oracle)
    );
}

/// Proxies that learn only from their own picks spread a prompt group over several pods
/// (see the calibration doc); sharing placements through the control plane keeps a picker
/// split over four proxies within 10% of one.
#[test]
fn pickers_in_separate_proxies_share_prefix_affinity() {
    let mut config = VirtualConfig::llm_d_benchmark(Profile::qwen3_32b_tp2_h100().unwrap(), 30.0);
    config.routers = vec![RouterKind::Picker];
    let from = config.load.stages.iter().position(|s| s.rate >= 43.0).unwrap();
    let rps = |config: &VirtualConfig| {
        let report = run_virtual(config).unwrap();
        mean_from(router(&report, "picker"), from, |s| s.requests_per_s)
    };
    let one = rps(&config);
    config.proxies = 4;
    let four = rps(&config);
    assert!(
        four >= 0.9 * one,
        "one proxy {one:.2} req/s, four proxies {four:.2}"
    );
}

#[test]
fn same_seed_same_report() {
    let config = |seed| VirtualConfig {
        profile: Profile::qwen3_32b_tp2_h100().unwrap(),
        pods: 2,
        routers: vec![RouterKind::RoundRobin, RouterKind::LeastQueue, RouterKind::Oracle],
        workload: WorkloadSpec::SharedPrefix {
            num_groups: 6,
            num_prompts_per_group: 3,
            system_prompt_len: 2000,
            question_len: 300,
            output_len: 50,
        },
        load: LoadSpec {
            stages: vec![workload::Stage {
                rate: 8.0,
                duration_s: 5.0,
            }],
            seed,
            max_in_flight: None,
        },
        signals: SignalSpec::default(),
        proxies: 1,
    };
    let a = run_virtual(&config(5)).unwrap();
    let b = run_virtual(&config(5)).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
    assert_ne!(a, run_virtual(&config(6)).unwrap());
    assert_eq!(a.routers.len(), 3);
    assert!(a
        .routers
        .iter()
        .all(|r| r.stages[0].requests > 20 && r.stages[0].failures == 0));
}

#[test]
fn configs_round_trip_and_are_validated() {
    let config = VirtualConfig::llm_d_benchmark(Profile::qwen3_32b_tp2_h100().unwrap(), 30.0);
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<VirtualConfig>(&json).unwrap(), config);
    let mut bad = config.clone();
    bad.pods = 0;
    assert!(run_virtual(&bad).is_err());
    let mut bad = config.clone();
    bad.load.stages.clear();
    assert!(run_virtual(&bad).is_err());
    for (interval_s, delay_s) in [(1e-9, 0.1), (f64::NAN, 0.1), (0.05, f64::NAN), (0.05, -1.0)] {
        let mut bad = config.clone();
        bad.signals = SignalSpec { interval_s, delay_s };
        let error = run_virtual(&bad).unwrap_err().to_string();
        assert!(error.contains("signals."), "{error}");
    }
}
