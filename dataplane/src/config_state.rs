//! The live config: compiled tables swapped atomically, and the listeners that serve them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::uri::Authority;
use portcullis_config::{
    collect_objects, ConfigError, ConfigSet, GuardrailPhase, InferencePoolSpec, Kind, ListenerSpec, Object,
    ObjectKey, RouteSpec,
};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::cache::ConfigCache;
use crate::listener::{BoundSocket, Limits, RunningListener, Workers};
use crate::llm;
use crate::normalize::Forwarding;
use crate::pipeline::Pipeline;
use crate::placements::Outbox;
use crate::policy::guardrail::GuardrailIndex;
use crate::policy::{Policy, PolicyIndex};
use crate::route::{Route, RouteTable};
use crate::target::{self, InferencePoolTarget, InputWaits, Targets, WeightedTargets};
use crate::telemetry::{InForce, Telemetry};
use crate::upstream::{RetryPolicy, Upstream};

/// How long a stopping proxy waits for background work (MCP sessions being opened for
/// clients that left, and closed) once its workers have stopped.
const BACKGROUND_GRACE: Duration = Duration::from_secs(10);

/// One applied config version, compiled for serving.
#[derive(Default)]
pub(crate) struct Snapshot {
    /// `None` until the first version is applied.
    pub(crate) version: Option<u64>,
    pub(crate) config: ConfigSet,
    /// Each listener by name, sorted by name.
    pub(crate) listeners: Vec<ListenerEntry>,
    /// Keyed by listener address rather than name, so renaming a listener keeps its socket.
    pub(crate) tables: HashMap<SocketAddr, ListenerTable>,
    /// Kept to reuse unchanged policies (and their state) in the next version.
    policies: PolicyIndex,
    /// Kept to reuse unchanged targets' state (pool pickers) in the next version.
    targets: Targets,
    /// Kept to reuse unchanged guardrails (replica health, breakers) in the next version.
    guardrails: GuardrailIndex,
    /// Every upstream address the targets of this version use.
    endpoints: HashSet<Authority>,
}

pub(crate) struct ListenerEntry {
    pub(crate) name: String,
    pub(crate) address: SocketAddr,
    limits: Limits,
}

/// What a listener does with a request before and around its route.
pub(crate) struct ListenerTable {
    pub(crate) name: Arc<str>,
    pub(crate) routes: RouteTable,
    pub(crate) policies: Vec<Arc<dyn Policy>>,
    pub(crate) merge_slashes: bool,
    pub(crate) forwarding: Forwarding,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ApplyError {
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    #[error("{0}")]
    Compile(String),
    #[error("Listener/{listener}: cannot listen on {address}: {source}")]
    Bind {
        listener: String,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("the proxy is shutting down")]
    ShuttingDown,
    /// A delta this proxy cannot apply: the control plane sends the version whole instead.
    #[error("a delta against version {base} does not fit the config this proxy holds: {problem}")]
    Delta { base: u64, problem: String },
}

pub(crate) struct ConfigState {
    snapshots: Arc<ArcSwap<Snapshot>>,
    upstream: Arc<Upstream>,
    telemetry: Arc<Telemetry>,
    /// Also serializes applies, so two versions never bind or drain concurrently.
    listeners: Mutex<Listeners>,
    cache: Option<ConfigCache>,
    drain_grace: Duration,
    draining: AtomicBool,
}

struct Listeners {
    /// The threads every listener accepts and serves on.
    workers: Workers,
    running: HashMap<SocketAddr, RunningListener>,
    /// Drains of listeners that a newer version removed; shutdown waits for them too.
    retiring: Vec<JoinHandle<()>>,
    closed: bool,
}

impl Snapshot {
    pub(crate) fn pool(&self, name: &str) -> Option<&Arc<InferencePoolTarget>> {
        self.targets.pools.get(name)
    }

    pub(crate) fn pools(&self) -> impl Iterator<Item = (&String, &Arc<InferencePoolTarget>)> {
        self.targets.pools.iter()
    }
}

impl ConfigState {
    /// Answers MCP clients gave to questions of calls this proxy holds.
    pub(crate) fn input_waits(&self) -> &InputWaits {
        &self.upstream.input_waits
    }

