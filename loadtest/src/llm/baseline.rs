//! The shared baseline comparison ([`crate::baseline`]) applied per stage: each target's
//! stage is compared with the baseline's (the first target's) stage of the same index.

use super::report::{StageReport, TargetReport};
use crate::baseline::{Side, VsBaseline};

/// Fills `vs_baseline` in every stage of every target (the baseline gets +0 and 1.0).
pub fn compare(targets: &mut [TargetReport]) {
    let Some(baseline) = targets.first().map(|t| t.stages.clone()) else {
        return;
    };
    for target in targets {
        for (stage, base) in target.stages.iter_mut().zip(&baseline) {
            stage.vs_baseline = Some(VsBaseline::between(&side(stage), &side(base)));
        }
    }
}

fn side(stage: &StageReport) -> Side {
    let latency = &stage.successes.latency.request_latency;
    Side {
        successes: stage.successes.count as u64,
        p50_s: latency.p50,
        p99_s: latency.p99,
        requests_per_sec: stage.successes.throughput.requests_per_sec,
    }
}
