//! A session-based client's answer to a 2026-07-28 server's question that reaches another
//! replica than the one holding the call (behind a load balancer that does not keep a
//! session on one replica). The question's id names, sealed with the McpBackend's key, the
//! peer address of the proxy waiting for the answer ([`InputWaits`]); the replica the
//! answer reaches hands it over to that proxy's admin port, which delivers it only to a call
//! of its own, of the same session.

use std::time::Duration;

use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::input::{Delivery, InputWaits, QUESTION_ID_PREFIX};
use super::jsonrpc::{self, accepted};
use super::session::Sealer;
use crate::body::{self, Body, Held};
use crate::response;
use crate::upstream::Upstream;

/// Where a proxy's admin port takes answers handed over by other replicas.
pub(crate) const ANSWERS_PATH: &str = "/mcp/answers";
/// A handover is one small exchange between two proxies of one deployment.
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(5);

/// What one replica hands another.
#[derive(Serialize, Deserialize)]
struct HandedOver {
    /// The client's `Mcp-Session-Id`: the holder delivers only to a call of that session.
    session: String,
    id: String,
    response: Map<String, Value>,
}

/// Hands a response no call on this proxy waits for to the proxy its question id names.
pub(super) async fn hand_over(
    sealer: &Sealer,
    waits: &InputWaits,
    id: &str,
    session: &str,
    response: Map<String, Value>,
) -> Response<Body> {
    let holder = id
        .strip_prefix(QUESTION_ID_PREFIX)
        .and_then(|sealed| sealer.question_holder(sealed))
        .filter(|holder| waits.holder() != Some(holder.as_str()));
    let Some(holder) = holder else {
        return not_waiting();
    };
    let handed = HandedOver {
        session: session.to_string(),
        id: id.to_string(),
        response,
    };
    match tokio::time::timeout(HANDOVER_TIMEOUT, send(&holder, &handed)).await {
        Ok(Ok(StatusCode::ACCEPTED)) => accepted(),
        Ok(Ok(StatusCode::NOT_FOUND)) => not_waiting(),
        Ok(Ok(status)) => unreachable_holder(&holder, &format!("it answered HTTP {status}")),
        Ok(Err(problem)) => unreachable_holder(&holder, &problem),
        Err(_) => unreachable_holder(&holder, &format!("no answer within {HANDOVER_TIMEOUT:?}")),
    }
}

async fn send(holder: &str, handed: &HandedOver) -> Result<StatusCode, String> {
    let host = HeaderValue::from_str(holder).map_err(|_| "its address is no host".to_string())?;
    // Maps of JSON values: serializing cannot fail.
    let json = serde_json::to_vec(handed).unwrap_or_default();
    let request = Request::post(format!("http://{holder}{ANSWERS_PATH}"))
        .header(HOST, host)
        .header(CONTENT_TYPE, "application/json")
        .body(body::full(json))
        .map_err(|error| format!("its address is no URL: {error}"))?;
    let answer = Upstream::http1_exchange(&Upstream::http1(), request)
        .await
        .map_err(|failure| failure.reason)?;
    Ok(answer.status())
}

fn not_waiting() -> Response<Body> {
    jsonrpc::error(
        StatusCode::BAD_REQUEST,
        &Value::Null,
        jsonrpc::INVALID_REQUEST,
        "Invalid Request: no call awaits this response (it was answered, or timed out, or the \
         proxy holding the call is gone)",
        None,
        "mcp_invalid_message",
    )
}

fn unreachable_holder(holder: &str, problem: &str) -> Response<Body> {
    tracing::warn!(%holder, %problem, "a client's answer could not be handed to the proxy holding its call");
    jsonrpc::error(
        StatusCode::BAD_GATEWAY,
        &Value::Null,
        jsonrpc::UPSTREAM_FAILED,
        format!("the proxy replica holding this call could not take the response: {problem}"),
        None,
        "mcp_handover_failed",
    )
}

impl InputWaits {
    /// Takes an answer another replica handed over (the admin port's `POST /mcp/answers`):
    /// 202 once a call of this proxy has it, 404 if none waits for it.
    pub(crate) async fn take_handed_over(&self, body: Incoming) -> Response<Body> {
        let bytes = match body::hold(body::boxed(body), body::MAX_HELD_ANSWER_BYTES).await {
            Held::Whole(bytes) => bytes,
            Held::Broken(error) => {
                return response::error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("reading the body: {error}"),
                )
            }
            Held::TooLarge { .. } => {
                return response::error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("more than {} bytes", body::MAX_HELD_ANSWER_BYTES),
                )
            }
        };
        let handed: HandedOver = match serde_json::from_slice(&bytes) {
            Ok(handed) => handed,
            Err(error) => {
                return response::error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("expected {{session, id, response}}: {error}"),
                )
            }
        };
        match self.deliver(&Value::String(handed.id), &handed.session, handed.response) {
            Delivery::Delivered => response::with_body(StatusCode::ACCEPTED, "text/plain", ""),
            Delivery::NotOurs(_) | Delivery::NotWaiting(_) => response::error(
                StatusCode::NOT_FOUND,
                "not_waiting",
                "no call on this proxy awaits this response",
            ),
        }
    }
}