    /// What the proxy finds while serving (McpToolPins drift), as it changes.
    pub(crate) fn findings(&self) -> tokio::sync::watch::Receiver<portcullis_proto::v1::Findings> {
        self.upstream.tool_pins.subscribe()
    }
}

impl ConfigState {
    pub(crate) fn new(
        cache: Option<ConfigCache>,
        drain_grace: Duration,
        telemetry: Arc<Telemetry>,
        placements: Outbox,
        workers: Workers,
        peer_address: Option<String>,
    ) -> ConfigState {
        ConfigState {
            snapshots: Arc::new(ArcSwap::from_pointee(Snapshot::default())),
            upstream: Arc::new(Upstream::new(telemetry.clone(), placements, peer_address)),
            telemetry,
            listeners: Mutex::new(Listeners {
                workers,
                running: HashMap::new(),
                retiring: Vec::new(),
                closed: false,
            }),
            cache,
            drain_grace,
            draining: AtomicBool::new(false),
        }
    }

    pub(crate) fn current(&self) -> Arc<Snapshot> {
        self.snapshots.load_full()
    }

    /// Why the proxy should not receive traffic, if it should not.
    pub(crate) fn not_ready_reason(&self) -> Option<&'static str> {
        if self.draining.load(Ordering::Relaxed) {
            Some("draining")
        } else if self.current().version.is_none() {
            Some("no config version applied yet")
        } else {
            None
        }
    }

    pub(crate) fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// Applies a version as received from the control plane: whole, or as a delta against
    /// the version this proxy holds. Either way the version applies whole or not at all.
    pub(crate) async fn apply_wire(
        &self,
        message: &portcullis_proto::v1::ConfigSnapshot,
    ) -> Result<(), ApplyError> {
        let received = collect_objects(message.objects.iter().enumerate().map(|(index, object)| {
            let location = format!("object {} ({}/{})", index + 1, object.kind, object.name);
            Object::from_json_bytes(&object.json, &location)
        }))?;
        let objects = match message.base_version {
            None => received,
            Some(base) => {
                let current = self.current();
                let problem = |problem: String| ApplyError::Delta { base, problem };
                if current.version != Some(base) {
                    let held = current
                        .version
                        .map_or("none".to_string(), |version| version.to_string());
                    return Err(problem(format!("this proxy holds version {held}")));
                }
                let mut objects: BTreeMap<ObjectKey, Object> = current
                    .config
                    .objects()
                    .map(|object| (object.key(), object.clone()))
                    .collect();
                for removed in &message.removed {
                    let key = Kind::from_name(&removed.kind)
                        .map(|kind| ObjectKey::new(kind, removed.name.as_str()));
                    if key.and_then(|key| objects.remove(&key)).is_none() {
                        return Err(problem(format!(
                            "it removes {}/{}, which this proxy does not hold",
                            removed.kind, removed.name
                        )));
                    }
                }
                objects.extend(received.into_iter().map(|object| (object.key(), object)));
                objects.into_values().collect()
            }
        };
        self.apply(message.version, objects).await
    }

    /// All or nothing: on any error the previous version keeps serving untouched.
    pub(crate) async fn apply(&self, version: u64, objects: Vec<Object>) -> Result<(), ApplyError> {
        let result = self.apply_version(version, objects).await;
        match &result {
            Ok(()) => {
                let current = self.current();
                let live = InForce::new(&current.config, current.endpoints.iter().map(Authority::as_str));
                self.telemetry.config_applied(version, &live);
            }
            Err(ApplyError::ShuttingDown) => {}
            Err(_) => self.telemetry.config_rejected(version),
        }
        result
    }

