//! One OpenAI-compatible request, timed: TTFT at the first content chunk, a timestamp per
//! content chunk for inter-token latency, E2E at the end of the stream, failures classified.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use super::config::{ApiKind, LlmApi};
use super::sse::{interpret, text_of, usage_of, Event, Usage};
use crate::sim::tokenizer;
use crate::sse::SseParser;

/// Why a request failed; the report counts failures per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureKind {
    /// TCP connect failed (refused, unreachable).
    Connect,
    /// `request_timeout` elapsed before the response completed.
    Timeout,
    Http4xx,
    Http5xx,
    /// Any other non-2xx status (1xx/3xx).
    HttpOther,
    /// Unparsable chunk, missing `[DONE]`, or a body that is not the expected JSON.
    MalformedStream,
    /// The server sent `{"error": …}` inside a 200 stream.
    StreamError,
    /// The connection broke after it was established.
    Transport,
}

impl FailureKind {
    pub const ALL: [Self; 8] = [
        Self::Connect,
        Self::Timeout,
        Self::Http4xx,
        Self::Http5xx,
        Self::HttpOther,
        Self::MalformedStream,
        Self::StreamError,
        Self::Transport,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Http4xx => "http_4xx",
            Self::Http5xx => "http_5xx",
            Self::HttpOther => "http_other",
            Self::MalformedStream => "malformed_stream",
            Self::StreamError => "stream_error",
            Self::Transport => "transport",
        }
    }

    fn of_status(status: StatusCode) -> Self {
        if status.is_client_error() {
            Self::Http4xx
        } else if status.is_server_error() {
            Self::Http5xx
        } else {
            Self::HttpOther
        }
    }
}

/// A failed request: `kind` is a [`FailureKind`] name for LLM requests and an MCP failure
/// kind (`connect`, `http_404`, `rpc_-32602`, …) for MCP calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub kind: String,
    pub message: String,
}

impl Failure {
    fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self::named(kind.name().to_string(), message.into())
    }

    pub fn named(kind: String, message: String) -> Self {
        Self { kind, message }
    }
}

/// Timestamps (seconds since the run's epoch) and token counts of one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub sent: f64,
    /// First non-empty content chunk; `None` for non-streamed requests and failures before it.
    pub first_token: Option<f64>,
    /// Arrival of every content chunk, in order (ITL = gaps between consecutive ones).
    pub token_times: Vec<f64>,
    pub finish: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub failure: Option<Failure>,
}

/// Sends requests to one target over a pooled HTTP/1.1 client.
pub struct Sender {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    api: LlmApi,
    model: String,
    timeout: Duration,
}

