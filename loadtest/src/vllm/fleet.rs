//! Starting pods on consecutive ports, and running them until a signal.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::pod::{Pod, PodSettings};
use super::server::serve;
use super::VllmSimConfig;

/// With `port = 0`, how many free base ports to try before giving up on finding a run of
/// consecutive free ports (another process may take one between our binds).
const PORT_ZERO_ATTEMPTS: usize = 16;

/// A running fleet of simulated vLLM pods. Dropping it stops the pods too.
pub struct VllmFleet {
    addrs: Vec<SocketAddr>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl VllmFleet {
    /// Pod addresses, in pod order (consecutive ports).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    pub fn ports(&self) -> Vec<u16> {
        self.addrs.iter().map(SocketAddr::port).collect()
    }

    /// Stops accepting, drops open connections and stops every engine.
    pub async fn shutdown(mut self) {
        self.shutdown.send_replace(true);
        for task in std::mem::take(&mut self.tasks) {
            if let Err(error) = task.await {
                tracing::warn!(%error, "vLLM simulator task failed");
            }
        }
    }
}

impl Drop for VllmFleet {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// Binds every pod and starts serving; returns once all ports accept connections.
pub async fn start(config: VllmSimConfig) -> anyhow::Result<VllmFleet> {
    config.validate()?;
    let listeners = bind_consecutive(&config).await?;
    let (shutdown, _) = watch::channel(false);
    let settings = PodSettings {
        model: config.model.clone(),
        max_model_len: config.profile.max_model_len,
        block_size: config.profile.block_size,
        num_gpu_blocks: config.profile.num_gpu_blocks,
        time_scale: config.time_scale,
        max_loras: config.max_loras,
    };
    let mut addrs = Vec::with_capacity(listeners.len());
    let mut tasks = Vec::with_capacity(2 * listeners.len());
    for listener in listeners {
        addrs.push(listener.local_addr().context("listener address")?);
        let pod = Arc::new(Pod::new(settings.clone(), config.profile.clone(), &config.loras));
        tasks.push(tokio::spawn(pod.clone().drive(shutdown.subscribe())));
        tasks.push(tokio::spawn(serve(listener, pod, shutdown.subscribe())));
    }
    Ok(VllmFleet {
        addrs,
        shutdown,
        tasks,
    })
}

async fn bind_consecutive(config: &VllmSimConfig) -> anyhow::Result<Vec<TcpListener>> {
    let bind_run = |base: u16| async move {
        let mut listeners = Vec::with_capacity(config.pods);
        for i in 0..config.pods {
            let port = u16::try_from(usize::from(base) + i)
                .ok()
                .filter(|&p| p != 0)
                .with_context(|| format!("pod {i} would need a port above 65535"))?;
            let addr = SocketAddr::new(config.host, port);
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot bind pod {i} to {addr}"))?;
            listeners.push(listener);
        }
        anyhow::Ok(listeners)
    };
    if config.port != 0 {
        return bind_run(config.port).await;
    }
    let mut last_error = None;
    for _ in 0..PORT_ZERO_ATTEMPTS {
        let probe = TcpListener::bind(SocketAddr::new(config.host, 0))
            .await
            .with_context(|| format!("cannot bind {}", config.host))?;
        let base = probe.local_addr().context("listener address")?.port();
        drop(probe);
        match bind_run(base).await {
            Ok(listeners) => return Ok(listeners),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| anyhow::anyhow!("no free port run found")))
        .context("looking for consecutive free ports")
}
