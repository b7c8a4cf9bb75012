//! What servers send outside any request. For a session-based client, the standalone GET stream
//! (<https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#listening-for-messages-from-the-server>):
//! one GET to each server of the session that keeps a session of its own and a
//! `subscriptions/listen` for list changes to each 2026-07-28 server, which keeps none, their
//! event streams merged into one for the client. Servers send on it what belongs to no request:
//! `list_changed` notifications, which also drop the server's reused list pages and make its
//! pinned tools be listed again before the next call, and requests to the client, whose ids
//! name their server when the route multiplexes ([`super::remap`]). For a 2026-07-28 client,
//! `subscriptions/listen` (SEP-2575), merged the same way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{BoxStream, FuturesUnordered, SelectAll, StreamExt};
use http::header::{ACCEPT, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use portcullis_config::mcp_rules::{Item, ItemKind};
use portcullis_config::McpFailureMode;
use serde_json::{json, Map, Value};

use super::bridged_listen;
use super::cancel::Cancellable;
use super::jsonrpc::{invalid_params, upstream_failed};
use super::reach::{self, ClientMeta, Reach, Sent};
use super::remap::{ListWatch, RemapRequests, SUBSCRIPTION_ID};
use super::resume::{Resumption, SessionStream};
use super::server::{self, Headers, Server, MODERN_VERSION};
use super::{jsonrpc, session_header, Exchange, McpTarget};
use crate::body::{self, Body};
use crate::sse;
use crate::telemetry::RequestTrace;
use crate::upstream::{Http1Body, Upstream};

/// How long a merged stream may stay silent before the gateway sends a comment, so idle
/// timeouts of proxies and load balancers between it and the client do not close it.
pub(super) const KEEPALIVE: Duration = Duration::from_secs(15);
/// What goes out then: a comment, which SSE clients ignore.
pub(super) use crate::sse::KEEPALIVE_COMMENT;

/// Which reused lists a server's notification makes stale.
pub(super) fn lists_changed(method: &str) -> &'static [&'static str] {
    match method {
        "notifications/tools/list_changed" => &["tools/list"],
        "notifications/prompts/list_changed" => &["prompts/list"],
        "notifications/resources/list_changed" => &["resources/list", "resources/templates/list"],
        _ => &[],
    }
}

