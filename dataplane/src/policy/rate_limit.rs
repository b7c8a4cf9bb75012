//! RateLimitPolicy: token buckets, one per target or per client key, answered with 429 and
//! `Retry-After` when empty. Local to this proxy replica.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
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
    shards: Vec<Mutex<Shard>>,
    /// Keys are stored as a keyed 128-bit hash of the header value or address: bounded in
    /// size whatever a client sends, and not forgeable into another client's bucket.
    hashers: (RandomState, RandomState),
    /// Shared by new keys when every shard is full of busy buckets.
    overflow: Mutex<Bucket>,
}

enum Key {
    Target,
    ClientAddress,
    Header(HeaderName),
}

#[derive(Default)]
struct Shard {
    buckets: HashMap<(u64, u64), Bucket>,
    /// Sweeping a full shard scans it: at most once a second, not once per new key.
    last_sweep: Option<Instant>,
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
            // Validation bounds the rate, so the wait fits; saturate rather than panic anyway.
            Err(Duration::try_from_secs_f64((1.0 - self.tokens) / rate).unwrap_or(Duration::MAX))
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
            shards: (0..shard_count).map(|_| Mutex::new(Shard::default())).collect(),
            hashers: (RandomState::new(), RandomState::new()),
            overflow: Mutex::new(Bucket::full(burst, now)),
        })
    }

    fn key_of(&self, ctx: &RequestContext, request: &Request<Body>) -> (u64, u64) {
        match &self.key {
            Key::Target => (0, 0),
            Key::ClientAddress => self.address_key(ctx.client_ip),
            // Requests without the header share the bucket of the empty value.
            Key::Header(name) => self.hash(
                request
                    .headers()
                    .get(name)
                    .map_or(&[][..], |value| value.as_bytes()),
            ),
        }
    }

    fn hash(&self, bytes: &[u8]) -> (u64, u64) {
        (self.hashers.0.hash_one(bytes), self.hashers.1.hash_one(bytes))
    }

    /// An IPv6 client is its /64: that is what one customer is usually given, and keyed by
    /// whole address it could take a fresh bucket per request. An IPv4-mapped address is
    /// the IPv4 client it stands for (all of them are in one /64).
    fn address_key(&self, address: IpAddr) -> (u64, u64) {
        match address {
            IpAddr::V4(v4) => self.hash(&v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => self.hash(&v4.octets()),
                None => self.hash(&v6.octets()[..8]),
            },
        }
    }

    fn take(&self, key: (u64, u64), now: Instant) -> Result<(), Duration> {
        let index = usize::try_from(key.0 % self.shards.len() as u64).unwrap_or_default();
        // A poisoned lock only means another request panicked mid-update; the bucket
        // values are still plain numbers, so keep going.
        let mut shard = self.shards[index]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(bucket) = shard.buckets.get_mut(&key) {
            return bucket.take(self.rate, self.burst, now);
        }
        if shard.buckets.len() >= self.max_keys_per_shard
            && shard
                .last_sweep
                .is_none_or(|last| now.saturating_duration_since(last) >= Duration::from_secs(1))
        {
            shard.last_sweep = Some(now);
            let (rate, burst) = (self.rate, self.burst);
            shard
                .buckets
                .retain(|_, bucket| !bucket.is_idle(rate, burst, now));
        }
        if shard.buckets.len() >= self.max_keys_per_shard {
            drop(shard);
            let mut overflow = self.overflow.lock().unwrap_or_else(|poison| poison.into_inner());
            return overflow.take(self.rate, self.burst, now);
        }
        shard
            .buckets
            .entry(key)
            .or_insert_with(|| Bucket::full(self.burst, now))
            .take(self.rate, self.burst, now)
    }
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
                let seconds = wait.as_secs().saturating_add(u64::from(wait.subsec_nanos() > 0));
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
        let allowed = (0..64u64).filter(|i| limit.take((*i, *i), now).is_ok()).count();
        assert!(allowed < 64, "{allowed}");
        let kept: usize = limit.shards.iter().map(|s| s.lock().unwrap().buckets.len()).sum();
        assert!(kept <= 16, "{kept}");
        // A second later every bucket is full again, so new keys replace them.
        let later = now + Duration::from_secs(2);
        assert!(limit.take((1_000, 1_000), later).is_ok());
    }

    #[test]
    fn ipv6_clients_share_a_bucket_per_64_and_mapped_ipv4_per_address() {
        let spec: RateLimitPolicySpec = serde_json::from_value(serde_json::json!({
            "targetRefs": [{"kind": "Route", "name": "r"}],
            "requestsPerSecond": 0.01, "burst": 1, "key": "clientAddress"
        }))
        .unwrap();
        let limit = RateLimit::compile("t", &spec).unwrap();
        let now = Instant::now();
        let take = |address: &str| limit.take(limit.address_key(address.parse().unwrap()), now);
        assert!(take("2001:db8:0:1::1").is_ok());
        assert!(
            take("2001:db8:0:1:ffff:ffff:ffff:ffff").is_err(),
            "same /64, same bucket"
        );
        assert!(take("2001:db8:0:2::1").is_ok(), "another /64 has its own bucket");
        // Every IPv4-mapped address is in ::ffff:0:0/96: keyed by its IPv4 address instead.
        assert!(take("::ffff:192.0.2.1").is_ok());
        assert!(take("::ffff:192.0.2.2").is_ok());
        assert!(
            take("192.0.2.1").is_err(),
            "the mapped and plain forms are one client"
        );
        assert!(take("192.0.2.3").is_ok());
    }
}
