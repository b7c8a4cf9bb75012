//! Guardrails on an McpBackend: each server's request guards see the call's arguments
//! before it goes upstream; its response guards see the result before the client does,
//! whether the server answers with JSON or with an event stream (other events of the
//! stream, such as the server's own requests, pass as they come).

use std::collections::VecDeque;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use portcullis_config::{GuardrailPhase, COMPLETION};
use serde_json::{json, Value};

use super::jsonrpc;
use super::remap::MAX_PENDING_EVENT_BYTES;
use super::server::is_event_stream;
use crate::body::{self, Body, BoxError, Held, MAX_HELD_ANSWER_BYTES};
use crate::policy::guardrail::{Asker, Guards, Stop, Subject};
use crate::sse;

/// The guards of one server.
#[derive(Default)]
pub(super) struct ServerGuards {
    pub(super) request: Guards,
    pub(super) response: Guards,
}

/// What a check is about, owned so a streamed response can check after `call` returned.
#[derive(Clone)]
pub(super) struct Item {
    pub(super) server: String,
    pub(super) method: String,
    /// The item's own name on its server.
    pub(super) name: String,
    /// As the client named it, for messages.
    pub(super) public: String,
}

impl Item {
    fn subject(&self, phase: GuardrailPhase) -> Subject<'_> {
        Subject {
            phase,
            server: &self.server,
            method: &self.method,
            name: &self.name,
            // A resource read has no arguments a mutation could replace, and a completion's
            // typed values are not the call's arguments either.
            mutable: !(phase == GuardrailPhase::McpRequest
                && (self.method == "resources/read" || self.method == COMPLETION)),
        }
    }
}

/// Checks a call's arguments: `Ok` with the replacement arguments when a guard mutated
/// them, or the answer to give instead.
pub(super) async fn check_request(
    guards: &Guards,
    asker: &Asker,
    item: &Item,
    id: &Value,
    arguments: Value,
) -> Result<Option<Value>, Response<Body>> {
    match guards
        .check(asker, &item.subject(GuardrailPhase::McpRequest), arguments)
        .await
    {
        Ok(passed) => Ok(passed.mutated.then_some(passed.payload)),
        Err(stop) => Err(refusal(stop, item, id, "request")),
    }
}

/// Checks the result in a server's answer before it reaches the client.
pub(super) async fn check_response(
    response: Response<Body>,
    guards: Guards,
    asker: Asker,
    item: Item,
    id: Value,
) -> Response<Body> {
    let (mut parts, inner) = response.into_parts();
    if !is_event_stream(&parts.headers) {
        let bytes = match body::hold(inner, MAX_HELD_ANSWER_BYTES).await {
            Held::Whole(bytes) => bytes,
            Held::Broken(problem) => {
                let server = format!("server {}", item.server);
                return jsonrpc::upstream_failed(&id, &server, &format!("its answer broke off: {problem}"));
            }
            // Too large to check: the failure modes decide, as for any unreadable answer.
            Held::TooLarge { start, rest } => {
                let subject = item.subject(GuardrailPhase::McpResponse);
                let problem = format!("the server's answer is larger than {MAX_HELD_ANSWER_BYTES} bytes");
                return match guards.unreadable(&asker, &subject, &problem) {
                    Ok(()) => {
                        parts.headers.remove(http::header::CONTENT_LENGTH);
                        Response::from_parts(parts, body::prepend(start, rest))
                    }
                    Err(stop) => refusal(stop, &item, &id, "result"),
                };
            }
        };
        let checked = match checked_data(&bytes, &guards, &asker, &item, &id).await {
            Checked::Unchanged => body::full(bytes),
            Checked::Changed(message) => body::full(message.to_string()),
            Checked::Refused(answer) => return answer,
        };
        parts.headers.remove(http::header::CONTENT_LENGTH);
        return Response::from_parts(parts, checked);
    }
    // Events are re-encoded: the server's length no longer holds.
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let state = Stream {
        inner,
        parser: sse::Parser::default(),
        ready: VecDeque::new(),
        ended: false,
        guards,
        asker,
        item,
        id,
    };
    let frames = futures::stream::unfold(state, Stream::next);
    Response::from_parts(parts, body::boxed(StreamBody::new(frames)))
}

enum Checked {
    Unchanged,
    Changed(Value),
    /// The whole answer to give instead.
    Refused(Response<Body>),
}