impl Sender {
    pub fn new(base_url: &str, api: LlmApi, model: &str, timeout: Duration) -> anyhow::Result<Self> {
        let path = match api.kind {
            ApiKind::Completion => "/v1/completions",
            ApiKind::Chat => "/v1/chat/completions",
        };
        let uri: Uri = format!("{}{path}", base_url.trim_end_matches('/')).parse()?;
        let mut connector = HttpConnector::new();
        // Streams write one small chunk per token; Nagle would batch them and distort ITL.
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Self {
            client,
            uri,
            api,
            model: model.to_string(),
            timeout,
        })
    }

    /// Sends one prompt and times it against `epoch`. Never fails: errors end up in the trace.
    pub async fn send(&self, prompt: &str, input_len: usize, max_tokens: usize, epoch: Instant) -> Trace {
        let mut trace = Trace {
            sent: epoch.elapsed().as_secs_f64(),
            input_tokens: input_len as u64,
            ..Trace::default()
        };
        let mut usage = None;
        let outcome = match tokio::time::timeout(
            self.timeout,
            self.exchange(prompt, max_tokens, epoch, &mut trace, &mut usage),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(Failure::new(
                FailureKind::Timeout,
                format!("no complete response within {:?}", self.timeout),
            )),
        };
        trace.finish = epoch.elapsed().as_secs_f64();
        trace.output_tokens = trace.token_times.len() as u64;
        if let Some(usage) = usage {
            trace.input_tokens = usage.prompt_tokens.unwrap_or(trace.input_tokens);
            trace.output_tokens = usage.completion_tokens.unwrap_or(trace.output_tokens);
        }
        trace.failure = outcome.err();
        trace
    }

    fn body(&self, prompt: &str, max_tokens: usize) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": max_tokens,
            // Output length is part of the workload definition, so the model must not stop early.
            "ignore_eos": true,
            "stream": self.api.streaming,
        });
        match self.api.kind {
            ApiKind::Completion => body["prompt"] = json!(prompt),
            ApiKind::Chat => body["messages"] = json!([{"role": "user", "content": prompt}]),
        }
        if self.api.streaming {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }

    async fn exchange(
        &self,
        prompt: &str,
        max_tokens: usize,
        epoch: Instant,
        trace: &mut Trace,
        usage: &mut Option<Usage>,
    ) -> Result<(), Failure> {
        let body = serde_json::to_vec(&self.body(prompt, max_tokens))
            .map_err(|e| Failure::new(FailureKind::MalformedStream, e.to_string()))?;
        let request = Request::post(self.uri.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Failure::new(FailureKind::Transport, e.to_string()))?;
        let response = self.client.request(request).await.map_err(|e| {
            let kind = if e.is_connect() {
                FailureKind::Connect
            } else {
                FailureKind::Transport
            };
            Failure::new(kind, format!("{e:?}"))
        })?;
        let status = response.status();
        if !status.is_success() {
            return Err(Failure::new(
                FailureKind::of_status(status),
                format!("HTTP {status}"),
            ));
        }
        let mut body = response.into_body();
        if !self.api.streaming {
            let bytes = body
                .collect()
                .await
                .map_err(|e| Failure::new(FailureKind::Transport, e.to_string()))?
                .to_bytes();
            return self.read_whole(&bytes, usage);
        }
        let mut parser = SseParser::default();
        let mut payloads = Vec::new();
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::new(FailureKind::Transport, e.to_string()))?;
            let Some(data) = frame.data_ref() else { continue };
            let now = epoch.elapsed().as_secs_f64();
            parser
                .feed(data, &mut payloads)
                .map_err(|e| Failure::new(FailureKind::MalformedStream, e))?;
            for payload in payloads.drain(..) {
                if done {
                    continue;
                }
                match interpret(&payload, self.api.kind)
                    .map_err(|e| Failure::new(FailureKind::MalformedStream, e))?
                {
                    Event::Done => done = true,
                    Event::Error(message) => return Err(Failure::new(FailureKind::StreamError, message)),
                    Event::Chunk { content, usage: u } => {
                        if content {
                            trace.first_token.get_or_insert(now);
                            trace.token_times.push(now);
                        }
                        if u.is_some() {
                            *usage = u;
                        }
                    }
                }
            }
        }
        if done {
            Ok(())
        } else {
            Err(Failure::new(
                FailureKind::MalformedStream,
                "stream ended before [DONE]",
            ))
        }
    }

    /// A non-streamed response: no TTFT/ITL, output counted from `usage`, else by tokenizing
    /// the text with the stand-in tokenizer the simulator uses.
    fn read_whole(&self, bytes: &[u8], usage: &mut Option<Usage>) -> Result<(), Failure> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| Failure::new(FailureKind::MalformedStream, format!("response is not JSON: {e}")))?;
        let choices = value
            .get("choices")
            .and_then(Value::as_array)
            .ok_or_else(|| Failure::new(FailureKind::MalformedStream, "response has no choices"))?;
        let counted: usize = choices
            .iter()
            .map(|c| tokenizer::encode(text_of(c, self.api.kind)).len())
            .sum();
        let reported = usage_of(&value).unwrap_or_default();
        *usage = Some(Usage {
            prompt_tokens: reported.prompt_tokens,
            completion_tokens: reported.completion_tokens.or(Some(counted as u64)),
        });
        Ok(())
    }
}
