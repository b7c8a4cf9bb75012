//! The admin port: liveness, readiness, metrics, what the proxy is serving and the pod
//! signals its pickers hold; and, from the other replicas, MCP clients' answers to questions
//! of calls this proxy holds.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::body::Body;
use crate::config_state::ConfigState;
use crate::listener::Handler;
use crate::response;
use crate::target::ANSWERS_PATH;

#[derive(Clone)]
pub(crate) struct AdminHandler {
    pub(crate) state: Arc<ConfigState>,
    pub(crate) proxy_id: Arc<str>,
}

impl Handler for AdminHandler {
    async fn handle(&self, _peer: SocketAddr, request: Request<Incoming>) -> Response<Body> {
        if request.uri().path() == ANSWERS_PATH {
            if request.method() != Method::POST {
                return response::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "use POST");
            }
            return self.state.input_waits().take_handed_over(request).await;
        }
        if request.method() != Method::GET {
            return response::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "use GET");
        }
        match request.uri().path() {
            "/livez" => response::with_body(StatusCode::OK, "text/plain", "ok\n"),
            "/readyz" => match self.state.not_ready_reason() {
                None => response::with_body(StatusCode::OK, "text/plain", "ready\n"),
                Some(reason) => response::with_body(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {reason}\n"),
                ),
            },
            "/metrics" => {
                let (content_type, text) = self.state.telemetry().encode_metrics();
                response::with_body(StatusCode::OK, content_type, text)
            }
            "/status" => {
                let snapshot = self.state.current();
                let listeners: Vec<serde_json::Value> = snapshot
                    .listeners
                    .iter()
                    .map(|entry| serde_json::json!({ "name": entry.name, "address": entry.address.to_string() }))
                    .collect();
                let status = serde_json::json!({
                    "proxyId": &*self.proxy_id,
                    "version": snapshot.version,
                    "listeners": listeners,
                    "ready": self.state.not_ready_reason().is_none(),
                });
                response::json(StatusCode::OK, &status)
            }
            "/signals" => {
                // `?pool=NAME` reports one pool: a 512-pod report is large to poll.
                let only = request.uri().query().and_then(|query| {
                    query
                        .split('&')
                        .find_map(|pair| pair.strip_prefix("pool="))
                        .map(str::to_string)
                });
                let snapshot = self.state.current();
                let pools: serde_json::Map<String, serde_json::Value> = snapshot
                    .pools()
                    .filter(|(name, _)| only.as_ref().is_none_or(|only| only == *name))
                    .map(|(name, pool)| (name.clone(), pool.report()))
                    .collect();
                response::json(StatusCode::OK, &serde_json::json!({ "pools": pools }))
            }
            other => response::error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no admin endpoint {other}"),
            ),
        }
    }
}