impl McpTarget {
    pub(super) async fn listen(&self, exchange: &mut Exchange<'_>) -> Response<Body> {
        let accepts_events = exchange
            .headers
            .get_all(ACCEPT)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .any(|value| value.contains("text/event-stream"));
        if !accepts_events {
            return jsonrpc::error(
                StatusCode::NOT_ACCEPTABLE,
                &Value::Null,
                jsonrpc::INVALID_REQUEST,
                "Not Acceptable: the stream of a session is text/event-stream",
                None,
                "mcp_not_acceptable",
            );
        }
        let session = match self.session(exchange, &Value::Null) {
            Ok(session) => session,
            Err(answer) => return *answer,
        };
        let trace = &exchange.ctx.trace;
        let mut opens: Late = self
            .servers
            .iter()
            .enumerate()
            .filter_map(|(index, server)| {
                let state = session.server(&server.name)?;
                let (server, trace) = (server.clone(), trace.detached());
                let (remap, watch) = (self.multiplexed, self.list_watch(index));
                if state.version == MODERN_VERSION {
                    // A 2026-07-28 server keeps no session, so it has no stream of one: its
                    // list changes come on a subscription the gateway holds for this stream,
                    // and for this stream only (one opened again ends the one before).
                    let client = session.modern_client();
                    let upstream = exchange.upstream.clone();
                    let held = upstream.cancellations.reserve(
                        session_header(&exchange.headers).unwrap_or_default(),
                        &server.name,
                    );
                    let again = Resubscribe {
                        target: self.name.clone(),
                        server: server.name.clone(),
                        client,
                        upstream,
                        trace,
                    };
                    let open: BoxFuture<'static, Opened> =
                        Box::pin(list_changes_of_modern(server, again, held, remap, watch));
                    return Some(open);
                }
                let id = state.id.clone()?;
                let version = state.version.clone();
                let (target, upstream) = (self.name.clone(), exchange.upstream.clone());
                let open: BoxFuture<'static, Opened> = Box::pin(async move {
                    let headers = Headers {
                        session: Some(&id),
                        version: Some(&version),
                        modern: false,
                        trace: &trace,
                    };
                    let opened = server.get(&headers).await;
                    let resumption = Resumption::of_stream(SessionStream {
                        target,
                        server: server.name.clone(),
                        session: id.clone(),
                        version: version.clone(),
                        upstream,
                        trace: trace.detached(),
                    });
                    Opened::classify(&server, opened, remap, watch, resumption)
                });
                Some(open)
            })
            .collect();
        // The client's stream begins with the first server's: one that is slow to open joins
        // when it does. Only when none opens does the answer depend on them all.
        let (mut failed, mut tried, mut gone) = (false, 0, 0);
        while let Some(opened) = opens.next().await {
            tried += 1;
            match opened {
                Opened::Stream(server, events) => {
                    return event_stream(merged(vec![(server, *events)], opens))
                }
                Opened::NoStream => {}
                Opened::Gone => {
                    gone += 1;
                    failed = true;
                }
                Opened::Failed => failed = true,
            }
        }
        if tried > 0 && gone == tried {
            return jsonrpc::session_not_found(&Value::Null);
        }
        if failed {
            return jsonrpc::error(
                StatusCode::BAD_GATEWAY,
                &Value::Null,
                jsonrpc::UPSTREAM_FAILED,
                format!(
                    "{}: no stream of this session's servers could be opened",
                    self.name
                ),
                None,
                "mcp_upstream_failed",
            );
        }
        let mut answer = jsonrpc::error(
            StatusCode::METHOD_NOT_ALLOWED,
            &Value::Null,
            jsonrpc::INVALID_REQUEST,
            "Method Not Allowed: no server of this session offers a stream",
            None,
            "mcp_method_not_allowed",
        );
        answer
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST, DELETE"));
        answer
    }
}

/// How opening one server's stream of the session went.
enum Opened {
    Stream(Arc<str>, Box<RemapRequests>),
    /// The server offers none (405).
    NoStream,
    /// The server lost the session (404).
    Gone,
    Failed,
}

/// Servers' streams still being opened.
type Late = FuturesUnordered<BoxFuture<'static, Opened>>;

impl Opened {
    fn classify(
        server: &Server,
        opened: Result<Response<Http1Body>, server::Failure>,
        remap: bool,
        watch: ListWatch,
        resumption: Resumption,
    ) -> Opened {
        match opened {
            Ok(response)
                if response.status() == StatusCode::OK && server::is_event_stream(response.headers()) =>
            {
                let events = RemapRequests::new(body::boxed(response.into_body()), &server.name)
                    .remapping(remap)
                    .watching(watch)
                    .resuming(resumption);
                Opened::Stream(server.name.clone(), Box::new(events))
            }
            Ok(response) if response.status() == StatusCode::METHOD_NOT_ALLOWED => {
                tracing::debug!(server = %server.name, "an MCP server offers no stream");
                Opened::NoStream
            }
            // Anything else is a stream that could not be opened. A 404 is a server that lost
            // the session; only when all did is the client's session gone.
            Err(failure) if failure.session_gone => {
                tracing::warn!(server = %server.name, "an MCP server no longer knows the session");
                Opened::Gone
            }
            Ok(response) => {
                tracing::warn!(server = %server.name, status = %response.status(),
                    "an MCP server's stream could not be opened");
                Opened::Failed
            }
            Err(failure) => {
                tracing::warn!(server = %server.name, %failure, "an MCP server's stream could not be opened");
                Opened::Failed
            }
        }
    }
}

/// Numbers the `subscriptions/listen` requests the gateway holds at 2026-07-28 servers for
/// session-based clients' streams, so no two share an id; clients never see them.
static HELD_SUBSCRIPTIONS: AtomicU64 = AtomicU64::new(0);
/// The first pause before a held subscription the server ended is made again; it doubles up
/// to [`RESUBSCRIBE_MAX`] until a subscription lasts that long, so a server that keeps ending
/// them (one at its limit of subscriptions) is not asked every second.
const RESUBSCRIBE_FIRST: Duration = Duration::from_secs(1);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(30);

