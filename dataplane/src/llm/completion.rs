//! Guardrails on completions (the `LlmResponse` phase). Each choice's text is checked on its
//! own. A JSON answer is held until its checks are done: a denial replaces it with an error,
//! a mutation replaces the choice's text (and drops its `logprobs`, which would repeat the
//! original). A streamed answer passes event by event and is checked at its end, before
//! `[DONE]`: a denial ends the stream with an error event instead (the text already sent
//! stays with the client), and a mutation, which can no longer be applied, counts as a check
//! without a verdict (that guard's failure mode decides). Text only: tool-call arguments are
//! not checked.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use portcullis_config::GuardrailPhase;
use serde_json::Value;

use super::error::{error, error_type, stopped};
use crate::body::{self, Body, BoxError, Held, MAX_HELD_ANSWER_BYTES};
use crate::policy::guardrail::{Asker, Guards, Stop, Subject};
use crate::sse;

/// The completion guards of one request, and who asks.
pub(crate) struct CompletionCheck {
    pub(crate) guards: Guards,
    pub(crate) asker: Asker,
    /// The model the client asked for.
    pub(crate) model: String,
}

impl std::fmt::Debug for CompletionCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionCheck")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl CompletionCheck {
    /// `streamed`: the text already went out, so it can no longer be replaced.
    fn subject(&self, streamed: bool) -> Subject<'_> {
        Subject {
            phase: GuardrailPhase::LlmResponse,
            server: "",
            method: &self.model,
            name: "",
            mutable: !streamed,
        }
    }

    /// Checks one choice's text: the replacement when a guard mutated it.
    async fn text(&self, text: String, streamed: bool) -> Result<Option<String>, Stop> {
        let passed = self
            .guards
            .check(&self.asker, &self.subject(streamed), Value::String(text))
            .await?;
        Ok(match passed.payload {
            Value::String(text) if passed.mutated => Some(text),
            _ => None,
        })
    }

    fn unreadable(&self, problem: &str, streamed: bool) -> Result<(), Stop> {
        self.guards
            .unreadable(&self.asker, &self.subject(streamed), problem)
    }
}

/// Checks a successful answer of the model server before (JSON) or as (stream) it passes.
pub(crate) async fn check(response: Response<Body>, check: CompletionCheck) -> Response<Body> {
    if !response.status().is_success() {
        return response;
    }
    let (mut parts, inner) = response.into_parts();
    let streamed = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.to_ascii_lowercase().starts_with("text/event-stream"));
    // The proxy asks for an identity encoding when completions are checked; a server that
    // compresses anyway cannot be read.
    let encoded = parts
        .headers
        .get(http::header::CONTENT_ENCODING)
        .is_some_and(|encoding| !encoding.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return match check.unreadable("the model server's answer is compressed", streamed) {
            Ok(()) => Response::from_parts(parts, inner),
            Err(stop) => refusal(stop),
        };
    }
    parts.headers.remove(http::header::CONTENT_LENGTH);
    if streamed {
        let state = Stream {
            inner: Some(inner),
            parser: sse::Parser::default(),
            texts: BTreeMap::new(),
            unreadable: None,
            broken: false,
            ready: VecDeque::new(),
            check,
        };
        let frames = futures::stream::unfold(state, Stream::next);
        return Response::from_parts(parts, body::boxed(StreamBody::new(frames)));
    }
    match body::hold(inner, MAX_HELD_ANSWER_BYTES).await {
        Held::Whole(bytes) => match checked_answer(&bytes, &check).await {
            Ok(None) => Response::from_parts(parts, body::full(bytes)),
            Ok(Some(answer)) => Response::from_parts(parts, body::full(answer.to_string())),
            Err(stop) => refusal(stop),
        },
        // Not the guards' doing: the client sees a failed upstream, and no decision is made.
        Held::Broken(problem) => error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("the model server's answer broke off: {problem}"),
        ),
        Held::TooLarge { start, rest } => {
            let problem = format!("the model server's answer is larger than {MAX_HELD_ANSWER_BYTES} bytes");
            match check.unreadable(&problem, false) {
                Ok(()) => Response::from_parts(parts, body::prepend(start, rest)),
                Err(stop) => refusal(stop),
            }
        }
    }
}

/// The text of a choice: chat `message.content`, completions `text`.
fn choice_text(choice: &mut Value) -> Option<&mut Value> {
    let text = if choice.get("message").is_some() {
        choice.get_mut("message")?.get_mut("content")?
    } else {
        choice.get_mut("text")?
    };
    text.is_string().then_some(text)
}

