//! What the `data:` payloads of OpenAI-compatible SSE streams mean (as the `openai` Python
//! SDK reads them: its `ChatCompletionChunk` type and `_streaming.py`): content chunks, usage,
//! `[DONE]` or an error event. The framing itself (bytes → payloads) is
//! the crate's shared [`crate::sse::SseParser`].

use serde_json::Value;

use super::config::ApiKind;

/// Token counts from a `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// What one `data:` payload means for the measurement.
#[derive(Debug, PartialEq)]
pub enum Event {
    Done,
    /// A chunk; `content` is true when it carries non-empty generated text.
    Chunk {
        content: bool,
        usage: Option<Usage>,
    },
    /// The server reported an error inside the stream (`{"error": …}`).
    Error(String),
}

/// Interprets one payload: `[DONE]`, an error object, or a (chat) completion chunk.
pub fn interpret(data: &str, api: ApiKind) -> Result<Event, String> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    let value: Value = serde_json::from_str(data).map_err(|e| format!("chunk is not JSON: {e}"))?;
    if let Some(error) = value.get("error").filter(|e| !e.is_null()) {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("stream error");
        return Ok(Event::Error(message.to_string()));
    }
    let choices = value
        .get("choices")
        .and_then(Value::as_array)
        .ok_or_else(|| "chunk has no choices array".to_string())?;
    let content = choices.iter().any(|choice| !text_of(choice, api).is_empty());
    Ok(Event::Chunk {
        content,
        usage: usage_of(&value),
    })
}

/// The generated text of one choice: `text` for completions, `delta.content` for chat chunks
/// (and `message.content` for non-streamed chat responses).
pub fn text_of(choice: &Value, api: ApiKind) -> &str {
    let text = match api {
        ApiKind::Completion => choice.get("text"),
        ApiKind::Chat => choice
            .get("delta")
            .or_else(|| choice.get("message"))
            .and_then(|m| m.get("content")),
    };
    text.and_then(Value::as_str).unwrap_or("")
}

/// `usage` of a chunk or response; `None` when absent or `null` (every chunk but the last when
/// `include_usage` is on).
pub fn usage_of(value: &Value) -> Option<Usage> {
    let usage = value.get("usage").filter(|u| u.is_object())?;
    Some(Usage {
        prompt_tokens: usage.get("prompt_tokens").and_then(Value::as_u64),
        completion_tokens: usage.get("completion_tokens").and_then(Value::as_u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_interpreted_per_api() {
        let chat = r#"{"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}"#;
        assert_eq!(
            interpret(chat, ApiKind::Chat),
            Ok(Event::Chunk {
                content: true,
                usage: None
            })
        );
        let role_only = r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(
            interpret(role_only, ApiKind::Chat),
            Ok(Event::Chunk {
                content: false,
                usage: None
            })
        );
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#;
        assert_eq!(
            interpret(usage, ApiKind::Completion),
            Ok(Event::Chunk {
                content: false,
                usage: Some(Usage {
                    prompt_tokens: Some(7),
                    completion_tokens: Some(3)
                })
            })
        );
        assert_eq!(interpret(" [DONE]", ApiKind::Chat), Ok(Event::Done));
        assert_eq!(
            interpret(r#"{"error":{"message":"boom","code":500}}"#, ApiKind::Chat),
            Ok(Event::Error("boom".into()))
        );
        assert!(interpret("{not json", ApiKind::Chat).is_err());
        assert!(interpret("{}", ApiKind::Chat).is_err());
    }
}
