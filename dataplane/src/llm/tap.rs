//! Reads an LLM response as it passes, without holding it back: when the first token
//! arrives, when the last one did, and the usage the server reports (OpenAI's `usage`:
//! `prompt_tokens`, `prompt_tokens_details.cached_tokens`, `completion_tokens`; in a stream,
//! the final chunk when the client asked for `stream_options.include_usage`). A streamed
//! response without usage is counted by its content chunks (one token each, as vLLM sends).
//!
//! When a streamed response breaks (the model server died, or paused past the idle
//! timeout), the client gets a last event carrying an OpenAI-shaped error and a clean end of
//! stream, which OpenAI SDKs raise as an API error, instead of a cut connection.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::body::{Body, BoxError};
use crate::sse;
use crate::telemetry::LlmRecord;

/// Parsing stops (the response still passes) past this much unparsed text: one SSE event or
/// a whole JSON answer larger than this carries no usage worth the memory.
const MAX_PENDING_BYTES: usize = 1024 * 1024;

pub(crate) struct Tap {
    inner: Body,
    record: Arc<Mutex<LlmRecord>>,
    /// When the proxy had the whole request.
    since: Instant,
    streamed: bool,
    /// A streamed answer's events.
    events: sse::Parser,
    /// A JSON answer so far.
    pending: BytesMut,
    gave_up: bool,
    content_chunks: u64,
    ended: bool,
    /// The error event went out; the stream is over.
    closed: bool,
}

impl Tap {
    pub(crate) fn new(inner: Body, record: Arc<Mutex<LlmRecord>>, since: Instant, streamed: bool) -> Tap {
        record.lock().unwrap_or_else(PoisonError::into_inner).streamed = streamed;
        Tap {
            inner,
            record,
            since,
            streamed,
            events: sse::Parser::default(),
            pending: BytesMut::new(),
            gave_up: false,
            content_chunks: 0,
            ended: false,
            closed: false,
        }
    }

    fn data(&mut self, data: &Bytes) {
        if self.gave_up {
            return;
        }
        if !self.streamed {
            self.pending.extend_from_slice(data);
        } else {
            let mut events = Vec::new();
            self.events.feed(data, &mut events);
            for event in events {
                self.event(&event.data);
            }
        }
        if self.pending.len() > MAX_PENDING_BYTES || self.events.pending() > MAX_PENDING_BYTES {
            self.gave_up = true;
            self.pending = BytesMut::new();
            self.events = sse::Parser::default();
        }
    }

    /// One SSE event's data.
    fn event(&mut self, data: &str) {
        if data == "[DONE]" {
            return;
        }
        let Ok(chunk) = serde_json::from_str::<serde_json::Value>(data) else {
            return;
        };
        let now = self.since.elapsed();
        let mut record = self.record.lock().unwrap_or_else(PoisonError::into_inner);
        if has_content(&chunk) {
            self.content_chunks += 1;
            record.first_token.get_or_insert(now);
            record.last_token = Some(now);
        }
        read_usage(&chunk, &mut record);
    }

    fn end(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        let mut record = self.record.lock().unwrap_or_else(PoisonError::into_inner);
        if self.streamed {
            if record.output_tokens.is_none() && self.content_chunks > 0 {
                record.output_tokens = Some(self.content_chunks);
            }
        } else if !self.gave_up {
            if let Ok(answer) = serde_json::from_slice::<serde_json::Value>(&self.pending) {
                read_usage(&answer, &mut record);
            }
        }
        self.pending = BytesMut::new();
    }
}

/// The last event of a stream the server broke off; `unfinished`: an event is still open.
fn error_event(error: &(dyn std::error::Error + Send + Sync), unfinished: bool) -> Bytes {
    let error = serde_json::json!({
        "error": {
            "message": format!("the model server's response broke off: {error}"),
            "type": "server_error",
            "param": null,
            "code": "upstream_stream_error",
        }
    });
    let close = if unfinished { "\n\n" } else { "" };
    Bytes::from(format!("{close}data: {error}\n\n"))
}

/// A chunk carries generated text: chat `choices[].delta.content` or completions'
/// `choices[].text`, non-empty.
fn has_content(chunk: &serde_json::Value) -> bool {
    chunk["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|choice| {
            let text = choice["delta"]["content"].as_str().or(choice["text"].as_str());
            text.is_some_and(|text| !text.is_empty())
        })
    })
}

fn read_usage(value: &serde_json::Value, record: &mut LlmRecord) {
    let usage = &value["usage"];
    if !usage.is_object() {
        return;
    }
    if let Some(n) = usage["prompt_tokens"].as_u64() {
        record.input_tokens = Some(n);
    }
    if let Some(n) = usage["completion_tokens"].as_u64() {
        record.output_tokens = Some(n);
    }
    if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        record.cached_input_tokens = Some(n);
    }
}

