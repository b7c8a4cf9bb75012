//! Choosing where a request goes: a weighted backend, then one of its endpoints, reached
//! through connection pools shared by every config version.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::uri::Authority;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use portcullis_config::{BackendRef, BackendSpec};
use rand::Rng;

#[derive(Debug)]
pub(crate) struct Backend {
    pub(crate) name: String,
    endpoints: Vec<Authority>,
    pub(crate) http2: bool,
    next_endpoint: AtomicUsize,
}

impl Backend {
    pub(crate) fn compile(name: &str, spec: &BackendSpec) -> Result<Backend, String> {
        let endpoints = spec
            .endpoints
            .iter()
            .map(|endpoint| {
                endpoint
                    .parse::<Authority>()
                    .map_err(|error| format!("Backend/{name}: endpoint {endpoint:?}: {error}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Backend {
            name: name.to_string(),
            endpoints,
            http2: spec.http2,
            next_endpoint: AtomicUsize::new(0),
        })
    }

    /// Round-robin; `None` only for a backend without endpoints, which validation rejects.
    pub(crate) fn next_endpoint(&self) -> Option<&Authority> {
        let turn = self.next_endpoint.fetch_add(1, Ordering::Relaxed);
        self.endpoints.get(turn.checked_rem(self.endpoints.len())?)
    }
}

/// A route's backends with their weights.
#[derive(Debug)]
pub(crate) struct WeightedBackends {
    choices: Vec<(Arc<Backend>, u64)>,
    total_weight: u64,
}

impl WeightedBackends {
    pub(crate) fn resolve(
        refs: &[BackendRef],
        backends: &HashMap<String, Arc<Backend>>,
    ) -> Result<WeightedBackends, String> {
        let choices: Vec<(Arc<Backend>, u64)> = refs
            .iter()
            .map(|backend_ref| {
                backends
                    .get(&backend_ref.name)
                    .map(|backend| (backend.clone(), u64::from(backend_ref.weight)))
                    .ok_or_else(|| format!("unknown Backend {:?}", backend_ref.name))
            })
            .collect::<Result<_, _>>()?;
        let total_weight = choices.iter().map(|(_, weight)| weight).sum();
        Ok(WeightedBackends {
            choices,
            total_weight,
        })
    }

    /// `None` only when every weight is 0, which validation rejects.
    pub(crate) fn pick(&self) -> Option<&Arc<Backend>> {
        if self.total_weight == 0 {
            return None;
        }
        let mut ticket = rand::rng().random_range(0..self.total_weight);
        // A weight-0 backend owns an empty range of tickets, so it is never chosen.
        self.choices.iter().find_map(|(backend, weight)| {
            if ticket < *weight {
                Some(backend)
            } else {
                ticket -= weight;
                None
            }
        })
    }
}

/// Upstream clients live as long as the proxy, so connection pools survive config changes.
#[derive(Clone)]
pub(crate) struct UpstreamClients {
    http1: Client<HttpConnector, Incoming>,
    http2: Client<HttpConnector, Incoming>,
}

impl UpstreamClients {
    pub(crate) fn new() -> UpstreamClients {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let http1 = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .build(connector.clone());
        let http2 = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .build(connector);
        UpstreamClients { http1, http2 }
    }

    pub(crate) fn for_backend(&self, backend: &Backend) -> &Client<HttpConnector, Incoming> {
        if backend.http2 {
            &self.http2
        } else {
            &self.http1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(name: &str, endpoints: &[&str]) -> Arc<Backend> {
        let spec = BackendSpec {
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            http2: false,
        };
        Arc::new(Backend::compile(name, &spec).unwrap())
    }

    fn weighted(weights: &[(&str, u32)]) -> WeightedBackends {
        let backends: HashMap<String, Arc<Backend>> = weights
            .iter()
            .map(|(name, _)| (name.to_string(), backend(name, &["127.0.0.1:1"])))
            .collect();
        let refs: Vec<BackendRef> = weights
            .iter()
            .map(|(name, weight)| BackendRef {
                name: name.to_string(),
                weight: *weight,
            })
            .collect();
        WeightedBackends::resolve(&refs, &backends).unwrap()
    }

    #[test]
    fn weighted_choice_follows_weights_and_never_picks_zero() {
        let backends = weighted(&[("heavy", 3), ("never", 0), ("light", 1)]);
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..20_000 {
            let chosen = backends.pick().unwrap();
            *counts.entry(chosen.name.clone()).or_default() += 1;
        }
        assert_eq!(counts.get("never"), None);
        let heavy = f64::from(counts["heavy"]) / 20_000.0;
        assert!((0.72..0.78).contains(&heavy), "heavy share {heavy}");
    }

    #[test]
    fn all_zero_weights_pick_nothing() {
        assert!(weighted(&[("a", 0)]).pick().is_none());
    }

    #[test]
    fn endpoints_rotate_round_robin() {
        let backend = backend("b", &["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let picked: Vec<String> = (0..6)
            .map(|_| backend.next_endpoint().unwrap().to_string())
            .collect();
        assert_eq!(
            picked,
            [
                "10.0.0.1:80",
                "10.0.0.2:80",
                "10.0.0.3:80",
                "10.0.0.1:80",
                "10.0.0.2:80",
                "10.0.0.3:80"
            ]
        );
    }

    #[test]
    fn unknown_backend_is_an_error() {
        let refs = [BackendRef {
            name: "ghost".into(),
            weight: 1,
        }];
        assert!(WeightedBackends::resolve(&refs, &HashMap::new()).is_err());
    }
}
