//! A server's questions to the client (sampling, elicitation, roots) when the two speak
//! different revisions.
//!
//! Session-based revisions ask mid-call: the server sends a JSON-RPC request on the call's
//! event stream and waits for the client's response, POSTed in the session
//! (<https://modelcontextprotocol.io/specification/2025-11-25/client/elicitation>).
//! 2026-07-28 asks by result (SEP-2322, multi round-trip requests): `resultType:
//! "input_required"` with the questions keyed in `inputRequests`; the client sends the
//! original request again with `inputResponses` under the same keys and the `requestState`
//! it was given.
//!
//! - **2026-07-28 client, session-based server** ([`Answers`]): a bridged request runs in a
//!   session opened for it. The first question the client has not answered ends the round
//!   (closing the session cancels the call) as `input_required`, keyed by a digest of the
//!   question. The next round runs the request again in a new session and answers every
//!   question asked again from the answers so far, which travel in `requestState`: nothing
//!   is kept on the proxy, so a round may reach any replica. The tool runs once per round,
//!   as a 2026-07-28 server's tool does.
//! - **Session-based client, 2026-07-28 server** ([`relay`]): the call's answer becomes an
//!   event stream the gateway writes. Each question goes to the client as a request on it;
//!   once every one has its response the gateway sends the request again with them. The
//!   responses are POSTs of the client's session awaited by the proxy holding the call
//!   ([`InputWaits`]); one that reaches another replica is handed over to it
//!   (`handover.rs`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use futures::stream::{self, StreamExt};
use http::Response;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

use super::jsonrpc::{self, upstream_failed};
use super::listen::{self, event, KEEPALIVE, KEEPALIVE_COMMENT};
use super::reach::{self, ClientMeta, Reach, Sent};
use super::remap;
use super::server::{self, Reply, Server, MAX_ANSWER_BYTES};
use super::session::{digest, unix_now, QuestionTicket, Sealer};
use crate::body::{self, Body};
use crate::sse;
use crate::telemetry::{LogThrottle, RequestTrace};
use crate::upstream::{Http1Body, Upstream};

/// The requests with which a session-based server asks the client, and which 2026-07-28
/// carries as input requests.
const QUESTIONS: &[&str] = &["sampling/createMessage", "elicitation/create", "roots/list"];
/// The methods whose results may be `input_required`.
pub(super) const INTERACTIVE: &[&str] = &["tools/call", "prompts/get", "resources/read"];
/// Answers carried from round to round of a bridged request; one needing more fails.
const MAX_ANSWERS: usize = 32;
/// Rounds of one session-based client's call; a server asking more fails the call.
const MAX_ROUNDS: usize = 16;
/// How often a failed handover to another replica is logged at most.
const HANDOVER_WARN_INTERVAL: Duration = Duration::from_secs(30);
/// Marks a `requestState` the gateway wrote.
const STATE_PREFIX: &str = "portcullis-answers.";
/// Marks the id of a question the gateway passed on. Never an id a server chose, nor one
/// the gateway renamed for its server (server names have no `:`). The rest is a sealed
/// [`QuestionTicket`].
pub(super) const QUESTION_ID_PREFIX: &str = "portcullis:input:";

/// The client's answers a bridged request carries, and the questions of this round it has
/// not answered.
#[derive(Debug, Default)]
pub(super) struct Answers {
    given: Map<String, Value>,
    asked: Map<String, Value>,
}

impl Answers {
    /// Takes `inputResponses` and `requestState` out of a bridged request (the session-based
    /// server knows neither). `Err`: what is wrong with them, for the client.
    pub(super) fn take(message: &mut Value) -> Result<Answers, String> {
        let mut answers = Answers::default();
        let Some(Value::Object(params)) = message.get_mut("params") else {
            return Ok(answers);
        };
        match params.remove("requestState") {
            None | Some(Value::Null) => {}
            Some(Value::String(state)) => {
                answers.given = decode_state(&state)
                    .ok_or("Invalid params: this requestState was not written by the gateway")?;
            }
            Some(_) => return Err("Invalid params: requestState must be a string".into()),
        }
        match params.remove("inputResponses") {
            None | Some(Value::Null) => {}
            Some(Value::Object(responses)) => answers.given.extend(responses),
            Some(_) => return Err("Invalid params: inputResponses must be an object".into()),
        }
        if answers.given.len() > MAX_ANSWERS {
            return Err(format!(
                "Invalid params: more than {MAX_ANSWERS} input responses in one request"
            ));
        }
        Ok(answers)
    }

