use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::kind::{KindInfo, KindSpec};
use crate::kinds::header_policy::POLICY_TARGET_KINDS;
use crate::reference::{target_refs, Reference, TargetRef};

/// A local token bucket per target (and per client key): each target in `targetRefs` has
/// its own buckets, and each proxy replica enforces the limit on its own traffic. Requests
/// over the limit get 429 with `Retry-After`. Attached to a Listener, the buckets are
/// shared by every route of that listener; a Route attached to as well is not limited twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RateLimitPolicySpec {
    pub target_refs: Vec<TargetRef>,
    /// Refill rate of each bucket; may be fractional (`0.5` = one request per 2 s).
    pub requests_per_second: f64,
    /// Bucket size: the burst allowed after a quiet period. Default: one second's worth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Which requests share a bucket.
    #[serde(default, skip_serializing_if = "RateLimitKey::is_target")]
    pub key: RateLimitKey,
    /// At most this many buckets per target (each client key is one); beyond it, idle ones
    /// are dropped and, if none is idle, new keys share one overflow bucket. Keys are
    /// spread over up to 16 shards, each holding its share. Default 100,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_keys: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub enum RateLimitKey {
    /// One bucket for everything the policy targets (a Route, or a whole Listener).
    #[default]
    Target,
    /// One bucket per client IP address (as the proxy sees it: the TCP peer, or the
    /// nearest untrusted address of `X-Forwarded-For` behind a trusted proxy); an IPv6
    /// client's bucket is its /64's, since one customer usually holds a whole /64.
    ClientAddress,
    /// One bucket per value of this request header; requests without it share one.
    Header(String),
}

impl RateLimitKey {
    fn is_target(&self) -> bool {
        *self == RateLimitKey::Target
    }
}

pub const DEFAULT_MAX_KEYS: u32 = 100_000;
/// About 50 MB of buckets per target at most.
pub const MAX_KEYS: u32 = 1_000_000;
/// Bounds of `requestsPerSecond`: a wait for the next token always fits a timer.
const MIN_RATE: f64 = 0.001;
const MAX_RATE: f64 = 1e9;

impl RateLimitPolicySpec {
    pub fn burst(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.requests_per_second.ceil().clamp(1.0, f64::from(u32::MAX)) as u32)
    }

    pub fn max_keys(&self) -> u32 {
        self.max_keys.unwrap_or(DEFAULT_MAX_KEYS)
    }
}

impl KindSpec for RateLimitPolicySpec {
    const INFO: &'static KindInfo =
        &KindInfo::of::<RateLimitPolicySpec>("RateLimitPolicy", "ratelimitpolicies", &["rlp"]);

    fn check(&self, checker: &mut Checker<'_>) {
        crate::reference::check_target_refs(checker, &self.target_refs, false);
        if !(MIN_RATE..=MAX_RATE).contains(&self.requests_per_second) {
            checker.fail(
                "spec.requestsPerSecond",
                format!("must be between {MIN_RATE} (one request in about 17 minutes) and {MAX_RATE}"),
            );
        }
        if self.burst == Some(0) {
            checker.fail("spec.burst", "must be at least 1");
        }
        if self.max_keys.is_some_and(|keys| !(1..=MAX_KEYS).contains(&keys)) {
            // Each key holds a bucket in the proxy's memory, and a full shard is swept
            // under its lock: the bound keeps both to what a proxy can afford.
            checker.fail("spec.maxKeys", format!("must be between 1 and {MAX_KEYS}"));
        }
        if let RateLimitKey::Header(name) = &self.key {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                checker.fail("spec.key.header", format!("invalid header name {name:?}"));
            }
        }
    }

    fn references(&self) -> Vec<Reference> {
        target_refs(&self.target_refs, POLICY_TARGET_KINDS)
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        crate::reference::retain_targets(&mut self.target_refs, keep);
    }
}
