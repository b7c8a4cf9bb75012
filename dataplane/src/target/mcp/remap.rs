//! Requests a server sends the client on a multiplexed route (sampling, elicitation, roots)
//! get ids that name their server, so ids of two servers cannot collide and the client's
//! answer goes back to the server that asked: `math__7` for the `7` of server `math`. On the
//! way, a server's `list_changed` notifications make what the gateway reuses of its lists
//! stale ([`ListWatch`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use portcullis_config::MCP_NAME_SEPARATOR;
use serde_json::Value;

use super::cache::ListCache;
use super::listen::{lists_changed, KEEPALIVE_COMMENT};
use super::pins::{PinObservations, ServerKey};
use super::resume::{Interruption, Resumption};
use super::URI_SEPARATOR;
use crate::body::{self, Body, BoxError};
use crate::sse;
use crate::telemetry::LogThrottle;

/// What one server's lists are reused as, to drop when the server says they changed.
pub(super) struct ListWatch {
    pub(super) lists: ListCache,
    pub(super) server: usize,
    pub(super) tool_pins: Arc<PinObservations>,
    pub(super) key: ServerKey,
}

impl ListWatch {
    fn notified(&self, method: &str) {
        let methods = lists_changed(method);
        if methods.is_empty() {
            return;
        }
        self.lists.forget(self.server, methods);
        if methods.contains(&"tools/list") {
            self.tool_pins.stale(&self.key);
        }
    }
}

/// Where a 2026-07-28 notification names the `subscriptions/listen` request it belongs to.
pub(super) const SUBSCRIPTION_ID: &str = "io.modelcontextprotocol/subscriptionId";

/// An SSE event left unfinished beyond this is not an MCP message.
pub(super) const MAX_PENDING_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// A server that sends responses nobody asked for may send them on every stream: their
/// warning is logged once per interval.
const STRAY_WARN_INTERVAL: Duration = Duration::from_secs(30);
static STRAY_RESPONSES: LazyLock<LogThrottle> = LazyLock::new(|| LogThrottle::new(STRAY_WARN_INTERVAL));

/// Logs a response of `server` that answers no request the gateway sent it on that stream,
/// which was dropped: passed on, it could settle another request of the client's (one sent
/// to another server, with the same id), unseen by that server's rules and guardrails.
pub(super) fn dropped_stray_response(server: &str) {
    if let Some(left_out) = STRAY_RESPONSES.admit() {
        tracing::warn!(
            %server,
            same_responses_not_logged = left_out,
            "an MCP server sent a response to no request it was sent there; it was dropped"
        );
    }
}

/// Whether a client could take `message` for a response: anything that carries a result or
/// an error, or has no method to be a request by (a batch too, which may hold one).
fn may_be_response(message: &Value) -> bool {
    match message {
        Value::Object(message) => {
            message.contains_key("result")
                || message.contains_key("error")
                || !message.get("method").is_some_and(Value::is_string)
        }
        Value::Array(_) => true,
        _ => false,
    }
}

pub(super) fn encode_id(server: &str, id: &Value) -> Value {
    Value::String(format!("{server}{MCP_NAME_SEPARATOR}{id}"))
}

/// The server and its own id, for an id made by [`encode_id`].
pub(super) fn decode_id(id: &Value) -> Option<(&str, Value)> {
    let (server, original) = id.as_str()?.split_once(MCP_NAME_SEPARATOR)?;
    Some((server, serde_json::from_str(original).ok()?))
}

/// The methods whose results name resources: tool results and prompt messages may link to
/// or embed one, a read names what it read.
pub(super) const NAMES_RESOURCES: [&str; 3] = ["tools/call", "prompts/get", "resources/read"];