    /// What becomes of a question the server asks: answered from what the client said, or
    /// the end of the round.
    pub(super) fn reply(&mut self, method: &str, params: &Value) -> Reply {
        if !QUESTIONS.contains(&method) {
            return Reply::Refuse;
        }
        let key = question_key(method, params);
        if let Some(result) = self.given.get(&key) {
            return Reply::Result(result.clone());
        }
        self.asked
            .insert(key, json!({"method": method, "params": params}));
        Reply::Stop
    }

    /// The `input_required` result that asks the client this round's questions.
    pub(super) fn input_required(self, id: &Value) -> Value {
        json!({"jsonrpc": "2.0", "id": id, "result": {
            "resultType": "input_required",
            "inputRequests": self.asked,
            "requestState": encode_state(&self.given),
        }})
    }
}

/// A question's key: the same question asked again in the next round has the same key.
/// `_meta` is left out (it carries per-request ids such as progress tokens).
fn question_key(method: &str, params: &Value) -> String {
    let mut params = params.clone();
    if let Value::Object(fields) = &mut params {
        fields.remove("_meta");
        // A URL-mode elicitation names each asking anew.
        fields.remove("elicitationId");
    }
    // serde_json maps keep their keys sorted: the same question serializes the same way.
    let digest = Sha256::digest(json!([method, params]).to_string());
    format!("q-{}", URL_SAFE_NO_PAD.encode(&digest[..12]))
}

/// The answers are the client's own, so they travel in the clear.
fn encode_state(given: &Map<String, Value>) -> String {
    format!(
        "{STATE_PREFIX}{}",
        URL_SAFE_NO_PAD.encode(Value::Object(given.clone()).to_string())
    )
}

fn decode_state(state: &str) -> Option<Map<String, Value>> {
    let encoded = state.strip_prefix(STATE_PREFIX)?;
    let bytes = URL_SAFE_NO_PAD.decode(encoded).ok()?;
    match serde_json::from_slice(&bytes).ok()? {
        Value::Object(given) => Some(given),
        _ => None,
    }
}

/// The responses to questions this proxy passed on to session-based clients, awaited by the
/// calls that asked them. On `Upstream`, so across config versions: a call outlives the
/// version it began in.
pub(crate) struct InputWaits {
    waiting: Mutex<HashMap<String, Waiting>>,
    /// Where other replicas reach this proxy's admin port to hand over answers that reached
    /// them (`--peer-address`); `None`: answers must reach this proxy.
    holder: Option<String>,
    /// Handovers that failed, logged at most once per interval.
    pub(super) handover_warnings: LogThrottle,
}

struct Waiting {
    /// The `Mcp-Session-Id` of the call: only its own session may answer.
    session: String,
    /// Its McpBackend's: opens what another replica hands over for it.
    sealer: Arc<Sealer>,
    answer: oneshot::Sender<Map<String, Value>>,
}

/// A question awaiting its response; forgotten when dropped (answered, timed out, or the
/// call gone).
struct Pending {
    waits: Arc<InputWaits>,
    id: String,
    answer: oneshot::Receiver<Map<String, Value>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.waits.lock().remove(&self.id);
    }
}

/// What became of a client's response.
pub(super) enum Delivery {
    /// Not the answer to a question the gateway passed on: the response, given back.
    NotOurs(Map<String, Value>),
    Delivered,
    /// The gateway's id, but no call on this proxy waits for it: the response, given back.
    NotWaiting(Map<String, Value>),
}

impl InputWaits {
    pub(crate) fn new(holder: Option<String>) -> InputWaits {
        InputWaits {
            waiting: Mutex::default(),
            holder,
            handover_warnings: LogThrottle::new(HANDOVER_WARN_INTERVAL),
        }
    }

