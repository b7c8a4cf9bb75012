//! The parts of an OpenAI-style request body the gateway needs, read once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::telemetry::LlmRecord;

/// An LLM request as the gateway understands it.
#[derive(Debug)]
pub(crate) struct LlmRequest {
    /// The `model` the client sent.
    pub(crate) requested_model: String,
    /// The model the servers know, after aliases and rewrites.
    pub(crate) model: Arc<str>,
    /// `model` is a LoRA adapter.
    pub(crate) lora: bool,
    /// The priority class the route fixes for its pool, if any.
    pub(crate) priority_class: Option<Arc<str>>,
    /// The prompt as sent: the raw JSON of `prompt` (completions) or `messages` (chat), for
    /// prefix affinity. A conversation's next turn repeats it as a prefix.
    pub(crate) prompt: Bytes,
    /// The member `prompt` came from, `messages` or `prompt`; `None` when the body has
    /// neither or both (then a prompt guard cannot tell what the model will read).
    pub(crate) prompt_member: Option<&'static str>,
    /// A member present that changes what the model reads without being the prompt: see
    /// [`UNCHECKED_TEXT`].
    pub(crate) unchecked_member: Option<&'static str>,
    /// When the proxy had the whole request; LLM latencies count from here.
    pub(crate) since: Instant,
    /// Filled in as the response passes; the request's telemetry record reads it.
    pub(crate) record: Arc<Mutex<LlmRecord>>,
    /// The pool's completion guards, taken when the answer comes.
    pub(crate) completion: Option<super::completion::CompletionCheck>,
}

/// Members that change what the model reads besides `messages` or `prompt`, which a prompt
/// check does not see: vLLM renders a request's own chat template and its documents into
/// the prompt, a completion's suffix follows it, and prompt embeddings are a prompt of their
/// own. The template's keyword arguments count only when they carry text (a switch such as
/// `{"enable_thinking": false}` adds none).
pub(crate) const UNCHECKED_TEXT: [&str; 5] = [
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "suffix",
    "prompt_embeds",
];

#[derive(Deserialize)]
struct Probe<'a> {
    model: Option<String>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    #[serde(borrow, default)]
    suffix: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_embeds: Option<&'a RawValue>,
}

/// Whether a JSON value holds a string anywhere.
fn carries_text(raw: &RawValue) -> bool {
    fn any_string(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::String(_) => true,
            serde_json::Value::Array(items) => items.iter().any(any_string),
            serde_json::Value::Object(members) => members.values().any(any_string),
            _ => false,
        }
    }
    // Unreadable, it is refused as if it carried text.
    serde_json::from_str(raw.get()).map_or(true, |value| any_string(&value))
}

impl LlmRequest {
    pub(crate) fn parse(body: &Bytes) -> Result<LlmRequest, String> {
        let probe: Probe<'_> = serde_json::from_slice(body).map_err(|error| {
            if error.is_data() {
                format!("the request body does not have the expected shape: {error}")
            } else {
                format!("the request body is not valid JSON: {error}")
            }
        })?;
        let requested_model = probe
            .model
            .ok_or("the request names no model: \"model\" is required")?;
        let (prompt, prompt_member) = match (probe.messages, probe.prompt) {
            (Some(raw), None) => (slice_of(body, raw.get().as_bytes()), Some("messages")),
            (None, Some(raw)) => (slice_of(body, raw.get().as_bytes()), Some("prompt")),
            (Some(raw), Some(_)) => (slice_of(body, raw.get().as_bytes()), None),
            (None, None) => (Bytes::new(), None),
        };
        let present = [
            probe.chat_template,
            probe.chat_template_kwargs.filter(|kwargs| carries_text(kwargs)),
            probe.documents,
            probe.suffix,
            probe.prompt_embeds,
        ];
        let unchecked_member = UNCHECKED_TEXT
            .iter()
            .zip(present)
            .find_map(|(name, value)| value.is_some().then_some(*name));
        Ok(LlmRequest {
            model: Arc::from(requested_model.as_str()),
            requested_model,
            lora: false,
            priority_class: None,
            prompt,
            prompt_member,
            unchecked_member,
            since: Instant::now(),
            record: Arc::default(),
            completion: None,
        })
    }

    /// The body with `model` replaced by `served` and, when given, the prompt (`messages`
    /// or `prompt`) by `prompt`; every other member passes through byte for byte (members
    /// come out sorted by name).
    pub(crate) fn rewrite(
        &self,
        body: &[u8],
        served: &str,
        prompt: Option<&serde_json::Value>,
    ) -> Result<Bytes, String> {
        let mut members: BTreeMap<String, Box<RawValue>> = serde_json::from_slice(body)
            .map_err(|error| format!("the request body is not a JSON object: {error}"))?;
        let model = serde_json::value::to_raw_value(served)
            .map_err(|error| format!("could not encode the model name: {error}"))?;
        members.insert("model".into(), model);
        if let Some(prompt) = prompt {
            let member = self
                .prompt_member
                .ok_or("the request has no single prompt member to replace")?;
            let prompt = serde_json::value::to_raw_value(prompt)
                .map_err(|error| format!("could not encode the prompt: {error}"))?;
            members.insert(member.into(), prompt);
        }
        serde_json::to_vec(&members)
            .map(Bytes::from)
            .map_err(|error| format!("could not re-encode the request: {error}"))
    }
}

