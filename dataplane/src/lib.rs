//! The Portcullis proxy. The modules follow a request's path (see [`pipeline`]):
//! [`listener`] accepts it, [`normalize`] gives it one canonical form, [`route`] finds its
//! route in the live config ([`config_state`]), the [`policy`] chain may change or answer
//! it, a [`target`] decides where it goes and [`upstream`] sends it there and streams the
//! answer back; [`telemetry`] records it. The config arrives from the control plane
//! ([`subscription`]; pod signals for the pickers beside it, [`signals`]), survives restarts in [`cache`], and [`admin`] reports on it all.

mod admin;
mod body;
mod cache;
mod config_state;
mod listener;
mod llm;
mod normalize;
mod pipeline;
mod placements;
mod policy;
mod response;
mod route;
mod signals;
mod sse;
mod subscription;
mod target;
mod telemetry;
mod upstream;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::admin::AdminHandler;
use crate::cache::ConfigCache;
use crate::config_state::ConfigState;
use crate::listener::{BoundSocket, Limits, RunningListener, Workers};
use crate::placements::PlacementExchange;
use crate::signals::SignalSubscriber;
use crate::subscription::{run_forever, ControlPlanes, Subscriber};
use crate::telemetry::Telemetry;
pub use crate::telemetry::{AccessLogConfig, AccessLogDestination, TelemetryConfig};

/// Admin requests are instant; anything still open after this is a stuck client.
const ADMIN_DRAIN_GRACE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Stable identity shown by the control plane.
    pub proxy_id: String,
    /// Control-plane node addresses, e.g. `http://127.0.0.1:7070`: any node serves the
    /// config; when the one in use fails, the proxy moves to the next.
    pub controlplanes: Vec<String>,
    /// Listener label selector; empty serves the whole config.
    pub shard: BTreeMap<String, String>,
    /// Address of `/livez`, `/readyz` and `/status`; port 0 picks a free port.
    pub admin_listen: SocketAddr,
    /// Where the last good config is kept across restarts; `None` keeps nothing.
    pub cache_dir: Option<PathBuf>,
    /// How long a drain waits for in-flight requests and streams before closing them.
    pub drain_grace: Duration,
    /// Threads serving traffic, each with its own runtime; 0 means one per core.
    pub workers: usize,
    /// Where the other replicas reach this proxy's admin port, to hand it an MCP client's
    /// answer to a question of a call this proxy holds: `HOST:PORT`, or an IP address (of the
    /// admin port). `None`: the admin address, unless it is unspecified (`0.0.0.0`) or
    /// loopback (no other host reaches it); then answers must reach this proxy.
    pub peer_address: Option<String>,
    pub telemetry: TelemetryConfig,
}

pub struct Proxy {
    state: Arc<ConfigState>,
    admin: RunningListener,
    admin_addr: SocketAddr,
    subscription: JoinHandle<()>,
    signals: JoinHandle<()>,
    placements: JoinHandle<()>,
}

/// Where other replicas reach this proxy's admin port (see [`ProxyConfig::peer_address`]).
fn peer_address(given: Option<&str>, admin: SocketAddr) -> anyhow::Result<Option<String>> {
    let Some(given) = given else {
        let reachable = !admin.ip().is_unspecified() && !admin.ip().is_loopback();
        return Ok(reachable.then(|| admin.to_string()));
    };
    if let Ok(ip) = given.parse::<std::net::IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, admin.port()).to_string()));
    }
    match given.parse::<http::uri::Authority>() {
        Ok(authority) if authority.port_u16().is_some() && !given.contains('@') => {
            Ok(Some(given.to_string()))
        }
        _ => anyhow::bail!(
            "--peer-address {given:?}: expected HOST:PORT (an IPv6 address in brackets) or an IP address"
        ),
    }
}

impl Proxy {
    /// Returns once the admin server is bound and any cached config is serving; the
    /// control-plane config arrives asynchronously.
    pub async fn start(config: ProxyConfig) -> anyhow::Result<Proxy> {
        // Every node would refuse it, and the proxy would wait for ever: say so at once.
        let identity = portcullis_proto::v1::Hello {
            proxy_id: config.proxy_id.clone(),
            shard: config.shard.clone().into_iter().collect(),
            ..Default::default()
        };
        if let Some(problem) = portcullis_proto::hello_problem(&identity) {
            anyhow::bail!("the control plane would refuse this proxy's id or shard: {problem}");
        }
        let controlplanes = Arc::new(ControlPlanes::new(&config.controlplanes)?);
        let telemetry = Arc::new(Telemetry::new(config.telemetry)?);
        let (outbox, placements) = placements::outbox();
        let workers = Workers::start(config.workers).context("cannot start the worker threads")?;
        let admin_socket = BoundSocket::bind(config.admin_listen, &Workers::current())
            .await
            .with_context(|| format!("cannot listen on admin address {}", config.admin_listen))?;
        let admin_addr = admin_socket.local_addr();
        let peer_address = peer_address(config.peer_address.as_deref(), admin_addr)?;
        match &peer_address {
            Some(address) => tracing::info!(peer_address = %address, "other replicas hand MCP answers over here"),
            None => tracing::info!(
                "no peer address (--peer-address): an MCP client's answer to a server's question must reach the replica holding the call"
            ),
        }
        let state = Arc::new(ConfigState::new(
            config
                .cache_dir
                .map(|dir| ConfigCache::new(dir, config.shard.clone())),
            config.drain_grace,
            telemetry,
            outbox,
            workers,
            peer_address,
        ));
        let admin_handler = AdminHandler {
            state: state.clone(),
            proxy_id: Arc::from(config.proxy_id.as_str()),
        };
        let admin = RunningListener::spawn(admin_socket, admin_handler, Limits::admin(), ADMIN_DRAIN_GRACE);
        state.restore_from_cache().await;
        let signals = tokio::spawn(run_forever(SignalSubscriber {
            state: state.clone(),
            controlplanes: controlplanes.clone(),
            proxy_id: config.proxy_id.clone(),
            shard: config.shard.clone(),
        }));
        let placements = tokio::spawn(run_forever(PlacementExchange {
            state: state.clone(),
            controlplanes: controlplanes.clone(),
            proxy_id: config.proxy_id.clone(),
            shard: config.shard.clone(),
            outbox: tokio::sync::Mutex::new(placements),
        }));
        let subscription = tokio::spawn(run_forever(Subscriber {
            state: state.clone(),
            controlplanes,
            instance: format!("{:016x}", rand::random::<u64>()),
            proxy_id: config.proxy_id,
            shard: config.shard,
        }));
        tracing::info!(%admin_addr, "proxy started");
        Ok(Proxy {
            state,
            admin,
            admin_addr,
            subscription,
            signals,
            placements,
        })
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Drain: stop accepting on every listener, readiness → 503, let in-flight requests
    /// and streams finish within drain_grace, then close the rest and return.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        // No new version may start listeners while the old ones drain.
        self.subscription.abort();
        self.signals.abort();
        self.placements.abort();
        self.state.shutdown().await;
        self.admin.drain().await.context("admin server task failed")?;
        self.state.telemetry().shutdown().await;
        tracing::info!("proxy stopped");
        Ok(())
    }
}
