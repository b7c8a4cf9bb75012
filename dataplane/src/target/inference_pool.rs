//! The InferencePool: model servers behind the endpoint picker (`portcullis-picker`). Each
//! request's pod comes from the picker; its fallbacks are tried, in order, when a pod refuses
//! the connection. The picker is credited when a request starts and released when its
//! response ends, so its in-flight counts are this proxy's real load on each pod.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use portcullis_config::{EjectionSpec, InferencePoolSpec};
use portcullis_picker::{
    block_hashes, LoraSignals, PickRequest, Picker, PickerConfig, PrefixConfig, Refusal, Signals, Strategy,
    Weights,
};
use portcullis_proto::v1::PodSignals;

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
    /// Endpoint index by its address as written in the spec (how signals name pods).
    by_address: HashMap<String, usize>,
    /// Signals older than this are not handed to the picker.
    staleness: Duration,
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
        let staleness = config.staleness;
        let picker = Picker::new(config, endpoints.len());
        Ok(InferencePoolTarget {
            name: Arc::from(label),
            spec: spec.clone(),
            endpoints,
            by_address: spec
                .endpoints
                .iter()
                .enumerate()
                .map(|(index, address)| (address.clone(), index))
                .collect(),
            staleness,
            ejection: EjectionSpec::default(),
            picker: Arc::new(Mutex::new(picker)),
            prefix,
            epoch: Instant::now(),
        })
    }

    pub(crate) fn spec(&self) -> &InferencePoolSpec {
        &self.spec
    }

    /// Hands one scrape round to the picker, all under one lock. The age the control plane
    /// measured when it sent the round places the sample on this proxy's clock (transit
    /// time aside), so the proxy needs no clock agreement with the control plane.
    pub(crate) fn observe(&self, pods: &[PodSignals]) {
        let now = self.epoch.elapsed();
        let mut picker = self.picker();
        for pod in pods {
            let age = Duration::from_millis(u64::from(pod.age_ms));
            // Already stale: nothing the picker would use. Skipping it also keeps a sample
            // older than this target from looking younger than it is.
            if age > self.staleness {
                continue;
            }
            let Some(&index) = self.by_address.get(&pod.endpoint) else {
                continue;
            };
            picker.observe(
                index,
                Signals {
                    sampled_at: now.saturating_sub(age),
                    waiting: pod.waiting,
                    kv_cache_usage: pod.kv_cache_usage,
                    lora: pod.lora.as_ref().map(|lora| LoraSignals {
                        running: lora.running.clone(),
                        waiting: lora.waiting.clone(),
                        max_loras: lora.max_loras,
                    }),
                },
            );
        }
    }

    /// What the picker holds per endpoint, for the admin port's `/signals`.
    pub(crate) fn report(&self) -> serde_json::Value {
        let now = self.epoch.elapsed();
        let picker = self.picker();
        let endpoints: serde_json::Map<String, serde_json::Value> = self
            .spec
            .endpoints
            .iter()
            .enumerate()
            .map(|(index, address)| {
                let signals = picker.signals(index).map(|signals| {
                    let age = now.saturating_sub(signals.sampled_at);
                    serde_json::json!({
                        "ageMs": age.as_secs_f64() * 1000.0,
                        "fresh": age <= self.staleness,
                        "waiting": signals.waiting,
                        "kvCacheUsage": signals.kv_cache_usage,
                        "lora": signals.lora.as_ref().map(|lora| serde_json::json!({
                            "running": lora.running,
                            "waiting": lora.waiting,
                            "maxLoras": lora.max_loras,
                        })),
                    })
                });
                let entry = serde_json::json!({
                    "inFlight": picker.in_flight(index),
                    "signals": signals,
                });
                (address.clone(), entry)
            })
            .collect();
        serde_json::json!({ "endpoints": endpoints })
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
        staleness: picker.staleness(),
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