/// A `subscriptions/listen` for every list whose changes a server can tell.
fn held_subscription() -> Value {
    let lists: Map<String, Value> = LIST_FLAGS
        .iter()
        .map(|(flag, ..)| ((*flag).to_string(), Value::Bool(true)))
        .collect();
    let id = format!(
        "portcullis-session-stream-{}",
        HELD_SUBSCRIPTIONS.fetch_add(1, Ordering::Relaxed)
    );
    json!({"jsonrpc": "2.0", "id": id, "method": "subscriptions/listen", "params": {"notifications": lists}})
}

/// What a held subscription needs to subscribe again: the server as the version in force has
/// it (its URL and TLS settings may have changed; once it is gone it is not asked again).
struct Resubscribe {
    target: Arc<str>,
    server: Arc<str>,
    client: Arc<ClientMeta>,
    upstream: Arc<Upstream>,
    trace: RequestTrace,
}

/// A 2026-07-28 server's list changes for a session-based client's stream: a
/// `subscriptions/listen` for every list the server's changes can be heard of, its
/// notifications passed on as a session's stream carries them (no subscription id). A server
/// that honors none of it has no stream to offer. One that ends the subscription (it
/// restarted: it keeps nothing the session depends on, so nothing else would tell the client
/// to open its stream again) is subscribed to again, after a pause.
async fn list_changes_of_modern(
    server: Arc<Server>,
    again: Resubscribe,
    held: Cancellable,
    remap: bool,
    watch: ListWatch,
) -> Opened {
    let Resubscribe {
        client,
        upstream,
        trace,
        ..
    } = &again;
    let response = match listen_modern(&server, client, held_subscription(), upstream, trace).await {
        Listened::Modern(response) => *response,
        Listened::Failed(failure) => {
            tracing::warn!(server = %server.name, %failure, "an MCP server's list changes cannot be listened to");
            return Opened::Failed;
        }
        Listened::Nothing | Listened::InSession(_) => return Opened::NoStream,
    };
    let subscribed = resubscribing(body::boxed(response.into_body()), again);
    let held = Arc::new(held);
    let events = RemapRequests::new(held.clone().until_cancelled(subscribed), &server.name)
        .remapping(remap)
        .watching(watch);
    match acknowledgment(events, server.timeout).await {
        Ok((honors, events)) => {
            let heard: Vec<&'static str> = LIST_FLAGS
                .iter()
                .filter(|(flag, ..)| honors.get(*flag).and_then(Value::as_bool) == Some(true))
                .map(|(.., notification)| *notification)
                .collect();
            if heard.is_empty() {
                return Opened::NoStream;
            }
            // In force from here: this stream, and no earlier one of the session, gets them.
            held.hold();
            // Later subscriptions' acknowledgments and ends are not list changes: left out.
            let events = events.only(heard).untagged();
            Opened::Stream(server.name.clone(), Box::new(events))
        }
        Err(why) => {
            tracing::warn!(server = %server.name, %why, "an MCP server's list changes cannot be listened to");
            Opened::Failed
        }
    }
}

/// What a server may have changed while no subscription was held: every list, told as
/// changed (the stream's filter passes those the server honors), so the client and the
/// gateway's reused pages ask again.
static CHANGED_MEANWHILE: LazyLock<Bytes> = LazyLock::new(|| {
    let mut events = b"\n\n".to_vec();
    for (.., notification) in LIST_FLAGS {
        events.extend_from_slice(&event(&json!({"jsonrpc": "2.0", "method": notification})));
    }
    Bytes::from(events)
});

