//! SignalStream: each proxy gets the latest scrape round of every pool in its shard, then
//! each new round, one message per change of the replicated signals. Any control-plane node
//! serves it from its own copy of the signals state machine.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use portcullis_config::{InferencePoolSpec, ShardSelector};
use portcullis_proto::v1::signal_stream_server::SignalStream;
use portcullis_proto::v1::{self as wire, SignalBatch, SignalSubscription};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::store::{HeldReading, PoolSignals, SignalView};
use crate::metrics::Metrics;
use crate::view::ConfigView;

pub struct SignalStreamService {
    signals: watch::Receiver<SignalView>,
    config: watch::Receiver<ConfigView>,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
}

impl SignalStreamService {
    pub fn new(
        signals: watch::Receiver<SignalView>,
        config: watch::Receiver<ConfigView>,
        shutdown: watch::Receiver<bool>,
        metrics: Metrics,
    ) -> Self {
        Self {
            signals,
            config,
            shutdown,
            metrics,
        }
    }
}

#[tonic::async_trait]
impl SignalStream for SignalStreamService {
    type SubscribeStream = ReceiverStream<Result<SignalBatch, Status>>;

    async fn subscribe(
        &self,
        request: Request<SignalSubscription>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let subscription = request.into_inner();
        if subscription.proxy_id.is_empty() {
            return Err(Status::invalid_argument("SignalSubscription.proxy_id is empty"));
        }
        let (outbound, rx) = mpsc::channel(2);
        let session = Session {
            shard: subscription.shard.into_iter().collect(),
            outbound,
            signals: self.signals.clone(),
            config: self.config.clone(),
            shutdown: self.shutdown.clone(),
            metrics: self.metrics.clone(),
            sent: HashMap::new(),
        };
        tracing::debug!(proxy_id = %subscription.proxy_id, "proxy subscribed to signals");
        tokio::spawn(session.run());
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Session {
    shard: ShardSelector,
    outbound: mpsc::Sender<Result<SignalBatch, Status>>,
    signals: watch::Receiver<SignalView>,
    config: watch::Receiver<ConfigView>,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    /// Per pool, the pool generation last sent: a pool goes out again only when it moved.
    sent: HashMap<String, u64>,
}

impl Session {
    async fn run(mut self) {
        let mut pools = BTreeSet::new();
        self.config.mark_changed();
        self.signals.mark_changed();
        let mut pending = false;
        loop {
            tokio::select! {
                changed = self.config.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    pools = pools_in_shard(&mut self.config, &self.shard);
                    // A pool that left the shard and comes back is sent whole again.
                    self.sent.retain(|pool, _| pools.contains(pool));
                    pending = true;
                }
                changed = self.signals.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    pending = true;
                }
                // Waiting for room before building: a slow proxy skips rounds it has not been
                // sent yet instead of queueing stale ones.
                permit = self.outbound.reserve(), if pending => {
                    let Ok(permit) = permit else { return };
                    pending = false;
                    let view = self.signals.borrow_and_update().clone();
                    if let Some(batch) = batch(&mut self.sent, &view, &pools) {
                        self.metrics.signals_sent();
                        permit.send(Ok(batch));
                    }
                }
                _ = self.shutdown.changed() => return,
                // The proxy went away while nothing changed.
                () = self.outbound.closed() => return,
            }
        }
    }
}

/// The InferencePools of the config's slice for `shard`.
pub(crate) fn pools_in_shard(
    config: &mut watch::Receiver<ConfigView>,
    shard: &ShardSelector,
) -> BTreeSet<String> {
    let view = config.borrow_and_update().clone();
    let slice = view.config.slice(shard);
    slice
        .specs::<InferencePoolSpec>()
        .map(|(metadata, _)| metadata.name.clone())
        .collect()
}

/// The pools of `pools` that moved since they were last sent (per `sent`), or `None`.
fn batch(
    sent: &mut HashMap<String, u64>,
    view: &SignalView,
    pools: &BTreeSet<String>,
) -> Option<SignalBatch> {
    let mut batch = SignalBatch {
        generation: view.generation,
        pools: Vec::new(),
    };
    for (name, pool) in &view.pools {
        if !pools.contains(name) || sent.get(name) == Some(&pool.generation) {
            continue;
        }
        sent.insert(name.clone(), pool.generation);
        batch.pools.push(to_wire(name, pool));
    }
    (!batch.pools.is_empty()).then_some(batch)
}

fn to_wire(name: &str, pool: &Arc<PoolSignals>) -> wire::PoolSignals {
    let pods = pool
        .endpoints
        .iter()
        .filter_map(|(endpoint, held)| Some(pod(endpoint, held.as_ref()?)))
        .collect();
    wire::PoolSignals {
        pool: name.to_string(),
        pods,
    }
}

fn pod(endpoint: &str, held: &HeldReading) -> wire::PodSignals {
    let reading = &held.reading;
    wire::PodSignals {
        endpoint: endpoint.to_string(),
        age_ms: held.age_ms(),
        waiting: reading.waiting,
        running: reading.running,
        kv_cache_usage: reading.kv_cache_usage,
        lora: reading.lora.as_ref().map(|lora| wire::LoraSignals {
            max_loras: lora.max_loras,
            running: lora.running.clone(),
            waiting: lora.waiting.clone(),
        }),
    }
}
