//! Per target × stage summaries, laid out like inference-perf's stage reports (reference §5.1:
//! `load_summary`, `successes.{latency,throughput}`, `failures`) with the simulator's metric
//! definitions and percentile maths (`sim::report::Summary`, seconds):
//! TTFT = first content chunk − send; ITL = gaps between content chunks;
//! TPOT = (E2E − TTFT)/(out − 1); normalized TPOT = E2E/out; E2E = end of response − send.
//!
//! Each stage is drained before the next starts, so a stage's throughput is what its own
//! requests delivered divided by the stage's wall time (first send slot to last completion),
//! which stays honest when a saturated target finishes long after the sending window.

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::{FailureKind, Trace};
use super::config::LoadtestConfig;
use crate::sim::report::Summary;

/// One request of a stage.
#[derive(Debug, Clone)]
pub struct Record {
    /// Planned send time, seconds since the target's epoch.
    pub scheduled: f64,
    pub trace: Trace,
}

/// Everything a run measured; written as `report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: LoadtestConfig,
    pub targets: Vec<TargetReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TargetReport {
    pub name: String,
    pub url: String,
    pub stages: Vec<StageReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    pub stage: usize,
    /// Wall time from the stage's start to its last completion (≥ the configured duration).
    pub duration: f64,
    pub load_summary: LoadSummary,
    pub successes: Successes,
    pub failures: Failures,
}

