//! Retry policy and budget: retries only where they are safe, and never so many that they
//! multiply the load on an upstream that is already failing.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::{Method, StatusCode};
use portcullis_config::RetrySpec;

/// Retries every route may make per second whatever its traffic, so a quiet route can
/// still ride over one failed connect.
const MIN_RETRIES_PER_SECOND: i64 = 10;
/// One retry, in budget units; a request deposits `budget_percent` units.
const RETRY_COST: i64 = 100;
/// The budget never saves up more than this many retries.
const MAX_SAVED_RETRIES: i64 = 1_000;

#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    /// Retries after the first attempt.
    pub(crate) attempts: u32,
    on_status: Vec<StatusCode>,
    budget: Arc<RetryBudget>,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy::compile(None)
    }
}

impl RetryPolicy {
    /// `None`: the default, one retry after a failed connect.
    pub(crate) fn compile(spec: Option<&RetrySpec>) -> RetryPolicy {
        let default = RetrySpec::default();
        let spec = spec.unwrap_or(&default);
        RetryPolicy {
            attempts: spec.attempts,
            on_status: spec
                .on_status
                .iter()
                .filter_map(|status| StatusCode::from_u16(*status).ok())
                .collect(),
            budget: Arc::new(RetryBudget::new(i64::from(spec.budget_percent))),
        }
    }

    /// Called once per request: earns budget for later retries.
    pub(crate) fn deposit(&self) {
        self.budget.deposit();
    }

    /// Whether an answer with `status` to a `method` request may be retried (the request
    /// reached the upstream, so only idempotent methods are).
    pub(crate) fn retries_status(&self, method: &Method, status: StatusCode) -> bool {
        method.is_idempotent() && self.on_status.contains(&status)
    }

    pub(crate) fn try_spend(&self) -> bool {
        self.budget.try_withdraw()
    }
}

#[derive(Debug)]
struct RetryBudget {
    percent: i64,
    balance: AtomicI64,
    /// Whole seconds since `start` when the minimum was last topped up.
    topped_up: AtomicU64,
    start: Instant,
}

impl RetryBudget {
    fn new(percent: i64) -> RetryBudget {
        RetryBudget {
            percent,
            balance: AtomicI64::new(MIN_RETRIES_PER_SECOND * RETRY_COST),
            topped_up: AtomicU64::new(0),
            start: Instant::now(),
        }
    }

    fn deposit(&self) {
        let cap = MAX_SAVED_RETRIES * RETRY_COST;
        if self.balance.load(Ordering::Relaxed) < cap {
            self.balance.fetch_add(self.percent, Ordering::Relaxed);
        }
    }

    fn try_withdraw(&self) -> bool {
        self.try_withdraw_at(self.start.elapsed().as_secs())
    }

    /// `second`: whole seconds since the budget was made.
    fn try_withdraw_at(&self, second: u64) -> bool {
        let last = self.topped_up.load(Ordering::Relaxed);
        if second > last
            && self
                .topped_up
                .compare_exchange(last, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let floor = MIN_RETRIES_PER_SECOND * RETRY_COST;
            let _ = self
                .balance
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |balance| {
                    Some(balance.max(floor))
                });
        }
        self.balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |balance| {
                (balance >= RETRY_COST).then_some(balance - RETRY_COST)
            })
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_limits_retries_to_a_share_of_requests() {
        let policy = RetryPolicy::compile(Some(&RetrySpec {
            attempts: 1,
            on_status: vec![503],
            budget_percent: 20,
        }));
        let budget = &policy.budget;
        // The minimum reserve first...
        let reserve = (0..100).take_while(|_| budget.try_withdraw_at(0)).count();
        assert_eq!(reserve, MIN_RETRIES_PER_SECOND as usize);
        // ...then one retry per five requests...
        for _ in 0..100 {
            policy.deposit();
        }
        let earned = (0..100).take_while(|_| budget.try_withdraw_at(0)).count();
        assert_eq!(earned, 20);
        // ...and the reserve again in the next second.
        let next_second = (0..100).take_while(|_| budget.try_withdraw_at(1)).count();
        assert_eq!(next_second, MIN_RETRIES_PER_SECOND as usize);
    }

    #[test]
    fn only_idempotent_methods_retry_on_status() {
        let policy = RetryPolicy::compile(Some(&RetrySpec {
            attempts: 2,
            on_status: vec![503],
            budget_percent: 20,
        }));
        assert!(policy.retries_status(&Method::GET, StatusCode::SERVICE_UNAVAILABLE));
        assert!(policy.retries_status(&Method::PUT, StatusCode::SERVICE_UNAVAILABLE));
        assert!(!policy.retries_status(&Method::POST, StatusCode::SERVICE_UNAVAILABLE));
        assert!(!policy.retries_status(&Method::GET, StatusCode::BAD_GATEWAY));
    }
}
