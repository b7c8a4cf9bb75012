use std::fmt::Write as _;
use std::time::Duration;

use http::Uri;
use serde::Serialize;

use super::loadgen::{closed_loop, Measurement};
use crate::baseline::{or_dash, Side, VsBaseline};

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
    /// Latency-phase quantiles; absent when no request of that phase succeeded (the empty
    /// histogram would report 0, which reads as "no latency at all").
    pub p50_us: Option<u64>,
    pub p90_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub latency_phase_rps: f64,
    pub throughput_connections: usize,
    pub max_rps: f64,
    pub throughput_p99_us: Option<u64>,
    pub errors: u64,
    /// Against the baseline (the first target): latency from the latency phase, requests/s
    /// from the throughput phase.
    pub vs_baseline: VsBaseline,
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
    let mut measured = Vec::new();
    for (index, (name, _)) in options.targets.iter().enumerate() {
        let (Some(low), Some(high)) = (&latency[index], &throughput[index]) else {
            anyhow::bail!("no measurement for {name}");
        };
        measured.push((low, high));
    }
    let Some(&(base_low, base_high)) = measured.first() else {
        anyhow::bail!("at least one target is needed");
    };
    let base = side(base_low, base_high);
    let targets = options
        .targets
        .iter()
        .zip(measured)
        .map(|((name, url), (low, high))| TargetReport {
            name: name.clone(),
            url: url.to_string(),
            latency_connections: options.latency_connections,
            p50_us: quantile_us(low, 0.50),
            p90_us: quantile_us(low, 0.90),
            p99_us: quantile_us(low, 0.99),
            latency_phase_rps: low.requests_per_second(),
            throughput_connections: options.throughput_connections,
            max_rps: high.requests_per_second(),
            throughput_p99_us: quantile_us(high, 0.99),
            errors: low.errors + high.errors,
            vs_baseline: VsBaseline::between(&side(low, high), &base),
        })
        .collect();
    Ok(Report {
        duration_per_phase_s: options.duration.as_secs_f64(),
        rounds: options.rounds,
        targets,
    })
}

/// `q`-quantile of the successful requests' latency; `None` when there were none.
fn quantile_us(measurement: &Measurement, q: f64) -> Option<u64> {
    (measurement.ok > 0).then(|| measurement.latency_us.value_at_quantile(q))
}

fn side(low: &Measurement, high: &Measurement) -> Side {
    let seconds = |q| low.latency_us.value_at_quantile(q) as f64 / 1e6;
    Side {
        successes: low.ok,
        p50_s: seconds(0.50),
        p99_s: seconds(0.99),
        requests_per_sec: high.requests_per_second(),
    }
}

impl Report {
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>8} {:>8} {:>8} {:>11} {:>11} {:>9} {:>12} {:>7}",
            "target", "p50 µs", "p99 µs", "+p50 µs", "+p99 µs", "max req/s", "ratio", "p99@max µs", "errors"
        );
        let us = |x: Option<u64>| or_dash(x, |v| v.to_string());
        // Rounded to whole µs (the histograms' unit), so the float noise of the seconds round
        // trip neither truncates 150 to 149 nor prints "-0".
        let added_us = |x: Option<f64>| or_dash(x, |s| ((s * 1e6).round() as i64).to_string());
        for t in &self.targets {
            let vs = &t.vs_baseline;
            let _ = writeln!(
                out,
                "{:<10} {:>8} {:>8} {:>8} {:>11} {:>11.0} {:>9} {:>12} {:>7}",
                t.name,
                us(t.p50_us),
                us(t.p99_us),
                added_us(vs.added_p50_s),
                added_us(vs.added_p99_s),
                t.max_rps,
                or_dash(vs.requests_per_sec_ratio, |r| format!("{r:.3}")),
                us(t.throughput_p99_us),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn target(name: &str, p50_us: Option<u64>, vs_baseline: VsBaseline) -> TargetReport {
        TargetReport {
            name: name.into(),
            url: "http://127.0.0.1:1/".into(),
            latency_connections: 1,
            p50_us,
            p90_us: p50_us,
            p99_us: p50_us,
            latency_phase_rps: 0.0,
            throughput_connections: 8,
            max_rps: 0.0,
            throughput_p99_us: p50_us,
            errors: 0,
            vs_baseline,
        }
    }

    #[test]
    fn a_target_without_successes_shows_dashes_not_zeros() {
        let report = Report {
            duration_per_phase_s: 1.0,
            rounds: 1,
            targets: vec![
                target(
                    "direct",
                    Some(100),
                    VsBaseline {
                        added_p50_s: Some(0.0),
                        added_p99_s: Some(-4e-7),
                        requests_per_sec_ratio: Some(1.0),
                    },
                ),
                target(
                    "down",
                    None,
                    VsBaseline {
                        added_p50_s: None,
                        added_p99_s: None,
                        requests_per_sec_ratio: None,
                    },
                ),
            ],
        };
        let table = report.table();
        let rows: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(rows[1][..7], ["direct", "100", "100", "0", "0", "0", "1.000"]);
        assert_eq!(rows[2][..7], ["down", "-", "-", "-", "-", "0", "-"]);
    }
}