/// `part` as a zero-copy slice of `body`, which it points into.
fn slice_of(body: &Bytes, part: &[u8]) -> Bytes {
    let start = (part.as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
    if start + part.len() <= body.len() {
        body.slice(start..start + part.len())
    } else {
        Bytes::copy_from_slice(part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<LlmRequest, String> {
        LlmRequest::parse(&Bytes::copy_from_slice(body.as_bytes()))
    }

    #[test]
    fn reads_model_and_prompt_of_both_apis() {
        let chat =
            parse(r#"{"model":"m","messages":[{"role":"system","content":"be brief"}],"stream":true}"#)
                .unwrap();
        assert_eq!(chat.requested_model, "m");
        assert_eq!(&chat.prompt[..], br#"[{"role":"system","content":"be brief"}]"#);
        let completion = parse(r#"{"prompt":"once upon","model":"m","max_tokens":5}"#).unwrap();
        assert_eq!(&completion.prompt[..], br#""once upon""#);
    }

    #[test]
    fn text_the_model_reads_beside_the_prompt_is_noticed() {
        let plain = parse(r#"{"model":"m","messages":[],"chat_template_kwargs":null}"#).unwrap();
        assert_eq!(plain.unchecked_member, None, "null changes nothing");
        let templated = parse(r#"{"model":"m","messages":[],"chat_template":"{{ 'x' }}"}"#).unwrap();
        assert_eq!(templated.unchecked_member, Some("chat_template"));
        let switched =
            parse(r#"{"model":"m","messages":[],"chat_template_kwargs":{"enable_thinking":false}}"#).unwrap();
        assert_eq!(switched.unchecked_member, None, "a switch adds no text");
        let worded =
            parse(r#"{"model":"m","messages":[],"chat_template_kwargs":{"persona":["be evil"]}}"#).unwrap();
        assert_eq!(worded.unchecked_member, Some("chat_template_kwargs"));
        let embedded = parse(r#"{"model":"m","prompt":"a","prompt_embeds":"AAAA"}"#).unwrap();
        assert_eq!(embedded.unchecked_member, Some("prompt_embeds"));
        // Escaped names are the same names to the model server.
        let escaped = parse(r#"{"model":"m","prompt":"a","suf\u0066ix":"b"}"#).unwrap();
        assert_eq!(escaped.unchecked_member, Some("suffix"));
        assert!(
            parse(r#"{"model":"m","messages":[],"documents":[],"documents":[{"text":"x"}]}"#).is_err(),
            "a decoy twin of a member is refused"
        );
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        assert!(parse("{").unwrap_err().contains("not valid JSON"));
        assert!(parse("[1]").unwrap_err().contains("expected shape"));
        assert!(parse(r#"{"model":5}"#).unwrap_err().contains("expected shape"));
        assert!(parse(r#"{"prompt":"x"}"#)
            .unwrap_err()
            .contains("\"model\" is required"));
    }

    #[test]
    fn rewriting_keeps_everything_but_the_model() {
        let body = br#"{"model":"alias","prompt":"hi","seed":123456789012345678901234567890,"n":1.50}"#;
        let request = parse(std::str::from_utf8(body).unwrap()).unwrap();
        let rewritten = request.rewrite(body, "served", None).unwrap();
        assert_eq!(
            std::str::from_utf8(&rewritten).unwrap(),
            r#"{"model":"served","n":1.50,"prompt":"hi","seed":123456789012345678901234567890}"#,
            "numbers pass through as written"
        );
        let rewritten = request
            .rewrite(body, "alias", Some(&serde_json::json!("bye")))
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&rewritten).unwrap(),
            r#"{"model":"alias","n":1.50,"prompt":"bye","seed":123456789012345678901234567890}"#,
        );
    }
}
