//! Guardrails on completions (the `LlmResponse` phase). Each choice's text is checked on its
//! own. A JSON answer is held until its checks are done: a denial replaces it with an error,
//! a mutation replaces the choice's text. A streamed answer passes event by event and is
//! checked at its end, before `[DONE]`: a denial ends the stream with an error event instead
//! (the text already sent stays with the client), and a mutation, which can no longer be
//! applied, counts as a check that could not be made (the failure mode decides).

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use portcullis_config::GuardrailPhase;
use serde_json::Value;

use super::error::{error, error_type, stopped};
use crate::body::{self, Body, BoxError};
use crate::policy::guardrail::{Asker, Guards, Stop, Subject};
use crate::sse;

/// Largest JSON answer held for checking, and largest streamed text kept per choice.
const MAX_CHECKED_BYTES: usize = 16 << 20;

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
    fn subject(&self) -> Subject<'_> {
        Subject {
            phase: GuardrailPhase::LlmResponse,
            server: "",
            method: &self.model,
            name: "",
        }
    }

    /// Checks one choice's text: the replacement when a guard mutated it.
    async fn text(&self, text: String) -> Result<Option<String>, Stop> {
        let passed = self
            .guards
            .check(&self.asker, &self.subject(), Value::String(text))
            .await?;
        Ok(match passed.payload {
            Value::String(text) if passed.mutated => Some(text),
            _ => None,
        })
    }

    fn unreadable(&self, problem: &str) -> Result<(), Stop> {
        self.guards.unreadable(&self.asker, &self.subject(), problem)
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
    parts.headers.remove(http::header::CONTENT_LENGTH);
    if streamed {
        let state = Stream {
            inner,
            parser: sse::Parser::default(),
            texts: BTreeMap::new(),
            ready: VecDeque::new(),
            ended: false,
            check,
        };
        let frames = futures::stream::unfold(state, Stream::next);
        return Response::from_parts(parts, body::boxed(StreamBody::new(frames)));
    }
    let bytes = match read(inner).await {
        Ok(bytes) => bytes,
        Err(problem) => {
            return match check.unreadable(&problem) {
                Ok(()) => error(StatusCode::BAD_GATEWAY, "upstream_error", problem),
                Err(stop) => refusal(stop),
            };
        }
    };
    match checked_answer(&bytes, &check).await {
        Ok(None) => Response::from_parts(parts, body::full(bytes)),
        Ok(Some(answer)) => Response::from_parts(parts, body::full(answer.to_string())),
        Err(stop) => refusal(stop),
    }
}

async fn read(mut body: Body) -> Result<Bytes, String> {
    let mut buffer = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| format!("the model server's answer broke off: {error}"))?;
        if let Ok(data) = frame.into_data() {
            if buffer.len() + data.len() > MAX_CHECKED_BYTES {
                return Err(format!(
                    "the model server's answer is larger than {MAX_CHECKED_BYTES} bytes"
                ));
            }
            buffer.extend_from_slice(&data);
        }
    }
    Ok(buffer.freeze())
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
        check.unreadable("the model server's answer is not JSON")?;
        return Ok(None);
    };
    let Some(choices) = answer.get_mut("choices").and_then(Value::as_array_mut) else {
        check.unreadable("the model server's answer has no choices")?;
        return Ok(None);
    };
    let mut changed = false;
    for choice in choices.iter_mut() {
        // A choice without text (a tool call) has nothing to check.
        let Some(text) = choice_text(choice) else { continue };
        let original = text.as_str().unwrap_or_default().to_string();
        if let Some(replacement) = check.text(original).await? {
            *text = Value::String(replacement);
            changed = true;
        }
    }
    Ok(changed.then_some(answer))
}

struct Stream {
    inner: Body,
    parser: sse::Parser,
    /// Each choice's text so far, by index.
    texts: BTreeMap<u64, String>,
    ready: VecDeque<Bytes>,
    ended: bool,
    check: CompletionCheck,
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
                // A stream that ends without `[DONE]` is checked at its end all the same.
                None => {
                    self.ended = true;
                    if let Err(stop) = self.verdict().await {
                        self.ready.push_back(error_event(stop));
                    }
                }
                Some(Err(error)) => {
                    self.ended = true;
                    return Some((Err(error), self));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    let mut events = Vec::new();
                    self.parser.feed(&data, &mut events);
                    for event in events {
                        if event.data.trim() == "[DONE]" {
                            self.ended = true;
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

    /// Adds a chunk's text (chat `delta.content`, completions `text`) to its choice.
    fn collect(&mut self, data: &str) {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let text = choice["delta"]["content"].as_str().or(choice["text"].as_str());
            if let (Some(index), Some(text)) = (choice["index"].as_u64(), text) {
                let so_far = self.texts.entry(index).or_default();
                if so_far.len() + text.len() <= MAX_CHECKED_BYTES {
                    so_far.push_str(text);
                }
            }
        }
    }

    /// The checks at the end of the stream.
    async fn verdict(&mut self) -> Result<(), Stop> {
        for text in std::mem::take(&mut self.texts).into_values() {
            if self.check.text(text).await?.is_some() {
                self.check.unreadable(
                    "the completion was already sent: a mutation cannot be applied to a stream",
                )?;
            }
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
