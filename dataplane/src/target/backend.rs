//! The plain Backend: equivalent endpoints, tried round-robin, ejected ones last.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::uri::Authority;
use http::Request;
use portcullis_config::{BackendSpec, EjectionSpec};

use super::{ResponseFuture, Target};
use crate::body::Body;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::{Dispatch, Endpoint, Upstream};

pub(crate) struct BackendTarget {
    name: Arc<str>,
    endpoints: Vec<Endpoint>,
    http2: bool,
    ejection: EjectionSpec,
    next: AtomicUsize,
}

impl BackendTarget {
    pub(crate) fn compile(
        name: &str,
        spec: &BackendSpec,
        upstream: &Upstream,
    ) -> Result<BackendTarget, String> {
        let endpoints = super::endpoints(&format!("Backend/{name}"), &spec.endpoints, upstream)?;
        Ok(BackendTarget {
            name: Arc::from(format!("Backend/{name}")),
            endpoints,
            http2: spec.http2,
            ejection: spec.ejection.clone().unwrap_or_default(),
            next: AtomicUsize::new(0),
        })
    }

    /// Every endpoint once: the healthy ones in turn, starting at the next, then the ejected
    /// ones, tried only when nothing healthy is left. The turn goes round the healthy ones
    /// only, so an ejected endpoint's share is spread over all of them, not handed to its
    /// neighbour.
    fn plan(&self) -> Vec<&Endpoint> {
        if self.endpoints.len() <= 1 {
            return self.endpoints.iter().collect();
        }
        let (mut healthy, ejected): (Vec<&Endpoint>, Vec<&Endpoint>) = self
            .endpoints
            .iter()
            .partition(|endpoint| !endpoint.health.is_ejected());
        if !healthy.is_empty() {
            let start = self.next.fetch_add(1, Ordering::Relaxed) % healthy.len();
            healthy.rotate_left(start);
        }
        healthy.extend(ejected);
        healthy
    }
}

impl Target for BackendTarget {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Arc<Upstream>,
        request: Request<Body>,
    ) -> ResponseFuture<'a> {
        let dispatch = Dispatch {
            target: &self.name,
            endpoints: self.plan(),
            http2: self.http2,
            ejection: &self.ejection,
            connect_fallback: false,
        };
        Box::pin(upstream.send(ctx, route, dispatch, request))
    }

    fn endpoints(&self) -> Vec<&Authority> {
        self.endpoints
            .iter()
            .map(|endpoint| &endpoint.authority)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::HealthRegistry;

    #[test]
    fn an_ejected_endpoints_turns_are_spread_over_the_healthy_ones() {
        let registry = HealthRegistry::default();
        let endpoints: Vec<Endpoint> = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
            .iter()
            .map(|address| registry.endpoint(address.parse().unwrap()))
            .collect();
        let eject_at_once = EjectionSpec {
            consecutive_failures: 1,
            ..EjectionSpec::default()
        };
        assert!(endpoints[1]
            .health
            .record_connect_failure(&eject_at_once)
            .is_some());
        let target = BackendTarget {
            name: Arc::from("Backend/up"),
            endpoints,
            http2: false,
            ejection: EjectionSpec::default(),
            next: AtomicUsize::new(0),
        };
        let mut first = [0; 3];
        for _ in 0..300 {
            let plan = target.plan();
            assert_eq!(plan.len(), 3, "every endpoint is in every plan");
            assert_eq!(plan[2].label.as_ref(), "127.0.0.1:2", "the ejected one last");
            let index = target
                .endpoints
                .iter()
                .position(|endpoint| std::ptr::eq(endpoint, plan[0]))
                .unwrap();
            first[index] += 1;
        }
        assert_eq!(first, [150, 0, 150]);
    }
}
