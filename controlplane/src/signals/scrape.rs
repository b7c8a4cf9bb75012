//! Collection: while this node leads the signals group, one task per InferencePool whose
//! picker reads signals (the Scored strategy) reads every endpoint's `/metrics` once per
//! interval, and one proposer turns the finished rounds into signals-log entries (whatever
//! finished while the previous entry was being committed goes into the next one, so the
//! entry rate adapts to the commit latency).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use openraft::error::{ClientWriteError, RaftError};
use portcullis_config::{InferencePoolSpec, Strategy};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::MissedTickBehavior;

use super::exposition::read_vllm;
use super::types::{EndpointRound, PoolRound, Reading, SignalEntry, SignalsRaft};
use crate::metrics::Metrics;
use crate::types::NodeId;
use crate::view::ConfigView;

/// A `/metrics` body larger than this is refused (vLLM's is tens of KiB).
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

enum Update {
    /// A finished round; its readings' ages are as of `finished`.
    Round {
        round: PoolRound,
        finished: Instant,
    },
    Removed(String),
}

/// Collects while this node leads the signals group; idle otherwise. Never returns.
pub async fn run(node_id: NodeId, raft: SignalsRaft, config: watch::Receiver<ConfigView>, metrics: Metrics) {
    let mut raft_metrics = raft.metrics();
    loop {
        let leading = raft_metrics.borrow_and_update().current_leader == Some(node_id);
        if leading {
            tracing::info!("leading the signals group: collecting pod signals");
            let lost = async {
                while raft_metrics.borrow_and_update().current_leader == Some(node_id) {
                    if raft_metrics.changed().await.is_err() {
                        return;
                    }
                }
            };
            tokio::select! {
                () = lost => {}
                () = collect(raft.clone(), config.clone(), metrics.clone()) => {}
            }
            tracing::info!("no longer leading the signals group: collection stopped");
        } else if raft_metrics.changed().await.is_err() {
            return;
        }
    }
}

/// Keeps one scrape task per pool in step with the config, until the config source ends or
/// the proposer stops (this node no longer leads).
async fn collect(raft: SignalsRaft, mut config: watch::Receiver<ConfigView>, metrics: Metrics) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    let (updates, rounds) = mpsc::channel(1024);
    let mut tasks = JoinSet::new();
    // Closed (its sender dropped) when the proposer stops.
    let (proposing, mut proposer_stopped) = oneshot::channel::<()>();
    let proposer_metrics = metrics.clone();
    tasks.spawn(async move {
        propose(raft, rounds, proposer_metrics).await;
        drop(proposing);
    });
    // Per pool: what its task scrapes, to restart it only when that changes.
    let mut running: HashMap<String, (Vec<String>, Duration, AbortHandle)> = HashMap::new();
    config.mark_changed();
    loop {
        tokio::select! {
            changed = config.changed() => if changed.is_err() { return },
            _ = &mut proposer_stopped => return,
        }
        // Reap the scrapers aborted so far.
        while tasks.try_join_next().is_some() {}
        let view = config.borrow_and_update().clone();
        // RoundRobin and LeastRequest read no signals: their pods are left alone, and a pool
        // switched to one of them is dropped like a removed one.
        let pools: HashMap<&str, &InferencePoolSpec> = view
            .config
            .specs::<InferencePoolSpec>()
            .filter(|(_, spec)| spec.picker.strategy == Strategy::Scored)
            .map(|(metadata, spec)| (metadata.name.as_str(), spec))
            .collect();
        let gone: Vec<String> = running
            .keys()
            .filter(|name| !pools.contains_key(name.as_str()))
            .cloned()
            .collect();
        for name in gone {
            if let Some((_, _, task)) = running.remove(&name) {
                task.abort();
            }
            if updates.send(Update::Removed(name)).await.is_err() {
                return;
            }
        }
        for (name, spec) in pools {
            let interval = spec.signals.interval();
            if let Some((endpoints, every, _)) = running.get(name) {
                if *endpoints == spec.endpoints && *every == interval {
                    continue;
                }
            }
            let scraper = PoolScraper {
                pool: name.to_string(),
                endpoints: spec.endpoints.clone(),
                interval,
                client: client.clone(),
                updates: updates.clone(),
                metrics: metrics.clone(),
            };
            let task = tasks.spawn(scraper.run());
            if let Some((_, _, previous)) =
                running.insert(name.to_string(), (spec.endpoints.clone(), interval, task))
            {
                previous.abort();
            }
        }
    }
}

