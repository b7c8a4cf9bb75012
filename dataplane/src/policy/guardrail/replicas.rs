//! The replicas of one checking service: health-checked with the gRPC health protocol
//! (<https://github.com/grpc/grpc/blob/master/doc/health-checking.md>), taken in turn, each
//! behind a circuit breaker. A check that fails or times out is tried once more on another
//! replica; with hedging, a check still unanswered after a delay also goes to a second
//! replica and the first good verdict wins. Only when no replica gives one in time does the
//! Guardrail's failure mode apply.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use portcullis_config::{GuardrailService, DEFAULT_HEALTH_INTERVAL};
use portcullis_proto::guardrail::v1::guardrail_client::GuardrailClient;
use portcullis_proto::guardrail::v1::Verdict as WireVerdict;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::verdict::{Decision, Expected};
use super::CheckRequest;
use crate::body::MAX_HELD_ANSWER_BYTES;

/// Largest verdict accepted from a checker: twice the largest mutation a phase takes, so one
/// over its limit still arrives and is denied, instead of failing the call (which FailOpen
/// would answer by passing the payload the checker wanted changed).
const MAX_VERDICT_BYTES: usize = 2 * MAX_HELD_ANSWER_BYTES;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// HTTP/2 to the replicas, a multiplexed connection to each per thread, reopened on demand.
/// Not tonic's `Channel`: its request buffer is one more task hand-off on every check, which
/// the guardrail benchmark measured in the added latency.
type Transport = Client<HttpConnector, tonic::body::Body>;

/// A connection no check used for this long is closed: replicas leave with config changes,
/// and a thread's client outlives them.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

thread_local! {
    /// One per thread, as the upstream HTTP/1 pools: a worker's checks go over connections
    /// its own runtime drives, so a check never wakes another core to be written or read
    /// (one connection shared by all workers made a check cost 0.33 ms instead of 0.10 in
    /// the guardrail benchmark). Health checks run on the main runtime, over its threads'
    /// connections: they ask after the replica, not after one connection.
    static TRANSPORT: Transport = transport();
}

fn transport() -> Transport {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .timer(TokioTimer::new())
        // A checker host that vanished without closing the connection is noticed.
        .http2_keep_alive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keep_alive_timeout(KEEPALIVE_INTERVAL)
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .build(connector)
}

pub(super) struct Replicas {
    replicas: Vec<Replica>,
    next: AtomicUsize,
    timeout: Duration,
    hedge_after: Option<Duration>,
    breaker_failures: u32,
    breaker_open_for: Duration,
}

struct Replica {
    address: Arc<str>,
    origin: http::Uri,
    /// The latest health answer; a replica is presumed healthy until asked.
    healthy: AtomicBool,
    breaker: Mutex<Breaker>,
}

/// Closed while `open_until` is `None`; open until then; after it, one probe (half-open).
#[derive(Default)]
struct Breaker {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    /// When the probe in flight was let through. A probe whose call was dropped (a hedge
    /// answered first, the client left) never reports back: after a timeout another may go.
    probe_since: Option<Instant>,
}

/// A verdict, or why none came, with the replica that gave the last answer or failure.
pub(super) struct Called {
    pub(super) outcome: Result<Decision, String>,
    pub(super) replica: Option<Arc<str>>,
    pub(super) attempts: u32,
}

