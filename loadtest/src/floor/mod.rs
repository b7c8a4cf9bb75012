//! Reference forwarders for `loadtest/http-bench.sh`: the least work an HTTP/1.1 reverse proxy
//! on tokio does per request, measured in the same run as Portcullis and nginx, so that the
//! benchmark tells how much of a proxy's CPU is the runtime and the HTTP codec and how much
//! its own layers (routing, policies, limits, timeouts, telemetry).
//!
//! **Not a proxy to run.** No routing, no limits, no timeouts; messages framed by
//! `Content-Length` only in the one-pass engine (a chunked message, a response without a
//! length, a `1xx` or an oversized message is refused: `400` to the client for its own,
//! `502` for the upstream's, and the connection closed) — exactly enough for the benchmark's
//! GETs against an nginx origin. What each engine does per request, alike: drop the
//! hop-by-hop headers (RFC 9110 §7.6.1), set `X-Forwarded-For`, keep upstream connections
//! alive in a pool of the thread.
//!
//! Both engines run as Portcullis's proxy does (`dataplane/src/listener/workers.rs`): one
//! current-thread runtime per thread, every thread accepting from the one listening socket
//! and handing each connection to the thread with the fewest open, so that a connection and
//! its upstream connections stay on one thread and a burst of connects is spread evenly:
//!
//! * [`Engine::OnePass`]: the client connection's task parses a request head with `httparse`,
//!   writes it to an upstream connection, reads the response and writes it back: one task per
//!   client connection and nothing else, the shape of nginx's event loop.
//! * [`Engine::Hyper`]: hyper's HTTP/1 server connection, and its client connection
//!   (`hyper::client::conn::http1`) driven by a task of its own, the pool keeping its
//!   senders; bodies are collected whole, up to the same limit (2 bytes here), and framed as
//!   hyper frames them (chunked too). The two hyper dispatchers Portcullis has, without
//!   anything of Portcullis between them.
//!
//! Both skip pooled connections they have seen closed. When a reused one closes under a
//! request, the one-pass engine sends the request once more on a new connection if nothing
//! came back and its method is idempotent (RFC 9110 §9.2.2); the hyper engine only when
//! hyper had not started sending it. Past that an upstream failure is a `502`, after which
//! the one-pass engine closes the client's connection and the hyper engine keeps it.

mod hyper_engine;
mod one_pass;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use hyper_engine::{hyper_connection, Senders};
use one_pass::one_pass;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// A message (head and body) larger than this is refused rather than buffered.
const MAX_MESSAGE_BYTES: usize = 1 << 20;
const BUFFER_BYTES: usize = 8 << 10;
/// How long a thread waits after an accept fails for want of descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Headers a message may carry; more is refused.
const MAX_HEADERS: usize = 64;
/// Connection-specific headers, which a proxy does not forward (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

#[derive(clap::Args, Debug)]
pub struct FloorArgs {
    #[arg(long, default_value = "127.0.0.1:18090")]
    pub listen: SocketAddr,
    /// The origin every request goes to.
    #[arg(long)]
    pub upstream: SocketAddr,
    #[arg(long, value_enum, default_value = "one-pass")]
    pub engine: Engine,
    /// Threads, each with its own runtime; 0 means one per core (as the proxy's workers).
    #[arg(long, env = "PORTCULLIS_WORKERS", default_value_t = 0)]
    pub threads: usize,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    OnePass,
    Hyper,
}

