//! OpenAI-compatible LLM traffic (the OpenAI API reference, platform.openai.com/docs/api-reference;
//! vLLM serves the same shape). A Route whose backends are InferencePools is an LLM route:
//! once the policy chain has admitted a request, [`Models::prepare`] reads the body once,
//! finds the model it names, resolves aliases and weighted rewrites to the model the servers
//! know and to the pool that serves it, and leaves the parsed request in the context for the
//! pool's picker and the telemetry. `GET /v1/models` is answered here, from the pools' models.

mod completion;
mod error;
mod request;
mod tap;

use std::collections::HashMap;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use portcullis_config::{GuardrailPhase, InferencePoolSpec, ModelName};
use rand::Rng;

pub(crate) use completion::check as check_completion;
pub(crate) use error::{error, restated};
pub(crate) use request::LlmRequest;
pub(crate) use tap::Tap;

use crate::body::Body;
use crate::policy::guardrail::{Asker, Guards, Subject};
use crate::policy::{self, RequestContext};
use crate::target::Target;

/// What a client's model name stands for.
struct Entry {
    target: Arc<dyn Target>,
    /// The pool's prompt guards.
    guards: Guards,
    /// The pool's completion guards.
    completion_guards: Guards,
    /// The priority class the route fixes for this pool.
    priority_class: Option<Arc<str>>,
    /// (served model, is a LoRA adapter, weight); one entry unless the name is a rewrite.
    choices: Vec<(Arc<str>, bool, u32)>,
}

/// The models of one route's pools, by every name a client may send.
pub(crate) struct Models {
    by_name: HashMap<String, Entry>,
    /// `GET /v1/models`, rendered once per config version.
    listing: serde_json::Value,
}

/// One of a route's pools, as the route sends to it.
pub(crate) struct RoutePool<'a> {
    pub(crate) spec: &'a InferencePoolSpec,
    pub(crate) target: Arc<dyn Target>,
    /// The pool's LlmRequest guards.
    pub(crate) guards: Guards,
    /// The pool's LlmResponse guards.
    pub(crate) completion_guards: Guards,
    /// The priority class the route fixes for the pool's requests.
    pub(crate) priority_class: Option<Arc<str>>,
}

/// What the LLM stage decided.
pub(crate) enum Prepared {
    /// Send to this pool (the parsed request is in the context).
    Forward(Arc<dyn Target>),
    /// Answer the client with this.
    Answer(Response<Body>),
}

