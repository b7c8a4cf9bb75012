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

    /// Every endpoint once, starting at the next in turn; ejected ones go last, so they
    /// are tried only when nothing healthy is left.
    fn plan(&self) -> Vec<&Endpoint> {
        let count = self.endpoints.len();
        if count <= 1 {
            return self.endpoints.iter().collect();
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % count;
        let rotated = self.endpoints[start..].iter().chain(&self.endpoints[..start]);
        let (healthy, ejected): (Vec<&Endpoint>, Vec<&Endpoint>) =
            rotated.partition(|endpoint| !endpoint.health.is_ejected());
        let mut plan = healthy;
        plan.extend(ejected);
        plan
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
