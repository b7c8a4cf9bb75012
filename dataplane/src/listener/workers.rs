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
//!
//! Which worker accepts a connection is up to the kernel's wake-ups: a burst of connects
//! (a load generator's, a client pool's) often lands whole on the first worker to wake,
//! leaving the others idle for the connections' whole life. So the accepting worker hands
//! each connection to the worker with the fewest open ([`WorkerLoad`]); the hand-off costs
//! one cross-thread message per connection, not per request.

use std::num::NonZeroUsize;
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// How long a stopping worker waits for blocking calls (DNS lookups) it still runs.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(1);

/// The serving threads; listeners spawn one accept loop on each.
pub(crate) struct Workers {
    handles: Vec<Handle>,
    load: Arc<WorkerLoad>,
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
            load: Arc::new(WorkerLoad::new(count)),
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
            load: Arc::new(WorkerLoad::new(1)),
            threads: Vec::new(),
        }
    }

    pub(crate) fn handles(&self) -> &[Handle] {
        &self.handles
    }

    pub(crate) fn load(&self) -> &Arc<WorkerLoad> {
        &self.load
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

/// Open connections per worker, over all listeners.
#[derive(Debug)]
pub(crate) struct WorkerLoad {
    /// A lock, not atomics: choosing the least loaded worker and counting the connection on
    /// it must be one step, or two workers accepting at once both choose the same one. It
    /// is taken once per connection.
    open: Mutex<Vec<usize>>,
}

impl WorkerLoad {
    fn new(workers: usize) -> WorkerLoad {
        WorkerLoad {
            open: Mutex::new(vec![0; workers]),
        }
    }

    /// Counts a new connection on the worker with the fewest open among those that `take`
    /// connections (a worker whose accept loop has stopped takes none), `accepting` (the
    /// worker that accepted it) when it is among them, so an even load needs no hand-off.
    pub(crate) fn assign(self: &Arc<Self>, accepting: usize, take: impl Fn(usize) -> bool) -> WorkerSlot {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let candidates: Vec<(usize, usize)> = open
            .iter()
            .copied()
            .enumerate()
            .filter(|&(worker, _)| worker == accepting || take(worker))
            .collect();
        let fewest = candidates.iter().map(|&(_, count)| count).min().unwrap_or(0);
        let worker = match open.get(accepting) {
            Some(&count) if count == fewest => accepting,
            _ => candidates
                .iter()
                .find(|&&(_, count)| count == fewest)
                .map_or(accepting, |&(worker, _)| worker),
        };
        if let Some(count) = open.get_mut(worker) {
            *count += 1;
        }
        WorkerSlot {
            load: self.clone(),
            worker,
        }
    }

    /// Counts a connection on `worker`, whatever the others hold: one that could not be
    /// handed to the worker [`assign`](Self::assign) chose stays where it was accepted.
    pub(crate) fn count_on(self: &Arc<Self>, worker: usize) -> WorkerSlot {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(worker) {
            *count += 1;
        }
        WorkerSlot {
            load: self.clone(),
            worker,
        }
    }
}

/// A connection counted on one worker; uncounted when dropped.
#[derive(Debug)]
pub(crate) struct WorkerSlot {
    load: Arc<WorkerLoad>,
    worker: usize,
}

impl WorkerSlot {
    pub(crate) fn worker(&self) -> usize {
        self.worker
    }
}

impl Drop for WorkerSlot {
    fn drop(&mut self) {
        let mut open = self.load.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(self.worker) {
            *count = count.saturating_sub(1);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_to_the_least_loaded_worker_and_stay_on_the_acceptor_when_even() {
        let load = Arc::new(WorkerLoad::new(3));
        // Worker 1 accepts everything, as after one wake-up of a burst.
        let slots: Vec<WorkerSlot> = (0..6).map(|_| load.assign(1, |_| true)).collect();
        let workers: Vec<usize> = slots.iter().map(WorkerSlot::worker).collect();
        assert_eq!(workers, [1, 0, 2, 1, 0, 2]);
        // Closing two of worker 0's connections makes it the one to fill next.
        let mut slots = slots;
        slots.remove(4);
        slots.remove(1);
        assert_eq!(load.assign(2, |_| true).worker(), 0);
        assert_eq!(
            load.assign(2, |_| true).worker(),
            0,
            "the slot above was dropped at once"
        );
        let kept: Vec<WorkerSlot> = (0..2).map(|_| load.assign(2, |_| true)).collect();
        assert_eq!(kept.iter().map(WorkerSlot::worker).collect::<Vec<_>>(), [0, 0]);
        assert_eq!(
            load.assign(2, |_| true).worker(),
            2,
            "even again: the acceptor keeps it"
        );
        drop((slots, kept));
        // A worker that takes none is passed over, however few it holds.
        let kept: Vec<WorkerSlot> = (0..4).map(|_| load.assign(0, |worker| worker != 1)).collect();
        assert_eq!(
            kept.iter().map(WorkerSlot::worker).collect::<Vec<_>>(),
            [0, 2, 0, 2]
        );
    }
}
