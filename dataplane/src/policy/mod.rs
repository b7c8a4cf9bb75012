//! The policy chain: what runs between route match and target, on the request and on
//! the response. A policy is one file here plus one call in [`PolicyIndex::compile`].
//!
//! Order: the listener's policies, then the route's; within each, by kind (admission
//! before transformation: rate limits, then header changes), then by name. Request hooks
//! run in that order; response hooks in reverse, and only for policies whose request hook
//! ran (a policy that answered itself sees its own answer).

pub(crate) mod guardrail;
mod headers;
mod rate_limit;

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use portcullis_config::{
    ConfigSet, HeaderPolicySpec, Kind, KindSpec, ObjectKey, RateLimitPolicySpec, TargetRef,
};

use crate::body::{self, Body, BodyFailure, BodyStatus};
use crate::telemetry::RequestTrace;

pub(crate) type PolicyFuture<'a> = Pin<Box<dyn Future<Output = Decision> + Send + 'a>>;

/// What a policy lets happen next.
pub(crate) enum Decision {
    Continue,
    /// Answer the client with this instead of going on (deny, 429, a cached answer…).
    Respond(Response<Body>),
}

pub(crate) trait Policy: Send + Sync {
    /// `Kind/name`, as in logs and metrics.
    fn name(&self) -> &Arc<str>;

    /// May change the request (headers, body), or answer it.
    fn on_request<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        request: &'a mut Request<Body>,
    ) -> PolicyFuture<'a>;

    /// May change the response (headers, or the body: wrap it to see each chunk and the
    /// end of the stream, or to end it with an error), or replace it.
    fn on_response<'a>(
        &'a self,
        _ctx: &'a mut RequestContext,
        _response: &'a mut Response<Body>,
    ) -> PolicyFuture<'a> {
        Box::pin(std::future::ready(Decision::Continue))
    }
}

/// What a policy knows about the request besides the request itself.
pub(crate) struct RequestContext {
    pub(crate) route: Arc<str>,
    /// The client as far as trusted proxies tell: the peer, or the nearest
    /// (right-most) untrusted address in `X-Forwarded-For` behind a trusted proxy.
    pub(crate) client_ip: IpAddr,
    pub(crate) trace: RequestTrace,
    /// Each policy's decision so far, for the access log and metrics.
    pub(crate) decisions: Vec<(Arc<str>, &'static str)>,
    /// Largest request body a policy may buffer (the route's body limit).
    pub(crate) max_body_bytes: u64,
    /// How reading the request body went, whoever reads it.
    pub(crate) request_body: Arc<BodyStatus>,
    /// Filled in by the target stage, for the record.
    pub(crate) target: Option<Arc<str>>,
    pub(crate) endpoint: Option<Arc<str>>,
    pub(crate) attempts: u32,
    pub(crate) upstream_headers: Option<std::time::Duration>,
    /// An LLM route's request, read right after route match (see `llm/`).
    pub(crate) llm: Option<crate::llm::LlmRequest>,
    /// An MCP request, as the McpBackend target understood it.
    pub(crate) mcp: Option<crate::telemetry::McpRecord>,
    /// Guardrail decisions, also those taken while the response streams.
    pub(crate) guardrails: guardrail::GuardrailLog,
}

impl RequestContext {
    pub(crate) fn decide(&mut self, policy: &Arc<str>, decision: &'static str) {
        self.decisions.push((policy.clone(), decision));
    }
}

// The body seam for stages that read payloads (the LLM stage now; MCP and guardrails next).
/// Reads the whole request body (within the route's limit) so a policy can inspect or
/// replace it; the request keeps a replayable copy. Answers 413 or 400 when it cannot.
pub(crate) async fn buffer_body(
    ctx: &RequestContext,
    request: &mut Request<Body>,
) -> Result<Bytes, Response<Body>> {
    let limit = ctx.max_body_bytes;
    let mut taken = std::mem::replace(request.body_mut(), body::empty());
    let mut buffer = bytes::BytesMut::new();
    while let Some(frame) = taken.frame().await {
        let frame = frame.map_err(|_| BodyStatus::answer(ctx.request_body.failure(), limit))?;
        if let Ok(data) = frame.into_data() {
            if (buffer.len() + data.len()) as u64 > limit {
                return Err(BodyStatus::answer(Some(BodyFailure::TooLarge), limit));
            }
            buffer.extend_from_slice(&data);
        }
    }
    let bytes = buffer.freeze();
    *request.body_mut() = body::full(bytes.clone());
    Ok(bytes)
}

/// Replaces the request body, keeping `content-length` true to it.
pub(crate) fn replace_body(request: &mut Request<Body>, bytes: Bytes) {
    request
        .headers_mut()
        .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(bytes.len()));
    request.headers_mut().remove(http::header::TRANSFER_ENCODING);
    *request.body_mut() = body::full(bytes);
}