/// `first`, then, each time the server ends or drops the subscription, a new one's events,
/// after a pause (jittered, so the sessions of a restarted server do not all come back at
/// once). It ends when the server no longer takes subscriptions, when no config version has
/// the server any more, or when dropped (the client left, or opened its stream again).
fn resubscribing(first: Body, again: Resubscribe) -> Body {
    let state = (Some(first), tokio::time::Instant::now(), RESUBSCRIBE_FIRST, again);
    let frames = futures::stream::unfold(state, |(mut current, mut since, mut pause, again)| async move {
        loop {
            if let Some(events) = &mut current {
                match events.frame().await {
                    Some(Ok(frame)) => {
                        return Some((Ok::<_, body::BoxError>(frame), (current, since, pause, again)))
                    }
                    Some(Err(error)) => {
                        tracing::debug!(%error, "a held MCP subscription failed")
                    }
                    None => {}
                }
                if since.elapsed() >= RESUBSCRIBE_MAX {
                    pause = RESUBSCRIBE_FIRST;
                }
                current = None;
            }
            tokio::time::sleep(pause.mul_f64(rand::random_range(0.5..1.5))).await;
            pause = (pause * 2).min(RESUBSCRIBE_MAX);
            let Resubscribe {
                target,
                server,
                client,
                upstream,
                trace,
            } = &again;
            let server = upstream.mcp_servers.get(target, server)?;
            match listen_modern(&server, client, held_subscription(), upstream, trace).await {
                Listened::Modern(response) => {
                    since = tokio::time::Instant::now();
                    // The end of the last stream closes any event it cut off, so the next
                    // one's first does not run into it.
                    let frame = Frame::data(CHANGED_MEANWHILE.clone());
                    return Some((
                        Ok(frame),
                        (Some(body::boxed(response.into_body())), since, pause, again),
                    ));
                }
                Listened::Nothing | Listened::InSession(_) => return None,
                Listened::Failed(failure) => {
                    tracing::warn!(server = %server.name, %failure, "a held MCP subscription could not be made again");
                }
            }
        }
    });
    body::boxed(StreamBody::new(frames))
}

/// A `text/event-stream` answer.
pub(super) fn event_stream(body: Body) -> Response<Body> {
    let mut answer = Response::new(body);
    let headers = answer.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    answer
}

/// One server's events on a merged stream: a failure ends it alone.
fn server_events(
    server: Arc<str>,
    events: RemapRequests,
) -> BoxStream<'static, Result<Frame<Bytes>, body::BoxError>> {
    BodyStream::new(events.merged())
        .scan((), move |(), frame| {
            std::future::ready(match frame {
                Ok(frame) => Some(Ok(frame)),
                Err(error) => {
                    tracing::warn!(%server, %error, "an MCP server's stream failed; the others go on");
                    None
                }
            })
        })
        .boxed()
}

/// Servers' streams merged into one for the client, with those of `late` as they open: a
/// server's stream that fails ends alone (the others go on), and a comment goes out after
/// [`KEEPALIVE`] of silence. It ends when every server's stream has ended.
fn merged(streams: Vec<(Arc<str>, RemapRequests)>, late: Late) -> Body {
    let servers: SelectAll<_> = streams
        .into_iter()
        .map(|(server, events)| server_events(server, events))
        .collect();
    let silence = Box::pin(tokio::time::sleep(KEEPALIVE));
    let frames = futures::stream::unfold(
        (servers, late, silence),
        |(mut servers, mut late, mut silence)| async move {
            loop {
                if servers.is_empty() && late.is_empty() {
                    return None;
                }
                let frame: Result<Frame<Bytes>, body::BoxError> = tokio::select! {
                    biased;
                    frame = servers.next(), if !servers.is_empty() => match frame {
                        Some(frame) => frame,
                        // The last stream ended; maybe some are still opening.
                        None => continue,
                    },
                    opened = late.next(), if !late.is_empty() => {
                        if let Some(Opened::Stream(server, events)) = opened {
                            servers.push(server_events(server, *events));
                        }
                        continue;
                    }
                    () = &mut silence => Ok(Frame::data(Bytes::from_static(KEEPALIVE_COMMENT))),
                };
                silence.as_mut().reset(tokio::time::Instant::now() + KEEPALIVE);
                return Some((frame, (servers, late, silence)));
            }
        },
    );
    body::boxed(StreamBody::new(frames))
}

/// The list flags of a `subscriptions/listen` filter the gateway passes on.
/// With the capability of a session-based server's that says it sends those changes, and the
/// notification it sends them with.
pub(super) const LIST_FLAGS: &[(&str, &str, &str)] = &[
    ("toolsListChanged", "tools", "notifications/tools/list_changed"),
    (
        "promptsListChanged",
        "prompts",
        "notifications/prompts/list_changed",
    ),
    (
        "resourcesListChanged",
        "resources",
        "notifications/resources/list_changed",
    ),
];