    async fn apply_version(&self, version: u64, objects: Vec<Object>) -> Result<(), ApplyError> {
        let mut guard = self.listeners.lock().await;
        // Fields borrowed apart: sockets bind for `workers` while `running` changes.
        let listeners = &mut *guard;
        if listeners.closed {
            return Err(ApplyError::ShuttingDown);
        }
        let config = ConfigSet::from_slice(objects)?;
        // Compare content too: a control plane rebuilt from empty storage counts versions
        // from 1 again, and the same number must not hide a different config.
        let current = self.current();
        // And every listener of it must be open: a failed move may have lost one, and the
        // same version sent again is the chance to reopen it.
        let all_open = current
            .listeners
            .iter()
            .all(|entry| listeners.running.contains_key(&entry.address));
        if current.version == Some(version) && current.config == config && all_open {
            return Ok(());
        }
        let snapshot = compile(version, config, &current, &self.upstream).map_err(ApplyError::Compile)?;

        // Make before break: every new socket is bound before anything changes, and the
        // ones bound so far are closed (dropped) if one fails. A listener moving to another
        // address on the same port may not be bindable while the old socket is open
        // (0.0.0.0:P and 127.0.0.1:P conflict): those moves come last, once everything
        // else is bound, closing the old socket first and reopening it if the move fails.
        let mut fresh = Vec::new();
        let mut moves = Vec::new();
        for entry in &snapshot.listeners {
            if listeners.running.contains_key(&entry.address) {
                continue;
            }
            match BoundSocket::bind(entry.address, &listeners.workers).await {
                Ok(socket) => fresh.push((entry.address, entry.limits.clone(), socket)),
                Err(error) => {
                    let moving_from = (error.kind() == std::io::ErrorKind::AddrInUse)
                        .then(|| {
                            listeners.running.keys().copied().find(|old| {
                                old.port() == entry.address.port()
                                    && !snapshot.tables.contains_key(old)
                                    && may_conflict(old.ip(), entry.address.ip())
                            })
                        })
                        .flatten();
                    match moving_from {
                        Some(old) => moves.push((old, entry)),
                        None => {
                            return Err(ApplyError::Bind {
                                listener: entry.name.clone(),
                                address: entry.address,
                                source: error,
                            })
                        }
                    }
                }
            }
        }
        let mut moved_from = Vec::new();
        for (old, entry) in moves {
            // Several new addresses may replace one old socket: it is closed once.
            if let Some(running) = listeners.running.remove(&old) {
                tracing::warn!(
                    from = %old, to = %entry.address,
                    "cannot bind the new address while the old one is open: closing the old listener first"
                );
                moved_from.push((old, running.limits()));
                let drain = running.close().await;
                listeners.retiring.push(drain);
            }
            match BoundSocket::bind(entry.address, &listeners.workers).await {
                Ok(socket) => fresh.push((entry.address, entry.limits.clone(), socket)),
                Err(source) => {
                    // Back to every old address, serving the current version as before;
                    // the new sockets bound so far close as `fresh` is dropped.
                    drop(fresh);
                    for (old, limits) in moved_from {
                        match BoundSocket::bind(old, &listeners.workers).await {
                            Ok(socket) => {
                                let pipeline = self.pipeline(old);
                                listeners.running.insert(
                                    old,
                                    RunningListener::spawn(socket, pipeline, limits, self.drain_grace),
                                );
                            }
                            Err(error) => {
                                tracing::error!(address = %old, %error, "could not reopen the listener after a failed move")
                            }
                        }
                    }
                    return Err(ApplyError::Bind {
                        listener: entry.name.clone(),
                        address: entry.address,
                        source,
                    });
                }
            }
        }

        let snapshot = Arc::new(snapshot);
        self.snapshots.store(snapshot.clone());
        self.upstream.retain_endpoints(&snapshot.endpoints);
        snapshot.targets.put_mcp_in_force(&self.upstream);
        for entry in &snapshot.listeners {
            if let Some(running) = listeners.running.get(&entry.address) {
                running.set_limits(entry.limits.clone());
            }
        }
        for (address, limits, socket) in fresh {
            let pipeline = self.pipeline(address);
            listeners.running.insert(
                address,
                RunningListener::spawn(socket, pipeline, limits, self.drain_grace),
            );
        }
        let removed: Vec<SocketAddr> = listeners
            .running
            .keys()
            .filter(|address| !snapshot.tables.contains_key(address))
            .copied()
            .collect();
        listeners.retiring.retain(|drain| !drain.is_finished());
        for address in removed {
            if let Some(listener) = listeners.running.remove(&address) {
                tracing::info!(%address, "listener removed, draining");
                // Once the version is in force its removed ports refuse connections.
                let drain = listener.close().await;
                listeners.retiring.push(drain);
            }
        }
        tracing::info!(version, listeners = snapshot.listeners.len(), "config applied");

        if let Some(cache) = &self.cache {
            if let Err(error) = cache.store(version, &snapshot.config).await {
                tracing::warn!(%error, path = %cache.path().display(), "could not write the config cache");
            }
        }
        Ok(())
    }

    fn pipeline(&self, listener: SocketAddr) -> Pipeline {
        Pipeline {
            snapshots: self.snapshots.clone(),
            upstream: self.upstream.clone(),
            telemetry: self.telemetry.clone(),
            listener,
        }
    }

    /// Serves the cached version, if any, so a restart while the control plane is down
    /// still serves traffic.
    pub(crate) async fn restore_from_cache(&self) {
        let Some(cache) = &self.cache else { return };
        match cache.load().await {
            Ok(None) => {}
            Ok(Some((version, objects))) => match self.apply(version, objects).await {
                Ok(()) => tracing::info!(
                    version,
                    "serving the cached config until the control plane answers"
                ),
                Err(error) => tracing::warn!(version, %error, "could not apply the cached config"),
            },
            Err(error) => {
                tracing::warn!(%error, path = %cache.path().display(), "ignoring unreadable config cache")
            }
        }
    }

