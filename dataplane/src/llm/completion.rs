//! Guardrails on completions (the `LlmResponse` phase). Each choice's text is checked on its
//! own, and so is the reasoning a reasoning model shows beside it. A JSON answer is held
//! until its checks are done: a denial replaces it with an error, a mutation replaces the
//! text (and drops the choice's `logprobs`, which would repeat the original). A streamed answer passes event by event and is checked at its end, before
//! `[DONE]`: a denial ends the stream with an error event instead (the text already sent
//! stays with the client), and a mutation, which can no longer be applied, counts as a check
//! without a verdict (that guard's failure mode decides). Text only: tool-call arguments are
//! not checked.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use portcullis_config::GuardrailPhase;
use serde_json::Value;

use super::error::{error, error_type, stopped};
use crate::body::{self, Body, BoxError, Held, MAX_HELD_ANSWER_BYTES};
use crate::policy::guardrail::{Asker, Guards, Stop, Subject};
use crate::sse;

/// How many of an answer's texts are checked at once: enough that an answer of many choices
/// waits little longer than one, few enough not to swamp the checking service with one
/// request's calls.
const CONCURRENT_CHECKS: usize = 8;

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

    /// Checks each text on its own, [`CONCURRENT_CHECKS`] at a time, so that the answer
    /// waits about as long for many choices (`n`) as for one: in order, the replacements.
    async fn texts(&self, texts: Vec<String>, streamed: bool) -> Result<Vec<Option<String>>, Stop> {
        futures::stream::iter(texts)
            .map(|text| self.text(text, streamed))
            .buffered(CONCURRENT_CHECKS)
            .try_collect()
            .await
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
            collected: Collected::default(),
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

/// The members of a chat message (or of a streamed chat delta) that users read: the content
/// and the reasoning of a reasoning model (vLLM's `--reasoning-parser` puts it in
/// `reasoning_content`, newer builds in `reasoning`).
const MESSAGE_TEXTS: [&str; 3] = ["content", "reasoning_content", "reasoning"];

/// The texts of a choice, each checked on its own: chat `message` members
/// ([`MESSAGE_TEXTS`]), completions `text`.
fn choice_texts(choice: &mut Value) -> Vec<&mut Value> {
    let texts: Vec<&mut Value> = if choice.get("message").is_some_and(Value::is_object) {
        choice["message"]
            .as_object_mut()
            .into_iter()
            .flat_map(|message| message.iter_mut())
            .filter(|(name, _)| MESSAGE_TEXTS.contains(&name.as_str()))
            .map(|(_, text)| text)
            .collect()
    } else {
        choice.get_mut("text").into_iter().collect()
    };
    texts.into_iter().filter(|text| text.is_string()).collect()
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
    // A choice without text (a tool call) has nothing to check.
    let texts: Vec<(usize, &mut Value)> = choices
        .iter_mut()
        .enumerate()
        .flat_map(|(choice, value)| choice_texts(value).into_iter().map(move |text| (choice, text)))
        .collect();
    let originals: Vec<String> = texts
        .iter()
        .map(|(_, text)| text.as_str().unwrap_or_default().to_string())
        .collect();
    let replacements = check.texts(originals, false).await?;
    let mut replaced = Vec::new();
    for ((choice, text), replacement) in texts.into_iter().zip(replacements) {
        if let Some(replacement) = replacement {
            *text = Value::String(replacement);
            replaced.push(choice);
        }
    }
    for choice in &replaced {
        if let Some(choice) = choices.get_mut(*choice).and_then(Value::as_object_mut) {
            choice.remove("logprobs");
        }
    }
    Ok((!replaced.is_empty()).then_some(answer))
}

struct Stream {
    /// `None` once the server's stream is over: let go before the checks run, so the pod's
    /// slot and the telemetry do not wait for them.
    inner: Option<Body>,
    parser: sse::Parser,
    collected: Collected,
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
                    // Keep-alives pass on, so idle timeouts downstream do not fire during a
                    // long prefill.
                    if self.parser.took_comment() {
                        self.ready.push_back(Bytes::from_static(sse::KEEPALIVE_COMMENT));
                    }
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
                        self.collected.add(&event.data);
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

    /// The checks at the end of the stream.
    async fn verdict(&mut self) -> Result<(), Stop> {
        if self.collected.broken {
            return Ok(());
        }
        if let Some(problem) = self.collected.unreadable {
            return self.check.unreadable(problem, true);
        }
        let texts = std::mem::take(&mut self.collected.texts).into_values().collect();
        self.check.texts(texts, true).await.map(drop)
    }
}

/// What a stream's events said, for the checks at its end.
#[derive(Debug, Default)]
struct Collected {
    /// Each choice's texts so far, by index and member.
    texts: BTreeMap<(u64, &'static str), String>,
    /// Why the stream cannot be checked, if it cannot.
    unreadable: Option<&'static str>,
    /// The stream already ended in an error event: there is nothing left to stop.
    broken: bool,
}

impl Collected {
    /// Adds a chunk's texts (chat `delta` members, completions `text`) to its choice. Every
    /// event but an error carries `choices` (the usage chunk an empty one): a stream of
    /// events without it is another API's, whose text the checks would not see.
    fn add(&mut self, data: &str) {
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
        let Some(choices) = chunk["choices"].as_array() else {
            self.unreadable
                .get_or_insert("an event of the stream has no choices");
            return;
        };
        for choice in choices {
            let Some(index) = choice["index"].as_u64() else {
                self.unreadable
                    .get_or_insert("a choice of the stream has no index");
                continue;
            };
            let delta = MESSAGE_TEXTS
                .iter()
                .filter_map(|member| Some((*member, choice["delta"][member].as_str()?)));
            let completion = choice["text"].as_str().map(|text| ("text", text));
            for (member, text) in delta.chain(completion) {
                let so_far = self.texts.entry((index, member)).or_default();
                if so_far.len() + text.len() <= MAX_HELD_ANSWER_BYTES {
                    so_far.push_str(text);
                } else {
                    self.unreadable.get_or_insert("a choice's text exceeds 16 MiB");
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::tests::support::*;

    #[tokio::test]
    async fn a_checked_stream_passes_the_servers_keepalives_on() {
        // A long prefill: the server keeps the stream alive with a comment between events.
        let pod = spawn_upstream(|_| async {
            let frames = [
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
                ": ping\n\n",
                "data: [DONE]\n\n",
            ];
            let frames = futures::stream::iter(frames).then(|frame| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(frame)))
            });
            http::Response::builder()
                .header(http::header::CONTENT_TYPE, "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(frames)))
                .unwrap()
        })
        .await;
        let port = free_port();
        let guardrail = "apiVersion: portcullis.dev/v1alpha1
kind: Guardrail
metadata: {name: no-secrets}
spec:
  targetRefs: [{kind: InferencePool, name: qwen}]
  phases: [LlmResponse]
  builtin: {deny: [{pattern: 'password', reason: no passwords}]}
";
        let proxy = start_proxy(None, Duration::from_secs(1)).await;
        proxy
            .state
            .apply(1, llm_config(port, &pod.to_string(), "", guardrail))
            .await
            .unwrap();
        let body = r#"{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hello"}]}"#;
        let request = http::Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(Bytes::from(body)))
            .unwrap();
        let response = http1_client().request(request).await.unwrap();
        let (status, text) = status_and_text(response).await;
        assert_eq!(status, 200, "{text}");
        // Frames a busy proxy reads together may put it ahead of the event that came with
        // it (clients ignore comments wherever they are); it is always before the end.
        let keepalive = text.find(": keepalive").expect("the keep-alive was dropped");
        assert!(text.find("[DONE]").is_some_and(|at| keepalive < at), "{text}");
        assert!(text.contains("\"hi\""), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        proxy.shutdown().await.unwrap();
    }

    #[test]
    fn a_choice_is_checked_for_its_content_and_its_reasoning() {
        let mut chat = json!({"index": 0, "message": {"role": "assistant", "content": "4",
            "reasoning_content": "2 + 2 is 4", "tool_calls": []}});
        let texts: Vec<String> = choice_texts(&mut chat)
            .into_iter()
            .filter_map(|text| text.as_str().map(String::from))
            .collect();
        assert_eq!(texts, ["4", "2 + 2 is 4"]);
        let mut completion = json!({"index": 0, "text": "once upon", "logprobs": null});
        let texts: Vec<String> = choice_texts(&mut completion)
            .into_iter()
            .filter_map(|text| text.as_str().map(String::from))
            .collect();
        assert_eq!(texts, ["once upon"]);
    }

    #[test]
    fn a_stream_collects_every_text_and_notices_what_it_cannot_read() {
        let mut collected = Collected::default();
        for event in [
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning": "think"}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "an"}}, {"index": 1, "delta": {"content": "b"}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "swer"}}]}),
            json!({"choices": [], "usage": {"completion_tokens": 3}}),
        ] {
            collected.add(&event.to_string());
        }
        assert_eq!(collected.unreadable, None);
        let texts: Vec<(&(u64, &str), &String)> = collected.texts.iter().collect();
        assert_eq!(
            texts,
            [
                (&(0, "content"), &"answer".to_string()),
                (&(0, "reasoning"), &"think".to_string()),
                (&(1, "content"), &"b".to_string()),
            ]
        );
        // Another API's events (the Responses API's) carry text where no check reads it.
        let mut other = Collected::default();
        other.add(r#"{"type":"response.output_text.delta","delta":"secret"}"#);
        assert_eq!(other.unreadable, Some("an event of the stream has no choices"));
    }
}