impl McpTarget {
    /// `subscriptions/listen` of a 2026-07-28 client: the same filter to every 2026-07-28
    /// server (a resource subscription to the server the URI names), one acknowledgment of
    /// what some server honors once all have answered, then their notifications merged, each
    /// tagged with the client's subscription id. Session-based servers have no such stream
    /// for a client without a session, and honor nothing here.
    pub(super) async fn subscribe(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        client: &Arc<ClientMeta>,
        params: Option<Value>,
    ) -> Response<Body> {
        let Some(Value::Object(filter)) = params.as_ref().and_then(|params| params.get("notifications"))
        else {
            return invalid_params(
                id,
                "Invalid params: subscriptions/listen needs params.notifications as an object".into(),
            );
        };
        let flags: Map<String, Value> = filter
            .iter()
            .filter(|(name, on)| {
                LIST_FLAGS.iter().any(|(flag, ..)| flag == name) && on.as_bool() == Some(true)
            })
            .map(|(name, on)| (name.clone(), on.clone()))
            .collect();
        let mut resources: Vec<Vec<String>> = vec![Vec::new(); self.servers.len()];
        match filter.get("resourceSubscriptions") {
            None | Some(Value::Null) => {}
            Some(Value::Array(uris)) => {
                for uri in uris {
                    let Some(uri) = uri.as_str() else {
                        return invalid_params(id, "Invalid params: resourceSubscriptions holds URIs".into());
                    };
                    let Some((index, own)) = self.resolve(ItemKind::Resource, uri) else {
                        return invalid_params(id, format!("Unknown resource: {uri}"));
                    };
                    // Hearing of a resource's changes is reading it, as far as rules go:
                    // judged as `resources/read` is, with no arguments.
                    let no_arguments = Value::Object(Map::new());
                    let item = Item {
                        kind: ItemKind::Resource,
                        server: &self.servers[index].name,
                        name: own,
                        arguments: Some(&no_arguments),
                    };
                    if let Some(denied) = self.authorize(exchange, id, uri, item) {
                        return denied;
                    }
                    resources[index].push(own.to_string());
                }
            }
            Some(_) => {
                return invalid_params(
                    id,
                    "Invalid params: resourceSubscriptions must be an array".into(),
                )
            }
        }
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        let opens = self.servers.iter().enumerate().map(|(index, server)| {
            let mut notifications = flags.clone();
            if !resources[index].is_empty() {
                notifications.insert("resourceSubscriptions".into(), json!(resources[index]));
            }
            let message = json!({"jsonrpc": "2.0", "id": id, "method": "subscriptions/listen",
                "params": {"notifications": notifications}});
            let (flags, resources) = (&flags, &resources[index]);
            async move {
                let listening = match server.speaks_modern(trace).await {
                    Ok(true) => listen_modern(server, client, message, upstream, trace).await,
                    // Nothing asked of it: no session to open.
                    Ok(false) if flags.is_empty() && resources.is_empty() => Listened::Nothing,
                    Ok(false) => bridged_listen::listen_in_session(
                        &self.name, server, upstream, trace, client, flags, resources,
                    )
                    .await
                    .map_or_else(
                        |failure| Listened::Failed(failure.to_string()),
                        |listening| {
                            listening.map_or(Listened::Nothing, |listening| {
                                Listened::InSession(Box::new(listening))
                            })
                        },
                    ),
                    Err(failure) => Listened::Failed(failure.to_string()),
                };
                (index, listening)
            }
        });
        let mut streams = Vec::new();
        let mut honored = Map::new();
        for (index, listened) in futures::future::join_all(opens).await {
            let server = &self.servers[index];
            let events = |body| {
                RemapRequests::new(body, &server.name)
                    .remapping(self.multiplexed)
                    .watching(self.list_watch(index))
                    .for_subscription(id.clone())
            };
            let acknowledged = match listened {
                Listened::Nothing => continue,
                Listened::Modern(response) => {
                    acknowledgment(events(body::boxed(response.into_body())), server.timeout)
                        .await
                        .map_err(|why| format!("server {}: {why}", server.name))
                }
                Listened::InSession(listening) => Ok((
                    listening.honors,
                    events(listening.events)
                        .only(listening.notifications)
                        .resuming(listening.resumption),
                )),
                Listened::Failed(failure) => Err(failure),
            };
            match acknowledged {
                Ok((server_honors, events)) => {
                    self.honor(&mut honored, index, &server_honors);
                    streams.push((server.name.clone(), events));
                }
                Err(failure) if server.failure_mode == McpFailureMode::Omit => {
                    tracing::warn!(target = %self.name, %failure, "MCP server left out of a subscription");
                }
                Err(failure) => return upstream_failed(id, &self.name, &failure),
            }
        }
        let meta = json!({ SUBSCRIPTION_ID: id });
        let ack = json!({"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
            "params": {"notifications": honored, "_meta": meta}});
        let first = event(&ack);
        // The subscription ends as the spec ends one, with its result: at once when there is
        // nothing to listen to, else once every server's stream has ended.
        let end = json!({"jsonrpc": "2.0", "id": id, "result": {"_meta": meta, "resultType": "complete"}});
        let rest = if streams.is_empty() {
            body::full(event(&end))
        } else {
            body::append(merged(streams, Late::new()), event(&end))
        };
        event_stream(body::prepend(first, rest))
    }

