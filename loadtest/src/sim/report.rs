//! Per-stage summaries with inference-perf's metric definitions (kubernetes-sigs/inference-perf,
//! `docs/metrics.md`):
//! TTFT = first token − send; ITL = gaps between tokens; TPOT = (E2E − TTFT)/(out − 1);
//! normalized TPOT = E2E/out; E2E = finish − send.
//!
//! Latencies of a stage cover the requests the load generator *meant to send* in it. Throughput
//! counts what the fleet delivered *during* the stage's window (requests finished, input tokens
//! of requests whose prefill finished, output tokens produced), divided by its duration, so that
//! a saturated fleet shows its real service rate rather than the offered rate.

use serde::Serialize;

use super::engine::EngineMetrics;
use super::fleet::{FleetOutcome, RequestRecord};
use super::workload::LoadSpec;

/// Distribution of one latency, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Nearest-rank percentiles; all zeros when there are no samples.
    pub fn of(samples: Vec<f64>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let n = samples.len();
        let mean = samples.iter().sum::<f64>() / n as f64;
        // Latencies are finite and non-negative, where IEEE-754 bit patterns order like the
        // values; sorting integers is several times faster than sorting floats in debug
        // builds, and a run can have millions of inter-token gaps.
        let mut bits: Vec<u64> = samples.iter().map(|x| x.max(0.0).to_bits()).collect();
        bits.sort_unstable();
        let rank = |q: f64| f64::from_bits(bits[((q * n as f64).ceil() as usize).clamp(1, n) - 1]);
        Self {
            count: n,
            mean,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: f64::from_bits(bits[n - 1]),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageReport {
    pub stage: usize,
    /// Offered requests per second.
    pub rate: f64,
    pub start_s: f64,
    pub duration_s: f64,
    /// Requests generated in this stage.
    pub requests: usize,
    pub failures: usize,
    pub requests_per_s: f64,
    pub input_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Cached / input tokens of this stage's successful requests.
    pub cached_token_fraction: f64,
    pub ttft: Summary,
    pub itl: Summary,
    pub tpot: Summary,
    pub normalized_tpot: Summary,
    pub e2e: Summary,
    /// Time requests waited in the load generator because of the in-flight limit.
    pub schedule_delay: Summary,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouterReport {
    pub router: String,
    pub stages: Vec<StageReport>,
    /// Final vLLM-style counters per replica.
    pub pods: Vec<EngineMetrics>,
    /// Virtual time when the last request finished.
    pub end_s: f64,
}

/// Everything `run_virtual` measured, one entry per router, all on identical arrivals.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub profile: String,
    pub pods: usize,
    pub routers: Vec<RouterReport>,
}

/// Summarises one router's run.
pub fn summarize(router: &str, load: &LoadSpec, outcome: &FleetOutcome) -> RouterReport {
    let windows = load.stage_windows();
    let stage_of = |t: f64| {
        let i = windows.partition_point(|w| w.1 <= t);
        (i < windows.len()).then_some(i)
    };
    // Delivered work per stage window: (finished requests, input tokens, output tokens).
    let mut delivered = vec![(0usize, 0usize, 0usize); windows.len()];
    for r in outcome.records.iter().filter(|r| r.error.is_none()) {
        if let Some(s) = r.finish.and_then(stage_of) {
            delivered[s].0 += 1;
        }
        if let Some(s) = r.first_token.and_then(stage_of) {
            delivered[s].1 += r.input_tokens;
        }
        for &t in &r.token_times {
            if let Some(s) = stage_of(t) {
                delivered[s].2 += 1;
            }
        }
    }
    let stages = windows
        .iter()
        .zip(&load.stages)
        .enumerate()
        .map(|(stage, (&(start_s, _), spec))| {
            let mine: Vec<&RequestRecord> = outcome.records.iter().filter(|r| r.stage == stage).collect();
            let (done, input, output) = delivered[stage];
            stage_report(
                stage,
                spec.rate,
                start_s,
                spec.duration_s,
                &mine,
                (done, input, output),
            )
        })
        .collect();
    RouterReport {
        router: router.to_string(),
        stages,
        pods: outcome.pods.clone(),
        end_s: outcome.end_time,
    }
}

fn stage_report(
    stage: usize,
    rate: f64,
    start_s: f64,
    duration_s: f64,
    records: &[&RequestRecord],
    (done, input, output): (usize, usize, usize),
) -> StageReport {
    let ok: Vec<&RequestRecord> = records.iter().copied().filter(|r| r.error.is_none()).collect();
    // Successful records always have these timestamps; the filter keeps this total anyway.
    let timed: Vec<(f64, f64, f64, &RequestRecord)> = ok
        .iter()
        .filter_map(|r| Some((r.sent?, r.first_token?, r.finish?, *r)))
        .collect();
    let e2e = |&(sent, _, finish, _): &(f64, f64, f64, &RequestRecord)| finish - sent;
    let input_total: usize = ok.iter().map(|r| r.input_tokens).sum();
    let cached_total: usize = ok.iter().map(|r| r.cached_tokens).sum();
    StageReport {
        stage,
        rate,
        start_s,
        duration_s,
        requests: records.len(),
        failures: records.len() - ok.len(),
        requests_per_s: done as f64 / duration_s,
        input_tokens_per_s: input as f64 / duration_s,
        output_tokens_per_s: output as f64 / duration_s,
        cached_token_fraction: if input_total == 0 {
            0.0
        } else {
            cached_total as f64 / input_total as f64
        },
        ttft: Summary::of(timed.iter().map(|&(sent, first, _, _)| first - sent).collect()),
        itl: Summary::of(
            ok.iter()
                .flat_map(|r| r.token_times.windows(2).map(|w| w[1] - w[0]))
                .collect(),
        ),
        tpot: Summary::of(
            timed
                .iter()
                .filter(|t| t.3.output_tokens > 1)
                .map(|&(_, first, finish, r)| (finish - first) / (r.output_tokens - 1) as f64)
                .collect(),
        ),
        normalized_tpot: Summary::of(timed.iter().map(|t| e2e(t) / t.3.output_tokens as f64).collect()),
        e2e: Summary::of(timed.iter().map(e2e).collect()),
        schedule_delay: Summary::of(ok.iter().filter_map(|r| Some(r.sent? - r.arrival)).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::workload::Stage;

    fn record(stage: usize, sent: f64, tokens: &[f64]) -> RequestRecord {
        RequestRecord {
            id: 0,
            stage,
            pod: Some(0),
            arrival: sent - 0.5,
            sent: Some(sent),
            first_token: tokens.first().copied(),
            token_times: tokens.to_vec(),
            finish: tokens.last().copied(),
            input_tokens: 100,
            output_tokens: tokens.len(),
            cached_tokens: 40,
            preemptions: 0,
            error: None,
        }
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let s = Summary::of((1..=100).map(f64::from).collect());
        assert_eq!(
            (s.p50, s.p90, s.p99, s.max, s.mean),
            (50.0, 90.0, 99.0, 100.0, 50.5)
        );
        assert_eq!(Summary::of(vec![]), Summary::default());
        assert_eq!(Summary::of(vec![3.0]).p99, 3.0);
    }

    #[test]
    fn stage_metrics_follow_inference_perf_definitions() {
        let load = LoadSpec {
            stages: vec![
                Stage {
                    rate: 1.0,
                    duration_s: 10.0,
                },
                Stage {
                    rate: 2.0,
                    duration_s: 10.0,
                },
            ],
            seed: 0,
            max_in_flight: None,
        };
        let mut failed = record(1, 12.0, &[]);
        failed.error = Some("boom".into());
        let outcome = FleetOutcome {
            records: vec![
                record(0, 1.0, &[2.0, 3.0, 5.0]),
                record(0, 8.0, &[9.0, 11.0]),
                failed,
            ],
            pods: vec![],
            end_time: 11.0,
        };
        let report = summarize("rr", &load, &outcome);
        let s0 = &report.stages[0];
        assert_eq!((s0.requests, s0.failures), (2, 0));
        assert_eq!(s0.ttft.p50, 1.0);
        assert_eq!(s0.e2e.max, 4.0);
        assert_eq!(s0.tpot.p50, 1.5); // (5 - 2) / 2 and (11 - 9) / 1 = 2
        assert_eq!(s0.itl.count, 3);
        assert_eq!(s0.schedule_delay.mean, 0.5);
        assert_eq!(s0.cached_token_fraction, 0.4);
        // Stage 0's window [0, 10) saw one finish, two prefills and four tokens.
        assert_eq!(
            (s0.requests_per_s, s0.input_tokens_per_s, s0.output_tokens_per_s),
            (0.1, 20.0, 0.4)
        );
        let s1 = &report.stages[1];
        assert_eq!((s1.requests, s1.failures, s1.requests_per_s), (1, 1, 0.1));
        assert_eq!(s1.ttft.count, 0);
    }
}