/// Gives the resources a result names their server's prefix, as lists do, so that a client
/// can read a resource a tool linked to and is never sent to another server by a URI that
/// happens to start with one's name: `content` blocks of a tool result, a read's `contents`,
/// the content of a prompt's `messages`. `true` when it changed something.
pub(super) fn prefix_result_uris(server: &str, result: &mut Value) -> bool {
    let mut changed = false;
    let mut prefix = |uri: Option<&mut Value>| {
        if let Some(uri) = uri {
            if let Some(own) = uri.as_str() {
                *uri = Value::from(format!("{server}{URI_SEPARATOR}{own}"));
                changed = true;
            }
        }
    };
    let mut block = |block: &mut Value| match block.get("type").and_then(Value::as_str) {
        Some("resource_link") => prefix(block.get_mut("uri")),
        Some("resource") => prefix(
            block
                .get_mut("resource")
                .and_then(|resource| resource.get_mut("uri")),
        ),
        _ => {}
    };
    for content in result
        .get_mut("content")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        block(content);
    }
    for message in result
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        if let Some(content) = message.get_mut("content") {
            block(content);
        }
    }
    for content in result
        .get_mut("contents")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        prefix(content.get_mut("uri"));
    }
    changed
}

/// A server's SSE answer or stream with the ids of its requests to the client rewritten
/// (when `remap`), and its list changes told to the `watch`. Responses pass only on the
/// answer to a request, and only that request's ([`RemapRequests::answering`]).
pub(super) struct RemapRequests {
    inner: Body,
    server: String,
    remap: bool,
    answering: Option<Value>,
    watch: Option<ListWatch>,
    subscription: Option<Value>,
    untagged: bool,
    only: Option<Vec<&'static str>>,
    merged: bool,
    resumption: Option<Resumption>,
    parser: sse::Parser,
    events: Vec<sse::Event>,
    ready: VecDeque<Bytes>,
    ended: bool,
}

impl RemapRequests {
    pub(super) fn new(inner: Body, server: &str) -> RemapRequests {
        RemapRequests {
            inner,
            server: server.to_string(),
            remap: true,
            answering: None,
            watch: None,
            subscription: None,
            untagged: false,
            only: None,
            merged: false,
            resumption: None,
            parser: sse::Parser::default(),
            events: Vec::new(),
            ready: VecDeque::new(),
            ended: false,
        }
    }

    /// Ids are rewritten only when several servers share the route.
    pub(super) fn remapping(mut self, remap: bool) -> RemapRequests {
        self.remap = remap;
        self
    }

    /// The answer to the request sent with `id`: its response passes, any other is dropped.
    pub(super) fn answering(mut self, id: Value) -> RemapRequests {
        self.answering = Some(id);
        self
    }

    pub(super) fn watching(mut self, watch: ListWatch) -> RemapRequests {
        self.watch = Some(watch);
        self
    }

    /// A `subscriptions/listen` stream of the client's request `id`: notifications carry it as
    /// their subscription id, updated resources their prefixed URI (when `remap`), and the
    /// server's own end of the stream (its result) is left out: the client's stream ends
    /// only when every server's has.
    pub(super) fn for_subscription(mut self, id: Value) -> RemapRequests {
        self.subscription = Some(id);
        self
    }

    /// A subscription the gateway holds for a client that never asked for one (a
    /// session-based client's stream): notifications lose the subscription id.
    pub(super) fn untagged(mut self) -> RemapRequests {
        self.untagged = true;
        self
    }

    /// Only these notifications pass (a session's stream listened to for a subscription
    /// carries whatever the server sends the session).
    pub(super) fn only(mut self, notifications: Vec<&'static str>) -> RemapRequests {
        self.only = Some(notifications);
        self
    }

    /// One of several streams merged into one: event ids and retry hints are left out. Ids of
    /// two servers may collide, and resuming a server's stream is the gateway's business
    /// ([`RemapRequests::resuming`]), so a `Last-Event-ID` from the client would be a promise
    /// nobody keeps.
    pub(super) fn merged(mut self) -> RemapRequests {
        self.merged = true;
        self
    }

    /// A stream of a server's session that the gateway takes up again itself when the server
    /// ends it early: event ids and retry hints are left out, as the client has nothing to
    /// resume.
    pub(super) fn resuming(mut self, resumption: Resumption) -> RemapRequests {
        self.resumption = Some(resumption);
        self
    }

