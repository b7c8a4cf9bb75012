//! A 2026-07-28 client's `subscriptions/listen` at a session-based server, which has no such
//! method: the gateway opens a session for the subscription and asks in the session's terms
//! (list changes come on the session's stream where the server offers `listChanged`, a
//! resource's updates after `resources/subscribe`), passes the session's stream on as the
//! subscription's, and closes the session when the subscription ends.

use std::sync::Arc;

use http::StatusCode;
use serde_json::{json, Map, Value};

use super::initialize::{open_session_detached, NewSession};
use super::listen::LIST_FLAGS;
use super::reach::{self, ClientMeta};
use super::resume::{Resumption, SessionStream};
use super::server::{self, Failure, Headers, Server};
use crate::body::{self, Body};
use crate::telemetry::RequestTrace;
use crate::upstream::Upstream;

/// A subscription a session-based server honors.
pub(super) struct Listening {
    /// As a 2026-07-28 server would acknowledge it (resources by the server's URIs).
    pub(super) honors: Map<String, Value>,
    /// The session's stream.
    pub(super) events: Body,
    /// How the stream is taken up again should the server end it; dropping it closes the
    /// session.
    pub(super) resumption: Resumption,
    /// The notifications that belong to the subscription (the session's stream carries
    /// whatever the server sends the session).
    pub(super) notifications: Vec<&'static str>,
}

/// `Ok(None)`: the server honors nothing of `flags` and `resources` (its own URIs).
pub(super) async fn listen_in_session(
    target: &Arc<str>,
    server: &Arc<Server>,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
    client: &ClientMeta,
    flags: &Map<String, Value>,
    resources: &[String],
) -> Result<Option<Listening>, Failure> {
    // Nobody answers requests on this session's stream: it offers the server nothing to ask
    // (no roots, sampling or elicitation).
    let listener = ClientMeta {
        capabilities: json!({}),
        info: client.info.clone(),
    };
    let NewSession {
        session,
        offer,
        closing,
    } = open_session_detached(server, upstream, trace, &reach::bridge_initialize(&listener)).await?;
    // A server that keeps no session has no stream to listen on. The session closes with
    // the stream, or at once when nothing is honored.
    let (Some(id), Some(closing)) = (session.id.as_deref(), closing) else {
        return Ok(None);
    };
    let headers = Headers {
        session: Some(id),
        version: Some(&session.version),
        modern: false,
        trace,
    };
    let offered = |capability: &str, flag: &str| {
        offer.pointer(&format!("/capabilities/{capability}/{flag}")) == Some(&Value::Bool(true))
    };
    let mut honors = Map::new();
    let mut notifications = Vec::new();
    for (flag, capability, notification) in LIST_FLAGS {
        if flags.get(*flag) == Some(&Value::Bool(true)) && offered(capability, "listChanged") {
            honors.insert((*flag).into(), Value::Bool(true));
            notifications.push(*notification);
        }
    }
    if !resources.is_empty() && offered("resources", "subscribe") {
        let mut subscribed = Vec::new();
        for (number, uri) in resources.iter().enumerate() {
            let subscribe = json!({"jsonrpc": "2.0", "id": format!("portcullis-subscribe-{number}"),
                "method": "resources/subscribe", "params": {"uri": uri}});
            match server
                .call(&headers, &subscribe)
                .await
                .and_then(|answer| answer.result(server))
            {
                Ok(_) => subscribed.push(Value::from(uri.as_str())),
                Err(failure) => tracing::debug!(%failure, "an MCP server refused a resource subscription"),
            }
        }
        if !subscribed.is_empty() {
            honors.insert("resourceSubscriptions".into(), Value::Array(subscribed));
            notifications.push("notifications/resources/updated");
        }
    }
    if honors.is_empty() {
        return Ok(None);
    }
    let response = server.get(&headers).await?;
    if response.status() != StatusCode::OK || !server::is_event_stream(response.headers()) {
        tracing::debug!(server = %server.name, status = %response.status(),
            "an MCP server's session offers no stream to listen on");
        server.drain(response).await;
        return Ok(None);
    }
    let resumption = Resumption::of_stream(SessionStream {
        target: target.clone(),
        server: server.name.clone(),
        session: id.to_string(),
        version: session.version.clone(),
        upstream: upstream.clone(),
        trace: trace.detached(),
    })
    .closing(closing);
    Ok(Some(Listening {
        honors,
        events: body::boxed(response.into_body()),
        resumption,
        notifications,
    }))
}
