//! Targets: where a route sends a request, and how. A target kind is one file here plus
//! one arm in [`compile`]; the plain [`Backend`](backend::BackendTarget) is the first, the
//! [`InferencePool`](inference_pool::InferencePoolTarget) (an endpoint picker over model
//! servers) the second, the [`McpBackend`](mcp::McpTarget) (MCP servers behind one route)
//! the third.
//! A target may answer by itself (an MCP target fanning out to several servers) or hand
//! [`Upstream`] an ordered list of endpoints to try.

mod backend;
mod inference_pool;
mod mcp;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::uri::Authority;
use http::{Request, Response};
use portcullis_config::{
    BackendRef, BackendSpec, ConfigSet, InferencePoolSpec, Kind, McpBackendSpec, ObjectKey,
};
use rand::Rng;

use crate::body::Body;
use crate::policy::guardrail::GuardrailIndex;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::{Endpoint, Upstream};

pub(crate) type ResponseFuture<'a> = Pin<Box<dyn Future<Output = Response<Body>> + Send + 'a>>;

pub(crate) trait Target: Send + Sync {
    /// `Kind/name`, as in logs and metrics.
    fn name(&self) -> &Arc<str>;

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Arc<Upstream>,
        request: Request<Body>,
    ) -> ResponseFuture<'a>;

    /// Every address this target may connect to (pooled connections to others close).
    fn endpoints(&self) -> Vec<&Authority>;
}

pub(crate) use inference_pool::InferencePoolTarget;
pub(crate) use mcp::{Cancellations, InputWaits, ListChanges, PinObservations, ServersInForce, ANSWERS_PATH};

/// Every target of a config version.
#[derive(Default)]
pub(crate) struct Targets {
    pub(crate) by_key: HashMap<ObjectKey, Arc<dyn Target>>,
    /// The pools again, typed: LLM routes read their specs, and the next version keeps the
    /// pickers of pools whose spec did not change.
    pub(crate) pools: HashMap<String, Arc<InferencePoolTarget>>,
    /// The McpBackends again, typed: their pins come into force with the version.
    mcp: Vec<Arc<mcp::McpTarget>>,
}

impl Targets {
    /// Once this version is in force: what was seen of pinned servers is judged against its
    /// pins, what was seen of servers it no longer has (their tools, their list changes) is
    /// forgotten, and its servers are the ones held subscriptions ask again.
    pub(crate) fn put_mcp_in_force(&self, upstream: &Upstream) {
        let mut servers = Vec::new();
        for target in &self.mcp {
            target.refresh_pins();
            servers.extend(target.server_keys());
        }
        upstream.tool_pins.retain(&servers);
        upstream.list_changes.retain(&servers);
        upstream.mcp_servers.put_in_force(&self.mcp);
    }
}

/// Compiles every target object of the config, keyed by its object key.
pub(crate) fn compile(
    config: &ConfigSet,
    upstream: &Upstream,
    previous: &Targets,
    guardrails: &GuardrailIndex,
) -> Result<Targets, String> {
    let mut targets = Targets::default();
    for (metadata, spec) in config.specs::<BackendSpec>() {
        let target = backend::BackendTarget::compile(&metadata.name, spec, upstream)?;
        targets.by_key.insert(
            ObjectKey::new(Kind::of::<BackendSpec>(), metadata.name.as_str()),
            Arc::new(target),
        );
    }
    for (metadata, spec) in config.specs::<InferencePoolSpec>() {
        let pool = match previous.pools.get(&metadata.name) {
            Some(kept) if kept.spec() == spec => kept.clone(),
            before => Arc::new(InferencePoolTarget::compile(
                &metadata.name,
                spec,
                upstream,
                before.map(|before| &**before),
            )?),
        };
        targets.by_key.insert(
            ObjectKey::new(Kind::of::<InferencePoolSpec>(), metadata.name.as_str()),
            pool.clone(),
        );
        targets.pools.insert(metadata.name.clone(), pool);
    }
    for (metadata, spec) in config.specs::<McpBackendSpec>() {
        let target = Arc::new(mcp::McpTarget::compile(
            &metadata.name,
            spec,
            config,
            guardrails,
            upstream,
        )?);
        targets.by_key.insert(
            ObjectKey::new(Kind::of::<McpBackendSpec>(), metadata.name.as_str()),
            target.clone(),
        );
        targets.mcp.push(target);
    }
    Ok(targets)
}

