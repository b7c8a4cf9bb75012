//! Drives a run: every target in turn, every stage in turn. Open-loop stages send on the
//! planned schedule, each request its own task so a slow target never slows the sender
//! down; closed-loop stages run `clients` tasks that each send, await and send again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::baseline;
use super::client::FailureKind;
use super::config::{LoadKind, LoadtestConfig, StageConfig, Target};
use super::prompts::schedule;
use super::report::{summarize_stage, Record, Report, StageReport, TargetReport};
use super::workload::Workload;

/// Refused connections fail in microseconds; a closed-loop client waits this long before
/// retrying so a dead target does not turn into a busy loop.
const CONNECT_BACKOFF: Duration = Duration::from_millis(10);

/// Runs every target of `config`; `progress` shows a bar per target on a terminal.
pub async fn execute(config: &LoadtestConfig, progress: bool) -> anyhow::Result<Report> {
    let plan = schedule(&config.load);
    let mut targets = Vec::with_capacity(config.targets.len());
    for target in &config.targets {
        let bar = progress_bar(
            progress,
            config.load.kind,
            &target.name,
            plan.iter().map(Vec::len).sum(),
        );
        let workload = Workload::new(config, target).with_context(|| format!("target {}", target.name))?;
        let report = run_target(config, &workload, target, &plan, &bar).await;
        workload.finish().await;
        bar.finish();
        targets.push(report?);
    }
    baseline::compare(&mut targets);
    Ok(Report {
        config: config.clone(),
        baseline: config.targets.first().map(|t| t.name.clone()).unwrap_or_default(),
        targets,
    })
}

fn progress_bar(progress: bool, kind: LoadKind, name: &str, total: usize) -> ProgressBar {
    if !progress {
        return ProgressBar::hidden();
    }
    // A closed loop's request count is not known in advance: count without a bar.
    let (bar, template) = match kind {
        LoadKind::ClosedLoop => (
            ProgressBar::no_length(),
            "{prefix:>12} [{elapsed_precise}] {pos} requests {msg}",
        ),
        _ => (
            ProgressBar::new(total as u64),
            "{prefix:>12} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
        ),
    };
    let bar = bar.with_prefix(name.to_string());
    // The template is a constant; a failure would only mean an indicatif API change.
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

async fn run_target(
    config: &LoadtestConfig,
    workload: &Workload,
    target: &Target,
    plan: &[Vec<f64>],
    bar: &ProgressBar,
) -> anyhow::Result<TargetReport> {
    let limit = config.load.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let epoch = Instant::now();
    let mut stages = Vec::with_capacity(plan.len());
    for (index, (offsets, stage)) in plan.iter().zip(&config.load.stages).enumerate() {
        bar.set_message(format!(
            "stage {}/{} {}",
            index + 1,
            plan.len(),
            load_label(stage)
        ));
        let start = epoch.elapsed().as_secs_f64();
        let records = match stage.clients {
            Some(clients) => closed_loop(workload, clients, epoch, start, stage, bar).await?,
            None => open_loop(workload, offsets, limit.clone(), epoch, start, stage, bar).await?,
        };
        stages.push(summarize_stage(
            index,
            stage,
            start,
            &records,
            workload.has_tokens(),
        ));
    }
    Ok(TargetReport {
        name: target.name.clone(),
        url: target.url.clone(),
        stages,
    })
}

async fn open_loop(
    workload: &Workload,
    offsets: &[f64],
    limit: Option<Arc<Semaphore>>,
    epoch: Instant,
    start: f64,
    stage: &StageConfig,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Record>> {
    let mut tasks = JoinSet::new();
    for &offset in offsets {
        let scheduled = start + offset;
        tokio::time::sleep_until(at(epoch, scheduled)).await;
        let request = workload.next(epoch);
        let (limit, bar) = (limit.clone(), bar.clone());
        tasks.spawn(async move {
            // Held until the response ends; the semaphore is never closed, so acquiring
            // fails only if that invariant breaks, and then the request goes unlimited.
            let _permit = match limit {
                Some(limit) => limit.acquire_owned().await.ok(),
                None => None,
            };
            let trace = request.await;
            bar.inc(1);
            Record { scheduled, trace }
        });
    }
    // A stage lasts at least its configured duration, then drains (see `report`).
    tokio::time::sleep_until(at(epoch, start + stage.duration.as_secs_f64())).await;
    let mut records = Vec::with_capacity(offsets.len());
    while let Some(record) = tasks.join_next().await {
        records.push(record.context("request task panicked")?);
    }
    Ok(records)
}

async fn closed_loop(
    workload: &Workload,
    clients: usize,
    epoch: Instant,
    start: f64,
    stage: &StageConfig,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<Record>> {
    let end = at(epoch, start + stage.duration.as_secs_f64());
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let (workload, bar) = (workload.clone(), bar.clone());
        tasks.spawn(async move {
            let mut records = Vec::new();
            // The request in flight at the end completes and counts: the stage drains.
            while tokio::time::Instant::now() < end {
                let trace = workload.next(epoch).await;
                bar.inc(1);
                let refused = trace
                    .failure
                    .as_ref()
                    .is_some_and(|f| f.kind == FailureKind::Connect.name());
                // No schedule in a closed loop: each request is "planned" when it is sent.
                records.push(Record {
                    scheduled: trace.sent,
                    trace,
                });
                if refused {
                    tokio::time::sleep(CONNECT_BACKOFF).await;
                }
            }
            records
        });
    }
    let mut records = Vec::new();
    while let Some(client) = tasks.join_next().await {
        records.extend(client.context("client task panicked")?);
    }
    Ok(records)
}

fn at(epoch: Instant, secs: f64) -> tokio::time::Instant {
    tokio::time::Instant::from_std(epoch + Duration::from_secs_f64(secs))
}

fn load_label(stage: &StageConfig) -> String {
    match (stage.clients, stage.rate) {
        (Some(clients), _) => format!("{clients:>4} clients"),
        (None, rate) => format!("{:>6.2} req/s", rate.unwrap_or(0.0)),
    }
}

/// A short human summary of one stage, printed after the run.
pub fn describe(target: &str, s: &StageReport) -> String {
    let load = match (s.load_summary.clients, s.load_summary.requested_rate) {
        (Some(clients), _) => format!("clients {clients:>4}"),
        (None, rate) => format!("rate {:>6.2}", rate.unwrap_or(0.0)),
    };
    let e2e = &s.successes.latency.request_latency;
    let tokens = match (&s.successes.latency.tokens, &s.successes.throughput.tokens) {
        (Some(l), Some(t)) => format!(
            " {:>9.1} out tok/s  TTFT p50 {:>8.3}s p99 {:>8.3}s  ITL p50 {:>7.4}s ",
            t.output_tokens_per_sec,
            l.time_to_first_token.p50,
            l.time_to_first_token.p99,
            l.inter_token_latency.p50,
        ),
        _ => String::new(),
    };
    let failures: Vec<String> = s
        .failures
        .by_kind
        .iter()
        .map(|(kind, n)| format!("{kind}={n}"))
        .collect();
    format!(
        "{target:>12} stage {:>2} {load}: {:>8.2} req/s{tokens} E2E p50 {:>8.4}s p99 {:>8.4}s  {}  failures {} {}",
        s.stage,
        s.successes.throughput.requests_per_sec,
        e2e.p50,
        e2e.p99,
        crate::baseline::describe(s.vs_baseline.as_ref()),
        s.failures.count,
        failures.join(" "),
    )
}
