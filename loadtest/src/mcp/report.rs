//! Tallies of one load run and the printed/JSON report, in the style of `http::compare`:
//! several targets, each compared with the first.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;

use super::client::Failure;

/// Outcomes of the calls against one target (all rounds merged).
pub struct Tally {
    pub ok: u64,
    pub failures: BTreeMap<String, u64>,
    /// Call latency in microseconds, successful calls only.
    pub latency_us: Histogram<u64>,
    pub elapsed: Duration,
}

impl Tally {
    pub fn new() -> anyhow::Result<Tally> {
        Ok(Tally {
            ok: 0,
            failures: BTreeMap::new(),
            // 1 µs .. 60 s at 3 significant digits.
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).context("creating latency histogram")?,
            elapsed: Duration::ZERO,
        })
    }

    pub fn record(&mut self, outcome: Result<Duration, Failure>) {
        match outcome {
            Ok(latency) => {
                self.ok += 1;
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
                self.latency_us.saturating_record(micros);
            }
            Err(failure) => *self.failures.entry(failure.kind()).or_default() += 1,
        }
    }

    pub fn merge(&mut self, other: &Tally) -> anyhow::Result<()> {
        self.ok += other.ok;
        for (kind, count) in &other.failures {
            *self.failures.entry(kind.clone()).or_default() += count;
        }
        self.elapsed += other.elapsed;
        self.latency_us
            .add(&other.latency_us)
            .context("merging latency histograms")
    }

    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }
}

#[derive(Debug, Serialize)]
pub struct McpTargetReport {
    pub name: String,
    pub url: String,
    pub ok: u64,
    pub failed: u64,
    /// Failure kind (`connect`, `io`, `timeout`, `http_404`, `rpc_-32602`, `mismatch`,
    /// `overload`, …) → count.
    pub failures: BTreeMap<String, u64>,
    /// Successful calls per second.
    pub rps: f64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// Against the baseline (the first target); 0 / 1.0 for the baseline itself.
    pub added_p50_us: i64,
    pub added_p99_us: i64,
    pub rps_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct McpReport {
    /// One line saying what ran (era, operation, loop, connection handling).
    pub scenario: String,
    pub duration_per_round_s: f64,
    pub rounds: usize,
    pub targets: Vec<McpTargetReport>,
}

impl McpReport {
    pub fn new(
        scenario: String,
        duration: Duration,
        rounds: usize,
        tallies: Vec<(String, String, Tally)>,
    ) -> McpReport {
        let mut targets: Vec<McpTargetReport> = tallies
            .into_iter()
            .map(|(name, url, tally)| {
                let seconds = tally.elapsed.as_secs_f64();
                let latency = &tally.latency_us;
                McpTargetReport {
                    name,
                    url,
                    ok: tally.ok,
                    failed: tally.failed(),
                    rps: if seconds > 0.0 {
                        tally.ok as f64 / seconds
                    } else {
                        0.0
                    },
                    mean_us: if tally.ok > 0 { latency.mean() } else { 0.0 },
                    p50_us: latency.value_at_quantile(0.50),
                    p90_us: latency.value_at_quantile(0.90),
                    p99_us: latency.value_at_quantile(0.99),
                    max_us: latency.max(),
                    failures: tally.failures,
                    added_p50_us: 0,
                    added_p99_us: 0,
                    rps_ratio: 1.0,
                }
            })
            .collect();
        if let Some((p50, p99, rps)) = targets.first().map(|t| (t.p50_us, t.p99_us, t.rps)) {
            for target in &mut targets {
                target.added_p50_us = target.p50_us as i64 - p50 as i64;
                target.added_p99_us = target.p99_us as i64 - p99 as i64;
                target.rps_ratio = if rps > 0.0 { target.rps / rps } else { 0.0 };
            }
        }
        McpReport {
            scenario,
            duration_per_round_s: duration.as_secs_f64(),
            rounds,
            targets,
        }
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>10} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>8}  failures",
            "target",
            "req/s",
            "p50 µs",
            "p90 µs",
            "p99 µs",
            "mean µs",
            "+p50 µs",
            "+p99 µs",
            "ratio",
            "failed"
        );
        for t in &self.targets {
            let failures: Vec<String> = t
                .failures
                .iter()
                .map(|(kind, count)| format!("{kind}={count}"))
                .collect();
            let _ = writeln!(
                out,
                "{:<10} {:>10.0} {:>8} {:>8} {:>8} {:>9.0} {:>8} {:>8} {:>7.3} {:>8}  {}",
                t.name,
                t.rps,
                t.p50_us,
                t.p90_us,
                t.p99_us,
                t.mean_us,
                t.added_p50_us,
                t.added_p99_us,
                t.rps_ratio,
                t.failed,
                failures.join(" ")
            );
        }
        if let Some(first) = self.targets.first() {
            let _ = writeln!(
                out,
                "{}; {} round(s) x {:.0}s per target; baseline: {}",
                self.scenario, self.rounds, self.duration_per_round_s, first.name
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_against_the_first_target() -> anyhow::Result<()> {
        let mut direct = Tally::new()?;
        let mut proxied = Tally::new()?;
        for _ in 0..100 {
            direct.record(Ok(Duration::from_micros(100)));
            proxied.record(Ok(Duration::from_micros(150)));
        }
        proxied.record(Err(Failure::Timeout));
        direct.elapsed = Duration::from_secs(1);
        proxied.elapsed = Duration::from_secs(2);
        let report = McpReport::new(
            "test".into(),
            Duration::from_secs(1),
            1,
            vec![
                ("direct".into(), "u1".into(), direct),
                ("proxy".into(), "u2".into(), proxied),
            ],
        );
        let proxy = &report.targets[1];
        assert!((proxy.rps_ratio - 0.5).abs() < 1e-9);
        assert_eq!(proxy.added_p50_us, 50);
        assert_eq!(proxy.failures.get("timeout"), Some(&1));
        assert!(report.table().contains("timeout=1"));
        Ok(())
    }
}
