//! Ratios against a baseline measured in the same run, as every Portcullis benchmark reports
//! them (`llm` per stage, for LLM and MCP runs): the first target — typically the upstream
//! reached directly — is the baseline.

use serde::Serialize;

/// What a comparison needs from one side of it.
#[derive(Debug, Clone, Copy)]
pub struct Side {
    /// Successful requests; the latency quantiles mean nothing when there are none (an empty
    /// histogram reports 0, which would read as "no latency at all").
    pub successes: u64,
    pub p50_s: f64,
    pub p99_s: f64,
    pub requests_per_sec: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct VsBaseline {
    /// p50 latency minus the baseline's, seconds; absent when either side had no successful
    /// request (a difference with nothing would be a made-up number).
    pub added_p50_s: Option<f64>,
    pub added_p99_s: Option<f64>,
    /// requests/s over the baseline's; absent when the baseline completed nothing.
    pub requests_per_sec_ratio: Option<f64>,
}

impl VsBaseline {
    pub fn between(ours: &Side, base: &Side) -> Self {
        let both = ours.successes > 0 && base.successes > 0;
        Self {
            added_p50_s: both.then_some(ours.p50_s - base.p50_s),
            added_p99_s: both.then_some(ours.p99_s - base.p99_s),
            requests_per_sec_ratio: (base.requests_per_sec > 0.0)
                .then(|| ours.requests_per_sec / base.requests_per_sec),
        }
    }
}

/// `value` formatted, or `-` when absent: how every table shows a missing number.
pub fn or_dash<T>(value: Option<T>, format: impl FnOnce(T) -> String) -> String {
    value.map_or_else(|| "-".to_string(), format)
}

/// `vs base: p50 +1.200ms p99 +3.400ms req/s x0.970` for summary lines; `-` where absent.
pub fn describe(vs: Option<&VsBaseline>) -> String {
    let ms = |x: Option<f64>| or_dash(x, |s| format!("{:+.3}ms", s * 1e3));
    format!(
        "vs base: p50 {} p99 {} req/s {}",
        ms(vs.and_then(|v| v.added_p50_s)),
        ms(vs.and_then(|v| v.added_p99_s)),
        or_dash(vs.and_then(|v| v.requests_per_sec_ratio), |r| format!("x{r:.3}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(successes: u64, p50_s: f64, requests_per_sec: f64) -> Side {
        Side {
            successes,
            p50_s,
            p99_s: 2.0 * p50_s,
            requests_per_sec,
        }
    }

    #[test]
    fn a_side_without_successes_has_no_latency_difference() {
        let base = side(10, 0.001, 100.0);
        let vs = VsBaseline::between(&side(10, 0.003, 50.0), &base);
        assert!(vs.added_p50_s.is_some_and(|d| (d - 0.002).abs() < 1e-12));
        assert_eq!(vs.requests_per_sec_ratio, Some(0.5));
        let empty = VsBaseline::between(&side(0, 0.0, 0.0), &base);
        assert_eq!((empty.added_p50_s, empty.added_p99_s), (None, None));
        assert_eq!(empty.requests_per_sec_ratio, Some(0.0));
        let no_base = VsBaseline::between(&base, &side(0, 0.0, 0.0));
        assert_eq!(no_base.requests_per_sec_ratio, None);
        assert_eq!(describe(None), "vs base: p50 - p99 - req/s -");
    }
}
