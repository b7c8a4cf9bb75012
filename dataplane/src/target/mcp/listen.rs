//! The standalone GET stream of a session-based client
//! (<https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#listening-for-messages-from-the-server>):
//! one GET to each server of the session that keeps a session of its own, their event
//! streams merged into one for the client. Servers send on it what belongs to no request:
//! `list_changed` notifications, which also drop the server's reused list pages and make its
//! pinned tools be listed again before the next call, and requests to the client, whose ids
//! name their server when the route multiplexes ([`super::remap`]).

use futures::stream::select_all;
use http::header::{ACCEPT, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyStream, StreamBody};
use serde_json::Value;

use super::remap::RemapRequests;
use super::server::{self, Headers, MODERN_VERSION};
use super::{jsonrpc, Exchange, McpTarget};
use crate::body::{self, Body};

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
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        let opens = self.servers.iter().enumerate().filter_map(|(index, server)| {
            let state = session.server(&server.name)?;
            // A 2026-07-28 server keeps no session, so it has no stream of one.
            let id = state.id.as_deref().filter(|_| state.version != MODERN_VERSION)?;
            Some(async move {
                let headers = Headers {
                    session: Some(id),
                    version: Some(&state.version),
                    modern: false,
                    trace,
                };
                (index, server.get(upstream, &headers).await)
            })
        });
        let mut streams = Vec::new();
        for (index, opened) in futures::future::join_all(opens).await {
            let server = &self.servers[index];
            match opened {
                Ok(response)
                    if response.status() == StatusCode::OK && server::is_event_stream(response.headers()) =>
                {
                    let events = RemapRequests::new(body::boxed(response.into_body()), &server.name)
                        .remapping(self.multiplexed)
                        .watching(self.list_watch(index));
                    streams.push(BodyStream::new(body::boxed(events)));
                }
                // 405: the server offers no stream; the client still gets the others'.
                Ok(response) => {
                    tracing::debug!(server = %server.name, status = %response.status(), "an MCP server offers no stream")
                }
                Err(failure) if failure.session_gone => return jsonrpc::session_not_found(&Value::Null),
                Err(failure) => {
                    tracing::warn!(server = %server.name, %failure, "an MCP server's stream could not be opened")
                }
            }
        }
        if streams.is_empty() {
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
                .insert(ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
            return answer;
        }
        let mut answer = Response::new(body::boxed(StreamBody::new(select_all(streams))));
        let headers = answer.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        answer
    }
}
