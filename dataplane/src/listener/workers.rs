//! The threads that serve traffic: one single-threaded tokio runtime per core, each
//! accepting from its own handle of every listener socket, so a connection lives on one
//! thread from accept to close and its tasks are never stolen across cores.
//!
//! This is nginx's worker model (and Seastar's shared-nothing one): on a loaded proxy a
//! work-stealing runtime moves request tasks between threads, paying for cross-core
//! wake-ups and cache misses on every hop; with a runtime per thread the request, its
//! connection and its HTTP/1.1 upstream connection (the pool is per thread, see `upstream`)
//! stay on one core. What it gives up: an HTTP/2 client's streams all run on the thread that
//! accepted its connection, and HTTP/2 upstream connections, shared by all threads, are
//! driven by the thread that opened them.

use std::num::NonZeroUsize;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How long a stopping worker waits for blocking calls (DNS lookups) it still runs.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

/// The serving threads; listeners spawn one accept loop on each.
pub(crate) struct Workers {
    handles: Vec<Handle>,
    /// Empty for [`Workers::current`], which owns no threads.
    threads: Vec<Thread>,
}

struct Thread {
    stop: Option<oneshot::Sender<()>>,
    /// Fires once the thread's runtime, and every task left on it, is gone.
    done: Option<oneshot::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Workers {
    /// Starts `count` threads; 0 means one per available core.
    pub(crate) fn start(count: usize) -> std::io::Result<Workers> {
        let count = match NonZeroUsize::new(count) {
            Some(count) => count.get(),
            None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
        };
        let mut workers = Workers {
            handles: Vec::with_capacity(count),
            threads: Vec::with_capacity(count),
        };
        for index in 0..count {
            let (stop, stopped) = oneshot::channel::<()>();
            let (finished, done) = oneshot::channel::<()>();
            let (started, handle) = mpsc::channel();
            // The runtime is built and dropped on its own thread: a runtime dropped inside
            // the caller's async context (were the spawn to fail) would panic.
            let thread = std::thread::Builder::new()
                .name(format!("portcullis-worker-{index}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(runtime) => runtime,
                        Err(error) => {
                            let _ = started.send(Err(error));
                            return;
                        }
                    };
                    let _ = started.send(Ok(runtime.handle().clone()));
                    let _ = runtime.block_on(stopped);
                    runtime.shutdown_timeout(SHUTDOWN_TIMEOUT);
                    let _ = finished.send(());
                })?;
            // Pushed before waiting, so an error below still stops the threads started so far.
            workers.threads.push(Thread {
                stop: Some(stop),
                done: Some(done),
                thread: Some(thread),
            });
            let handle = handle
                .recv()
                .map_err(|_| std::io::Error::other("a worker thread ended while starting"))??;
            workers.handles.push(handle);
        }
        Ok(workers)
    }

    /// The runtime of the caller, as a single worker: for the admin port, whose few
    /// requests do not earn threads of their own.
    pub(crate) fn current() -> Workers {
        Workers {
            handles: vec![Handle::current()],
            threads: Vec::new(),
        }
    }

    pub(crate) fn handles(&self) -> &[Handle] {
        &self.handles
    }

    /// Ends the threads, dropping whatever tasks they still run (streams a drain left open,
    /// background work of the MCP targets), and returns once they are gone: the records
    /// those tasks write as they are dropped come before telemetry is flushed.
    pub(crate) async fn stop(&mut self) {
        for thread in &mut self.threads {
            if let Some(stop) = thread.stop.take() {
                let _ = stop.send(());
            }
        }
        for thread in &mut self.threads {
            if let Some(done) = &mut thread.done {
                // Cleared only once finished: if this wait is cancelled, `drop` must not
                // join a thread still running.
                let _ = done.await;
                thread.done = None;
            }
        }
    }
}

impl Drop for Workers {
    /// Stops threads that [`Workers::stop`] did not (a proxy dropped without a shutdown).
    fn drop(&mut self) {
        for thread in &mut self.threads {
            if let Some(stop) = thread.stop.take() {
                let _ = stop.send(());
            }
            // Only join a thread known to be finished: this may run on a runtime thread.
            if thread.done.is_none() {
                if let Some(thread) = thread.thread.take() {
                    let _ = thread.join();
                }
            }
        }
    }
}