    /// Adds what server `index` honors to what the client is told: any server's flag, and
    /// resources by the names the client uses.
    fn honor(&self, honored: &mut Map<String, Value>, index: usize, server_honors: &Map<String, Value>) {
        for (flag, ..) in LIST_FLAGS {
            if server_honors.get(*flag).and_then(Value::as_bool) == Some(true) {
                honored.insert((*flag).into(), Value::Bool(true));
            }
        }
        if let Some(Value::Array(uris)) = server_honors.get("resourceSubscriptions") {
            let server = &self.servers[index].name;
            let public = uris
                .iter()
                .filter_map(Value::as_str)
                .map(|own| Value::from(self.public_name(server, ItemKind::Resource, own)));
            if let Value::Array(all) = honored
                .entry("resourceSubscriptions")
                .or_insert_with(|| Value::Array(Vec::new()))
            {
                all.extend(public);
            }
        }
    }
}

/// How a server took a subscription.
enum Listened {
    /// It honors nothing of it.
    Nothing,
    /// A 2026-07-28 server's stream, which begins with its acknowledgment.
    Modern(Box<Response<Http1Body>>),
    /// A session-based server's, in a session opened for it.
    InSession(Box<bridged_listen::Listening>),
    Failed(String),
}

/// `subscriptions/listen` sent on to a 2026-07-28 server.
async fn listen_modern(
    server: &Arc<Server>,
    client: &Arc<ClientMeta>,
    message: Value,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
) -> Listened {
    match reach::send(server, &Reach::Modern(client.clone()), message, upstream, trace).await {
        Ok(Sent::Relay(response))
            if response.status() == StatusCode::OK && server::is_event_stream(response.headers()) =>
        {
            Listened::Modern(Box::new(response))
        }
        // A server that is down or overloaded (behind a proxy or load balancer, a restart
        // reads as 502 or 503) is failing, not refusing.
        Ok(Sent::Relay(response))
            if response.status().is_server_error()
                || matches!(
                    response.status(),
                    StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_MANY_REQUESTS
                ) =>
        {
            let status = response.status();
            server.drain(response).await;
            Listened::Failed(format!(
                "server {}: subscriptions/listen answered HTTP {status}",
                server.name
            ))
        }
        // An answer without a stream (an error such as -32601): the server offers no
        // subscriptions, and honors nothing.
        Ok(Sent::Relay(response)) => {
            tracing::debug!(server = %server.name, status = %response.status(),
                "an MCP server offers no subscriptions");
            server.drain(response).await;
            Listened::Nothing
        }
        Ok(Sent::Answered(_)) => Listened::Nothing,
        Err(failure) => Listened::Failed(failure.to_string()),
    }
}

