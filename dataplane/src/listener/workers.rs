//! The threads that serve traffic: one single-threaded tokio runtime per core, each
//! accepting from its own handle of every listener socket, so a connection lives on one
//! thread from accept to close and its tasks are never stolen across cores.
//!
//! This is nginx's worker model (and Seastar's shared-nothing one): on a loaded proxy a
//! work-stealing runtime moves request tasks between threads, paying for cross-core
//! wake-ups and cache misses on every hop; with a runtime per thread the request, its
//! connection and its upstream connection (the HTTP/1.1 pool is per thread, see
//! `upstream`) stay on one core. The kernel spreads new connections over the threads
//! blocked in `accept` on the same socket.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

/// The serving threads; listeners spawn one accept loop on each.
#[derive(Clone)]
pub(crate) struct Workers {
    handles: Arc<[Handle]>,
    /// Present only for threads this value started; the last clone stops them.
    threads: Option<Arc<Threads>>,
}

struct Threads {
    stops: Mutex<Vec<oneshot::Sender<()>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Threads {
    fn stop(&self) {
        let stops = std::mem::take(&mut *self.stops.lock().unwrap_or_else(PoisonError::into_inner));
        for stop in stops {
            let _ = stop.send(());
        }
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.stop();
        // A worker being dropped from inside itself (the last clone lived in one of its
        // tasks) must not wait for itself.
        let me = std::thread::current().id();
        for thread in self.threads.drain(..) {
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
    }
}

impl Workers {
    /// Starts `count` threads; 0 means one per available core.
    pub(crate) fn start(count: usize) -> std::io::Result<Workers> {
        let count = match NonZeroUsize::new(count) {
            Some(count) => count.get(),
            None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
        };
        let mut handles = Vec::with_capacity(count);
        let mut stops = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            handles.push(runtime.handle().clone());
            let thread = std::thread::Builder::new()
                .name(format!("portcullis-worker-{index}"))
                .spawn(move || {
                    let _ = runtime.block_on(stopped);
                    // Tasks still open when the proxy stops are dropped; a blocking call
                    // still running is not waited for beyond this.
                    runtime.shutdown_timeout(SHUTDOWN_TIMEOUT);
                })?;
            stops.push(stop);
            threads.push(thread);
        }
        Ok(Workers {
            handles: handles.into(),
            threads: Some(Arc::new(Threads {
                stops: Mutex::new(stops),
                threads,
            })),
        })
    }

    /// The runtime of the caller, as a single worker: for the admin port, whose few
    /// requests do not earn threads of their own.
    pub(crate) fn current() -> Workers {
        Workers {
            handles: Arc::new([Handle::current()]),
            threads: None,
        }
    }

    /// Ends the threads, dropping whatever tasks they still run (streams a drain left
    /// open, background work of the MCP targets), without waiting for them.
    pub(crate) fn stop(&self) {
        if let Some(threads) = &self.threads {
            threads.stop();
        }
    }

    pub(crate) fn handles(&self) -> &[Handle] {
        &self.handles
    }
}
