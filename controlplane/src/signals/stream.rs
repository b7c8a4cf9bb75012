//! SignalStream: each proxy gets the latest scrape round of every pool in its shard, then
//! each new round, one message per change of the replicated signals. Any control-plane node
//! serves it from its own copy of the signals state machine.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use portcullis_config::{ConfigSet, InferencePoolSpec, ShardSelector, Slicer};
use portcullis_proto::v1::signal_stream_server::SignalStream;
use portcullis_proto::v1::{self as wire, SignalBatch, SignalSubscription};
use tokio::sync::{mpsc, watch, OnceCell};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::store::{HeldReading, PoolSignals, SignalView};
use crate::metrics::Metrics;
use crate::view::{ConfigView, Streamed};

pub struct SignalStreamService {
    signals: watch::Receiver<SignalView>,
    config: Streamed,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    pools: ShardPools,
}

impl SignalStreamService {
    pub fn new(
        signals: watch::Receiver<SignalView>,
        config: Streamed,
        shutdown: watch::Receiver<bool>,
        metrics: Metrics,
    ) -> Self {
        Self {
            signals,
            config,
            shutdown,
            metrics,
            pools: ShardPools::default(),
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
            config: self.config.subscribe(),
            shutdown: self.shutdown.clone(),
            metrics: self.metrics.clone(),
            pools: self.pools.clone(),
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
    pools: ShardPools,
    /// Per pool, the pool generation last sent: a pool goes out again only when it moved.
    sent: HashMap<String, u64>,
}

impl Session {
    async fn run(mut self) {
        let mut pools = Arc::default();
        self.config.mark_changed();
        self.signals.mark_changed();
        let mut pending = false;
        loop {
            tokio::select! {
                changed = self.config.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    pools = self.pools.latest(&mut self.config, &self.shard).await;
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

/// The InferencePools of each shard's slice of the latest config version, shared by the
/// sessions of a service: slicing links every object of the config, too much to repeat for
/// every proxy on every write, so a version is linked once and each shard's pools are read
/// once. The version before the latest is kept too: the streams' groups see a new version one
/// after another (`Streamed`), so for a moment some sessions still read the one before.
#[derive(Clone, Default)]
pub(crate) struct ShardPools(Arc<Mutex<[Cut; 2]>>);

/// One version's pools by shard, each worked out once.
#[derive(Default)]
struct Cut {
    version: u64,
    /// The version's config; a view holding another is another version.
    config: Arc<ConfigSet>,
    slicer: Arc<OnceCell<Slicer>>,
    pools: HashMap<ShardSelector, Arc<OnceCell<Arc<BTreeSet<String>>>>>,
}

impl ShardPools {
    /// The InferencePools of the latest version's slice for `shard`; marks the version seen.
    pub(crate) async fn latest(
        &self,
        config: &mut watch::Receiver<ConfigView>,
        shard: &ShardSelector,
    ) -> Arc<BTreeSet<String>> {
        let (version, config) = {
            let view = config.borrow_and_update();
            (view.version, view.config.clone())
        };
        self.of(version, &config, shard).await
    }

    async fn of(
        &self,
        version: u64,
        config: &Arc<ConfigSet>,
        shard: &ShardSelector,
    ) -> Arc<BTreeSet<String>> {
        let (slicer, pools) = {
            // Every change under the lock is a whole assignment or insert.
            let mut cuts = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let held = cuts.iter().position(|cut| Arc::ptr_eq(&cut.config, config));
            let older = usize::from(cuts[1].version < cuts[0].version);
            let slot = held.or_else(|| {
                (version >= cuts[older].version).then(|| {
                    cuts[older] = Cut {
                        version,
                        config: config.clone(),
                        ..Cut::default()
                    };
                    older
                })
            });
            match slot.and_then(|slot| cuts.get_mut(slot)) {
                Some(cut) => (
                    cut.slicer.clone(),
                    cut.pools.entry(shard.clone()).or_default().clone(),
                ),
                // Older than both kept versions: worked out for this session alone.
                None => Default::default(),
            }
        };
        let names = |slice: &ConfigSet| -> BTreeSet<String> {
            slice
                .specs::<InferencePoolSpec>()
                .map(|(metadata, _)| metadata.name.clone())
                .collect()
        };
        pools
            .get_or_init(|| async {
                // The whole config is every shard-less proxy's slice: nothing to link.
                if shard.is_empty() {
                    return Arc::new(names(config));
                }
                let slicer = slicer
                    .get_or_init(|| async { Slicer::new(ConfigSet::clone(config)) })
                    .await;
                Arc::new(names(&slicer.slice(shard)))
            })
            .await
            .clone()
    }
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

#[cfg(test)]
mod tests {
    use portcullis_config::parse_documents;

    use super::*;

    /// Pool `edge` behind a listener of shard `zone: edge`, pool `core` behind one of no shard.
    fn view(version: u64, edge: &str, core: &str) -> ConfigView {
        let header = "apiVersion: portcullis.dev/v1alpha1";
        let pool = |name: &str| {
            format!("{header}\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec: {{endpoints: ['127.0.0.1:1'], models: [{{name: m}}]}}\n---\n")
        };
        let serving = |listener: &str, port: u16, labels: &str, pool: &str| {
            format!(
                "{header}\nkind: Listener\nmetadata: {{name: {listener}, labels: {{{labels}}}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
                 {header}\nkind: Route\nmetadata: {{name: {listener}}}\nspec: {{listeners: [{listener}], backends: [{{kind: InferencePool, name: {pool}}}]}}\n---\n"
            )
        };
        let yaml = pool(edge)
            + &pool(core)
            + &serving("edge", 8081, "zone: edge", edge)
            + &serving("core", 8082, "", core);
        ConfigView {
            version,
            config: Arc::new(ConfigSet::from_slice(parse_documents(&yaml).unwrap()).unwrap()),
            unreadable: None,
        }
    }

    fn names(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|name| name.to_string()).collect()
    }

    #[tokio::test]
    async fn sessions_share_each_shards_pools_and_see_a_write_move_them() {
        let version_1 = view(1, "a", "b");
        let (publish, config) = watch::channel(version_1.clone());
        let edge = ShardSelector::from([("zone".to_string(), "edge".to_string())]);
        let pools = ShardPools::default();
        let (mut first, mut second) = (config.clone(), config.clone());
        let got = pools.latest(&mut first, &edge).await;
        assert_eq!(*got, names(&["a"]));
        let shared = pools.clone().latest(&mut second, &edge).await;
        assert!(Arc::ptr_eq(&got, &shared), "worked out once for both sessions");
        assert_eq!(
            *pools.latest(&mut first, &ShardSelector::new()).await,
            names(&["a", "b"])
        );

        // The write swaps the pools' places: the edge shard now has b.
        let version_2 = view(2, "b", "a");
        publish.send(version_2.clone()).unwrap();
        assert!(first.has_changed().unwrap());
        assert_eq!(*pools.latest(&mut first, &edge).await, names(&["b"]));
        assert!(!first.has_changed().unwrap(), "the version is marked seen");
        let moved = pools.latest(&mut second, &edge).await;
        assert_eq!(*moved, names(&["b"]));

        // A session whose group of streams still holds version 1 gets version 1's pools as
        // worked out before, and version 2's stay.
        let (_kept, mut behind) = watch::channel(version_1);
        let back = pools.latest(&mut behind, &edge).await;
        assert!(Arc::ptr_eq(&got, &back), "version 1's pools are kept");
        let again = pools.latest(&mut first, &edge).await;
        assert!(Arc::ptr_eq(&moved, &again), "and version 2's");

        // Version 3 takes version 1's place: a session still on version 1 gets its pools
        // worked out alone, and version 2's stay.
        publish.send(view(3, "a", "b")).unwrap();
        let third = pools.latest(&mut first, &edge).await;
        assert_eq!(*third, names(&["a"]));
        let alone = pools.latest(&mut behind, &edge).await;
        assert_eq!(*alone, names(&["a"]));
        assert!(!Arc::ptr_eq(&got, &alone), "version 1 is no longer kept");
        let (_kept, mut on_2) = watch::channel(version_2);
        assert!(Arc::ptr_eq(&moved, &pools.latest(&mut on_2, &edge).await));
        assert!(Arc::ptr_eq(&third, &pools.latest(&mut second, &edge).await));
    }
}
