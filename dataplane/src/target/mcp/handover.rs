//! A session-based client's answer to a 2026-07-28 server's question that reaches another
//! replica than the one holding the call (behind a load balancer that does not keep a
//! session on one replica). The question's id names, sealed with the McpBackend's key, the
//! peer address of the proxy waiting for the answer, the session and when it was asked
//! ([`QuestionTicket`]); the replica the answer reaches checks the last two before anything
//! leaves it, then hands the answer over, sealed with the same key, to that proxy's admin
//! port. The holder takes it only for a call of its own, of the same session, and only if it
//! opens with that call's key: the handover is private to the deployment's proxies and
//! cannot be forged by whoever reaches the admin port.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::input::{Delivery, InputWaits, QUESTION_ID_PREFIX};
use super::jsonrpc::{self, accepted};
use super::session::{digest, unix_now, Sealer};
use crate::body::{self, Body, Held};
use crate::response;
use crate::upstream::Upstream;

/// Where a proxy's admin port takes answers handed over by other replicas.
pub(crate) const ANSWERS_PATH: &str = "/mcp/answers";
/// A handover is one small exchange between two proxies of one deployment.
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(5);
/// How old a question may be beyond the Route's body idle timeout (the time its client has
/// to answer) and still be handed over: clocks of two replicas differ a little.
const CLOCK_SLACK: Duration = Duration::from_secs(30);
/// What the holder answers when no call of its own waits for an answer: told apart from a
/// 404 of whatever else may listen at an address a replica once had.
const NOT_WAITING: &str = "not_waiting";
/// Largest answer of the holder read back.
const MAX_REPLY_BYTES: usize = 4096;
/// Largest handover taken: an answer as large as the proxy holds, sealed (base64 adds a
/// third) and framed.
const MAX_HANDOVER_BYTES: usize = body::MAX_HELD_ANSWER_BYTES / 3 * 4 + 4096;

/// What one replica hands another, as sent: the id in the clear (the holder finds the call
/// by it), the rest sealed.
#[derive(Serialize, Deserialize)]
struct HandedOver {
    id: String,
    sealed: String,
}

/// What is sealed in a handover.
#[derive(Serialize, Deserialize)]
struct Answer {
    /// The question it answers, as sealed: one answer cannot be passed off as another's.
    id: String,
    /// The client's `Mcp-Session-Id`: the holder delivers only to a call of that session.
    session: String,
    response: Map<String, Value>,
}

/// Hands a response no call on this proxy waits for to the proxy its question id names.
/// `idle`: how long the Route gives a client to answer.
pub(super) async fn hand_over(
    sealer: &Sealer,
    waits: &InputWaits,
    id: &str,
    session: &str,
    response: Map<String, Value>,
    idle: Duration,
) -> Response<Body> {
    let Some((ticket, key)) = id
        .strip_prefix(QUESTION_ID_PREFIX)
        .and_then(|sealed| sealer.open_question(sealed))
        .filter(|(ticket, _)| ticket.session == digest(session.as_bytes()))
        .filter(|(ticket, _)| unix_now().saturating_sub(ticket.asked) <= (idle + CLOCK_SLACK).as_secs())
    else {
        return not_waiting();
    };
    let holder = match (ticket.holder, waits.holder()) {
        // Its own question carries its own address: this one is another replica's.
        (None, Some(_)) => return held_elsewhere(),
        // This proxy's question, or another's: neither can be told.
        (None, None) => return not_waiting(),
        (Some(holder), own) if own == Some(holder.as_str()) => return not_waiting(),
        (Some(holder), _) => holder,
    };
    let answer = Answer {
        id: id.to_string(),
        session: session.to_string(),
        response,
    };
    // Strings and JSON values: serializing cannot fail.
    let handed = HandedOver {
        id: id.to_string(),
        sealed: sealer.seal_handover(&serde_json::to_vec(&answer).unwrap_or_default(), key),
    };
    let problem = match tokio::time::timeout(HANDOVER_TIMEOUT, send(&holder, &handed)).await {
        Ok(Ok(Taken::Yes)) => return accepted(),
        Ok(Ok(Taken::NotWaiting)) => return not_waiting(),
        Ok(Ok(Taken::Other(status))) => format!("it answered HTTP {status}"),
        Ok(Err(problem)) => problem,
        // It may have taken the answer meanwhile: the client then hears of the call's end on
        // its stream, and an answer sent again finds nothing waiting.
        Err(_) => format!("no answer within {HANDOVER_TIMEOUT:?}"),
    };
    if let Some(left_out) = waits.handover_warnings.admit() {
        tracing::warn!(%holder, %problem, left_out, "a client's answer could not be handed to the proxy holding its call");
    }
    jsonrpc::error(
        StatusCode::BAD_GATEWAY,
        &Value::Null,
        jsonrpc::UPSTREAM_FAILED,
        format!("the proxy replica holding this call could not take the response: {problem}"),
        None,
        "mcp_handover_failed",
    )
}

/// What the holder made of a handover.
enum Taken {
    Yes,
    NotWaiting,
    Other(StatusCode),
}

async fn send(holder: &str, handed: &HandedOver) -> Result<Taken, String> {
    let host = HeaderValue::from_str(holder).map_err(|_| "its address is no host".to_string())?;
    // Two strings: serializing cannot fail.
    let json = serde_json::to_vec(handed).unwrap_or_default();
    let request = Request::post(format!("http://{holder}{ANSWERS_PATH}"))
        .header(HOST, host)
        .header(CONTENT_TYPE, "application/json")
        .body(body::full(json))
        .map_err(|error| format!("its address is no URL: {error}"))?;
    let answer = Upstream::http1_exchange(&Upstream::http1(), request)
        .await
        .map_err(|failure| failure.reason)?;
    let status = answer.status();
    let bytes = match body::hold(body::boxed(answer.into_body()), MAX_REPLY_BYTES).await {
        Held::Whole(bytes) => bytes,
        _ => Bytes::new(),
    };
    Ok(match status {
        StatusCode::ACCEPTED => Taken::Yes,
        StatusCode::NOT_FOUND if says_not_waiting(&bytes) => Taken::NotWaiting,
        other => Taken::Other(other),
    })
}

