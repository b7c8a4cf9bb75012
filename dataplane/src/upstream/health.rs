//! Passive health: endpoints whose connects keep failing are ejected for a while, then
//! re-admitted. State is per address and survives config versions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use http::uri::Authority;
use portcullis_config::EjectionSpec;

/// Ejection times are stored as milliseconds since this instant, so they fit an atomic.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Repeated ejections without a success in between double the time out, up to this.
const MAX_EJECTION_MULTIPLIER: u32 = 10;

fn now_ms() -> u64 {
    u64::try_from(EPOCH.elapsed().as_millis()).unwrap_or(u64::MAX)
}

#[derive(Debug, Default)]
pub(crate) struct EndpointHealth {
    consecutive_failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
}

impl EndpointHealth {
    pub(crate) fn is_ejected(&self) -> bool {
        self.is_ejected_at(now_ms())
    }

    fn is_ejected_at(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// Reads before writing: the hot path of a healthy endpoint touches no cache line
    /// other proxies' threads write.
    pub(crate) fn record_success(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
        if self.ejections.load(Ordering::Relaxed) != 0 {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// Counts a failed connect; returns the ejection time if this failure ejected it.
    pub(crate) fn record_connect_failure(&self, policy: &EjectionSpec) -> Option<Duration> {
        self.record_connect_failure_at(policy, now_ms())
    }

    fn record_connect_failure_at(&self, policy: &EjectionSpec, now_ms: u64) -> Option<Duration> {
        let ejected_until = self.ejected_until_ms.load(Ordering::Relaxed);
        // Requests that chose the endpoint before it was ejected still fail after: they
        // say nothing new and must not stretch the ejection.
        if ejected_until > now_ms {
            return None;
        }
        let failures = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < policy.consecutive_failures {
            return None;
        }
        let ejections = self.ejections.load(Ordering::Relaxed);
        let multiplier = 2u32.saturating_pow(ejections).min(MAX_EJECTION_MULTIPLIER);
        let duration = policy.duration().saturating_mul(multiplier);
        let until = now_ms.saturating_add(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX));
        // Of the failures that reach the count together, one ejects.
        self.ejected_until_ms
            .compare_exchange(ejected_until, until, Ordering::Relaxed, Ordering::Relaxed)
            .ok()?;
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.ejections.fetch_add(1, Ordering::Relaxed);
        Some(duration)
    }
}

/// One endpoint of a target, with the health it shares with every other version.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub(crate) authority: Authority,
    /// The authority as text, for records: made once, not per request.
    pub(crate) label: Arc<str>,
    pub(crate) health: Arc<EndpointHealth>,
}

/// Hands out the one health record of each address.
#[derive(Default)]
pub(crate) struct HealthRegistry {
    records: Mutex<HashMap<Authority, Weak<EndpointHealth>>>,
}

impl HealthRegistry {
    pub(crate) fn endpoint(&self, authority: Authority) -> Endpoint {
        let mut records = self.records.lock().unwrap_or_else(|poison| poison.into_inner());
        let label = Arc::from(authority.as_str());
        if let Some(health) = records.get(&authority).and_then(Weak::upgrade) {
            return Endpoint {
                authority,
                label,
                health,
            };
        }
        // Addresses no config uses any more are forgotten as they come and go.
        records.retain(|_, record| record.strong_count() > 0);
        let health = Arc::new(EndpointHealth::default());
        records.insert(authority.clone(), Arc::downgrade(&health));
        Endpoint {
            authority,
            label,
            health,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ejected_after_consecutive_failures_then_readmitted_with_backoff() {
        let policy = EjectionSpec {
            consecutive_failures: 2,
            duration: portcullis_config::HumanDuration(Duration::from_millis(40)),
        };
        let health = EndpointHealth::default();
        assert_eq!(health.record_connect_failure_at(&policy, 1_000), None);
        health.record_success();
        assert_eq!(
            health.record_connect_failure_at(&policy, 1_000),
            None,
            "a success resets the count"
        );
        assert_eq!(
            health.record_connect_failure_at(&policy, 1_000),
            Some(Duration::from_millis(40))
        );
        assert!(health.is_ejected_at(1_039));
        assert!(
            !health.is_ejected_at(1_040),
            "re-admitted after the ejection time"
        );
        health.record_connect_failure_at(&policy, 1_040);
        assert_eq!(
            health.record_connect_failure_at(&policy, 1_040),
            Some(Duration::from_millis(80)),
            "ejected again without a success: twice as long"
        );
        assert!(health.is_ejected_at(1_119));
    }

    #[test]
    fn failures_while_ejected_do_not_stretch_the_ejection() {
        let policy = EjectionSpec {
            consecutive_failures: 2,
            duration: portcullis_config::HumanDuration(Duration::from_millis(40)),
        };
        let health = EndpointHealth::default();
        health.record_connect_failure_at(&policy, 1_000);
        assert!(health.record_connect_failure_at(&policy, 1_000).is_some());
        // Requests already under way when it was ejected fail in a burst.
        for _ in 0..10 {
            assert_eq!(health.record_connect_failure_at(&policy, 1_010), None);
        }
        assert!(
            !health.is_ejected_at(1_040),
            "re-admitted after one ejection time"
        );
        health.record_connect_failure_at(&policy, 1_040);
        assert_eq!(
            health.record_connect_failure_at(&policy, 1_040),
            Some(Duration::from_millis(80)),
            "the next ejection doubles once, not once per failure while it was out"
        );
    }

    #[test]
    fn one_record_per_address() {
        let registry = HealthRegistry::default();
        let a = registry.endpoint("127.0.0.1:1".parse().unwrap());
        let b = registry.endpoint("127.0.0.1:1".parse().unwrap());
        assert!(Arc::ptr_eq(&a.health, &b.health));
    }
}