    /// The event as the client gets it; `None` to leave it out.
    fn rewrite(&mut self, mut event: sse::Event) -> Option<Bytes> {
        let parsed = serde_json::from_str::<Value>(&event.data);
        if let Some(resumption) = &mut self.resumption {
            let message = match &parsed {
                Ok(Value::Object(message)) => Some(message),
                _ => None,
            };
            resumption.saw(&event, message);
        }
        if self.merged || self.resumption.is_some() {
            // An event that only set an id or a retry hint (a priming event) says nothing now.
            if event.data.is_empty() {
                return None;
            }
            event.id = None;
            event.retry = None;
        }
        if let Some(only) = &self.only {
            let passes = match &parsed {
                Ok(Value::Object(message)) if !message.contains_key("id") => message
                    .get("method")
                    .and_then(Value::as_str)
                    .is_some_and(|method| only.contains(&method)),
                _ => false,
            };
            if !passes {
                return None;
            }
        }
        if let Ok(message) = &parsed {
            if may_be_response(message) {
                let id = message.get("id");
                let expected =
                    |awaited: &Option<Value>| awaited.as_ref().is_some_and(|awaited| id == Some(awaited));
                if !expected(&self.answering) {
                    // A subscription's own end is no stray: the gateway writes the client's.
                    if !expected(&self.subscription) {
                        dropped_stray_response(&self.server);
                    }
                    return None;
                }
            }
        }
        if let Ok(Value::Object(mut message)) = parsed {
            match (
                message.get("method").and_then(Value::as_str).map(str::to_string),
                message.get("id").cloned(),
            ) {
                (Some(_), Some(id)) if self.remap => {
                    message.insert("id".into(), encode_id(&self.server, &id));
                    event.data = Value::Object(message).to_string();
                }
                (Some(method), None) => {
                    if let Some(watch) = &self.watch {
                        watch.notified(&method);
                    }
                    // The server cancels a request of its own: the client knows it by the
                    // name it was given.
                    if self.remap && method == "notifications/cancelled" {
                        if let Some(Value::Object(params)) = message.get_mut("params") {
                            if let Some(id) = params.get("requestId") {
                                let encoded = encode_id(&self.server, id);
                                params.insert("requestId".into(), encoded);
                            }
                        }
                        event.data = Value::Object(message.clone()).to_string();
                    }
                    if let Some(subscription) = &self.subscription {
                        self.tag(&method, &mut message, subscription);
                        event.data = Value::Object(message).to_string();
                    } else if self.untagged {
                        untag(&mut message);
                        self.prefix_uri(&method, &mut message);
                        event.data = Value::Object(message).to_string();
                    } else if self.prefix_uri(&method, &mut message) {
                        event.data = Value::Object(message).to_string();
                    }
                }
                (None, Some(_)) if self.remap => {
                    if let Some(result) = message.get_mut("result") {
                        if prefix_result_uris(&self.server, result) {
                            event.data = Value::Object(message).to_string();
                        }
                    }
                }
                _ => {}
            }
        }
        Some(event.encode())
    }

    /// An updated resource's URI as the client knows it (with its server's prefix, when
    /// several servers share the route); `true` when it changed.
    fn prefix_uri(&self, method: &str, message: &mut serde_json::Map<String, Value>) -> bool {
        if !self.remap || method != "notifications/resources/updated" {
            return false;
        }
        let Some(Value::Object(params)) = message.get_mut("params") else {
            return false;
        };
        let Some(uri) = params.get("uri").and_then(Value::as_str) else {
            return false;
        };
        let prefixed = format!("{}{URI_SEPARATOR}{uri}", self.server);
        params.insert("uri".into(), Value::from(prefixed));
        true
    }

    fn tag(&self, method: &str, message: &mut serde_json::Map<String, Value>, subscription: &Value) {
        self.prefix_uri(method, message);
        let params = message
            .entry("params")
            .or_insert_with(|| Value::Object(Default::default()));
        let Value::Object(params) = params else { return };
        let meta = params
            .entry("_meta")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(meta) = meta {
            meta.insert(SUBSCRIPTION_ID.into(), subscription.clone());
        }
    }
}

/// Takes the subscription id out of a notification's `_meta` (and `_meta` with it, when that
/// was all it held).
fn untag(message: &mut serde_json::Map<String, Value>) {
    let Some(Value::Object(params)) = message.get_mut("params") else {
        return;
    };
    if let Some(Value::Object(meta)) = params.get_mut("_meta") {
        meta.remove(SUBSCRIPTION_ID);
        if meta.is_empty() {
            params.remove("_meta");
        }
    }
}