async fn acknowledgment(
    mut events: RemapRequests,
    timeout: std::time::Duration,
) -> Result<(Map<String, Value>, RemapRequests), String> {
    // Each frame of `events` is one whole event, or a comment (passed on keep-alives), which
    // holds none.
    let deadline = tokio::time::Instant::now() + timeout;
    let mut parsed = Vec::new();
    while parsed.is_empty() {
        let frame = match tokio::time::timeout_at(deadline, events.frame()).await {
            Err(_) => return Err(format!("no acknowledgment within {timeout:?}")),
            Ok(None) => return Err("the stream ended before its acknowledgment".into()),
            Ok(Some(Err(error))) => {
                return Err(format!("the stream failed before its acknowledgment: {error}"))
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let data = frame.into_data().unwrap_or_default();
        sse::Parser::default().feed(&data, &mut parsed);
    }
    let message: Option<Value> = parsed
        .first()
        .and_then(|event| serde_json::from_str(&event.data).ok());
    match message {
        Some(message) if message["method"] == "notifications/subscriptions/acknowledged" => {
            let honors = match message.pointer("/params/notifications") {
                Some(Value::Object(honors)) => honors.clone(),
                _ => Map::new(),
            };
            Ok((honors, events))
        }
        _ => Err("its stream did not begin with notifications/subscriptions/acknowledged".into()),
    }
}

/// One JSON-RPC message as an SSE event.
pub(super) fn event(message: &Value) -> bytes::Bytes {
    sse::Event {
        id: None,
        event: Some("message".into()),
        data: message.to_string(),
        retry: None,
    }
    .encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> Result<Frame<Bytes>, body::BoxError> {
        Ok(Frame::data(Bytes::from(format!(
            "event: message\nid: 7\nretry: 1000\ndata: {data}\n\n"
        ))))
    }

    fn text(frame: Option<Result<Frame<Bytes>, body::BoxError>>) -> String {
        let data = frame
            .expect("a frame")
            .expect("no error")
            .into_data()
            .expect("data");
        String::from_utf8(data.to_vec()).expect("UTF-8")
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_stream_ends_alone_a_late_one_joins_silence_gets_a_comment_and_ids_are_left_out() {
        let failing = futures::stream::iter([
            event(r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#),
            Err("connection reset".into()),
        ]);
        let (open, rest) = tokio::sync::mpsc::unbounded_channel();
        let lasting = tokio_stream::wrappers::UnboundedReceiverStream::new(rest);
        let streams = vec![
            (
                Arc::from("math"),
                RemapRequests::new(body::boxed(StreamBody::new(failing)), "math"),
            ),
            (
                Arc::from("web"),
                RemapRequests::new(body::boxed(StreamBody::new(lasting)), "web"),
            ),
        ];
        // A third server's stream opens late, once the others have ended.
        let (opens, opened) = tokio::sync::oneshot::channel::<()>();
        let late: Late = std::iter::once(Box::pin(async move {
            let _ = opened.await;
            let stream = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\"}\n\n";
            Opened::Stream(
                Arc::from("docs"),
                Box::new(RemapRequests::new(body::full(stream), "docs")),
            )
        }) as BoxFuture<'static, Opened>)
        .collect();
        let mut merged = merged(streams, late);
        let first = text(merged.frame().await);
        assert!(first.contains("list_changed"), "{first}");
        assert!(
            !first.contains("id:") && !first.contains("retry:"),
            "no server's event ids: {first}"
        );
        open.send(event(
            r#"{"jsonrpc":"2.0","method":"notifications/prompts/list_changed"}"#,
        ))
        .unwrap();
        let second = text(merged.frame().await);
        assert!(
            second.contains("prompts/list_changed"),
            "web's stream goes on: {second}"
        );
        let started = tokio::time::Instant::now();
        assert_eq!(text(merged.frame().await), ": keepalive\n\n");
        assert_eq!(started.elapsed(), KEEPALIVE);
        drop(open);
        assert_eq!(
            text(merged.frame().await),
            ": keepalive\n\n",
            "a stream still opening keeps it going"
        );
        opens.send(()).unwrap();
        let late = text(merged.frame().await);
        assert!(late.contains("notifications/message"), "{late}");
        assert!(merged.frame().await.is_none(), "it ends once every stream has");
    }
}