/// Whether an error the proxy wrote ([`response::error`]) is of type `not_waiting`.
fn says_not_waiting(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes)
        .is_ok_and(|body| body.pointer("/error/type").and_then(Value::as_str) == Some(NOT_WAITING))
}

fn not_waiting() -> Response<Body> {
    jsonrpc::error(
        StatusCode::BAD_REQUEST,
        &Value::Null,
        jsonrpc::INVALID_REQUEST,
        "Invalid Request: no call awaits this response (it was answered, or timed out, or is \
         not of this session; or it is held by another replica that other replicas cannot \
         reach, without --peer-address)",
        None,
        "mcp_invalid_message",
    )
}

fn held_elsewhere() -> Response<Body> {
    jsonrpc::error(
        StatusCode::BAD_REQUEST,
        &Value::Null,
        jsonrpc::INVALID_REQUEST,
        "Invalid Request: the call awaiting this response is held by another proxy replica, \
         which other replicas cannot reach (it has no --peer-address): a session's requests \
         must reach one replica while a server waits for the client's input",
        None,
        "mcp_invalid_message",
    )
}

impl InputWaits {
    /// Takes an answer another replica handed over (the admin port's `POST /mcp/answers`):
    /// 202 once a call of this proxy has it, 404 (`not_waiting`) if none waits for it.
    pub(crate) async fn take_handed_over(&self, request: Request<Incoming>) -> Response<Body> {
        let json = request
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("application/json"));
        if !json {
            return response::error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send application/json",
            );
        }
        let held = tokio::time::timeout(
            HANDOVER_TIMEOUT,
            body::hold(body::boxed(request.into_body()), MAX_HANDOVER_BYTES),
        )
        .await;
        let bytes = match held {
            Ok(Held::Whole(bytes)) => bytes,
            Ok(Held::Broken(error)) => {
                return response::error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("reading the body: {error}"),
                )
            }
            Ok(Held::TooLarge { .. }) => {
                return response::error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("more than {MAX_HANDOVER_BYTES} bytes"),
                )
            }
            Err(_) => {
                return response::error(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!("the body did not come within {HANDOVER_TIMEOUT:?}"),
                )
            }
        };
        let handed: HandedOver = match serde_json::from_slice(&bytes) {
            Ok(handed) => handed,
            Err(error) => {
                return response::error(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("expected {{id, sealed}}: {error}"),
                )
            }
        };
        let not_waiting = || {
            response::error(
                StatusCode::NOT_FOUND,
                NOT_WAITING,
                "no call on this proxy awaits this response",
            )
        };
        let Some(sealer) = self.sealer_of(&handed.id) else {
            return not_waiting();
        };
        let Some(answer) = sealer
            .open_handover(&handed.sealed)
            .and_then(|plain| serde_json::from_slice::<Answer>(&plain).ok())
            .filter(|answer| answer.id == handed.id)
        else {
            return response::error(
                StatusCode::FORBIDDEN,
                "not_sealed",
                "not sealed for this question with the key of the McpBackend of the call awaiting it",
            );
        };
        match self.deliver(&Value::String(handed.id), &answer.session, answer.response) {
            Delivery::Delivered => response::with_body(StatusCode::ACCEPTED, "text/plain", ""),
            Delivery::NotOurs(_) | Delivery::NotWaiting(_) => not_waiting(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::target::mcp::session::QuestionTicket;
    use crate::tests::support::status_and_text;

    /// Each check is made before anything leaves the proxy: nothing listens at the holder's
    /// address, so an answer handed over would come back as 502.
    #[tokio::test]
    async fn an_answer_is_checked_before_it_is_handed_over() {
        let nobody = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let sealer = Sealer::load(&Arc::from("McpBackend/tools"), &[], Duration::from_secs(60)).unwrap();
        let waits = InputWaits::new(Some("10.9.9.9:7071".into()));
        let idle = Duration::from_secs(10);
        let answer = |holder: Option<&str>, age: u64, session: &str| {
            let ticket = QuestionTicket {
                holder: holder.map(str::to_string),
                asked: unix_now() - age,
                session: digest(session.as_bytes()),
            };
            let id = format!("{QUESTION_ID_PREFIX}{}", sealer.seal_question(&ticket));
            let (sealer, waits) = (&sealer, &waits);
            async move {
                status_and_text(hand_over(sealer, waits, &id, "session-a", Map::new(), idle).await).await
            }
        };
        let (status, body) = answer(Some(&nobody), 0, "session-a").await;
        assert_eq!(status, 502, "a handover is attempted: {body}");
        assert!(body.contains("could not take the response"), "{body}");
        for (case, holder, age, session) in [
            ("another session's", Some(nobody.as_str()), 0, "session-b"),
            ("too old", Some(&nobody), 41, "session-a"),
            ("this proxy's own", Some("10.9.9.9:7071"), 0, "session-a"),
        ] {
            let (status, body) = answer(holder, age, session).await;
            assert_eq!(status, 400, "{case}: {body}");
            assert!(body.contains("no call awaits this response"), "{case}: {body}");
        }
        let (status, body) = answer(None, 0, "session-a").await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("held by another proxy replica"), "{body}");
    }
}
