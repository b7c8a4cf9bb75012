//! The InferencePool: model servers behind the endpoint picker (`portcullis-picker`). Each
//! request's pod comes from the picker; its fallbacks are tried, in order, when a pod refuses
//! the connection. The picker is credited when a request starts and released when its
//! response ends, so its in-flight counts are this proxy's real load on each pod.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use portcullis_config::{EjectionSpec, InferencePoolSpec};
use portcullis_picker::{
    block_hashes, PickRequest, Picker, PickerConfig, PrefixConfig, Refusal, Strategy, Weights,
};

use super::{ResponseFuture, Target};
use crate::body::{self, Body, BoxError};
use crate::llm;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::{Dispatch, Endpoint, Upstream};

pub(crate) struct InferencePoolTarget {
    name: Arc<str>,
    /// The spec it was compiled from: an unchanged pool keeps its picker (and what the
    /// picker learned) across config versions.
    spec: InferencePoolSpec,
    endpoints: Vec<Endpoint>,
    ejection: EjectionSpec,
    picker: Arc<Mutex<Picker>>,
    /// How the picker cuts prompts, hashed before taking the picker's lock; `None` for the
    /// plain strategies, which do not look at prompts.
    prefix: Option<PrefixConfig>,
    /// The picker counts time from here.
    epoch: Instant,
}

impl InferencePoolTarget {
    pub(crate) fn compile(
        name: &str,
        spec: &InferencePoolSpec,
        upstream: &Upstream,
    ) -> Result<InferencePoolTarget, String> {
        let label = format!("InferencePool/{name}");
        let endpoints = super::endpoints(&label, &spec.endpoints, upstream)?;
        let config = picker_config(spec);
        let prefix = (config.strategy == Strategy::Scored).then_some(config.prefix);
        let picker = Picker::new(config, endpoints.len());
        Ok(InferencePoolTarget {
            name: Arc::from(label),
            spec: spec.clone(),
            endpoints,
            ejection: EjectionSpec::default(),
            picker: Arc::new(Mutex::new(picker)),
            prefix,
            epoch: Instant::now(),
        })
    }

    pub(crate) fn spec(&self) -> &InferencePoolSpec {
        &self.spec
    }

    fn picker(&self) -> std::sync::MutexGuard<'_, Picker> {
        // The picker's state stays consistent even if a holder panicked: every update is a
        // counter or an index insert completed under the lock.
        self.picker.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn picker_config(spec: &InferencePoolSpec) -> PickerConfig {
    let defaults = PickerConfig::default();
    let picker = &spec.picker;
    PickerConfig {
        strategy: match picker.strategy {
            portcullis_config::Strategy::Scored => Strategy::Scored,
            portcullis_config::Strategy::RoundRobin => Strategy::RoundRobin,
            portcullis_config::Strategy::LeastRequest => Strategy::LeastRequest,
        },
        weights: picker.weights.map_or(defaults.weights, |w| Weights {
            queue: w.queue.unwrap_or(defaults.weights.queue),
            kv_cache: w.kv_cache.unwrap_or(defaults.weights.kv_cache),
            prefix: w.prefix.unwrap_or(defaults.weights.prefix),
            lora: w.lora.unwrap_or(defaults.weights.lora),
        }),
        queue_threshold: picker.queue_threshold.unwrap_or(defaults.queue_threshold),
        kv_cache_threshold: picker.kv_cache_threshold.unwrap_or(defaults.kv_cache_threshold),
        staleness: picker.staleness.map_or(defaults.staleness, |d| d.0),
        failure_mode: match spec.failure_mode {
            portcullis_config::FailureMode::FailOpen => portcullis_picker::FailureMode::FailOpen,
            portcullis_config::FailureMode::FailClose => portcullis_picker::FailureMode::FailClose,
        },
        fallbacks: picker.fallbacks.map_or(defaults.fallbacks, |n| n as usize),
        seed: rand::random(),
        ..defaults
    }
}

impl Target for InferencePoolTarget {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Upstream,
        request: Request<Body>,
    ) -> ResponseFuture<'a> {
        Box::pin(async move {
            let Some(llm) = ctx.llm.as_ref() else {
                // Route compilation sends only parsed LLM requests here.
                return llm::error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "not_an_llm_request",
                    format!("{} received a request the LLM stage did not read", self.name),
                );
            };
            let hashes = self
                .prefix
                .map(|prefix| block_hashes(&llm.model, &llm.prompt, &prefix))
                .unwrap_or_default();
            let now = self.epoch.elapsed();
            let pick = self.picker().pick(
                now,
                &PickRequest {
                    model: &llm.model,
                    lora: llm.lora,
                    prompt_hashes: &hashes,
                },
                |index| !self.endpoints[index].health.is_ejected(),
            );
            let pick = match pick {
                Ok(pick) => pick,
                Err(refusal) => {
                    let code = match refusal {
                        Refusal::NoEndpoint => "no_endpoint",
                        Refusal::SignalsUnavailable => "signals_unavailable",
                    };
                    return llm::error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        code,
                        format!("{}: {refusal}", self.name),
                    );
                }
            };
            // Whatever happens from here (the client leaves, the exchange fails), dropping
            // the credit gives the picker its count back.
            let mut credit = Credit {
                picker: self.picker.clone(),
                endpoint: pick.endpoints[0],
            };
            {
                let mut record = llm.record.lock().unwrap_or_else(PoisonError::into_inner);
                record.pick_basis = Some(pick.basis.as_str());
                record.prefix_blocks = Some((pick.prefix_hit_blocks, hashes.len() as u32));
                record.saturated = pick.saturated;
            }
            let (record, since) = (llm.record.clone(), llm.since);
            ctx.decide(&self.name, pick.basis.as_str());
            let dispatch = Dispatch {
                target: &self.name,
                endpoints: pick
                    .endpoints
                    .iter()
                    .map(|&index| &self.endpoints[index])
                    .collect(),
                http2: false,
                ejection: &self.ejection,
                connect_fallback: true,
            };
            let response = upstream.send(ctx, route, dispatch, request).await;
            let used = ctx.endpoint.as_ref().and_then(|label| {
                pick.endpoints
                    .iter()
                    .copied()
                    .find(|&index| self.endpoints[index].label == *label)
            });
            if let Some(used) = used.filter(|&used| used != credit.endpoint) {
                self.picker().moved(credit.endpoint, used, now, &hashes);
                credit.endpoint = used;
            }
            let (parts, body) = response.into_parts();
            let streamed = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|value| {
                    // Media types are case-insensitive (RFC 9110 §8.3.1).
                    value.as_bytes().len() >= 17
                        && value.as_bytes()[..17].eq_ignore_ascii_case(b"text/event-stream")
                });
            let release = Release {
                inner: llm::Tap::new(body, record, since, streamed),
                _credit: credit,
            };
            Response::from_parts(parts, body::boxed(release))
        })
    }

    fn endpoints(&self) -> Vec<&Authority> {
        self.endpoints
            .iter()
            .map(|endpoint| &endpoint.authority)
            .collect()
    }
}

/// A request counted in flight at `endpoint`; dropping it gives the count back.
struct Credit {
    picker: Arc<Mutex<Picker>>,
    endpoint: usize,
}

impl Drop for Credit {
    fn drop(&mut self) {
        self.picker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .finished(self.endpoint);
    }
}

/// The response body; holds the request's credit until the exchange ends (the body is
/// dropped at its end, on error, or when the client leaves).
struct Release {
    inner: llm::Tap,
    _credit: Credit,
}

impl HttpBody for Release {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
