//! A warning that can repeat on every request (an upstream whose certificate is wrong fails
//! each one) is logged at most once per interval, with the count of those left out, so one
//! broken upstream cannot flood the log or spend the proxy's time writing it.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

pub(crate) struct LogThrottle {
    interval: Duration,
    /// When one was logged last, and how many were left out since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogThrottle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(left_out)` when this occurrence is to be logged, with how many were left out
    /// since the last one logged; `None` when it is to be left out.
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (last, left_out) = &mut *state;
        match *last {
            Some(at) if now.duration_since(at) < self.interval => {
                *left_out += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(left_out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn logs_once_per_interval_and_counts_what_it_left_out() {
        let throttle = LogThrottle::new(Duration::from_secs(30));
        assert_eq!(throttle.admit(), Some(0));
        assert_eq!(throttle.admit(), None);
        assert_eq!(throttle.admit(), None);
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(throttle.admit(), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(throttle.admit(), Some(3));
        assert_eq!(throttle.admit(), None);
    }
}