impl HttpBody for Tap {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.closed {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(error))) = &polled {
            if this.streamed {
                this.closed = true;
                this.record
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .interrupted = true;
                // An event the server left unfinished must not swallow the error event.
                let unfinished = this.events.in_event();
                this.end();
                return Poll::Ready(Some(Ok(Frame::data(error_event(&**error, unfinished)))));
            }
        }
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.data(data);
                }
                if this.inner.is_end_stream() {
                    this.end();
                }
            }
            Poll::Ready(None) => this.end(),
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.closed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::body;

    /// Runs `frames` through a tap: what the client receives, and the record.
    fn run(streamed: bool, frames: Vec<Result<Frame<Bytes>, BoxError>>) -> (String, LlmRecord) {
        let inner = body::boxed(http_body_util::StreamBody::new(futures::stream::iter(frames)));
        let record = Arc::new(Mutex::new(LlmRecord::default()));
        let tap = Tap::new(inner, record.clone(), Instant::now(), streamed);
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let collected = runtime.block_on(tap.collect()).unwrap().to_bytes();
        let record = record.lock().unwrap().clone();
        (String::from_utf8(collected.to_vec()).unwrap(), record)
    }

    fn data(text: &str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::copy_from_slice(text.as_bytes())))
    }

    /// A body that ends normally passes unchanged; returns the record.
    fn tapped(streamed: bool, chunks: &[&str]) -> LlmRecord {
        let (received, record) = run(streamed, chunks.iter().map(|c| data(c)).collect());
        assert_eq!(received, chunks.concat(), "the body passes unchanged");
        record
    }

    #[test]
    fn a_stream_split_anywhere_yields_first_token_and_usage() {
        let record = tapped(
            true,
            &[
                "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choi",
                "ces\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n",
            ],
        );
        assert!(record.streamed);
        assert!(record.first_token.is_some() && record.last_token >= record.first_token);
        assert_eq!(
            (
                record.input_tokens,
                record.cached_input_tokens,
                record.output_tokens
            ),
            (Some(12), Some(8), Some(2))
        );
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event() {
        let first = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        let (text, record) = run(
            true,
            vec![data(first), Err("connection reset".into()), data("never seen")],
        );
        let last = text.strip_prefix(first).unwrap().trim_end();
        let event: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(event["error"]["code"], "upstream_stream_error");
        assert!(event["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connection reset"));
        assert!(record.interrupted);
        assert_eq!(record.output_tokens, Some(1));
    }

    #[test]
    fn every_sse_line_ending_ends_events() {
        // LF, CRLF and bare CR (WHATWG HTML, "Server-sent events"), split between frames.
        let record = tapped(
            true,
            &[
                "data: {\"choices\":[{\"text\":\"a\"}]}\r",
                "\r\ndata: {\"choices\":[{\"text\":\"b\"}]}\r\rdata: {\"choices\":[{\"text\":\"c\"}]}\r\n\r",
                "\ndata: {\"choices\":[{\"text\":\"d\"}]}\n\n",
            ],
        );
        assert_eq!(record.output_tokens, Some(4));
    }

    #[test]
    fn an_unfinished_event_is_closed_before_the_error_event() {
        let (text, _) = run(
            true,
            vec![
                data("data: {\"choices\":[{\"text\":\"a\"}]}\r\n"),
                Err("reset".into()),
            ],
        );
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
        assert_eq!(events.len(), 2, "{text:?}");
        assert!(events[1].trim_start().starts_with("data: {\"error\""), "{text:?}");
    }

    #[test]
    fn an_event_end_split_between_frames_is_found() {
        let record = tapped(
            true,
            &[
                "data: {\"choices\":[{\"text\":\"a\"}]}\n",
                "\n",
                "data: {\"choices\":[{\"text\":\"b\"}]}\n",
                "\n",
            ],
        );
        assert_eq!(record.output_tokens, Some(2));
    }

    #[test]
    fn without_usage_a_stream_counts_its_content_chunks() {
        let record = tapped(
            true,
            &["data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n"],
        );
        assert_eq!(record.output_tokens, Some(2));
        assert_eq!(record.input_tokens, None);
    }

    #[test]
    fn a_json_answer_is_read_at_its_end_and_garbage_is_ignored() {
        let record = tapped(
            false,
            &[
                "{\"choices\":[{\"text\":\"hi\"}],",
                "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}",
            ],
        );
        assert_eq!((record.input_tokens, record.output_tokens), (Some(3), Some(1)));
        assert_eq!(
            record.first_token, None,
            "no time to first token without streaming"
        );
        let garbage = tapped(false, &["<html>not json"]);
        assert_eq!((garbage.input_tokens, garbage.output_tokens), (None, None));
    }
}