/// Binds `args.listen` and starts the threads; returns the address bound (its port chosen
/// by the kernel when `args.listen` has port 0). The threads serve until the process exits.
pub fn start(args: &FloorArgs) -> anyhow::Result<SocketAddr> {
    let threads = match NonZeroUsize::new(args.threads) {
        Some(threads) => threads.get(),
        None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
    };
    let listener =
        std::net::TcpListener::bind(args.listen).with_context(|| format!("cannot bind {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    let open = Arc::new(Load(Mutex::new(vec![0; threads])));
    let (hand_offs, inboxes): (Vec<_>, Vec<_>) = (0..threads)
        .map(|_| tokio::sync::mpsc::unbounded_channel())
        .unzip();
    for (index, inbox) in inboxes.into_iter().enumerate() {
        let thread = Thread {
            index,
            listener: listener.try_clone()?,
            inbox,
            hand_offs: hand_offs.clone(),
            open: open.clone(),
            engine: args.engine,
            upstream: args.upstream,
        };
        std::thread::Builder::new()
            .name(format!("floor-{index}"))
            .spawn(move || {
                if let Err(error) = thread.serve() {
                    tracing::warn!(%error, "a forwarder thread stopped");
                }
            })
            .context("starting a forwarder thread")?;
    }
    Ok(address)
}

/// A connection handed from the thread that accepted it to the one that serves it, counted
/// on the latter.
type HandOff = (std::net::TcpStream, SocketAddr, Slot);

struct Thread {
    index: usize,
    listener: std::net::TcpListener,
    inbox: UnboundedReceiver<HandOff>,
    hand_offs: Vec<UnboundedSender<HandOff>>,
    open: Arc<Load>,
    engine: Engine,
    upstream: SocketAddr,
}

impl Thread {
    fn serve(self) -> anyhow::Result<()> {
        let Thread {
            index,
            listener,
            mut inbox,
            hand_offs,
            open,
            engine,
            upstream,
        } = self;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let tasks = tokio::task::LocalSet::new();
        tasks.block_on(&runtime, async move {
            let listener = TcpListener::from_std(listener)?;
            let pools = Pools::default();
            loop {
                let (client, peer, slot) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((client, peer)) => {
                            let slot = open.assign(index, |thread| !hand_offs[thread].is_closed());
                            if slot.thread == index {
                                (client, peer, slot)
                            } else {
                                // Served where it was accepted when the hand-off fails.
                                let target = slot.thread;
                                match client.into_std() {
                                    Ok(std_client) => match hand_offs[target].send((std_client, peer, slot)) {
                                        Ok(()) => continue,
                                        Err(returned) => {
                                            let (std_client, peer, _uncounted) = returned.0;
                                            match TcpStream::from_std(std_client) {
                                                Ok(client) => (client, peer, open.count_on(index)),
                                                Err(_) => continue,
                                            }
                                        }
                                    },
                                    Err(_) => continue,
                                }
                            }
                        }
                        Err(error) => {
                            tracing::debug!(%error, "accept failed");
                            // One client's failure is not a reason to wait; running out of
                            // descriptors or memory is, since the socket stays readable.
                            if !matches!(
                                error.kind(),
                                io::ErrorKind::ConnectionAborted
                                    | io::ErrorKind::ConnectionReset
                                    | io::ErrorKind::Interrupted
                            ) {
                                tokio::time::sleep(ACCEPT_BACKOFF).await;
                            }
                            continue;
                        }
                    },
                    Some((client, peer, slot)) = inbox.recv() => match TcpStream::from_std(client) {
                        Ok(client) => (client, peer, slot),
                        Err(error) => {
                            tracing::debug!(%error, "a handed-off connection could not be registered");
                            continue;
                        }
                    },
                };
                let _ = client.set_nodelay(true);
                let (engine, upstream, pools) = (engine, upstream, pools.clone());
                tokio::task::spawn_local(async move {
                    match engine {
                        Engine::OnePass => {
                            if let Err(error) = one_pass(client, peer, upstream, pools.streams).await {
                                tracing::debug!(%error, "connection ended with an error");
                            }
                        }
                        Engine::Hyper => hyper_connection(client, peer, upstream, pools.senders).await,
                    }
                    drop(slot);
                });
            }
        })
    }
}

/// Open connections per thread. A lock, not atomics: choosing the least loaded thread and
/// counting the connection on it must be one step, or two threads accepting at once both
/// choose the same one.
struct Load(Mutex<Vec<usize>>);

impl Load {
    /// Counts a new connection on the thread with the fewest open among those that `take`
    /// connections, the accepting thread when it is among them.
    fn assign(self: &Arc<Self>, accepting: usize, take: impl Fn(usize) -> bool) -> Slot {
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let fewest = (0..open.len())
            .filter(|&thread| thread == accepting || take(thread))
            .min_by_key(|&thread| (open[thread], thread != accepting))
            .unwrap_or(accepting);
        open[fewest] += 1;
        Slot {
            load: self.clone(),
            thread: fewest,
        }
    }

    fn count_on(self: &Arc<Self>, thread: usize) -> Slot {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)[thread] += 1;
        Slot {
            load: self.clone(),
            thread,
        }
    }
}

/// One open connection counted on a thread; uncounted when its task ends.
struct Slot {
    load: Arc<Load>,
    thread: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.load.0.lock().unwrap_or_else(PoisonError::into_inner);
        open[self.thread] = open[self.thread].saturating_sub(1);
    }
}

/// A thread's idle upstream connections, for the engine it runs.
#[derive(Clone, Default)]
struct Pools {
    streams: Rc<RefCell<Vec<TcpStream>>>,
    senders: Senders,
}

async fn connect(upstream: SocketAddr) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}