/// The endpoints of a target, with their shared health (`target` names it in errors).
fn endpoints(target: &str, endpoints: &[String], upstream: &Upstream) -> Result<Vec<Endpoint>, String> {
    endpoints
        .iter()
        .map(|endpoint| {
            endpoint
                .parse::<Authority>()
                .map(|authority| upstream.health.endpoint(authority))
                .map_err(|error| format!("{target}: endpoint {endpoint:?}: {error}"))
        })
        .collect()
}

/// A route's targets with their weights.
#[derive(Default)]
pub(crate) struct WeightedTargets {
    choices: Vec<(Arc<dyn Target>, u64)>,
    total_weight: u64,
}

impl WeightedTargets {
    pub(crate) fn resolve(
        refs: &[BackendRef],
        targets: &HashMap<ObjectKey, Arc<dyn Target>>,
    ) -> Result<WeightedTargets, String> {
        let choices: Vec<(Arc<dyn Target>, u64)> = refs
            .iter()
            .map(|reference| {
                let kind = Kind::from_name(&reference.kind)
                    .ok_or_else(|| format!("unknown kind {:?}", reference.kind))?;
                targets
                    .get(&ObjectKey::new(kind, reference.name.as_str()))
                    .map(|target| (target.clone(), u64::from(reference.weight)))
                    .ok_or_else(|| format!("unknown {kind} {:?}", reference.name))
            })
            .collect::<Result<_, String>>()?;
        let total_weight = choices.iter().map(|(_, weight)| weight).sum();
        Ok(WeightedTargets {
            choices,
            total_weight,
        })
    }

    /// `None` only when every weight is 0, which validation rejects.
    pub(crate) fn pick(&self) -> Option<&Arc<dyn Target>> {
        match self.choices.as_slice() {
            [] => None,
            [(only, weight)] => (*weight > 0).then_some(only),
            choices => {
                if self.total_weight == 0 {
                    return None;
                }
                let mut ticket = rand::rng().random_range(0..self.total_weight);
                // A weight-0 target owns an empty range of tickets, so it is never chosen.
                choices.iter().find_map(|(target, weight)| {
                    if ticket < *weight {
                        Some(target)
                    } else {
                        ticket -= weight;
                        None
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Named(Arc<str>);

    impl Target for Named {
        fn name(&self) -> &Arc<str> {
            &self.0
        }

        fn forward<'a>(
            &'a self,
            _ctx: &'a mut RequestContext,
            _route: &'a Route,
            _upstream: &'a Arc<Upstream>,
            _request: Request<Body>,
        ) -> ResponseFuture<'a> {
            Box::pin(async { Response::new(crate::body::empty()) })
        }

        fn endpoints(&self) -> Vec<&Authority> {
            Vec::new()
        }
    }

    fn weighted(weights: &[(&str, u32)]) -> WeightedTargets {
        let targets: HashMap<ObjectKey, Arc<dyn Target>> = weights
            .iter()
            .map(|(name, _)| {
                let target: Arc<dyn Target> = Arc::new(Named(Arc::from(*name)));
                (ObjectKey::new(Kind::of::<BackendSpec>(), *name), target)
            })
            .collect();
        let refs: Vec<BackendRef> = weights
            .iter()
            .map(|(name, weight)| BackendRef {
                kind: "Backend".into(),
                name: name.to_string(),
                weight: *weight,
                priority_class: None,
            })
            .collect();
        WeightedTargets::resolve(&refs, &targets).unwrap()
    }

    #[test]
    fn weighted_choice_follows_weights_and_never_picks_zero() {
        let targets = weighted(&[("heavy", 3), ("never", 0), ("light", 1)]);
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..20_000 {
            let chosen = targets.pick().unwrap();
            *counts.entry(chosen.name().to_string()).or_default() += 1;
        }
        assert_eq!(counts.get("never"), None);
        let heavy = f64::from(counts["heavy"]) / 20_000.0;
        assert!((0.72..0.78).contains(&heavy), "heavy share {heavy}");
    }

    #[test]
    fn all_zero_weights_pick_nothing() {
        assert!(weighted(&[("a", 0)]).pick().is_none());
        assert!(weighted(&[("a", 0), ("b", 0)]).pick().is_none());
    }

    #[test]
    fn unknown_target_is_an_error() {
        let refs = [BackendRef {
            kind: "Backend".into(),
            name: "ghost".into(),
            weight: 1,
            priority_class: None,
        }];
        assert!(WeightedTargets::resolve(&refs, &HashMap::new()).is_err());
    }
}
