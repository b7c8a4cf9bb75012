//! Ratios against a baseline measured in the same run, as every Portcullis benchmark reports
//! them: the first target (typically the upstream reached directly) is the baseline, and each
//! target's stage is compared with the baseline's stage of the same index.

use serde::Serialize;

use super::report::{StageReport, TargetReport};

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct VsBaseline {
    /// p50 end-to-end latency minus the baseline's, seconds; absent when either side had no
    /// successful request (a difference with nothing would be a made-up number).
    pub added_p50_s: Option<f64>,
    pub added_p99_s: Option<f64>,
    /// requests/s over the baseline's; absent when the baseline completed nothing.
    pub requests_per_sec_ratio: Option<f64>,
}

/// Fills `vs_baseline` in every stage of every target (the baseline gets +0 and 1.0).
pub fn compare(targets: &mut [TargetReport]) {
    let Some(baseline) = targets.first().map(|t| t.stages.clone()) else {
        return;
    };
    for target in targets {
        for (stage, base) in target.stages.iter_mut().zip(&baseline) {
            stage.vs_baseline = Some(versus(stage, base));
        }
    }
}

fn versus(stage: &StageReport, base: &StageReport) -> VsBaseline {
    let both = stage.successes.count > 0 && base.successes.count > 0;
    let (ours, theirs) = (
        &stage.successes.latency.request_latency,
        &base.successes.latency.request_latency,
    );
    let base_rps = base.successes.throughput.requests_per_sec;
    VsBaseline {
        added_p50_s: both.then_some(ours.p50 - theirs.p50),
        added_p99_s: both.then_some(ours.p99 - theirs.p99),
        requests_per_sec_ratio: (base_rps > 0.0)
            .then(|| stage.successes.throughput.requests_per_sec / base_rps),
    }
}

/// `vs base: +p50 1.2ms +p99 3.4ms x0.97` for the summary lines; `-` where absent.
pub fn describe(vs: Option<&VsBaseline>) -> String {
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |s| format!("{:+.3}ms", s * 1e3));
    let ratio = vs
        .and_then(|v| v.requests_per_sec_ratio)
        .map_or("-".to_string(), |r| format!("x{r:.3}"));
    format!(
        "vs base: p50 {} p99 {} req/s {ratio}",
        ms(vs.and_then(|v| v.added_p50_s)),
        ms(vs.and_then(|v| v.added_p99_s)),
    )
}