/// Drains finished rounds into signals-log entries, one write at a time.
async fn propose(raft: SignalsRaft, mut updates: mpsc::Receiver<Update>, metrics: Metrics) {
    while let Some(first) = updates.recv().await {
        let mut rounds: HashMap<String, (PoolRound, Instant)> = HashMap::new();
        let mut removed: HashSet<String> = HashSet::new();
        let mut add = |update| match update {
            Update::Round { mut round, finished } => {
                removed.remove(&round.pool);
                if let Some((earlier, earlier_finished)) = rounds.remove(&round.pool) {
                    // An endpoint that missed this round keeps what it said in the one before.
                    let since = finished.saturating_duration_since(earlier_finished);
                    inherit_readings(&mut round, earlier, since);
                }
                rounds.insert(round.pool.clone(), (round, finished));
            }
            Update::Removed(pool) => {
                rounds.remove(&pool);
                removed.insert(pool);
            }
        };
        add(first);
        while let Ok(update) = updates.try_recv() {
            add(update);
        }
        // Ages as of now: the time the rounds waited for the previous write counts.
        let rounds = rounds
            .into_values()
            .map(|(mut round, finished)| {
                let waited = finished.elapsed();
                for reading in round.endpoints.iter_mut().filter_map(|e| e.reading.as_mut()) {
                    reading.age_ms = add_ms(reading.age_ms, waited);
                }
                round
            })
            .collect();
        let entry = SignalEntry {
            rounds,
            removed_pools: removed.into_iter().collect(),
        };
        let bytes = serde_json::to_vec(&entry).map_or(0, |json| json.len());
        match raft.client_write(entry).await {
            Ok(_) => metrics.signals_committed(bytes),
            // Leadership moved on; `run` stops this collection.
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => return,
            Err(error) => {
                tracing::warn!(%error, "could not replicate pod signals");
                metrics.signals_failed();
            }
        }
    }
}

/// Fills the endpoints of `round` that have no reading with `earlier`'s, aged by `since`.
fn inherit_readings(round: &mut PoolRound, earlier: PoolRound, since: Duration) {
    let mut earlier: HashMap<String, Reading> = earlier
        .endpoints
        .into_iter()
        .filter_map(|endpoint| Some((endpoint.endpoint, endpoint.reading?)))
        .collect();
    for endpoint in round.endpoints.iter_mut().filter(|e| e.reading.is_none()) {
        endpoint.reading = earlier.remove(&endpoint.endpoint).map(|mut reading| {
            reading.age_ms = add_ms(reading.age_ms, since);
            reading
        });
    }
}

/// `age_ms + elapsed`, saturating.
pub(crate) fn add_ms(age_ms: u32, elapsed: Duration) -> u32 {
    let elapsed = u32::try_from(elapsed.as_millis()).unwrap_or(u32::MAX);
    age_ms.saturating_add(elapsed)
}

struct PoolScraper {
    pool: String,
    endpoints: Vec<String>,
    interval: Duration,
    client: HttpClient,
    updates: mpsc::Sender<Update>,
    metrics: Metrics,
}

impl PoolScraper {
    async fn run(self) {
        let uris: Vec<Result<Uri, String>> = self
            .endpoints
            .iter()
            .map(|endpoint| {
                format!("http://{endpoint}/metrics")
                    .parse::<Uri>()
                    .map_err(|e| format!("invalid endpoint {endpoint:?}: {e}"))
            })
            .collect();
        // Whether each endpoint's last read failed: failures are logged when they start and
        // when they end, not every round.
        let mut failing = vec![false; uris.len()];
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let reads = uris.iter().map(|uri| self.read(uri));
            let readings = futures::future::join_all(reads).await;
            let finished = Instant::now();
            let mut endpoints = Vec::with_capacity(readings.len());
            for (index, reading) in readings.into_iter().enumerate() {
                let endpoint = &self.endpoints[index];
                let reading = match reading {
                    Ok((mut reading, sampled)) => {
                        reading.age_ms = add_ms(0, finished.saturating_duration_since(sampled));
                        if std::mem::replace(&mut failing[index], false) {
                            tracing::info!(pool = %self.pool, %endpoint, "pod signals readable again");
                        }
                        self.metrics.signal_scraped(true);
                        Some(reading)
                    }
                    Err(error) => {
                        if !std::mem::replace(&mut failing[index], true) {
                            tracing::warn!(pool = %self.pool, %endpoint, %error, "cannot read pod signals");
                        }
                        self.metrics.signal_scraped(false);
                        None
                    }
                };
                endpoints.push(EndpointRound {
                    endpoint: endpoint.clone(),
                    reading,
                });
            }
            let round = PoolRound {
                pool: self.pool.clone(),
                endpoints,
            };
            if self
                .updates
                .send(Update::Round { round, finished })
                .await
                .is_err()
            {
                return;
            }
        }
    }

    /// One `GET /metrics`; a pod slower than the interval misses the round.
    /// The reading and when the request for it went out.
    async fn read(&self, uri: &Result<Uri, String>) -> Result<(Reading, Instant), String> {
        let uri = uri.as_ref().map_err(Clone::clone)?;
        let sampled = Instant::now();
        let read = async {
            let response = self
                .client
                .get(uri.clone())
                .await
                .map_err(|e| format!("request failed: {e}"))?;
            if !response.status().is_success() {
                return Err(format!("answered {}", response.status()));
            }
            let body = Limited::new(response.into_body(), MAX_METRICS_BYTES)
                .collect()
                .await
                .map_err(|e| format!("reading the body: {e}"))?
                .to_bytes();
            let text = std::str::from_utf8(&body).map_err(|_| "the body is not UTF-8".to_string())?;
            read_vllm(text).map(|reading| (reading, sampled))
        };
        tokio::time::timeout(self.interval, read)
            .await
            .map_err(|_| format!("no answer within {:?}", self.interval))?
    }
}
