//! Work a request starts that must run to its end even if the request's worker stops first:
//! opening and closing MCP sessions whose client may have left. It runs on the proxy's main
//! runtime, which outlives the workers, and shutdown waits for it after the workers stop, for
//! a bounded time: each piece has its own timeouts, but opening a session takes several
//! exchanges, each bounded by the server's (possibly long) timeout.

use std::future::Future;
use std::time::Duration;

use tokio_util::task::TaskTracker;

#[derive(Clone)]
pub(crate) struct Background {
    /// The main runtime; `None` where the proxy was built outside one (some unit tests),
    /// and then the calling runtime is used.
    runtime: Option<tokio::runtime::Handle>,
    tasks: TaskTracker,
}

impl Background {
    /// Takes the current runtime as the one background work runs on.
    pub(crate) fn on_current_runtime() -> Self {
        Self {
            runtime: tokio::runtime::Handle::try_current().ok(),
            tasks: TaskTracker::new(),
        }
    }

    /// Runs `work` on the main runtime, counted until it ends; it is dropped unrun only where
    /// there is no runtime at all (a guard dropped outside one). What it produces goes
    /// nowhere: anything to hand back goes over a channel, from inside the work.
    pub(crate) fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if let Some(runtime) = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        {
            runtime.spawn(self.tasks.track_future(work));
        }
    }

    /// Runs `work` as background work and hands back what it produces; `None` only if it
    /// panicked or could not run. A caller that stops waiting (its client left) does not stop
    /// the work: what it produced is then dropped inside the task, so a session it opened is
    /// closed as background work too (a task's unclaimed output would be dropped only after
    /// it stopped counting as running).
    pub(crate) async fn outcome<T, F>(&self, work: F) -> Option<T>
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        let (produced, outcome) = tokio::sync::oneshot::channel();
        self.spawn(async move {
            let _ = produced.send(work.await);
        });
        outcome.await.ok()
    }

    /// Waits for every piece of background work, including any started meanwhile, for at
    /// most `grace`; what is still running then is left to end with the runtime. Whether
    /// everything ended.
    pub(crate) async fn drain(&self, grace: Duration) -> bool {
        self.tasks.close();
        let ended = tokio::time::timeout(grace, self.tasks.wait()).await.is_ok();
        if !ended {
            tracing::warn!(
                running = self.tasks.len(),
                "background work (opening or closing MCP sessions) did not end in time; stopping anyway"
            );
        }
        ended
    }
}
