//! Per target × stage summaries, laid out like inference-perf's stage reports
//! (kubernetes-sigs/inference-perf, `docs/reports.md`: `load_summary`,
//! `successes.{latency,throughput}`, `failures`) with the simulator's metric
//! definitions and percentile maths (`sim::report::Summary`, seconds):
//! TTFT = first content chunk − send; ITL = gaps between content chunks;
//! TPOT = (E2E − TTFT)/(out − 1); normalized TPOT = E2E/out; E2E = end of response − send.
//! MCP stages have E2E call latency and requests/s only: the token metrics are absent.
//!
//! Each stage is drained before the next starts, so a stage's throughput is what its own
//! requests delivered divided by the stage's wall time (first send slot to last completion),
//! which stays honest when a saturated target finishes long after the sending window.

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::Trace;
use super::config::{LoadtestConfig, StageConfig};
use crate::baseline::VsBaseline;
use crate::sim::report::Summary;

/// One request of a stage.
#[derive(Debug, Clone)]
pub struct Record {
    /// Planned send time, seconds since the target's epoch (the send time in a closed loop).
    pub scheduled: f64,
    pub trace: Trace,
}

/// Everything a run measured; written as `report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: LoadtestConfig,
    /// The first target: every stage's `vs_baseline` compares with its stage of the same index.
    pub baseline: String,
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
    /// Filled in once every target has run (see [`super::baseline`]).
    pub vs_baseline: Option<VsBaseline>,
    /// The stage cut into [`TIMELINE_SLICES`] slices by send time: shows a blip (a replica
    /// killed mid-run) that the stage's percentiles average away.
    pub timeline: Vec<TimelinePoint>,
}

/// One slice of a stage: the requests sent in it and how they went.
#[derive(Debug, Clone, Serialize)]
pub struct TimelinePoint {
    /// Seconds from the stage's start to the slice's start.
    pub at: f64,
    pub requests: usize,
    pub failures: usize,
    /// End-to-end latency of the slice's successes, seconds (0 without any).
    pub p50: f64,
    pub p99: f64,
}

pub const TIMELINE_SLICES: usize = 50;

#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    /// Requests sent in the stage.
    pub count: usize,
    /// Open loop only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested_rate: Option<f64>,
    /// Closed loop only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clients: Option<usize>,
    /// `count / send_duration`.
    pub achieved_rate: f64,
    /// From the stage start to the last send (at least the configured duration).
    pub send_duration: f64,
    /// How late requests were sent, e.g. waiting for `max_concurrency` (0 in a closed loop).
    pub schedule_delay: Summary,
}

impl LoadSummary {
    /// The x of the charts: the requested rate, or in a closed loop the achieved rate, which
    /// is the rate its clients offered (clients alone say nothing about load).
    pub fn offered_rate(&self) -> f64 {
        self.requested_rate.unwrap_or(self.achieved_rate)
    }
}

