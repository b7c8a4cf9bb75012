use std::fmt::Write as _;
use std::time::Duration;

use http::Uri;
use serde::Serialize;

use super::loadgen::{closed_loop, Measurement};

pub struct CompareOptions {
    /// (name, url); the first one is the baseline.
    pub targets: Vec<(String, Uri)>,
    /// Concurrency for the latency phase: low, so queueing does not hide the added latency.
    pub latency_connections: usize,
    /// Concurrency for the throughput phase: high enough to saturate the 2 cores.
    pub throughput_connections: usize,
    pub duration: Duration,
    /// Targets are interleaved round by round so that drift on a shared machine hits all alike.
    pub rounds: usize,
}

#[derive(Debug, Serialize)]
pub struct TargetReport {
    pub name: String,
    pub url: String,
    pub latency_connections: usize,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub latency_phase_rps: f64,
    pub throughput_connections: usize,
    pub max_rps: f64,
    pub throughput_p99_us: u64,
    pub errors: u64,
    /// Against the baseline (the first target); 0 for the baseline itself.
    pub added_p50_us: i64,
    pub added_p99_us: i64,
    pub rps_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub duration_per_phase_s: f64,
    pub rounds: usize,
    pub targets: Vec<TargetReport>,
}

pub async fn compare(options: &CompareOptions) -> anyhow::Result<Report> {
    anyhow::ensure!(!options.targets.is_empty(), "at least one target is needed");
    anyhow::ensure!(options.rounds > 0, "rounds must be at least 1");
    let mut latency: Vec<Option<Measurement>> = vec![None; options.targets.len()];
    let mut throughput: Vec<Option<Measurement>> = vec![None; options.targets.len()];
    for round in 0..options.rounds {
        for (index, (name, url)) in options.targets.iter().enumerate() {
            for (phase, connections, slot) in [
                ("latency", options.latency_connections, &mut latency),
                ("throughput", options.throughput_connections, &mut throughput),
            ] {
                eprintln!(
                    "round {}/{} {name:<10} {phase:<10} c={connections}",
                    round + 1,
                    options.rounds
                );
                let measurement = closed_loop(url, connections, options.duration).await?;
                match &mut slot[index] {
                    Some(total) => total.merge(&measurement)?,
                    None => slot[index] = Some(measurement),
                }
            }
        }
    }
    let mut targets = Vec::new();
    for (index, (name, url)) in options.targets.iter().enumerate() {
        let (Some(low), Some(high)) = (&latency[index], &throughput[index]) else {
            anyhow::bail!("no measurement for {name}");
        };
        targets.push(TargetReport {
            name: name.clone(),
            url: url.to_string(),
            latency_connections: options.latency_connections,
            p50_us: low.latency_us.value_at_quantile(0.50),
            p90_us: low.latency_us.value_at_quantile(0.90),
            p99_us: low.latency_us.value_at_quantile(0.99),
            latency_phase_rps: low.requests_per_second(),
            throughput_connections: options.throughput_connections,
            max_rps: high.requests_per_second(),
            throughput_p99_us: high.latency_us.value_at_quantile(0.99),
            errors: low.errors + high.errors,
            added_p50_us: 0,
            added_p99_us: 0,
            rps_ratio: 1.0,
        });
    }
    let (base_p50, base_p99, base_rps) = (targets[0].p50_us, targets[0].p99_us, targets[0].max_rps);
    for target in &mut targets {
        target.added_p50_us = target.p50_us as i64 - base_p50 as i64;
        target.added_p99_us = target.p99_us as i64 - base_p99 as i64;
        target.rps_ratio = if base_rps > 0.0 {
            target.max_rps / base_rps
        } else {
            0.0
        };
    }
    Ok(Report {
        duration_per_phase_s: options.duration.as_secs_f64(),
        rounds: options.rounds,
        targets,
    })
}

impl Report {
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>8} {:>8} {:>8} {:>11} {:>11} {:>9} {:>12} {:>7}",
            "target", "p50 µs", "p99 µs", "+p50 µs", "+p99 µs", "max req/s", "ratio", "p99@max µs", "errors"
        );
        for t in &self.targets {
            let _ = writeln!(
                out,
                "{:<10} {:>8} {:>8} {:>8} {:>11} {:>11.0} {:>9.3} {:>12} {:>7}",
                t.name,
                t.p50_us,
                t.p99_us,
                t.added_p50_us,
                t.added_p99_us,
                t.max_rps,
                t.rps_ratio,
                t.throughput_p99_us,
                t.errors
            );
        }
        if let Some(first) = self.targets.first() {
            let _ = writeln!(
                out,
                "latency at {} connection(s), max req/s at {} connections; {} round(s) x {:.0}s per phase; baseline: {}",
                first.latency_connections, first.throughput_connections, self.rounds, self.duration_per_phase_s, first.name
            );
        }
        out
    }
}