    /// Stops accepting everywhere and waits for the drains; later applies are refused.
    pub(crate) async fn shutdown(&self) {
        self.draining.store(true, Ordering::Relaxed);
        let mut listeners = self.listeners.lock().await;
        listeners.closed = true;
        let retiring = std::mem::take(&mut listeners.retiring);
        let drains: Vec<_> = listeners
            .running
            .drain()
            .map(|(_, listener)| listener.drain())
            .chain(retiring)
            .collect();
        for drain in futures::future::join_all(drains).await {
            if let Err(error) = drain {
                tracing::warn!(%error, "listener drain task failed");
            }
        }
        listeners.workers.stop().await;
        drop(listeners);
        // The workers' last tasks dropped ended their sessions on the main runtime.
        self.upstream.background.drain(BACKGROUND_GRACE).await;
    }
}

pub(crate) fn compile(
    version: u64,
    config: ConfigSet,
    previous: &Snapshot,
    upstream: &Upstream,
) -> Result<Snapshot, String> {
    let guardrails = GuardrailIndex::compile(&config, &previous.guardrails)?;
    let targets = target::compile(&config, upstream, &previous.targets, &guardrails)?;
    let endpoints = targets
        .by_key
        .values()
        .flat_map(|target| target.endpoints().into_iter().cloned())
        .collect();
    let policies = PolicyIndex::compile(&config, &previous.policies)?;
    let route_kind = Kind::of::<RouteSpec>();
    let listener_kind = Kind::of::<ListenerSpec>();
    let mut routes_by_listener: HashMap<&str, Vec<Arc<Route>>> = HashMap::new();
    for (metadata, spec) in config.specs::<RouteSpec>() {
        let label = format!("Route/{}", metadata.name);
        let weighted = WeightedTargets::resolve(&spec.backends, &targets.by_key)
            .map_err(|problem| format!("{label}: {problem}"))?;
        let route = Route::compile(
            &metadata.name,
            spec,
            weighted,
            llm_models(spec, &targets, &guardrails),
            policies.chain(&ObjectKey::new(route_kind, metadata.name.as_str())),
            RetryPolicy::compile(spec.retry.as_ref()),
        )
        .map_err(|problem| format!("{label}: {problem}"))?;
        let route = Arc::new(route);
        for listener in &spec.listeners {
            routes_by_listener
                .entry(listener.as_str())
                .or_default()
                .push(route.clone());
        }
    }
    let mut listeners = Vec::new();
    let mut tables = HashMap::new();
    for (metadata, spec) in config.specs::<ListenerSpec>() {
        let address = spec.socket_addr();
        listeners.push(ListenerEntry {
            name: metadata.name.clone(),
            address,
            limits: Limits::from_spec(&spec.limits),
        });
        let table = ListenerTable {
            name: Arc::from(metadata.name.as_str()),
            routes: RouteTable::new(
                routes_by_listener
                    .remove(metadata.name.as_str())
                    .unwrap_or_default(),
            ),
            policies: policies.chain(&ObjectKey::new(listener_kind, metadata.name.as_str())),
            merge_slashes: spec.merge_slashes(),
            forwarding: Forwarding::new(spec.trusted_proxies.clone()),
        };
        tables.insert(address, table);
    }
    Ok(Snapshot {
        version: Some(version),
        config,
        listeners,
        tables,
        policies,
        targets,
        guardrails,
        endpoints,
    })
}

/// The model table of a route whose backends are InferencePools (validation keeps a route
/// from mixing them with other kinds), `None` for any other route.
fn llm_models(spec: &RouteSpec, targets: &Targets, guardrails: &GuardrailIndex) -> Option<llm::Models> {
    let pool_kind = Kind::of::<InferencePoolSpec>();
    let pools: Vec<llm::RoutePool<'_>> = spec
        .backends
        .iter()
        .filter(|backend| Kind::from_name(&backend.kind) == Some(pool_kind))
        .filter_map(|backend| {
            let pool = targets.pools.get(&backend.name)?;
            Some(llm::RoutePool {
                spec: pool.spec(),
                target: pool.clone(),
                guards: guardrails.pool(GuardrailPhase::LlmRequest, &backend.name),
                completion_guards: guardrails.pool(GuardrailPhase::LlmResponse, &backend.name),
                priority_class: backend.priority_class.as_deref().map(Arc::from),
            })
        })
        .collect();
    (!pools.is_empty()).then(|| llm::Models::compile(&pools))
}

/// Whether sockets on `a` and `b` (same port) can keep each other from binding: a wildcard
/// takes every address, and `::ffff:a.b.c.d` is `a.b.c.d`. Any other address in use belongs to
/// someone else, and closing one of ours would not free it.
fn may_conflict(a: std::net::IpAddr, b: std::net::IpAddr) -> bool {
    a.is_unspecified() || b.is_unspecified() || a.to_canonical() == b.to_canonical()
}