/// Policies attached to one object, each with its kind's rank in the chain.
type Attached = Vec<(u8, Arc<dyn Policy>)>;

/// Compiled policies by the object they target: one instance per (policy, target), so a
/// rate limit attached to two routes gives each its own buckets. Instances are kept
/// across versions while their spec, targets aside, is unchanged, so buckets survive
/// unrelated changes.
#[derive(Default)]
pub(crate) struct PolicyIndex {
    by_target: std::collections::HashMap<ObjectKey, Attached>,
    compiled: std::collections::HashMap<(ObjectKey, ObjectKey), (serde_json::Value, Arc<dyn Policy>)>,
}

impl PolicyIndex {
    /// Compiles every policy of the config. Each kind of policy is one call here; the
    /// first argument is its rank: admission (rate limits) before transformation.
    pub(crate) fn compile(config: &ConfigSet, previous: &PolicyIndex) -> Result<PolicyIndex, String> {
        let mut index = PolicyIndex::default();
        index.add_kind::<RateLimitPolicySpec>(
            0,
            config,
            previous,
            |spec| &spec.target_refs,
            |name, spec| Ok(Arc::new(rate_limit::RateLimit::compile(name, spec)?)),
        )?;
        index.add_kind::<HeaderPolicySpec>(
            1,
            config,
            previous,
            |spec| &spec.target_refs,
            |name, spec| Ok(Arc::new(headers::HeaderPolicy::compile(name, spec)?)),
        )?;
        for policies in index.by_target.values_mut() {
            policies
                .sort_by(|(a_rank, a), (b_rank, b)| a_rank.cmp(b_rank).then_with(|| a.name().cmp(b.name())));
        }
        Ok(index)
    }

    fn add_kind<T: KindSpec>(
        &mut self,
        rank: u8,
        config: &ConfigSet,
        previous: &PolicyIndex,
        targets: impl Fn(&T) -> &Vec<TargetRef>,
        compile: impl Fn(&str, &T) -> Result<Arc<dyn Policy>, String>,
    ) -> Result<(), String> {
        for (metadata, spec) in config.specs::<T>() {
            let key = ObjectKey::new(Kind::of::<T>(), metadata.name.as_str());
            // Targets say where a policy runs, not what it does: attaching it to one more
            // object must not refill the buckets of the objects it already limits.
            let mut detached = spec.clone();
            detached.retain_attachments(&|_| false);
            let value = serde_json::to_value(&detached).map_err(|error| error.to_string())?;
            for target in targets(spec) {
                let Some(kind) = Kind::from_name(&target.kind) else {
                    continue;
                };
                let target = ObjectKey::new(kind, target.name.as_str());
                let pair = (key.clone(), target.clone());
                let policy = match previous.compiled.get(&pair) {
                    Some((spec, policy)) if *spec == value => policy.clone(),
                    _ => compile(&metadata.name, spec)?,
                };
                self.compiled.insert(pair, (value.clone(), policy.clone()));
                self.by_target.entry(target).or_default().push((rank, policy));
            }
        }
        Ok(())
    }

    /// The ordered chain of policies attached to one object.
    pub(crate) fn chain(&self, target: &ObjectKey) -> Vec<Arc<dyn Policy>> {
        self.by_target
            .get(target)
            .map(|policies| policies.iter().map(|(_, policy)| policy.clone()).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