impl Models {
    pub(crate) fn compile(pools: &[RoutePool<'_>]) -> Models {
        let mut by_name = HashMap::new();
        let mut ids = Vec::new();
        for RoutePool {
            spec,
            target,
            guards,
            completion_guards,
            priority_class,
        } in pools
        {
            for (name, meaning) in spec.names() {
                let choices = match meaning {
                    ModelName::Served(model) | ModelName::Alias(model) => {
                        vec![(Arc::from(model.name.as_str()), model.lora, 1)]
                    }
                    ModelName::Rewrite(rewrite) => rewrite
                        .targets
                        .iter()
                        .filter_map(|choice| {
                            let model = spec.models.iter().find(|m| m.name == choice.model)?;
                            Some((Arc::from(model.name.as_str()), model.lora, choice.weight))
                        })
                        .collect(),
                };
                ids.push(serde_json::json!({
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": target.name().as_ref(),
                }));
                by_name.insert(
                    name.to_string(),
                    Entry {
                        target: target.clone(),
                        guards: guards.clone(),
                        completion_guards: completion_guards.clone(),
                        priority_class: priority_class.clone(),
                        choices,
                    },
                );
            }
        }
        Models {
            by_name,
            listing: serde_json::json!({ "object": "list", "data": ids }),
        }
    }

    /// `GET /v1/models` (the list) and `GET /v1/models/{id}` (one model, or 404), also under
    /// a path prefix; `None` for any other path.
    fn listing_for(&self, path: &str) -> Option<Response<Body>> {
        let at = path.find("/v1/models")?;
        let rest = &path[at + "/v1/models".len()..];
        if rest.is_empty() || rest == "/" {
            return Some(crate::response::json(StatusCode::OK, &self.listing));
        }
        // Clients encode the `/` of names like `Qwen/Qwen3-32B` (or not); normalization keeps
        // `%2F` encoded, so decode here.
        let id = percent_encoding::percent_decode_str(rest.strip_prefix('/')?).decode_utf8_lossy();
        let found = self.listing["data"]
            .as_array()
            .and_then(|models| models.iter().find(|model| model["id"] == *id));
        Some(match found {
            Some(model) => crate::response::json(StatusCode::OK, model),
            None => error(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("the model {id:?} does not exist on this route"),
            ),
        })
    }

    /// Reads and checks an LLM request, or answers it.
    pub(crate) async fn prepare(&self, ctx: &mut RequestContext, request: &mut Request<Body>) -> Prepared {
        if let Some(listing) = self.listing_for(request.uri().path()) {
            return Prepared::Answer(if matches!(*request.method(), Method::GET | Method::HEAD) {
                listing
            } else {
                method_not_allowed("GET, HEAD", "model listings are read with GET")
            });
        }
        if request.method() != Method::POST {
            return Prepared::Answer(method_not_allowed(
                "POST",
                format!("{} takes POST with a JSON body", request.uri().path()),
            ));
        }
        let body = match policy::buffer_body(ctx, request).await {
            Ok(body) => body,
            Err(answer) => return Prepared::Answer(answer),
        };
        let mut parsed = match LlmRequest::parse(&body) {
            Ok(parsed) => parsed,
            Err(problem) => {
                return Prepared::Answer(error(StatusCode::BAD_REQUEST, "invalid_request_error", problem));
            }
        };
        let Some(entry) = self.by_name.get(parsed.requested_model.as_str()) else {
            return Prepared::Answer(error(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!(
                    "the model {:?} does not exist on this route (GET /v1/models lists them)",
                    parsed.requested_model
                ),
            ));
        };
        let Some((served, lora)) = choose(&entry.choices) else {
            return Prepared::Answer(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "model_unavailable",
                format!(
                    "no model behind {:?} has a weight above 0",
                    parsed.requested_model
                ),
            ));
        };
        if !entry.guards.is_empty() || !entry.completion_guards.is_empty() {
            if let Err(problem) = guardable(request.uri().path(), &parsed, !entry.guards.is_empty()) {
                return Prepared::Answer(error(StatusCode::BAD_REQUEST, "invalid_request_error", problem));
            }
        }
        let prompt = match check_prompt(ctx, request.headers(), entry, &parsed).await {
            Ok(prompt) => prompt,
            Err(answer) => return Prepared::Answer(answer),
        };
        if served.as_ref() != parsed.requested_model || prompt.is_some() {
            match parsed.rewrite(&body, &served, prompt.as_ref()) {
                Ok(rewritten) => policy::replace_body(request, rewritten),
                Err(problem) => {
                    return Prepared::Answer(error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        problem,
                    ));
                }
            }
            if let Some(prompt) = &prompt {
                parsed.prompt = bytes::Bytes::from(prompt.to_string());
            }
        } else {
            policy::replace_body(request, body);
        }
        parsed
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .model = served.clone();
        parsed.model = served;
        parsed.lora = lora;
        parsed.priority_class = entry.priority_class.clone();
        if !entry.completion_guards.is_empty() {
            // The answer must be readable to be checked. Without the header any coding would
            // be acceptable (RFC 9110 §12.5.3), so ask for none.
            request.headers_mut().insert(
                http::header::ACCEPT_ENCODING,
                http::HeaderValue::from_static("identity"),
            );
            parsed.completion = Some(completion::CompletionCheck {
                guards: entry.completion_guards.clone(),
                asker: Asker::new(ctx, entry.target.name(), request.headers()),
                model: parsed.requested_model.clone(),
            });
        }
        ctx.llm = Some(parsed);
        Prepared::Forward(entry.target.clone())
    }
}