/// The token fields are LLM-only: absent (not zero) for MCP stages.
#[derive(Debug, Clone, Serialize)]
pub struct Successes {
    pub count: usize,
    pub latency: Latency,
    pub throughput: Throughput,
    #[serde(flatten)]
    pub lengths: Option<Lengths>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Lengths {
    pub prompt_len: Summary,
    pub output_len: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// End to end: send to the end of the response (MCP: of the call, including opening a
    /// connection and session when one is opened for it).
    pub request_latency: Summary,
    #[serde(flatten)]
    pub tokens: Option<TokenLatency>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenLatency {
    pub normalized_time_per_output_token: Summary,
    pub time_per_output_token: Summary,
    pub time_to_first_token: Summary,
    pub inter_token_latency: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    pub requests_per_sec: f64,
    #[serde(flatten)]
    pub tokens: Option<TokenThroughput>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenThroughput {
    pub input_tokens_per_sec: f64,
    pub output_tokens_per_sec: f64,
    pub total_tokens_per_sec: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failures {
    pub count: usize,
    /// Failure kind → count, only kinds that occurred.
    pub by_kind: BTreeMap<String, usize>,
    /// First message seen per kind, to tell *why* without a per-request log.
    pub examples: BTreeMap<String, String>,
}

impl Failures {
    pub fn of_kind(&self, kind: &str) -> usize {
        self.by_kind.get(kind).copied().unwrap_or(0)
    }
}

/// Summarises the requests of one stage that started at `start` (seconds since the epoch);
/// `tokens` says whether the token metrics apply (LLM) or are left out (MCP).
pub fn summarize_stage(
    stage: usize,
    config: &StageConfig,
    start: f64,
    records: &[Record],
    tokens: bool,
) -> StageReport {
    let planned = config.duration.as_secs_f64();
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
        *failures.by_kind.entry(failure.kind.clone()).or_default() += 1;
        failures
            .examples
            .entry(failure.kind.clone())
            .or_insert_with(|| failure.message.clone());
    }
    let input: u64 = ok.iter().map(|t| t.input_tokens).sum();
    let output: u64 = ok.iter().map(|t| t.output_tokens).sum();
    let per_sec = |x: f64| x / duration;
    let e2e = Summary::of(ok.iter().map(|t| t.finish - t.sent).collect());
    StageReport {
        stage,
        duration,
        load_summary: LoadSummary {
            count: records.len(),
            requested_rate: config.rate,
            clients: config.clients,
            achieved_rate: records.len() as f64 / last_send,
            send_duration: last_send,
            schedule_delay: Summary::of(records.iter().map(|r| r.trace.sent - r.scheduled).collect()),
        },
        successes: Successes {
            count: ok.len(),
            latency: Latency {
                request_latency: e2e,
                tokens: tokens.then(|| token_latency(&ok)),
            },
            throughput: Throughput {
                requests_per_sec: per_sec(ok.len() as f64),
                tokens: tokens.then(|| TokenThroughput {
                    input_tokens_per_sec: per_sec(input as f64),
                    output_tokens_per_sec: per_sec(output as f64),
                    total_tokens_per_sec: per_sec((input + output) as f64),
                }),
            },
            lengths: tokens.then(|| Lengths {
                prompt_len: Summary::of(ok.iter().map(|t| t.input_tokens as f64).collect()),
                output_len: Summary::of(ok.iter().map(|t| t.output_tokens as f64).collect()),
            }),
        },
        failures,
        vs_baseline: None,
        timeline: timeline(planned, start, records),
    }
}

fn timeline(planned: f64, start: f64, records: &[Record]) -> Vec<TimelinePoint> {
    let width = (planned / TIMELINE_SLICES as f64).max(1e-3);
    let mut slices: Vec<(usize, Vec<f64>)> = vec![(0, Vec::new()); TIMELINE_SLICES];
    for record in records {
        // Requests sent after the planned end (an open loop catching up) go in the last slice.
        let index = (((record.trace.sent - start) / width).max(0.0) as usize).min(TIMELINE_SLICES - 1);
        match &record.trace.failure {
            Some(_) => slices[index].0 += 1,
            None => slices[index].1.push(record.trace.finish - record.trace.sent),
        }
    }
    slices
        .into_iter()
        .enumerate()
        .map(|(index, (failures, latencies))| {
            let requests = failures + latencies.len();
            let latency = Summary::of(latencies);
            TimelinePoint {
                at: index as f64 * width,
                requests,
                failures,
                p50: latency.p50,
                p99: latency.p99,
            }
        })
        .collect()
}

fn token_latency(ok: &[&Trace]) -> TokenLatency {
    let e2e = |t: &Trace| t.finish - t.sent;
    TokenLatency {
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
    use std::time::Duration;

    use super::*;
    use crate::llm::client::{Failure, FailureKind};

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
        failed.trace.failure = Some(Failure::named("http_5xx".into(), "HTTP 503".into()));
        let records = vec![
            record(10.0, &[11.0, 12.0, 14.0], 14.0),
            record(11.0, &[12.0, 14.0], 30.0),
            failed,
        ];
        let stage = StageConfig {
            rate: Some(2.0),
            clients: None,
            duration: Duration::from_secs(10),
        };
        let s = summarize_stage(0, &stage, 10.0, &records, true);
        assert_eq!(
            (s.load_summary.count, s.successes.count, s.failures.count),
            (3, 2, 1)
        );
        assert_eq!(s.failures.of_kind(FailureKind::Http5xx.name()), 1);
        assert_eq!(s.failures.examples["http_5xx"], "HTTP 503");
        let Some(l) = &s.successes.latency.tokens else {
            panic!("LLM stages have token latencies");
        };
        assert_eq!(l.time_to_first_token.p50, 1.0);
        assert_eq!(l.time_to_first_token.max, 1.0);
        assert_eq!(l.inter_token_latency.count, 3);
        assert_eq!(l.inter_token_latency.max, 2.0);
        // (14 - 11) / 2 = 1.5 and (30 - 12) / 1 = 18.
        assert_eq!(
            (l.time_per_output_token.p50, l.time_per_output_token.max),
            (1.5, 18.0)
        );
        assert_eq!(s.successes.latency.request_latency.max, 19.0);
        assert_eq!(l.normalized_time_per_output_token.max, 9.5);
        // The stage ran from t = 10 until the last completion at t = 30.
        assert_eq!(s.duration, 20.0);
        assert_eq!(s.successes.throughput.requests_per_sec, 0.1);
        let tokens = s
            .successes
            .throughput
            .tokens
            .as_ref()
            .map(|t| (t.output_tokens_per_sec, t.input_tokens_per_sec));
        assert_eq!(tokens, Some((0.25, 10.0)));
        assert_eq!(s.load_summary.schedule_delay.mean, 0.25);
        assert_eq!(s.load_summary.achieved_rate, 0.3);
        // MCP stages: the same latency and rate, and no token metrics at all.
        let mcp = summarize_stage(0, &stage, 10.0, &records, false);
        assert_eq!(mcp.successes.latency.request_latency.max, 19.0);
        assert!(mcp.successes.latency.tokens.is_none() && mcp.successes.lengths.is_none());
        let json = serde_json::to_value(&mcp.successes).expect("serializable");
        assert!(json.get("prompt_len").is_none() && json["latency"].get("time_to_first_token").is_none());
        assert_eq!(json["throughput"]["requests_per_sec"], 0.1);
    }
}
