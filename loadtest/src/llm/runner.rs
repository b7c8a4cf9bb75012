//! Drives a run: every target in turn, every stage in turn, open-loop arrivals on the planned
//! schedule, each request its own task so a slow target never slows the sender down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::client::Sender;
use super::config::{LoadtestConfig, Target};
use super::prompts::{schedule, text_of, PromptGen};
use super::report::{summarize_stage, Record, Report, StageReport, TargetReport};

/// Runs every target of `config`; `progress` shows a bar per target on a terminal.
pub async fn execute(config: &LoadtestConfig, progress: bool) -> anyhow::Result<Report> {
    let plan = schedule(&config.load);
    let total: usize = plan.iter().map(Vec::len).sum();
    let mut targets = Vec::with_capacity(config.targets.len());
    for target in &config.targets {
        let bar = if progress {
            progress_bar(&target.name, total)
        } else {
            ProgressBar::hidden()
        };
        let report = run_target(config, target, &plan, &bar).await?;
        bar.finish();
        targets.push(report);
    }
    Ok(Report {
        config: config.clone(),
        targets,
    })
}

fn progress_bar(name: &str, total: usize) -> ProgressBar {
    let bar = ProgressBar::new(total as u64).with_prefix(name.to_string());
    // The template is a constant; a failure would only mean an indicatif API change.
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>12} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
    {
        bar.set_style(style);
    }
    bar
}

async fn run_target(
    config: &LoadtestConfig,
    target: &Target,
    plan: &[Vec<f64>],
    bar: &ProgressBar,
) -> anyhow::Result<TargetReport> {
    let sender = Arc::new(
        Sender::new(&target.url, config.api, &config.model, config.request_timeout)
            .with_context(|| format!("target {}", target.name))?,
    );
    // A fresh generator per target: every target gets the same prompts in the same order.
    let mut prompts = PromptGen::new(&config.data, config.load.seed);
    let limit = config.load.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let epoch = Instant::now();
    let mut stages = Vec::with_capacity(plan.len());
    for (index, (offsets, stage)) in plan.iter().zip(&config.load.stages).enumerate() {
        bar.set_message(format!(
            "stage {}/{} at {} req/s",
            index + 1,
            plan.len(),
            stage.rate
        ));
        let start = epoch.elapsed().as_secs_f64();
        let mut tasks = JoinSet::new();
        for &offset in offsets {
            let scheduled = start + offset;
            tokio::time::sleep_until(at(epoch, scheduled)).await;
            let (ids, max_tokens) = prompts.next_prompt();
            let (sender, limit, bar) = (sender.clone(), limit.clone(), bar.clone());
            tasks.spawn(async move {
                // Held until the response ends; the semaphore is never closed, so acquiring
                // fails only if that invariant breaks, and then the request goes unlimited.
                let _permit = match limit {
                    Some(limit) => limit.acquire_owned().await.ok(),
                    None => None,
                };
                let prompt = ids.ids();
                let trace = sender
                    .send(&text_of(prompt), prompt.len(), max_tokens, epoch)
                    .await;
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
        stages.push(summarize_stage(
            index,
            stage.rate,
            start,
            stage.duration.as_secs_f64(),
            &records,
        ));
    }
    Ok(TargetReport {
        name: target.name.clone(),
        url: target.url.clone(),
        stages,
    })
}

fn at(epoch: Instant, secs: f64) -> tokio::time::Instant {
    tokio::time::Instant::from_std(epoch + Duration::from_secs_f64(secs))
}

/// A short human summary of one stage, printed after the run.
pub fn describe(target: &str, s: &StageReport) -> String {
    format!(
        "{target:>12} stage {:>2} rate {:>6.2}: {:>7.2} req/s {:>9.1} out tok/s  TTFT p50 {:>8.3}s p99 {:>8.3}s  ITL p50 {:>7.4}s  E2E p50 {:>8.3}s  failures {}",
        s.stage,
        s.load_summary.requested_rate,
        s.successes.throughput.requests_per_sec,
        s.successes.throughput.output_tokens_per_sec,
        s.successes.latency.time_to_first_token.p50,
        s.successes.latency.time_to_first_token.p99,
        s.successes.latency.inter_token_latency.p50,
        s.successes.latency.request_latency.p50,
        s.failures.count,
    )
}
