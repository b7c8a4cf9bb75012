//! ConfigStream: every proxy gets its slice of the config, one complete version per
//! message (whole, or a delta against the version it acknowledged), and answers each with an
//! ACK or NACK that lands in the [`ProxyRegistry`]. The next version goes out once the last
//! is answered. Messages are built once for all proxies ([`fanout`]).

mod fanout;

use std::sync::Arc;
use std::time::Duration;

use portcullis_config::ShardSelector;
use portcullis_proto::v1::config_stream_server::ConfigStream;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{ConfigSnapshot, Hello, ProxyMessage};
use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use self::fanout::Fanout;
use crate::metrics::Metrics;
use crate::node::standing::Standing;
use crate::registry::{truncated, ProxyRegistry, MAX_REASON_BYTES};
use crate::types::Raft;
use crate::view::{ConfigView, Streamed};

/// How long a new stream may take to send its Hello; a client that never does would
/// otherwise hold a task and a connection forever.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a proxy holding a newer version than this node waits for it to catch up.
const CATCH_UP_GRACE: Duration = Duration::from_secs(10);
/// How long the leader may take to confirm, with a quorum, that it is behind a version a proxy
/// holds.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);
/// A version a proxy refused whole is offered again after this, the wait doubling with each
/// refusal up to [`REFUSED_RETRY_MAX`]: a refusal can pass (a port another process held is
/// freed), and without a new write nothing else would send that version again.
const REFUSED_RETRY_FIRST: Duration = Duration::from_secs(1);
const REFUSED_RETRY_MAX: Duration = Duration::from_secs(60);
/// How long a node may be out of touch with the cluster before its proxies are sent to
/// other nodes (an election takes a second or two).
const LEADERLESS_GRACE: Duration = Duration::from_secs(5);

pub struct ConfigStreamService {
    raft: Raft,
    /// The applied config, to compare a proxy's version with.
    view: watch::Receiver<ConfigView>,
    /// The same, from 2 ms late, group by group ([`ConfigView::streamed`]): what is sent,
    /// and when.
    streamed: Streamed,
    /// This node's standing in the cluster: whether its proxies should go elsewhere.
    cluster: watch::Receiver<Standing>,
    registry: ProxyRegistry,
    /// Flips to `true` on shutdown, ending every stream so the server can stop gracefully.
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    fanout: Arc<Fanout>,
}

