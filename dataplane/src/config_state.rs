//! The live config: compiled tables swapped atomically, and the listeners that serve them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use portcullis_config::{collect_objects, ConfigError, ConfigSet, Kind, Object};
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::backend::{Backend, UpstreamClients};
use crate::cache::ConfigCache;
use crate::forward::Forwarder;
use crate::listener::RunningListener;
use crate::route::{Route, RouteTable};

/// One applied config version, compiled for serving.
#[derive(Default)]
pub(crate) struct Snapshot {
    /// `None` until the first version is applied.
    pub(crate) version: Option<u64>,
    pub(crate) config: ConfigSet,
    /// Name and address of each listener, sorted by name.
    pub(crate) listeners: Vec<(String, SocketAddr)>,
    /// Keyed by listener address rather than name, so renaming a listener keeps its socket.
    pub(crate) routes: HashMap<SocketAddr, RouteTable>,
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
}

pub(crate) struct ConfigState {
    snapshots: Arc<ArcSwap<Snapshot>>,
    clients: UpstreamClients,
    /// Also serializes applies, so two versions never bind or drain concurrently.
    listeners: Mutex<Listeners>,
    cache: Option<ConfigCache>,
    drain_grace: Duration,
    draining: AtomicBool,
}

#[derive(Default)]
struct Listeners {
    running: HashMap<SocketAddr, RunningListener>,
    /// Drains of listeners that a newer version removed; shutdown waits for them too.
    retiring: Vec<JoinHandle<()>>,
    closed: bool,
}

impl ConfigState {
    pub(crate) fn new(cache: Option<ConfigCache>, drain_grace: Duration) -> ConfigState {
        ConfigState {
            snapshots: Arc::new(ArcSwap::from_pointee(Snapshot::default())),
            clients: UpstreamClients::new(),
            listeners: Mutex::new(Listeners::default()),
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

    /// Applies a snapshot as received from the control plane.
    pub(crate) async fn apply_wire(
        &self,
        version: u64,
        objects: &[portcullis_proto::v1::Object],
    ) -> Result<(), ApplyError> {
        let parsed = collect_objects(objects.iter().enumerate().map(|(index, object)| {
            let location = format!("object {} ({}/{})", index + 1, object.kind, object.name);
            Object::from_json_bytes(&object.json, &location)
        }))?;
        self.apply(version, parsed).await
    }

    /// All or nothing: on any error the previous version keeps serving untouched.
    pub(crate) async fn apply(&self, version: u64, objects: Vec<Object>) -> Result<(), ApplyError> {
        let mut listeners = self.listeners.lock().await;
        if listeners.closed {
            return Err(ApplyError::ShuttingDown);
        }
        let config = ConfigSet::from_objects(objects)?;
        // Compare content too: a control plane rebuilt from empty storage counts versions
        // from 1 again, and the same number must not hide a different config.
        let current = self.current();
        if current.version == Some(version) && current.config == config {
            return Ok(());
        }
        let snapshot = compile(version, config).map_err(ApplyError::Compile)?;

        // Make before break: every new socket is bound before anything changes, and the
        // ones bound so far are closed (dropped) if one fails.
        let mut fresh = Vec::new();
        for (name, address) in &snapshot.listeners {
            if !listeners.running.contains_key(address) {
                let socket = TcpListener::bind(address)
                    .await
                    .map_err(|source| ApplyError::Bind {
                        listener: name.clone(),
                        address: *address,
                        source,
                    })?;
                fresh.push((*address, socket));
            }
        }

        let snapshot = Arc::new(snapshot);
        self.snapshots.store(snapshot.clone());
        for (address, socket) in fresh {
            let forwarder = Forwarder {
                snapshots: self.snapshots.clone(),
                clients: self.clients.clone(),
                listener: address,
            };
            listeners.running.insert(
                address,
                RunningListener::spawn(socket, forwarder, self.drain_grace),
            );
        }
        let wanted: Vec<SocketAddr> = snapshot.listeners.iter().map(|(_, address)| *address).collect();
        let removed: Vec<SocketAddr> = listeners
            .running
            .keys()
            .filter(|address| !wanted.contains(address))
            .copied()
            .collect();
        listeners.retiring.retain(|drain| !drain.is_finished());
        for address in removed {
            if let Some(listener) = listeners.running.remove(&address) {
                tracing::info!(%address, "listener removed, draining");
                let drain = listener.drain();
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
        let drains: Vec<_> = {
            let mut listeners = self.listeners.lock().await;
            listeners.closed = true;
            let retiring = std::mem::take(&mut listeners.retiring);
            listeners
                .running
                .drain()
                .map(|(_, listener)| listener.drain())
                .chain(retiring)
                .collect()
        };
        for drain in futures::future::join_all(drains).await {
            if let Err(error) = drain {
                tracing::warn!(%error, "listener drain task failed");
            }
        }
    }
}

fn compile(version: u64, config: ConfigSet) -> Result<Snapshot, String> {
    let backends: HashMap<String, Arc<Backend>> = config
        .objects()
        .filter_map(|object| match object {
            Object::Backend { metadata, spec } => Some(
                Backend::compile(&metadata.name, spec)
                    .map(|backend| (metadata.name.clone(), Arc::new(backend))),
            ),
            _ => None,
        })
        .collect::<Result<_, _>>()?;
    let listeners: Vec<(String, SocketAddr)> = config
        .of_kind(Kind::Listener)
        .filter_map(|object| match object {
            Object::Listener { metadata, spec } => Some((metadata.name.clone(), spec.socket_addr())),
            _ => None,
        })
        .collect();
    let mut routes_by_listener: HashMap<&str, Vec<Arc<Route>>> = HashMap::new();
    for object in config.of_kind(Kind::Route) {
        if let Object::Route { metadata, spec } = object {
            let route = Arc::new(Route::compile(&metadata.name, spec, &backends)?);
            for listener in &spec.listeners {
                routes_by_listener
                    .entry(listener.as_str())
                    .or_default()
                    .push(route.clone());
            }
        }
    }
    let routes = listeners
        .iter()
        .map(|(name, address)| {
            let routes = routes_by_listener.remove(name.as_str()).unwrap_or_default();
            (*address, RouteTable::new(routes))
        })
        .collect();
    Ok(Snapshot {
        version: Some(version),
        config,
        listeners,
        routes,
    })
}
