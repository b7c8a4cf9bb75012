//! Work a request starts that must run to its end even if the request's worker stops first:
//! opening and closing MCP sessions whose client may have left. It runs on the proxy's main
//! runtime, which outlives the workers, and shutdown waits for it after the workers stop
//! (each piece bounded by its own timeout).

use std::future::Future;

use tokio::task::JoinHandle;
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

    /// Runs `work` on the main runtime, counted until it ends. `None` only when there is no
    /// runtime at all to run it on (a guard dropped outside one).
    pub(crate) fn spawn<F>(&self, work: F) -> Option<JoinHandle<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())?;
        Some(runtime.spawn(self.tasks.track_future(work)))
    }

    /// Waits for every piece of background work, including any started meanwhile.
    pub(crate) async fn drain(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}