    pub(super) fn holder(&self) -> Option<&str> {
        self.holder.as_deref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait(self: &Arc<Self>, session: &str, sealer: &Arc<Sealer>) -> Pending {
        let (sender, answer) = oneshot::channel();
        // Unguessable (a random nonce): a client of another session must not guess it (the
        // session is checked too).
        let ticket = QuestionTicket {
            holder: self.holder.clone(),
            asked: unix_now(),
            session: digest(session.as_bytes()),
        };
        let id = format!("{QUESTION_ID_PREFIX}{}", sealer.seal_question(&ticket));
        self.lock().insert(
            id.clone(),
            Waiting {
                session: session.to_string(),
                sealer: sealer.clone(),
                answer: sender,
            },
        );
        Pending {
            waits: self.clone(),
            id,
            answer,
        }
    }

    /// The sealer of the call waiting for `id`, if one is.
    pub(super) fn sealer_of(&self, id: &str) -> Option<Arc<Sealer>> {
        self.lock().get(id).map(|waiting| waiting.sealer.clone())
    }

    /// Hands a client's response to the call awaiting it.
    pub(super) fn deliver(&self, id: &Value, session: &str, response: Map<String, Value>) -> Delivery {
        let Some(id) = id.as_str().filter(|id| id.starts_with(QUESTION_ID_PREFIX)) else {
            return Delivery::NotOurs(response);
        };
        let mut waiting = self.lock();
        if waiting.get(id).is_none_or(|waiting| waiting.session != session) {
            return Delivery::NotWaiting(response);
        }
        match waiting.remove(id) {
            Some(waiting) => match waiting.answer.send(response) {
                Ok(()) => Delivery::Delivered,
                Err(response) => Delivery::NotWaiting(response),
            },
            None => Delivery::NotWaiting(response),
        }
    }
}

/// A session-based client's call to a 2026-07-28 server: what it takes to send it again.
pub(super) struct Call {
    pub(super) target: Arc<str>,
    pub(super) server: Arc<Server>,
    pub(super) upstream: Arc<Upstream>,
    pub(super) client: Arc<ClientMeta>,
    pub(super) trace: RequestTrace,
    /// The client's `Mcp-Session-Id`.
    pub(super) session: String,
    /// Seals the ids of the questions passed on.
    pub(super) sealer: Arc<Sealer>,
    /// The request as the client sent it (renamed for the server), before `_meta` is added.
    pub(super) message: Value,
    /// How long a server's answer, and the client's, may stay silent.
    pub(super) idle: Duration,
}

/// One round's answer from the server.
enum Round {
    Answered(Value),
    Stream(Body),
}

/// Why a call ended without the server's final answer; the client gets a JSON-RPC error.
struct Problem {
    code: i64,
    message: String,
}

/// Relays a 2026-07-28 server's answer to a session-based client's call. An answer that
/// asks for input, or may (an event stream), becomes an event stream the gateway writes.
pub(super) async fn relay(call: Call, response: Response<Http1Body>) -> Response<Body> {
    let (parts, body) = server::relay(response, call.idle).into_parts();
    if server::is_event_stream(&parts.headers) {
        return driven(call, Round::Stream(body));
    }
    let id = call.message.get("id").cloned().unwrap_or(Value::Null);
    let bytes = match call.server.own_response(body, parts.status, &id).await {
        Ok(bytes) => bytes,
        Err(failure) => return upstream_failed(&id, &call.target, &failure.to_string()),
    };
    // Most answers ask nothing: only one that names the result type is parsed.
    let asks = bytes
        .windows(INPUT_REQUIRED.len())
        .any(|window| window == INPUT_REQUIRED);
    match asks.then(|| serde_json::from_slice::<Value>(&bytes)) {
        Some(Ok(message)) if questions(&message).is_some() => driven(call, Round::Answered(message)),
        _ => Response::from_parts(parts, body::full(bytes)),
    }
}

const INPUT_REQUIRED: &[u8] = b"\"input_required\"";

/// The event stream of a call the gateway carries through its rounds: the server's own
/// events as they come, the questions, then the final answer.
fn driven(call: Call, first: Round) -> Response<Body> {
    let (events, receiver) = mpsc::channel::<Bytes>(16);
    let driver = async move {
        let id = call.message.get("id").cloned().unwrap_or(Value::Null);
        let last = match call.rounds(first, &events).await {
            Ok(message) => message,
            Err(problem) => json!({"jsonrpc": "2.0", "id": id, "error": {
                "code": problem.code, "message": problem.message,
            }}),
        };
        emit(&events, event(&last)).await;
    };
    // The driver runs as the body is read, and stops when the client leaves (the body is
    // dropped); its events end with it.
    let driver = stream::once(driver).filter_map(|()| async { None });
    let frames = stream::select(ReceiverStream::new(receiver), driver)
        .map(|bytes| Ok::<_, Infallible>(Frame::data(bytes)));
    listen::event_stream(body::boxed(StreamBody::new(frames)))
}

/// Sends an event to the client. The driver and the receiving end live in one body, so the
/// receiver is there as long as anyone sends: a client that leaves drops both.
async fn emit(events: &mpsc::Sender<Bytes>, bytes: Bytes) {
    let _ = events.send(bytes).await;
}

/// The questions of an `input_required` result, and its `requestState`.
fn questions(message: &Value) -> Option<(Map<String, Value>, Option<Value>)> {
    let result = message.get("result")?;
    if result.get("resultType").and_then(Value::as_str) != Some("input_required") {
        return None;
    }
    let requests = match result.get("inputRequests") {
        Some(Value::Object(requests)) => requests.clone(),
        _ => Map::new(),
    };
    Some((requests, result.get("requestState").cloned()))
}

impl Call {
    async fn rounds(&self, first: Round, events: &mpsc::Sender<Bytes>) -> Result<Value, Problem> {
        let mut round = first;
        for asked in 0..=MAX_ROUNDS {
            let message = match round {
                Round::Answered(message) => message,
                Round::Stream(body) => self.read(body, events).await?,
            };
            let Some((requests, state)) = questions(&message) else {
                return Ok(message);
            };
            if asked == MAX_ROUNDS {
                break;
            }
            let responses = self.ask(requests, events).await?;
            let mut retry = self.message.clone();
            if let Some(Value::Object(params)) = retry.get_mut("params") {
                params.insert("inputResponses".into(), Value::Object(responses));
                if let Some(state) = state {
                    params.insert("requestState".into(), state);
                }
            }
            round = self.send(retry).await?;
        }
        Err(self.failed(format!(
            "asked for input more than {MAX_ROUNDS} times in one call"
        )))
    }