impl RemapRequests {
    /// The server's stream ended or broke: whether it is being resumed.
    fn interrupted(&mut self, error: Option<&BoxError>) -> Interruption {
        self.resumption
            .as_mut()
            .map_or(Interruption::Ends, |resumption| resumption.interrupted(error))
    }

    /// Ends the client's stream as `interruption` says (unless it is being resumed), with
    /// the error to pass on, if any: the server's own `error`, or why it cannot be resumed.
    fn after(
        &mut self,
        interruption: Interruption,
        error: Option<BoxError>,
    ) -> Option<Result<Frame<Bytes>, BoxError>> {
        if matches!(interruption, Interruption::Resuming) {
            return None;
        }
        self.ended = true;
        match interruption {
            Interruption::Fails(why) => Some(Err(why.into())),
            _ => error.map(Err),
        }
    }
}

impl HttpBody for RemapRequests {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(bytes) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if let Some(resumed) = this
                .resumption
                .as_mut()
                .and_then(|resumption| resumption.poll_resumed(cx))
            {
                match resumed {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(Some(body))) => {
                        // An event cut off by the break is sent again after the last whole one.
                        (this.inner, this.parser) = (body, sse::Parser::default());
                        continue;
                    }
                    Poll::Ready(Ok(None)) => {
                        let left = this
                            .resumption
                            .as_ref()
                            .map_or(Interruption::Ends, Resumption::server_left);
                        match this.after(left, None) {
                            Some(failed) => return Poll::Ready(Some(failed)),
                            None => continue,
                        }
                    }
                    Poll::Ready(Err(failure)) => {
                        this.ended = true;
                        let over = this
                            .resumption
                            .as_ref()
                            .is_some_and(|resumption| resumption.over_when(&failure));
                        if over {
                            tracing::debug!(%failure, "an MCP server's stream is over: it no longer knows the session");
                            continue;
                        }
                        return Poll::Ready(Some(Err(format!("resuming the stream: {failure}").into())));
                    }
                }
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    let interruption = this.interrupted(None);
                    if let Some(failed) = this.after(interruption, None) {
                        return Poll::Ready(Some(failed));
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    let interruption = this.interrupted(Some(&error));
                    if let Some(failed) = this.after(interruption, Some(error)) {
                        return Poll::Ready(Some(failed));
                    }
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else { continue };
                    let mut events = std::mem::take(&mut this.events);
                    this.parser.feed(&data, &mut events);
                    for event in events.drain(..) {
                        if let Some(bytes) = this.rewrite(event) {
                            this.ready.push_back(bytes);
                        }
                    }
                    this.events = events;
                    if this.resumption.as_ref().is_some_and(Resumption::complete) {
                        this.ended = true;
                        this.inner = body::empty();
                        continue;
                    }
                    if this.parser.took_comment() {
                        this.ready.push_back(Bytes::from_static(KEEPALIVE_COMMENT));
                    }
                    if this.parser.pending() > MAX_PENDING_EVENT_BYTES {
                        return Poll::Ready(Some(Err(
                            "an event of the server's stream exceeds 16 MiB".into()
                        )));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::cache::PageRef;
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn ids_name_their_server_and_come_back() {
        for id in [Value::from(7), Value::from("a__b"), Value::from(-1)] {
            let encoded = encode_id("math", &id);
            assert_eq!(decode_id(&encoded), Some(("math", id)));
        }
        assert_eq!(decode_id(&Value::from(7)), None);
        assert_eq!(decode_id(&Value::from("math__{")), None);
    }

    #[tokio::test]
    async fn a_servers_request_and_its_cancellation_reach_the_client_under_one_name() {
        let stream = "data: {\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"sampling/createMessage\",\"params\":{}}\n\n\
            data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":{\"requestId\":7}}\n\n";
        let out = RemapRequests::new(crate::body::full(stream), "math")
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let messages: Vec<Value> = String::from_utf8_lossy(&out)
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap())
            .collect();
        assert_eq!(messages[0]["id"], "math__7");
        assert_eq!(messages[1]["params"]["requestId"], "math__7");
    }

    #[test]
    fn the_resources_a_result_names_get_their_servers_prefix() {
        let mut called = serde_json::json!({"content": [
            {"type": "text", "text": "see the report"},
            {"type": "resource_link", "uri": "file:///r.md", "name": "r"},
            {"type": "resource", "resource": {"uri": "mem://note", "text": "x"}}]});
        assert!(prefix_result_uris("math", &mut called));
        assert_eq!(called["content"][1]["uri"], "math+file:///r.md");
        assert_eq!(called["content"][2]["resource"]["uri"], "math+mem://note");
        let mut read = serde_json::json!({"contents": [{"uri": "file:///r.md", "text": "r"}]});
        assert!(prefix_result_uris("math", &mut read));
        assert_eq!(read["contents"][0]["uri"], "math+file:///r.md");
        let mut prompt = serde_json::json!({"messages": [{"role": "user",
            "content": {"type": "resource_link", "uri": "git://a"}}]});
        assert!(prefix_result_uris("docs", &mut prompt));
        assert_eq!(prompt["messages"][0]["content"]["uri"], "docs+git://a");
        let mut plain = serde_json::json!({"content": [{"type": "text", "text": "3"}]});
        assert!(!prefix_result_uris("math", &mut plain));
    }

    #[tokio::test]
    async fn a_streamed_result_names_resources_with_their_servers_prefix() {
        let stream = "data: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"content\":[{\"type\":\"resource_link\",\"uri\":\"file:///r.md\"}]}}\n\n";
        let out = RemapRequests::new(crate::body::full(stream), "math")
            .answering(Value::from(3))
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let data = String::from_utf8_lossy(&out);
        let answer: Value = serde_json::from_str(data.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(answer["id"], 3);
        assert_eq!(answer["result"]["content"][0]["uri"], "math+file:///r.md");
    }

    #[tokio::test]
    async fn a_list_change_drops_the_pages_it_concerns() {
        let key = |server: &str| -> ServerKey {
            (
                Arc::from("McpBackend/tools"),
                Arc::from(server),
                Arc::from(format!("http://127.0.0.1:9000/{server}")),
            )
        };
        let lists = ListCache::new(Arc::default(), vec![key("math"), key("web")]);
        let reuse = super::super::cache::Reuse {
            ttl: std::time::Duration::from_secs(60),
            private: false,
        };
        let page = Arc::new(super::super::lists::Page::of_names(&["get-sum"]));
        let at = |server, method| PageRef {
            server,
            method,
            cursor: None,
        };
        for (server, method) in [(0, "tools/list"), (0, "prompts/list"), (1, "tools/list")] {
            lists.put(at(server, method), 1, 0, reuse, &page);
        }
        let telemetry = crate::telemetry::Telemetry::new(crate::tests::support::quiet_telemetry()).unwrap();
        let watch = ListWatch {
            lists: lists.clone(),
            server: 0,
            tool_pins: Arc::new(PinObservations::new(Arc::new(telemetry))),
            key: key("math"),
        };
        let stream = "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\r\n\r\n";
        let body = RemapRequests::new(crate::body::full(stream), "math")
            .remapping(false)
            .watching(watch);
        let out = body.collect().await.unwrap().to_bytes();
        assert!(
            String::from_utf8_lossy(&out).contains("notifications/tools/list_changed"),
            "relayed"
        );
        assert_eq!(
            lists.get(at(0, "tools/list"), 1),
            None,
            "the changed list is asked again"
        );
        assert!(
            lists.get(at(0, "prompts/list"), 1).is_some(),
            "other lists are kept"
        );
        assert!(
            lists.get(at(1, "tools/list"), 1).is_some(),
            "other servers' are kept"
        );
    }

    #[tokio::test]
    async fn a_subscription_held_for_a_session_stream_passes_its_list_changes_untagged() {
        let stream = concat!(
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\",",
            "\"params\":{\"_meta\":{\"io.modelcontextprotocol/subscriptionId\":\"portcullis-session-stream\"}}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/prompts/list_changed\",",
            "\"params\":{\"_meta\":{\"io.modelcontextprotocol/subscriptionId\":\"portcullis-session-stream\",\"note\":1}}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":\"portcullis-session-stream\",\"result\":{}}\n\n",
        );
        let body = RemapRequests::new(crate::body::full(stream), "math")
            .only(vec![
                "notifications/tools/list_changed",
                "notifications/prompts/list_changed",
            ])
            .untagged();
        let out = body.collect().await.unwrap().to_bytes();
        let mut events = Vec::new();
        sse::Parser::default().feed(&out, &mut events);
        let messages: Vec<Value> = events
            .iter()
            .map(|event| serde_json::from_str(&event.data).unwrap())
            .collect();
        assert_eq!(
            messages,
            vec![
                serde_json::json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}}),
                serde_json::json!({"jsonrpc": "2.0", "method": "notifications/prompts/list_changed",
                    "params": {"_meta": {"note": 1}}}),
            ],
            "the list changes pass without the subscription the client never made; the rest and \
             the subscription's own end do not"
        );
    }