/// One JSON-RPC message from the server (a JSON body, or an event's data). The server's
/// requests and notifications, and errors, pass (an error's `message` and `data` are not
/// checked); anything with a `result` is a result, and is checked. Anything else (not JSON,
/// a batch, a result that is not an object, a result with an error, a method that is not a
/// string) cannot be checked, and the failure modes decide: under FailClosed a guarded
/// result never slips through unread, whatever a client would take the message for.
async fn checked_data(data: &[u8], guards: &Guards, asker: &Asker, item: &Item, id: &Value) -> Checked {
    let subject = item.subject(GuardrailPhase::McpResponse);
    let unreadable = |problem: &str| match guards.unreadable(asker, &subject, problem) {
        Ok(()) => Checked::Unchanged,
        Err(stop) => Checked::Refused(refusal(stop, item, id, "result")),
    };
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(data) else {
        return unreadable("the server's answer is not one JSON-RPC message");
    };
    if message.get("method").is_some_and(|method| !method.is_string()) {
        return unreadable("the server's message has a method that is not a string");
    }
    match (message.contains_key("result"), message.contains_key("error")) {
        (true, true) => return unreadable("the server's answer has both a result and an error"),
        (false, true) => return Checked::Unchanged,
        (false, false) if message.contains_key("method") => return Checked::Unchanged,
        _ => {}
    }
    // Only the response to this request reaches here: others were dropped on the way.
    let result = match message.get_mut("result").map(Value::take) {
        Some(result @ Value::Object(_)) => result,
        _ => return unreadable("the server's answer has no result object"),
    };
    match guards.check(asker, &subject, result).await {
        Ok(passed) if passed.mutated => {
            message.insert("result".into(), passed.payload);
            Checked::Changed(Value::Object(message))
        }
        Ok(_) => Checked::Unchanged,
        Err(stop) => Checked::Refused(refusal(stop, item, id, "result")),
    }
}

struct Stream {
    inner: Body,
    parser: sse::Parser,
    ready: VecDeque<Bytes>,
    ended: bool,
    guards: Guards,
    asker: Asker,
    item: Item,
    id: Value,
}

impl Stream {
    async fn next(mut self) -> Option<(Result<Frame<Bytes>, BoxError>, Stream)> {
        loop {
            if let Some(bytes) = self.ready.pop_front() {
                return Some((Ok(Frame::data(bytes)), self));
            }
            if self.ended {
                return None;
            }
            match self.inner.frame().await {
                None => self.ended = true,
                Some(Err(error)) => {
                    self.ended = true;
                    return Some((Err(error), self));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    let mut events = Vec::new();
                    self.parser.feed(&data, &mut events);
                    if self.parser.pending() > MAX_PENDING_EVENT_BYTES {
                        self.ended = true;
                        return Some((Err("an event of the server's stream exceeds 16 MiB".into()), self));
                    }
                    for mut event in events {
                        // Priming events (an id, no data) carry no message.
                        if event.data.trim().is_empty() {
                            self.ready.push_back(event.encode());
                            continue;
                        }
                        let checked = checked_data(
                            event.data.as_bytes(),
                            &self.guards,
                            &self.asker,
                            &self.item,
                            &self.id,
                        );
                        match checked.await {
                            Checked::Unchanged => {}
                            Checked::Changed(message) => event.data = message.to_string(),
                            Checked::Refused(answer) => {
                                // The refusal is the answer to the request: send it as the
                                // event's data and end the stream.
                                event.data = refusal_message(answer).await;
                                self.ready.push_back(event.encode());
                                self.ended = true;
                                break;
                            }
                        }
                        self.ready.push_back(event.encode());
                    }
                }
            }
        }
    }
}

/// The JSON text of a gateway answer, to send as an event.
async fn refusal_message(answer: Response<Body>) -> String {
    match answer.into_body().collect().await {
        Ok(collected) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
        Err(_) => String::new(),
    }
}

/// A denial or a failed check, as JSON-RPC with HTTP 200 (clients keep their session).
fn refusal(stop: Stop, item: &Item, id: &Value, what: &str) -> Response<Body> {
    match stop {
        Stop::Denied { guardrail, reason } => jsonrpc::error(
            StatusCode::OK,
            id,
            jsonrpc::GUARDRAIL_DENIED,
            format!(
                "{guardrail} denied the {what} of {} {}: {reason}",
                item.method, item.public
            ),
            Some(json!({"guardrail": &*guardrail, "reason": reason})),
            "mcp_guardrail_denied",
        ),
        Stop::Unavailable { guardrail } => jsonrpc::error(
            StatusCode::OK,
            id,
            jsonrpc::GUARDRAIL_UNAVAILABLE,
            format!(
                "{guardrail} could not check the {what} of {} {}: no verdict could be had, so it \
                 was not let through (try again later)",
                item.method, item.public
            ),
            Some(json!({"guardrail": &*guardrail})),
            "mcp_guardrail_unavailable",
        ),
    }
}