    fn failed(&self, reason: impl Into<String>) -> Problem {
        Problem {
            code: jsonrpc::UPSTREAM_FAILED,
            message: format!("{}: {}", self.target, self.server.failure(reason)),
        }
    }

    /// Passes the server's events on to the client until its answer to the call comes.
    async fn read(&self, mut body: Body, events: &mpsc::Sender<Bytes>) -> Result<Value, Problem> {
        let id = self.message.get("id");
        let mut parser = sse::Parser::default();
        let mut parsed = Vec::new();
        loop {
            let data = match body.frame().await {
                None => return Err(self.failed("the event stream ended without the response")),
                Some(Err(error)) => return Err(self.failed(format!("reading the event stream: {error}"))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
            };
            if parser.pending() > MAX_ANSWER_BYTES {
                return Err(self.failed("sent an event larger than the gateway reads"));
            }
            parser.feed(&data, &mut parsed);
            if parser.took_comment() {
                emit(events, Bytes::from_static(KEEPALIVE_COMMENT)).await;
            }
            for sse_event in parsed.drain(..) {
                let Ok(message) = serde_json::from_str::<Value>(&sse_event.data) else {
                    continue;
                };
                if message.get("method").is_none() && message.get("id") == id {
                    return Ok(message);
                }
                // 2026-07-28 servers send no requests; their notifications (progress, logs)
                // go on to the client.
                match message.get("id") {
                    None => emit(events, event(&message)).await,
                    Some(_) if message.get("method").is_none() => {
                        remap::dropped_stray_response(&self.server.name)
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// Sends the client each question as a request and waits for every response.
    async fn ask(
        &self,
        requests: Map<String, Value>,
        events: &mpsc::Sender<Bytes>,
    ) -> Result<Map<String, Value>, Problem> {
        let unanswered = |message: String| Problem {
            code: jsonrpc::INPUT_UNANSWERED,
            message: format!("{}: {}", self.target, message),
        };
        let mut pending = Vec::with_capacity(requests.len());
        for (key, request) in requests {
            let Some(method) = request.get("method").and_then(Value::as_str) else {
                return Err(self.failed(format!("asked for input {key} without a method")));
            };
            let method = method.to_string();
            let waiting = self.upstream.input_waits.wait(&self.session, &self.sealer);
            let question = json!({
                "jsonrpc": "2.0", "id": waiting.id, "method": method,
                "params": request.get("params").cloned().unwrap_or_else(|| json!({})),
            });
            emit(events, event(&question)).await;
            pending.push((key, method, waiting));
        }
        // Every question is out: the client answers them in any order, all within one idle
        // time.
        let deadline = tokio::time::Instant::now() + self.idle;
        let mut keepalive = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
        let mut answers = Map::new();
        for (key, method, mut waiting) in pending {
            let mut response = loop {
                tokio::select! {
                    response = tokio::time::timeout_at(deadline, &mut waiting.answer) => break match response {
                        Err(_) => return Err(unanswered(format!(
                            "the client did not answer the server's {method} within {:?}", self.idle
                        ))),
                        Ok(Err(_)) => return Err(unanswered(format!("the client's answer to {method} was lost"))),
                        Ok(Ok(response)) => response,
                    },
                    // Someone may take a while to answer: idle timeouts between the gateway and
                    // the client must not close the stream meanwhile.
                    _ = keepalive.tick() => emit(events, Bytes::from_static(KEEPALIVE_COMMENT)).await,
                }
            };
            match response.remove("result") {
                Some(result) => {
                    answers.insert(key, result);
                }
                None => {
                    let error = response.remove("error").unwrap_or(Value::Null);
                    return Err(unanswered(format!(
                        "the client refused the server's {method}: {}",
                        error
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("(no message)")
                    )));
                }
            }
        }
        Ok(answers)
    }

    /// Sends the call again, with the client's answers.
    async fn send(&self, message: Value) -> Result<Round, Problem> {
        let reach = Reach::Modern(self.client.clone());
        match reach::send(&self.server, &reach, message, &self.upstream, &self.trace).await {
            Err(failure) => Err(Problem {
                code: jsonrpc::UPSTREAM_FAILED,
                message: format!("{}: {failure}", self.target),
            }),
            Ok(Sent::Answered(answer)) => Ok(Round::Answered(answer.message)),
            Ok(Sent::Relay(response)) => {
                let (parts, body) = server::relay(response, self.idle).into_parts();
                if server::is_event_stream(&parts.headers) {
                    return Ok(Round::Stream(body));
                }
                let id = self.message.get("id").unwrap_or(&Value::Null);
                let bytes = self
                    .server
                    .own_response(body, parts.status, id)
                    .await
                    .map_err(|failure| Problem {
                        code: jsonrpc::UPSTREAM_FAILED,
                        message: format!("{}: {failure}", self.target),
                    })?;
                match serde_json::from_slice::<Value>(&bytes) {
                    Ok(message) if message.get("result").is_some() || message.get("error").is_some() => {
                        Ok(Round::Answered(message))
                    }
                    _ => Err(self.failed(format!(
                        "answered HTTP {} without a JSON-RPC response",
                        parts.status
                    ))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::header::CONTENT_TYPE;
    use http::HeaderValue;
    use hyper::body::Incoming;
    use portcullis_config::{McpFailureMode, McpServerSpec};

    use super::*;
    use crate::telemetry::Telemetry;
    use crate::tests::support::{quiet_telemetry, spawn_upstream, text, UpstreamBody};

    fn confirm(meta: Value) -> Value {
        json!({"message": "Add 2 and 3?", "requestedSchema": {"type": "object"}, "_meta": meta})
    }

    #[test]
    fn a_question_asked_again_is_answered_from_what_the_client_said() {
        let mut call = json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "ask"}});
        let mut answers = Answers::take(&mut call).unwrap();
        assert!(matches!(
            answers.reply("ping-like/other", &json!({})),
            Reply::Refuse
        ));
        assert!(matches!(
            answers.reply("elicitation/create", &confirm(json!({"progressToken": 1}))),
            Reply::Stop
        ));
        let asked = answers.input_required(&json!(4));
        let result = &asked["result"];
        assert_eq!(result["resultType"], "input_required", "{asked}");
        let requests = result["inputRequests"].as_object().unwrap();
        assert_eq!(requests.len(), 1, "{asked}");
        let (key, request) = requests.iter().next().unwrap();
        assert_eq!(request["method"], "elicitation/create");
        assert_eq!(request["params"]["message"], "Add 2 and 3?");

        // The next round: the same question (other `_meta`) is answered, a new one ends it,
        // and the answers so far travel on.
        let mut retry = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
            "name": "ask",
            "inputResponses": {key.clone(): {"action": "accept", "content": {"ok": true}}},
            "requestState": result["requestState"],
        }});
        let mut answers = Answers::take(&mut retry).unwrap();
        assert_eq!(
            retry["params"],
            json!({"name": "ask"}),
            "the server sees neither field"
        );
        match answers.reply("elicitation/create", &confirm(json!({"progressToken": 2}))) {
            Reply::Result(result) => assert_eq!(result["action"], "accept"),
            _ => panic!("the answered question was asked again"),
        }
        assert!(matches!(answers.reply("roots/list", &json!({})), Reply::Stop));
        let asked = answers.input_required(&json!(5));
        let state = asked["result"]["requestState"].as_str().unwrap();
        assert!(decode_state(state).unwrap().contains_key(key), "{asked}");
        assert!(
            !asked["result"]["inputRequests"]
                .as_object()
                .unwrap()
                .contains_key(key),
            "{asked}"
        );
    }

    #[test]
    fn state_the_gateway_did_not_write_and_malformed_responses_are_refused() {
        for params in [
            json!({"requestState": "opaque-state-of-some-server"}),
            json!({"requestState": format!("{STATE_PREFIX}!!")}),
            json!({"requestState": 7}),
            json!({"inputResponses": ["not", "a", "map"]}),
        ] {
            let mut message = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params});
            let refused = Answers::take(&mut message).unwrap_err();
            assert!(refused.starts_with("Invalid params: "), "{refused}");
        }
    }

    #[tokio::test]
    async fn a_response_reaches_only_the_waiting_call_of_its_own_session() {
        let waits = Arc::new(InputWaits::new(Some("10.0.0.7:7071".into())));
        let sealer = sealer();
        let mut pending = waits.wait("session-a", &sealer);
        let ticket = pending
            .id
            .strip_prefix(QUESTION_ID_PREFIX)
            .and_then(|sealed| sealer.open_question(sealed))
            .map(|(ticket, _)| ticket)
            .unwrap();
        assert_eq!(
            (ticket.holder.as_deref(), ticket.session),
            (Some("10.0.0.7:7071"), digest(b"session-a")),
            "the id names the proxy holding the call, and the session"
        );
        let id = json!(pending.id.clone());
        let response = || Map::from_iter([("result".to_string(), json!({"action": "accept"}))]);
        assert!(matches!(
            waits.deliver(&json!("math__7"), "session-a", response()),
            Delivery::NotOurs(_)
        ));
        assert!(matches!(
            waits.deliver(&id, "session-b", response()),
            Delivery::NotWaiting(_)
        ));
        assert!(matches!(
            waits.deliver(&id, "session-a", response()),
            Delivery::Delivered
        ));
        assert_eq!((&mut pending.answer).await.unwrap(), response());
        assert!(matches!(
            waits.deliver(&id, "session-a", response()),
            Delivery::NotWaiting(_)
        ));

        let abandoned = waits.wait("session-a", &sealer);
        let id = json!(abandoned.id.clone());
        drop(abandoned);
        assert!(matches!(
            waits.deliver(&id, "session-a", response()),
            Delivery::NotWaiting(_)
        ));
        assert!(waits.lock().is_empty());
    }

    fn sealer() -> Arc<Sealer> {
        let ttl = Duration::from_secs(60);
        Arc::new(Sealer::load(&Arc::from("McpBackend/tools"), &[], ttl).unwrap())
    }

    /// A 2026-07-28 server that asks once (on an event stream, after a progress
    /// notification) and answers the retry that carries the client's answer.
    async fn asking_server(posts: Arc<AtomicUsize>) -> std::net::SocketAddr {
        spawn_upstream(move |request: http::Request<Incoming>| {
            let posts = posts.clone();
            async move {
                posts.fetch_add(1, Ordering::SeqCst);
                let bytes = request.into_body().collect().await.unwrap().to_bytes();
                let message: Value = serde_json::from_slice(&bytes).unwrap();
                let id = message["id"].clone();
                if let Some(responses) = message["params"].get("inputResponses") {
                    let answer = if responses["q1"]["content"]["ok"] == true
                        && message["params"]["requestState"] == "s1"
                    {
                        json!({"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": "5"}]}})
                    } else {
                        json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32602, "message": "bad retry"}})
                    };
                    return text(answer.to_string());
                }
                let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                    "params": {"progressToken": 1, "progress": 1}});
                let asks = json!({"jsonrpc": "2.0", "id": id, "result": {
                    "resultType": "input_required", "requestState": "s1",
                    "inputRequests": {"q1": {"method": "elicitation/create", "params": {"message": "Add?"}}},
                }});
                let stream: UpstreamBody = http_body_util::Full::new(Bytes::from(format!(
                    "data: {progress}\n\ndata: {asks}\n\n"
                )))
                .boxed();
                let mut response = http::Response::new(stream);
                response
                    .headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
                response
            }
        })
        .await
    }

    /// A session-based server that asks for the client's roots while it answers `tools/list`;
    /// what it was sent, in order.
    async fn questioning_server(seen: Arc<Mutex<Vec<String>>>) -> std::net::SocketAddr {
        spawn_upstream(move |request: http::Request<Incoming>| {
            let seen = seen.clone();
            async move {
                if request.method() == http::Method::DELETE {
                    seen.lock().unwrap().push("DELETE".into());
                    return text("");
                }
                let bytes = request.into_body().collect().await.unwrap().to_bytes();
                let message: Value = serde_json::from_slice(&bytes).unwrap();
                let id = message["id"].clone();
                let method = message["method"].as_str().unwrap_or("(response)").to_string();
                seen.lock().unwrap().push(if method == "(response)" {
                    message.to_string()
                } else {
                    method.clone()
                });
                let mut response = match method.as_str() {
                    "initialize" => text(
                        json!({"jsonrpc": "2.0", "id": id, "result": {
                        "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                        "serverInfo": {"name": "old", "version": "1"}}})
                        .to_string(),
                    ),
                    "tools/list" => {
                        let asks = json!({"jsonrpc": "2.0", "id": 0, "method": "roots/list"});
                        let list = json!({"jsonrpc": "2.0", "id": id, "result": {"tools": [{"name": "a"}]}});
                        let mut response = text(format!("data: {asks}\n\ndata: {list}\n\n"));
                        response
                            .headers_mut()
                            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
                        response
                    }
                    _ => {
                        let mut accepted = text("");
                        *accepted.status_mut() = http::StatusCode::ACCEPTED;
                        accepted
                    }
                };
                if method == "initialize" {
                    response
                        .headers_mut()
                        .insert("mcp-session-id", HeaderValue::from_static("s1"));
                    response
                        .headers_mut()
                        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                }
                response
            }
        })
        .await
    }

    #[tokio::test]
    async fn a_bridged_list_refuses_the_server_s_questions_and_its_session_ends() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let address = questioning_server(seen.clone()).await;
        let telemetry = Arc::new(Telemetry::new(quiet_telemetry()).unwrap());
        let upstream = Arc::new(Upstream::new(telemetry, crate::placements::outbox().0, None));
        let server = Server::compile(
            &McpServerSpec {
                name: "old".into(),
                url: format!("http://{address}/mcp"),
                tls: None,
                timeout: None,
                failure_mode: McpFailureMode::Fail,
                list_ttl: None,
            },
            &upstream,
        )
        .map(Arc::new)
        .unwrap();
        let client = Arc::new(ClientMeta::from_initialize(
            &json!({"capabilities": {"roots": {}}}),
        ));
        let list = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {}});
        let result = reach::ask(
            &server,
            &Reach::Bridge(client),
            list,
            &upstream,
            &RequestTrace::default(),
        )
        .await
        .ok()
        .unwrap();
        // A list cannot ask the client: the answer is the list, the question refused.
        assert_eq!(result["tools"][0]["name"], "a", "{result}");
        // The session ends in the background, as a task a stopping proxy waits for.
        assert!(
            upstream.background.drain(Duration::from_secs(30)).await,
            "the session opened for the list ends"
        );
        let seen = seen.lock().unwrap().clone();
        let refusal: Value = serde_json::from_str(&seen[3]).unwrap();
        assert_eq!(
            (refusal["id"].clone(), refusal["error"]["code"].clone()),
            (json!(0), json!(jsonrpc::METHOD_NOT_FOUND)),
            "{seen:?}"
        );
        assert_eq!(
            seen.iter()
                .map(String::as_str)
                .filter(|sent| !sent.starts_with('{'))
                .collect::<Vec<_>>(),
            ["initialize", "notifications/initialized", "tools/list", "DELETE"],
            "the session opened for the list ends with it"
        );
    }

    async fn next_message(body: &mut Body, parser: &mut sse::Parser, pending: &mut Vec<sse::Event>) -> Value {
        while pending.is_empty() {
            let frame = body.frame().await.expect("another event").unwrap();
            parser.feed(&frame.into_data().unwrap(), pending);
        }
        serde_json::from_str(&pending.remove(0).data).unwrap()
    }

    #[tokio::test]
    async fn a_session_based_client_answers_a_2026_server_through_the_rounds() {
        let posts = Arc::new(AtomicUsize::new(0));
        let address = asking_server(posts.clone()).await;
        let telemetry = Arc::new(Telemetry::new(quiet_telemetry()).unwrap());
        let upstream = Arc::new(Upstream::new(telemetry, crate::placements::outbox().0, None));
        let spec = McpServerSpec {
            name: "math".into(),
            url: format!("http://{address}/mcp"),
            tls: None,
            timeout: None,
            failure_mode: McpFailureMode::Fail,
            list_ttl: None,
        };
        for answer in [
            json!({"result": {"action": "accept", "content": {"ok": true}}}),
            json!({"error": {"code": -1, "message": "no UI"}}),
        ] {
            posts.store(0, Ordering::SeqCst);
            let call = Call {
                target: Arc::from("McpBackend/tools"),
                server: Arc::new(Server::compile(&spec, &upstream).unwrap()),
                upstream: upstream.clone(),
                client: Arc::new(ClientMeta::from_initialize(
                    &json!({"capabilities": {"elicitation": {}}}),
                )),
                trace: RequestTrace::default(),
                session: "session-a".into(),
                sealer: sealer(),
                message: json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "ask"}}),
                idle: Duration::from_secs(10),
            };
            let first = call.send(call.message.clone()).await.ok().unwrap();
            let mut body = driven(call, first).into_body();
            let (mut parser, mut pending) = (sse::Parser::default(), Vec::new());
            let progress = next_message(&mut body, &mut parser, &mut pending).await;
            assert_eq!(progress["method"], "notifications/progress", "{progress}");
            let question = next_message(&mut body, &mut parser, &mut pending).await;
            assert_eq!(question["method"], "elicitation/create", "{question}");
            assert_eq!(question["params"]["message"], "Add?", "{question}");
            let Value::Object(mut response) = answer.clone() else {
                unreachable!()
            };
            response.insert("id".into(), question["id"].clone());
            assert!(matches!(
                upstream
                    .input_waits
                    .deliver(&question["id"], "session-a", response),
                Delivery::Delivered
            ));
            let last = next_message(&mut body, &mut parser, &mut pending).await;
            assert_eq!(last["id"], 9, "{last}");
            if answer.get("result").is_some() {
                assert_eq!(last["result"]["content"][0]["text"], "5", "{last}");
                assert_eq!(posts.load(Ordering::SeqCst), 2);
            } else {
                assert_eq!(last["error"]["code"], jsonrpc::INPUT_UNANSWERED, "{last}");
                assert!(
                    last["error"]["message"].as_str().unwrap().contains("no UI"),
                    "{last}"
                );
                assert_eq!(posts.load(Ordering::SeqCst), 1, "no retry without the answer");
            }
            assert!(body.frame().await.is_none(), "the stream ends with the answer");
        }
    }
}