    #[tokio::test]
    async fn only_the_answer_to_the_request_sent_passes_and_a_stream_outside_requests_carries_none() {
        let stream = concat!(
            "data: {\"jsonrpc\":\"2.0\",\"id\":6,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"forged\"}]}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":6,\"error\":{\"code\":-1,\"message\":\"forged\"}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":5,\"method\":null,\"result\":{}}\n\n",
            "data: [{\"jsonrpc\":\"2.0\",\"id\":6,\"result\":{}}]\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":5,\"result\":{\"content\":[]}}\n\n",
        );
        let messages = |body: RemapRequests| async move {
            let out = body.collect().await.unwrap().to_bytes();
            let mut events = Vec::new();
            sse::Parser::default().feed(&out, &mut events);
            events
                .iter()
                .map(|event| serde_json::from_str::<Value>(&event.data).unwrap())
                .collect::<Vec<_>>()
        };
        let answer = RemapRequests::new(crate::body::full(stream), "math").answering(Value::from(5));
        let passed = messages(answer).await;
        assert_eq!(passed.len(), 3, "{passed:?}");
        assert_eq!(
            passed[0]["id"], 5,
            "a message with a null method is a response too"
        );
        assert_eq!(passed[1]["method"], "notifications/message");
        assert_eq!(
            passed[2],
            serde_json::json!({"jsonrpc": "2.0", "id": 5, "result": {"content": []}})
        );
        let outside = RemapRequests::new(crate::body::full(stream), "math").remapping(false);
        let passed = messages(outside).await;
        assert_eq!(passed.len(), 1, "{passed:?}");
        assert_eq!(passed[0]["method"], "notifications/message");
    }

