//! `POST /v1/completions` and `POST /v1/chat/completions`, plain and streamed (SSE), with
//! vLLM's validation order and messages: body shape (400), model (404), sampling parameters
//! and context length (400).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::pod::Pod;
use super::reply::{bad_request, error, json, unix_now, Body};
use super::text::{chat_prompt, Words};
use crate::sim::engine::Event;
use crate::sim::tokenizer::encode;

/// vLLM's `CompletionRequest.max_tokens` default (OpenAI's legacy default).
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completions,
    Chat,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<Message>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    /// Content parts; only `text` parts contribute to the prompt.
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: PromptInput,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    n: Option<i64>,
}

/// The shapes OpenAI allows for `prompt`; batches must hold exactly one prompt here.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// A request reduced to what the engine needs.
struct Job {
    model: Option<String>,
    tokens: Vec<u32>,
    max_tokens: Option<i64>,
    n: Option<i64>,
    stream: bool,
    include_usage: bool,
}

fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Job, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("Invalid JSON body: {e}"))?;
    let include_usage = |o: &Option<StreamOptions>| o.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    match endpoint {
        Endpoint::Chat => {
            let r: ChatRequest = serde_json::from_value(value).map_err(|e| e.to_string())?;
            let messages = r.messages.iter().map(|m| {
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(text)) => text.clone(),
                    Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
                };
                (m.role.as_str(), content)
            });
            let tokens = encode(&chat_prompt(messages));
            Ok(Job {
                include_usage: include_usage(&r.stream_options),
                model: r.model,
                tokens,
                // vLLM prefers the current name over the deprecated one.
                max_tokens: r.max_completion_tokens.or(r.max_tokens),
                n: r.n,
                stream: r.stream.unwrap_or(false),
            })
        }
        Endpoint::Completions => {
            let r: CompletionRequest = serde_json::from_value(value).map_err(|e| e.to_string())?;
            let tokens = match r.prompt {
                PromptInput::Text(text) => encode(&text),
                PromptInput::Tokens(tokens) => tokens,
                PromptInput::Texts(texts) if texts.len() == 1 => encode(&texts[0]),
                PromptInput::TokenLists(lists) if lists.len() == 1 => lists.into_iter().flatten().collect(),
                PromptInput::Texts(_) | PromptInput::TokenLists(_) => {
                    return Err("the simulator serves one prompt per request".into())
                }
            };
            Ok(Job {
                include_usage: include_usage(&r.stream_options),
                model: r.model,
                tokens,
                max_tokens: r.max_tokens,
                n: r.n,
                stream: r.stream.unwrap_or(false),
            })
        }
    }
}

/// Serves one completion request.
pub(super) async fn generate(pod: Arc<Pod>, endpoint: Endpoint, body: Bytes) -> Response<Body> {
    let job = match parse(endpoint, &body) {
        Ok(job) => job,
        Err(message) => return bad_request(message),
    };
    let model = job.model.unwrap_or_else(|| pod.settings.model.clone());
    let Some(target) = pod.resolve(&model) else {
        return error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
        );
    };
    if job.n.is_some_and(|n| n != 1) {
        return bad_request("the simulator only supports n = 1");
    }
    if let Some(m) = job.max_tokens.filter(|&m| m < 1) {
        return bad_request(format!("max_tokens must be at least 1, got {m}."));
    }
    let input = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    let (len, limit) = (job.tokens.len(), pod.settings.max_model_len);
    if len == 0 {
        return bad_request("The decoder prompt cannot be empty");
    }
    // At least one output token must fit, so a prompt of exactly the limit is refused too.
    if len >= limit {
        return bad_request(format!(
            "This model's maximum context length is {limit} tokens. However, you requested \
             {len} tokens in the {input}. Please reduce the length of the {input}."
        ));
    }
    let max_tokens = match (job.max_tokens, endpoint) {
        (Some(m), _) => usize::try_from(m).unwrap_or(usize::MAX),
        (None, Endpoint::Completions) => COMPLETIONS_DEFAULT_MAX_TOKENS.min(limit - len),
        // vLLM's chat default: whatever context remains.
        (None, Endpoint::Chat) => limit - len,
    };
    if max_tokens > limit - len {
        return bad_request(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's \
             maximum context length is {limit} tokens and your request has {len} input tokens \
             ({max_tokens} > {limit} - {len})."
        ));
    }

    let words = Words::for_prompt(&job.tokens);
    let rx = match pod.submit(job.tokens, max_tokens, target) {
        Ok(rx) => rx,
        Err(rejected) => return bad_request(rejected.to_string()),
    };
    let answer = Answer {
        endpoint,
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{:032x}", rand::random::<u128>()),
            Endpoint::Completions => format!("cmpl-{:032x}", rand::random::<u128>()),
        },
        created: unix_now(),
        model,
        prompt_tokens: len,
        words,
    };
    if job.stream {
        stream(answer, rx, job.include_usage)
    } else {
        whole(answer, rx).await
    }
}