impl ConfigStreamService {
    pub fn new(
        raft: Raft,
        view: watch::Receiver<ConfigView>,
        streamed: Streamed,
        cluster: watch::Receiver<Standing>,
        registry: ProxyRegistry,
        shutdown: watch::Receiver<bool>,
        metrics: Metrics,
    ) -> Self {
        Self {
            raft,
            view,
            streamed,
            cluster,
            registry,
            shutdown,
            metrics,
            fanout: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl ConfigStream for ConfigStreamService {
    type SubscribeStream = ReceiverStream<Result<ConfigSnapshot, Status>>;

    async fn subscribe(
        &self,
        request: Request<Streaming<ProxyMessage>>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        // Answer right away and wait for Hello in the session task: a client may only send
        // Hello once the call is established.
        let (tx, rx) = mpsc::channel(2);
        let session = Session {
            inbound: request.into_inner(),
            outbound: tx,
            raft: self.raft.clone(),
            view: self.view.clone(),
            streamed: self.streamed.subscribe(),
            cluster: self.cluster.clone(),
            registry: self.registry.clone(),
            shutdown: self.shutdown.clone(),
            metrics: self.metrics.clone(),
            fanout: self.fanout.clone(),
        };
        tokio::spawn(session.run());
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Session {
    inbound: Streaming<ProxyMessage>,
    outbound: mpsc::Sender<Result<ConfigSnapshot, Status>>,
    raft: Raft,
    view: watch::Receiver<ConfigView>,
    streamed: watch::Receiver<ConfigView>,
    cluster: watch::Receiver<Standing>,
    registry: ProxyRegistry,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    fanout: Arc<Fanout>,
}

struct Connected<'a> {
    registry: ProxyRegistry,
    proxy_id: &'a str,
    session: u64,
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.registry.disconnect(self.proxy_id, self.session);
        tracing::info!(proxy_id = %self.proxy_id, "proxy stream ended");
    }
}

/// What the proxy holds and has been sent, as far as this stream knows.
#[derive(Default)]
struct Exchange {
    /// The version the proxy acknowledged last on this stream: what it holds, and the base
    /// of the next delta. Unknown until the first acknowledgement.
    acked: Option<u64>,
    /// The version sent and not yet answered, and whether it was a delta.
    awaiting: Option<(u64, bool)>,
}

impl Session {
    fn place(&self) -> Standing {
        *self.cluster.borrow()
    }

    /// A node outside the cluster (started with `--join` and not added yet) or cut off from
    /// it for a while (no leader, or a leader no quorum answers: partitioned, or removed — a
    /// removed node need not learn that it was) gets no new versions: its proxies go
    /// elsewhere.
    fn left_cluster(&self) -> Status {
        Status::unavailable("this control-plane node is not in touch with the cluster; use another node")
    }

    /// Whether the version a proxy holds comes from another history than this cluster's: this
    /// node, confirmed as leader by a quorum and with every committed entry applied, is still
    /// behind it. A proxy only ever gets committed versions and versions only grow, so it got
    /// that one from a control plane rebuilt since from empty storage (the documented way
    /// through an entry-format change) or restored from an older backup, counting versions
    /// from where that one starts. Other nodes cannot tell a lagging log from another history.
    async fn holds_another_history(&self, held: u64) -> bool {
        if self.view.borrow().version >= held {
            return false;
        }
        let confirmed = tokio::time::timeout(CONFIRM_TIMEOUT, self.raft.ensure_linearizable()).await;
        matches!(confirmed, Ok(Ok(_))) && self.view.borrow().version < held
    }

    /// Ends the stream with `status`. `try_send`, because the proxy may have stopped
    /// reading and a full channel must not keep this task alive; if the status cannot be
    /// queued, dropping the sender still ends the stream.
    fn fail(&self, status: Status) {
        let _ = self.outbound.try_send(Err(status));
    }

    async fn run(mut self) {
        let first = tokio::select! {
            first = tokio::time::timeout(HELLO_TIMEOUT, self.inbound.message()) => first,
            _ = self.shutdown.changed() => return,
        };
        let hello = match first {
            Ok(Ok(Some(ProxyMessage {
                message: Some(Message::Hello(hello)),
            }))) => hello,
            Ok(Ok(Some(_))) => {
                return self.fail(Status::invalid_argument("the first message must be a Hello"))
            }
            Ok(Ok(None)) => return self.fail(Status::invalid_argument("the stream ended before a Hello")),
            // Undecodable or truncated input: tell the client why instead of ending with OK.
            Ok(Err(status)) => return self.fail(status),
            Err(_) => {
                return self.fail(Status::deadline_exceeded(format!(
                    "no Hello within {}s",
                    HELLO_TIMEOUT.as_secs()
                )))
            }
        };
        if let Some(problem) = portcullis_proto::hello_problem(&hello) {
            return self.fail(Status::invalid_argument(problem));
        }
        let Hello {
            proxy_id,
            shard,
            last_version,
            instance,
            accepts_deltas,
        } = hello;
        let shard: ShardSelector = shard.into_iter().collect();
        let session = match self.registry.connect(&proxy_id, &instance, &shard, last_version) {
            Ok(session) => session,
            Err(refused) => {
                tracing::warn!(%proxy_id, "{refused}");
                return self.fail(Status::already_exists(refused));
            }
        };
        tracing::info!(%proxy_id, ?shard, last_version, "proxy subscribed");
        // Marks the proxy gone however the session ends, a panic included: an entry left
        // connected would never be pruned and would refuse the proxy's next process.
        let _connected = Connected {
            registry: self.registry.clone(),
            proxy_id: &proxy_id,
            session,
        };
        self.serve(&proxy_id, &shard, session, last_version, accepts_deltas)
            .await;
    }

    async fn serve(
        &mut self,
        proxy_id: &str,
        shard: &ShardSelector,
        session: u64,
        held: u64,
        accepts_deltas: bool,
    ) {
        // The current version is always sent first, and whole, even if the proxy says it
        // has it: a control plane rebuilt from empty storage reuses version numbers.
        self.streamed.mark_changed();
        let mut pending = false;
        let mut exchange = Exchange::default();
        // A proxy that moved here from another node may hold a version this node has not
        // applied yet: it waits for this node to catch up rather than go back. If this node
        // does not, the proxy is sent to another one. Only the leader can tell a version this
        // cluster never reached, and sends what it has.
        let foreign = held > 0 && self.holds_another_history(held).await;
        if foreign {
            tracing::warn!(%proxy_id, held, version = self.view.borrow().version, "the proxy holds a version this cluster never reached (a control plane rebuilt from empty storage, or restored from an older backup?); it gets this cluster's current version");
        }
        let mut catching_up = (held > 0 && !foreign).then(|| tokio::time::Instant::now() + CATCH_UP_GRACE);
        // Nothing older than the proxy holds is sent, unless what it holds is another
        // history's. Checked on what is sent (the streamed copy), whichever way the wait ends.
        let mut floor = if foreign { 0 } else { held };
        let mut leaderless_until =
            (!self.place().in_touch).then(|| tokio::time::Instant::now() + LEADERLESS_GRACE);
        let mut offer_again: Option<tokio::time::Instant> = None;
        let mut refused_retry = REFUSED_RETRY_FIRST;
        let mut last_refused: Option<u64> = None;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(offer_again.unwrap_or_else(tokio::time::Instant::now)), if offer_again.is_some() => {
                    offer_again = None;
                    pending = true;
                }
                () = tokio::time::sleep_until(leaderless_until.unwrap_or_else(tokio::time::Instant::now)), if leaderless_until.is_some() => {
                    return self.fail(self.left_cluster());
                }
                () = tokio::time::sleep_until(catching_up.unwrap_or_else(tokio::time::Instant::now)), if catching_up.is_some() => {
                    if self.view.borrow().version < held {
                        if !self.holds_another_history(held).await {
                            return self.fail(Status::unavailable(format!(
                                "this control-plane node is behind version {held}; use another node"
                            )));
                        }
                        floor = 0;
                    }
                    catching_up = None;
                    pending = true;
                }
                changed = self.cluster.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // An election takes a second or two; only a longer silence sends the
                    // proxy away.
                    leaderless_until = match (self.place().in_touch, leaderless_until) {
                        (true, _) => None,
                        (false, None) => Some(tokio::time::Instant::now() + LEADERLESS_GRACE),
                        (false, waiting) => waiting,
                    };
                }
                changed = self.streamed.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    pending = true;
                }
                // Sending only once the last version is answered means a slow proxy skips
                // versions instead of queueing them, and a delta's base is what it holds.
                permit = self.outbound.reserve(), if pending && exchange.awaiting.is_none() => {
                    let Ok(permit) = permit else { return };
                    pending = false;
                    let view = self.streamed.borrow_and_update().clone();
                    // This build cannot read what the cluster holds: the proxy keeps what it
                    // has and looks for a node that can serve the current version.
                    if let Some(reason) = &view.unreadable {
                        permit.send(Err(Status::unavailable(reason.to_string())));
                        return;
                    }
                    if view.version < floor {
                        continue;
                    }
                    catching_up = None;
                    // Version 0 means nothing was ever applied; there is nothing to serve yet.
                    if view.version >= 1 {
                        let base = exchange.acked.filter(|_| accepts_deltas);
                        let message = self.fanout.message(&view, shard, base).await;
                        let delta = message.base_version.is_some();
                        self.metrics.config_sent(delta, message.encoded_len());
                        permit.send(Ok(ConfigSnapshot::clone(&message)));
                        exchange.awaiting = Some((view.version, delta));
                        self.registry.sent(proxy_id, session, view.version);
                    }
                }
                message = self.inbound.message() => match message {
                    Ok(Some(ProxyMessage { message: Some(Message::Ack(ack)) })) => {
                        if exchange.awaiting.is_some_and(|(version, _)| version == ack.version) {
                            exchange = Exchange { acked: Some(ack.version), awaiting: None };
                            offer_again = None;
                            refused_retry = REFUSED_RETRY_FIRST;
                        }
                        self.registry.ack(proxy_id, session, ack.version);
                        self.metrics.ack_received();
                    }
                    Ok(Some(ProxyMessage { message: Some(Message::Nack(nack)) })) => {
                        let reason = truncated(&nack.reason, MAX_REASON_BYTES);
                        tracing::warn!(%proxy_id, version = nack.version, %reason, "proxy rejected config");
                        if let Some((version, delta)) = exchange.awaiting.filter(|(version, _)| *version == nack.version) {
                            exchange.awaiting = None;
                            // The proxy keeps what it held. A refused delta is sent again
                            // whole at once: the proxy may not hold its base after all. A
                            // refused whole version is offered again later.
                            if delta {
                                exchange.acked = None;
                                pending = true;
                            } else {
                                // The wait grows with refusals of one version, not across versions.
                                if last_refused != Some(version) {
                                    refused_retry = REFUSED_RETRY_FIRST;
                                }
                                last_refused = Some(version);
                                offer_again = Some(tokio::time::Instant::now() + refused_retry);
                                refused_retry = (refused_retry * 2).min(REFUSED_RETRY_MAX);
                            }
                            tracing::debug!(%proxy_id, version, delta, "version refused");
                        }
                        self.registry.nack(proxy_id, session, nack.version, reason);
                        self.metrics.nack_received();
                    }
                    Ok(Some(ProxyMessage { message: Some(Message::Findings(findings)) })) => {
                        self.registry.findings(proxy_id, session, findings);
                    }
                    Ok(Some(ProxyMessage { message: Some(Message::Hello(_)) })) => {
                        return self.fail(Status::invalid_argument("Hello is sent once, first"))
                    }
                    // A newer proxy's message this build does not know.
                    Ok(Some(ProxyMessage { message: None })) => {}
                    Ok(None) => return,
                    Err(status) => return self.fail(status),
                },
                _ = self.shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests;