/// `Ok(Some(answer))` when a guard replaced a text.
async fn checked_answer(bytes: &[u8], check: &CompletionCheck) -> Result<Option<Value>, Stop> {
    let Ok(mut answer) = serde_json::from_slice::<Value>(bytes) else {
        check.unreadable("the model server's answer is not JSON", false)?;
        return Ok(None);
    };
    let Some(choices) = answer.get_mut("choices").and_then(Value::as_array_mut) else {
        check.unreadable("the model server's answer has no choices", false)?;
        return Ok(None);
    };
    let mut changed = false;
    for choice in choices.iter_mut() {
        // A choice without text (a tool call) has nothing to check.
        let Some(text) = choice_text(choice) else { continue };
        let original = text.as_str().unwrap_or_default().to_string();
        if let Some(replacement) = check.text(original, false).await? {
            *text = Value::String(replacement);
            if let Some(choice) = choice.as_object_mut() {
                choice.remove("logprobs");
            }
            changed = true;
        }
    }
    Ok(changed.then_some(answer))
}

struct Stream {
    /// `None` once the server's stream is over: let go before the checks run, so the pod's
    /// slot and the telemetry do not wait for them.
    inner: Option<Body>,
    parser: sse::Parser,
    /// Each choice's text so far, by index.
    texts: BTreeMap<u64, String>,
    /// Why the stream cannot be checked, if it cannot.
    unreadable: Option<&'static str>,
    /// The stream already ended in an error event: there is nothing left to stop.
    broken: bool,
    ready: VecDeque<Bytes>,
    check: CompletionCheck,
}

impl Stream {
    async fn next(mut self) -> Option<(Result<Frame<Bytes>, BoxError>, Stream)> {
        loop {
            if let Some(bytes) = self.ready.pop_front() {
                return Some((Ok(Frame::data(bytes)), self));
            }
            let inner = self.inner.as_mut()?;
            match inner.frame().await {
                // A stream that ends without `[DONE]` is checked at its end all the same.
                None => {
                    self.inner = None;
                    if let Err(stop) = self.verdict().await {
                        self.ready.push_back(error_event(stop));
                    }
                }
                Some(Err(error)) => {
                    self.inner = None;
                    return Some((Err(error), self));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    let mut events = Vec::new();
                    self.parser.feed(&data, &mut events);
                    if self.parser.pending() > MAX_HELD_ANSWER_BYTES {
                        self.inner = None;
                        let error = format!(
                            "an event of the model server's stream exceeds {MAX_HELD_ANSWER_BYTES} bytes"
                        );
                        return Some((Err(error.into()), self));
                    }
                    for event in events {
                        if event.data.trim() == "[DONE]" {
                            self.finish_upstream().await;
                            match self.verdict().await {
                                Ok(()) => self.ready.push_back(event.encode()),
                                Err(stop) => self.ready.push_back(error_event(stop)),
                            }
                            break;
                        }
                        self.collect(&event.data);
                        self.ready.push_back(event.encode());
                    }
                }
            }
        }
    }

    /// Reads what the server still sends after `[DONE]` (normally nothing) and lets go of it.
    async fn finish_upstream(&mut self) {
        if let Some(mut inner) = self.inner.take() {
            while let Some(Ok(_)) = inner.frame().await {}
        }
    }

    /// Adds a chunk's text (chat `delta.content`, completions `text`) to its choice.
    fn collect(&mut self, data: &str) {
        if data.trim().is_empty() {
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            self.unreadable
                .get_or_insert("an event of the stream is not JSON");
            return;
        };
        if chunk.get("error").is_some() {
            self.broken = true;
            return;
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let Some(index) = choice["index"].as_u64() else {
                self.unreadable
                    .get_or_insert("a choice of the stream has no index");
                continue;
            };
            let text = choice["delta"]["content"].as_str().or(choice["text"].as_str());
            if let Some(text) = text {
                let so_far = self.texts.entry(index).or_default();
                if so_far.len() + text.len() <= MAX_HELD_ANSWER_BYTES {
                    so_far.push_str(text);
                } else {
                    self.unreadable.get_or_insert("a choice's text exceeds 16 MiB");
                }
            }
        }
    }

    /// The checks at the end of the stream.
    async fn verdict(&mut self) -> Result<(), Stop> {
        if self.broken {
            return Ok(());
        }
        if let Some(problem) = self.unreadable {
            return self.check.unreadable(problem, true);
        }
        for text in std::mem::take(&mut self.texts).into_values() {
            self.check.text(text, true).await?;
        }
        Ok(())
    }
}

/// The answer to a stopped completion, in OpenAI's error shape.
fn refusal(stop: Stop) -> Response<Body> {
    let (status, code, message) = stopped(stop, "completion");
    error(status, code, message)
}

/// The stream's last event for a stopped completion (`data: {"error": …}`).
fn error_event(stop: Stop) -> Bytes {
    let (status, code, message) = stopped(stop, "completion");
    let error = serde_json::json!({
        "error": {"message": message, "type": error_type(status), "param": null, "code": code}
    });
    sse::Event {
        data: error.to_string(),
        ..sse::Event::default()
    }
    .encode()
}