#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    /// Requests sent in the stage.
    pub count: usize,
    pub requested_rate: f64,
    /// `count / send_duration`.
    pub achieved_rate: f64,
    /// From the stage start to the last send (at least the configured duration).
    pub send_duration: f64,
    /// How late requests were sent, e.g. waiting for `max_concurrency`.
    pub schedule_delay: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Successes {
    pub count: usize,
    pub latency: Latency,
    pub throughput: Throughput,
    pub prompt_len: Summary,
    pub output_len: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub request_latency: Summary,
    pub normalized_time_per_output_token: Summary,
    pub time_per_output_token: Summary,
    pub time_to_first_token: Summary,
    pub inter_token_latency: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    pub input_tokens_per_sec: f64,
    pub output_tokens_per_sec: f64,
    pub total_tokens_per_sec: f64,
    pub requests_per_sec: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failures {
    pub count: usize,
    /// Failure kind → count, only kinds that occurred.
    pub by_kind: BTreeMap<&'static str, usize>,
    /// First message seen per kind, to tell *why* without a per-request log.
    pub examples: BTreeMap<&'static str, String>,
}

impl Failures {
    pub fn of_kind(&self, kind: FailureKind) -> usize {
        self.by_kind.get(kind.name()).copied().unwrap_or(0)
    }
}

/// Summarises the requests of one stage that started at `start` (seconds since the epoch).
pub fn summarize_stage(stage: usize, rate: f64, start: f64, planned: f64, records: &[Record]) -> StageReport {
    let ok: Vec<&Trace> = records
        .iter()
        .map(|r| &r.trace)
        .filter(|t| t.failure.is_none())
        .collect();
    let last_send = records
        .iter()
        .map(|r| r.trace.sent - start)
        .fold(planned, f64::max);
    let duration = records
        .iter()
        .map(|r| r.trace.finish - start)
        .fold(planned, f64::max);
    let mut failures = Failures {
        count: 0,
        by_kind: BTreeMap::new(),
        examples: BTreeMap::new(),
    };
    for failure in records.iter().filter_map(|r| r.trace.failure.as_ref()) {
        failures.count += 1;
        *failures.by_kind.entry(failure.kind.name()).or_default() += 1;
        failures
            .examples
            .entry(failure.kind.name())
            .or_insert_with(|| failure.message.clone());
    }
    let input: u64 = ok.iter().map(|t| t.input_tokens).sum();
    let output: u64 = ok.iter().map(|t| t.output_tokens).sum();
    let per_sec = |x: f64| x / duration;
    StageReport {
        stage,
        duration,
        load_summary: LoadSummary {
            count: records.len(),
            requested_rate: rate,
            achieved_rate: records.len() as f64 / last_send,
            send_duration: last_send,
            schedule_delay: Summary::of(records.iter().map(|r| r.trace.sent - r.scheduled).collect()),
        },
        successes: Successes {
            count: ok.len(),
            latency: latency(&ok),
            throughput: Throughput {
                input_tokens_per_sec: per_sec(input as f64),
                output_tokens_per_sec: per_sec(output as f64),
                total_tokens_per_sec: per_sec((input + output) as f64),
                requests_per_sec: per_sec(ok.len() as f64),
            },
            prompt_len: Summary::of(ok.iter().map(|t| t.input_tokens as f64).collect()),
            output_len: Summary::of(ok.iter().map(|t| t.output_tokens as f64).collect()),
        },
        failures,
    }
}

fn latency(ok: &[&Trace]) -> Latency {
    let e2e = |t: &Trace| t.finish - t.sent;
    Latency {
        request_latency: Summary::of(ok.iter().map(|t| e2e(t)).collect()),
        normalized_time_per_output_token: Summary::of(
            ok.iter()
                .filter(|t| t.output_tokens > 0)
                .map(|t| e2e(t) / t.output_tokens as f64)
                .collect(),
        ),
        time_per_output_token: Summary::of(
            ok.iter()
                .filter(|t| t.output_tokens > 1)
                .filter_map(|t| Some((t.finish - t.first_token?) / (t.output_tokens - 1) as f64))
                .collect(),
        ),
        time_to_first_token: Summary::of(ok.iter().filter_map(|t| Some(t.first_token? - t.sent)).collect()),
        inter_token_latency: Summary::of(
            ok.iter()
                .flat_map(|t| t.token_times.windows(2).map(|w| w[1] - w[0]))
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::client::Failure;

    fn record(sent: f64, tokens: &[f64], finish: f64) -> Record {
        Record {
            scheduled: sent - 0.25,
            trace: Trace {
                sent,
                first_token: tokens.first().copied(),
                token_times: tokens.to_vec(),
                finish,
                input_tokens: 100,
                output_tokens: tokens.len() as u64,
                failure: None,
            },
        }
    }

    #[test]
    fn stage_metrics_follow_inference_perf_definitions() {
        let mut failed = record(12.0, &[], 12.5);
        failed.trace.failure = Some(Failure {
            kind: FailureKind::Http5xx,
            message: "HTTP 503".into(),
        });
        let records = vec![
            record(10.0, &[11.0, 12.0, 14.0], 14.0),
            record(11.0, &[12.0, 14.0], 30.0),
            failed,
        ];
        let s = summarize_stage(0, 2.0, 10.0, 10.0, &records);
        assert_eq!(
            (s.load_summary.count, s.successes.count, s.failures.count),
            (3, 2, 1)
        );
        assert_eq!(s.failures.of_kind(FailureKind::Http5xx), 1);
        assert_eq!(s.failures.examples["http_5xx"], "HTTP 503");
        let l = &s.successes.latency;
        assert_eq!(l.time_to_first_token.p50, 1.0);
        assert_eq!(l.time_to_first_token.max, 1.0);
        assert_eq!(l.inter_token_latency.count, 3);
        assert_eq!(l.inter_token_latency.max, 2.0);
        // (14 - 11) / 2 = 1.5 and (30 - 12) / 1 = 18.
        assert_eq!(
            (l.time_per_output_token.p50, l.time_per_output_token.max),
            (1.5, 18.0)
        );
        assert_eq!(l.request_latency.max, 19.0);
        assert_eq!(l.normalized_time_per_output_token.max, 9.5);
        // The stage ran from t = 10 until the last completion at t = 30.
        assert_eq!(s.duration, 20.0);
        assert_eq!(s.successes.throughput.requests_per_sec, 0.1);
        assert_eq!(s.successes.throughput.output_tokens_per_sec, 0.25);
        assert_eq!(s.successes.throughput.input_tokens_per_sec, 10.0);
        assert_eq!(s.load_summary.schedule_delay.mean, 0.25);
        assert_eq!(s.load_summary.achieved_rate, 0.3);
    }
}