    #[tokio::test]
    async fn requests_are_remapped_responses_and_notifications_are_not() {
        let stream = concat!(
            "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\n",
            "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"sampling/createMessage\",\"params\":{}}\r\n\r\n",
            "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":5,\"result\":{}}\r\n\r\n",
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/resources/updated\",\"params\":{\"uri\":\"file:///a\"}}\n\n",
            ": the server's keep-alive\n\n",
        );
        let body = RemapRequests::new(crate::body::full(stream), "math").answering(Value::from(5));
        let out = body.collect().await.unwrap().to_bytes();
        let out = String::from_utf8(out.to_vec()).unwrap();
        let mut parser = sse::Parser::default();
        let mut events = Vec::new();
        parser.feed(out.as_bytes(), &mut events);
        let messages: Vec<Value> = events
            .iter()
            .map(|e| serde_json::from_str(&e.data).unwrap())
            .collect();
        assert_eq!(messages.len(), 4);
        assert!(messages[0].get("id").is_none());
        assert_eq!(messages[1]["id"], "math__0");
        assert_eq!(messages[2]["id"], 5);
        // The URI the client subscribed to, with its server's prefix.
        assert_eq!(messages[3]["params"]["uri"], "math+file:///a");
        // Comments have no meaning but that the stream lives: they go on too.
        assert!(out.ends_with("\n\n: keepalive\n\n"), "{out}");

        // One server: nothing is renamed.
        let alone = RemapRequests::new(crate::body::full(stream), "math")
            .remapping(false)
            .answering(Value::from(5));
        let out = alone.collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&out).contains("\"uri\":\"file:///a\""));
    }
}