/// Whether a request to a pool with guardrails carries its text where they read it: the
/// chat completions API (`messages`; answers in `message`) or the completions API
/// (`prompt`; answers in `text`), also under a path prefix. Another API (the Responses API's
/// `input`, embeddings, ...) would carry text no check reads, in and out. With prompt checks
/// (`checks_prompt`), nothing else in the body may change what the model reads.
fn guardable(path: &str, parsed: &LlmRequest, checks_prompt: bool) -> Result<(), String> {
    let member = if path.ends_with("/v1/chat/completions") {
        "messages"
    } else if path.ends_with("/v1/completions") {
        "prompt"
    } else {
        return Err(format!(
            "this route's guardrails read POST /v1/chat/completions and /v1/completions only: {path} would carry text they cannot read"
        ));
    };
    if !checks_prompt {
        return Ok(());
    }
    match parsed.prompt_member {
        None => Err(
            "this route checks prompts: the request must carry exactly one of \"messages\" or \"prompt\"".to_string(),
        ),
        Some(sent) if sent != member => Err(format!(
            "this route checks prompts: {path} reads \"{member}\", but the request carries \"{sent}\""
        )),
        Some(_) => match parsed.unchecked_member {
            Some(unchecked) => Err(format!(
                "this route checks prompts: \"{unchecked}\" changes what the model reads, and the check cannot see it"
            )),
            None => Ok(()),
        },
    }
}

/// Runs the pool's prompt guards: `Ok(Some(prompt))` when one replaced the prompt.
async fn check_prompt(
    ctx: &RequestContext,
    headers: &http::HeaderMap,
    entry: &Entry,
    parsed: &LlmRequest,
) -> Result<Option<serde_json::Value>, Response<Body>> {
    if entry.guards.is_empty() {
        return Ok(None);
    }
    // What the model will read is what is checked: see `guardable`.
    let prompt: serde_json::Value = serde_json::from_slice(&parsed.prompt).map_err(|problem| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("the prompt is not valid JSON: {problem}"),
        )
    })?;
    // Text the guards can read: token ids would pass every text check unread.
    let text = match &prompt {
        serde_json::Value::String(_) => true,
        serde_json::Value::Array(items) if parsed.prompt_member == Some("prompt") => {
            items.iter().all(serde_json::Value::is_string)
        }
        serde_json::Value::Array(_) => true,
        _ => false,
    };
    if !text {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "this route checks prompts: \"messages\" must be an array, \"prompt\" a string or an array of strings",
        ));
    }
    let asker = Asker::new(ctx, entry.target.name(), headers);
    let subject = Subject {
        phase: GuardrailPhase::LlmRequest,
        server: "",
        method: &parsed.requested_model,
        name: "",
        mutable: true,
    };
    match entry.guards.check(&asker, &subject, prompt).await {
        Ok(passed) => Ok(passed.mutated.then_some(passed.payload)),
        Err(stop) => {
            let (status, code, message) = error::stopped(stop, "prompt");
            Err(error(status, code, message))
        }
    }
}

/// 405 with the methods the path takes (RFC 9110 §15.5.6).
fn method_not_allowed(allow: &'static str, message: impl Into<String>) -> Response<Body> {
    let mut answer = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", message);
    answer
        .headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    answer
}

/// A weighted choice among the served models behind a name.
fn choose(choices: &[(Arc<str>, bool, u32)]) -> Option<(Arc<str>, bool)> {
    let total: u64 = choices.iter().map(|(_, _, weight)| u64::from(*weight)).sum();
    if total == 0 {
        return None;
    }
    let mut ticket = rand::rng().random_range(0..total);
    choices.iter().find_map(|(model, lora, weight)| {
        if ticket < u64::from(*weight) {
            Some((model.clone(), *lora))
        } else {
            ticket -= u64::from(*weight);
            None
        }
    })
}