/// Everything about a response except its tokens.
struct Answer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    words: Words,
}

impl Answer {
    fn usage(&self, completion_tokens: usize, cached_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": { "cached_tokens": cached_tokens },
        })
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// One streamed chunk carrying `text` (and the finish reason on the last token).
    fn chunk(&self, delta: Value, text: String, last: bool) -> Value {
        let finish_reason = if last { json!("length") } else { Value::Null };
        match self.endpoint {
            Endpoint::Chat => {
                let mut delta = delta;
                delta["content"] = text.into();
                self.envelope(
                    "chat.completion.chunk",
                    json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason }]),
                )
            }
            Endpoint::Completions => self.envelope(
                "text_completion",
                json!([{ "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason, "stop_reason": null }]),
            ),
        }
    }
}

/// Collects every token, then answers like vLLM's non-streaming endpoints.
async fn whole(answer: Answer, mut rx: mpsc::UnboundedReceiver<Event>) -> Response<Body> {
    let mut text = String::new();
    let mut produced = 0;
    while let Some(event) = rx.recv().await {
        text.push_str(&answer.words.token(produced));
        produced += 1;
        if let Some(done) = event.finished {
            let choice = match answer.endpoint {
                Endpoint::Chat => json!({
                    "index": 0,
                    "message": { "role": "assistant", "content": text },
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }),
                Endpoint::Completions => json!({
                    "index": 0, "text": text,
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }),
            };
            let object = match answer.endpoint {
                Endpoint::Chat => "chat.completion",
                Endpoint::Completions => "text_completion",
            };
            let mut body = answer.envelope(object, json!([choice]));
            body["usage"] = answer.usage(produced, done.cached_tokens);
            return json(StatusCode::OK, &body);
        }
    }
    // The pod shut down with the request unfinished.
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "the engine stopped before the request finished",
    )
}

/// State of an SSE response between engine tokens.
struct Sse {
    answer: Answer,
    rx: mpsc::UnboundedReceiver<Event>,
    produced: usize,
    include_usage: bool,
}

/// Streams one SSE frame per engine token, as the engine produces it.
fn stream(answer: Answer, rx: mpsc::UnboundedReceiver<Event>, include_usage: bool) -> Response<Body> {
    let state = Some(Sse {
        answer,
        rx,
        produced: 0,
        include_usage,
    });
    let frames = futures::stream::unfold(state, |state| async move {
        let mut s = state?;
        // `None`: the pod shut down; the stream ends without `[DONE]`, like a dropped vLLM.
        let event = s.rx.recv().await?;
        let mut out = String::new();
        if s.produced == 0 && s.answer.endpoint == Endpoint::Chat {
            // vLLM announces the role in its own chunk, sent with the first token.
            let role = s
                .answer
                .chunk(json!({ "role": "assistant" }), String::new(), false);
            push_event(&mut out, &role);
        }
        let text = s.answer.words.token(s.produced);
        s.produced += 1;
        let last = event.finished.is_some();
        push_event(&mut out, &s.answer.chunk(json!({}), text, last));
        let Some(done) = event.finished else {
            return Some((Ok::<_, Infallible>(Frame::data(Bytes::from(out))), Some(s)));
        };
        if s.include_usage {
            let mut usage = s.answer.envelope(
                match s.answer.endpoint {
                    Endpoint::Chat => "chat.completion.chunk",
                    Endpoint::Completions => "text_completion",
                },
                json!([]),
            );
            usage["usage"] = s.answer.usage(s.produced, done.cached_tokens);
            push_event(&mut out, &usage);
        }
        out.push_str("data: [DONE]\n\n");
        Some((Ok(Frame::data(Bytes::from(out))), None))
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn push_event(out: &mut String, value: &Value) {
    out.push_str("data: ");
    out.push_str(&value.to_string());
    out.push_str("\n\n");
}