impl Replicas {
    pub(super) fn new(spec: &GuardrailService, timeout: Duration) -> Result<Arc<Replicas>, String> {
        let replicas = spec
            .replicas
            .iter()
            .map(|address| {
                let origin: http::Uri = format!("http://{address}")
                    .parse()
                    .map_err(|error| format!("replica {address:?}: {error}"))?;
                Ok(Replica {
                    address: Arc::from(address.as_str()),
                    origin,
                    healthy: AtomicBool::new(true),
                    breaker: Mutex::new(Breaker::default()),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let breaker = spec
            .circuit_breaker
            .clone()
            .unwrap_or(portcullis_config::CircuitBreakerSpec {
                consecutive_failures: None,
                open_for: None,
            });
        let replicas = Arc::new(Replicas {
            replicas,
            next: AtomicUsize::new(0),
            timeout,
            hedge_after: spec.hedge_after.map(|delay| delay.0),
            breaker_failures: breaker.consecutive_failures(),
            breaker_open_for: breaker.open_for(),
        });
        let interval = spec
            .health_interval
            .map_or(DEFAULT_HEALTH_INTERVAL, |interval| interval.0);
        // Compiling outside a runtime (unit tests) leaves replicas presumed healthy.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(watch_health(Arc::downgrade(&replicas), interval));
        }
        Ok(replicas)
    }

    /// Asks for a verdict: a first replica, one more on failure or timeout (or after the
    /// hedging delay), never the same replica twice.
    pub(super) async fn call(&self, request: &CheckRequest, expected: &Expected) -> Called {
        // One turn per check, whether it takes one call or two.
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut tried: Vec<usize> = Vec::with_capacity(2);
        let mut finished: Vec<usize> = Vec::with_capacity(2);
        let Some(first) = self.choose(start, &tried) else {
            return Called {
                outcome: Err("no replica is available (all unhealthy or taken out)".into()),
                replica: None,
                attempts: 0,
            };
        };
        tried.push(first);
        let mut running = FuturesUnordered::new();
        running.push(self.attempt(first, request, expected));
        let hedge = async {
            match self.hedge_after {
                Some(delay) => tokio::time::sleep(delay).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(hedge);
        let mut hedged = false;
        let mut last_failure = (String::new(), first);
        loop {
            let next = tokio::select! {
                done = running.next() => {
                    let Some((index, outcome)) = done else {
                        return Called {
                            outcome: Err(last_failure.0),
                            replica: Some(self.replicas[last_failure.1].address.clone()),
                            attempts: tried.len() as u32,
                        };
                    };
                    finished.push(index);
                    match outcome {
                        Ok(decision) => {
                            // A call still running was outrun by the hedge: slower than
                            // `hedgeAfter` plus the winner's time, which counts as a failure.
                            for &slow in tried.iter().filter(|index| !finished.contains(index)) {
                                self.replicas[slow].record(false, self);
                            }
                            return Called {
                                outcome: Ok(decision),
                                replica: Some(self.replicas[index].address.clone()),
                                attempts: tried.len() as u32,
                            };
                        }
                        Err(problem) => {
                            last_failure = (format!("{}: {problem}", self.replicas[index].address), index);
                            true
                        }
                    }
                }
                () = &mut hedge, if !hedged => {
                    hedged = true;
                    true
                }
            };
            if next && tried.len() < 2 {
                if let Some(index) = self.choose(start, &tried) {
                    tried.push(index);
                    running.push(self.attempt(index, request, expected));
                }
            }
        }
    }

    /// One call to one replica, within the timeout; its result feeds the replica's breaker.
    async fn attempt(
        &self,
        index: usize,
        request: &CheckRequest,
        expected: &Expected,
    ) -> (usize, Result<Decision, String>) {
        let replica = &self.replicas[index];
        let client = GuardrailClient::with_origin(TRANSPORT.with(Clone::clone), replica.origin.clone())
            .max_decoding_message_size(MAX_VERDICT_BYTES);
        // The timeout covers connecting too.
        let called = tokio::time::timeout(self.timeout, send(client, request)).await;
        let outcome = match called {
            Err(_) => Err(format!(
                "no verdict within {}",
                humantime::format_duration(self.timeout)
            )),
            // A verdict over what the client decodes can only be a mutation far over any
            // phase's limit: the checker answered, and the original must not pass, whatever
            // the failure mode. Told by tonic's own status for it and this client's limit, not
            // by the code alone, which a checker may answer with for reasons of its own (its
            // tonic refusing a request over its own limit, say).
            Ok(Err(status))
                if status.code() == tonic::Code::OutOfRange
                    && status.message().contains("decoded message length too large")
                    && status
                        .message()
                        .contains(&format!("the limit is: {MAX_VERDICT_BYTES} bytes")) =>
            {
                Ok(Decision::Oversized {
                    bytes: MAX_VERDICT_BYTES as u64 + 1,
                    limit: expected.max_bytes,
                })
            }
            Ok(Err(status)) => Err(format!("{:?}: {}", status.code(), status.message())),
            // A mutation too large for this request is a verdict too: requests must not be
            // able to take replicas out.
            Ok(Ok(verdict)) => super::verdict::decode(verdict, expected),
        };
        replica.record(outcome.is_ok(), self);
        (index, outcome)
    }

    /// From the `start`-th replica on, the first one not yet tried that is healthy and whose
    /// breaker lets a call through; if none is healthy, one whose breaker does (health
    /// answers can lag behind a recovery).
    fn choose(&self, start: usize, tried: &[usize]) -> Option<usize> {
        let count = self.replicas.len();
        let order = (0..count)
            .map(|offset| (start + offset) % count)
            .filter(|index| !tried.contains(index));
        let (healthy, unhealthy): (Vec<usize>, Vec<usize>) =
            order.partition(|&index| self.replicas[index].healthy.load(Ordering::Relaxed));
        let now = Instant::now();
        healthy
            .into_iter()
            .chain(unhealthy)
            .find(|&index| self.replicas[index].admits(now, self.timeout))
    }

    #[cfg(test)]
    pub(super) fn is_healthy(&self, address: &str) -> Option<bool> {
        self.replicas
            .iter()
            .find(|replica| &*replica.address == address)
            .map(|replica| replica.healthy.load(Ordering::Relaxed))
    }
}

impl Replica {
    /// Whether the breaker lets a call through now (taking the probe when half-open).
    fn admits(&self, now: Instant, timeout: Duration) -> bool {
        let mut breaker = self.breaker.lock().unwrap_or_else(PoisonError::into_inner);
        match breaker.open_until {
            None => true,
            Some(until) if now < until => false,
            _ if breaker.probe_since.is_some_and(|since| now < since + timeout) => false,
            Some(_) => {
                breaker.probe_since = Some(now);
                true
            }
        }
    }

    /// A call's result: success closes the breaker; a run of failures opens it.
    fn record(&self, success: bool, replicas: &Replicas) {
        let mut breaker = self.breaker.lock().unwrap_or_else(PoisonError::into_inner);
        if success {
            *breaker = Breaker::default();
            return;
        }
        breaker.probe_since = None;
        breaker.consecutive_failures += 1;
        if breaker.consecutive_failures >= replicas.breaker_failures {
            breaker.open_until = Some(Instant::now() + replicas.breaker_open_for);
        }
    }
}

async fn send(
    mut client: GuardrailClient<Transport>,
    request: &CheckRequest,
) -> Result<WireVerdict, tonic::Status> {
    let response = match request {
        CheckRequest::McpRequest(check) => client.check_mcp_request(check.clone()).await,
        CheckRequest::McpResponse(check) => client.check_mcp_response(check.clone()).await,
        CheckRequest::LlmRequest(check) => client.check_llm_request(check.clone()).await,
        CheckRequest::LlmResponse(check) => client.check_llm_response(check.clone()).await,
    };
    response.map(tonic::Response::into_inner)
}

/// Asks every replica's health each interval until the replica set is dropped (its
/// Guardrail left the config or changed).
async fn watch_health(replicas: Weak<Replicas>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(replicas) = replicas.upgrade() else {
            return;
        };
        let asks = replicas.replicas.iter().map(|replica| async {
            let mut health = HealthClient::with_origin(TRANSPORT.with(Clone::clone), replica.origin.clone());
            let answer = tokio::time::timeout(
                interval,
                health.check(HealthCheckRequest {
                    service: String::new(),
                }),
            )
            .await;
            let healthy = match answer {
                Ok(Ok(response)) => response.into_inner().status == ServingStatus::Serving as i32,
                // A checker without the health service is judged by its checks alone.
                Ok(Err(status)) => status.code() == tonic::Code::Unimplemented,
                Err(_) => false,
            };
            let was = replica.healthy.swap(healthy, Ordering::Relaxed);
            if was != healthy {
                tracing::info!(replica = %replica.address, healthy, "guardrail replica health changed");
            }
        });
        futures::future::join_all(asks).await;
    }
}
