//! RateLimitPolicy: token buckets, one per target or per client key, answered with 429 and
//! `Retry-After` when empty. Local to this proxy replica.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::header::RETRY_AFTER;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use portcullis_config::{RateLimitKey, RateLimitPolicySpec};

use super::{Decision, Policy, PolicyFuture, RequestContext};
use crate::body::Body;
use crate::response;

/// Keys are spread over shards so concurrent clients rarely wait on one lock.
const SHARDS: usize = 16;

pub(crate) struct RateLimit {
    name: Arc<str>,
    key: Key,
    rate: f64,
    burst: f64,
    max_keys_per_shard: usize,
    shards: Vec<Mutex<HashMap<String, Bucket>>>,
    /// Shared by new keys when every shard is full of busy buckets.
    overflow: Mutex<Bucket>,
}

enum Key {
    Target,
    ClientAddress,
    Header(HeaderName),
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            updated: now,
        }
    }

    /// Takes a token, or says how long until one is there.
    fn take(&mut self, rate: f64, burst: f64, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.updated = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }

    /// A bucket that has refilled completely is the same as a new one: safe to forget.
    fn is_idle(&self, rate: f64, burst: f64, now: Instant) -> bool {
        self.tokens + now.saturating_duration_since(self.updated).as_secs_f64() * rate >= burst
    }
}

impl RateLimit {
    pub(crate) fn compile(name: &str, spec: &RateLimitPolicySpec) -> Result<RateLimit, String> {
        let key = match &spec.key {
            RateLimitKey::Target => Key::Target,
            RateLimitKey::ClientAddress => Key::ClientAddress,
            RateLimitKey::Header(header) => Key::Header(
                HeaderName::from_bytes(header.as_bytes())
                    .map_err(|error| format!("RateLimitPolicy/{name}: header {header:?}: {error}"))?,
            ),
        };
        let burst = f64::from(spec.burst());
        let now = Instant::now();
        // Fewer shards than keys allowed, so that shards × keys per shard ≤ maxKeys.
        let max_keys = spec.max_keys() as usize;
        let shard_count = SHARDS.min(max_keys).max(1);
        Ok(RateLimit {
            name: Arc::from(format!("RateLimitPolicy/{name}")),
            key,
            rate: spec.requests_per_second,
            burst,
            max_keys_per_shard: (max_keys / shard_count).max(1),
            shards: (0..shard_count).map(|_| Mutex::new(HashMap::new())).collect(),
            overflow: Mutex::new(Bucket::full(burst, now)),
        })
    }

    fn key_of(&self, ctx: &RequestContext, request: &Request<Body>) -> String {
        match &self.key {
            Key::Target => String::new(),
            Key::ClientAddress => ctx.client_ip.to_string(),
            // Requests without the header share the bucket of the empty key.
            Key::Header(name) => request
                .headers()
                .get(name)
                .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                .unwrap_or_default(),
        }
    }

    fn take(&self, key: String, now: Instant) -> Result<(), Duration> {
        let shard = &self.shards[shard_of(&key) % self.shards.len()];
        // A poisoned lock only means another request panicked mid-update; the bucket
        // values are still plain numbers, so keep going.
        let mut buckets = shard.lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some(bucket) = buckets.get_mut(&key) {
            return bucket.take(self.rate, self.burst, now);
        }
        if buckets.len() >= self.max_keys_per_shard {
            buckets.retain(|_, bucket| !bucket.is_idle(self.rate, self.burst, now));
        }
        if buckets.len() >= self.max_keys_per_shard {
            drop(buckets);
            let mut overflow = self.overflow.lock().unwrap_or_else(|poison| poison.into_inner());
            return overflow.take(self.rate, self.burst, now);
        }
        buckets
            .entry(key)
            .or_insert_with(|| Bucket::full(self.burst, now))
            .take(self.rate, self.burst, now)
    }
}

fn shard_of(key: &str) -> usize {
    use std::hash::Hasher;
    // Fixed keys: a key must land in the same shard every time. Each shard's map keeps
    // its own random keys, so crafted keys can only make one lock busier.
    let mut hasher = std::hash::DefaultHasher::new();
    hasher.write(key.as_bytes());
    hasher.finish() as usize
}

impl Policy for RateLimit {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn on_request<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        request: &'a mut Request<Body>,
    ) -> PolicyFuture<'a> {
        let key = self.key_of(ctx, request);
        let decision = match self.take(key, Instant::now()) {
            Ok(()) => {
                ctx.decide(&self.name, "allow");
                Decision::Continue
            }
            Err(wait) => {
                ctx.decide(&self.name, "deny");
                // Whole seconds, rounded up: `Retry-After: 0` would invite a retry storm.
                let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                let mut answer = response::error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limited",
                    format!("{} allows {} requests per second", self.name, self.rate),
                );
                answer
                    .headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from(seconds.max(1)));
                Decision::Respond(answer)
            }
        };
        Box::pin(std::future::ready(decision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_burst_then_refills_at_rate() {
        let start = Instant::now();
        let mut bucket = Bucket::full(3.0, start);
        for _ in 0..3 {
            assert!(bucket.take(2.0, 3.0, start).is_ok());
        }
        let wait = bucket.take(2.0, 3.0, start).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(bucket.take(2.0, 3.0, start + Duration::from_millis(500)).is_ok());
        assert!(bucket.take(2.0, 3.0, start + Duration::from_millis(500)).is_err());
    }

    #[test]
    fn idle_keys_are_dropped_and_busy_ones_overflow() {
        let spec: RateLimitPolicySpec = serde_json::from_value(serde_json::json!({
            "targetRefs": [{"kind": "Route", "name": "r"}],
            "requestsPerSecond": 1.0, "burst": 1, "key": "clientAddress", "maxKeys": 16
        }))
        .unwrap();
        let limit = RateLimit::compile("t", &spec).unwrap();
        let now = Instant::now();
        // 64 busy keys cannot all have buckets: some share the overflow bucket.
        let allowed = (0..64)
            .filter(|i| limit.take(format!("10.0.0.{i}"), now).is_ok())
            .count();
        assert!(allowed < 64, "{allowed}");
        let kept: usize = limit.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(kept <= 16, "{kept}");
        // A second later every bucket is full again, so new keys replace them.
        let later = now + Duration::from_secs(2);
        assert!(limit.take("10.1.0.1".into(), later).is_ok());
    }
}
