//! HeaderPolicy: edits request headers before the upstream sees them and response headers
//! before the client does.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use portcullis_config::{HeaderEdits, HeaderPolicySpec};

use super::{Decision, Policy, PolicyFuture, RequestContext};
use crate::body::Body;

pub(crate) struct HeaderPolicy {
    name: Arc<str>,
    request: Edits,
    response: Edits,
}

#[derive(Default)]
struct Edits {
    remove: Vec<HeaderName>,
    set: Vec<(HeaderName, HeaderValue)>,
    add: Vec<(HeaderName, HeaderValue)>,
}

impl Edits {
    fn compile(edits: &HeaderEdits) -> Result<Edits, String> {
        let header = |name: &str, value: &str| -> Result<(HeaderName, HeaderValue), String> {
            Ok((
                HeaderName::from_bytes(name.as_bytes())
                    .map_err(|error| format!("header {name:?}: {error}"))?,
                HeaderValue::from_str(value).map_err(|error| format!("value of header {name:?}: {error}"))?,
            ))
        };
        Ok(Edits {
            remove: edits
                .remove
                .iter()
                .map(|name| {
                    HeaderName::from_bytes(name.as_bytes())
                        .map_err(|error| format!("header {name:?}: {error}"))
                })
                .collect::<Result<_, _>>()?,
            set: edits
                .set
                .iter()
                .map(|h| header(&h.name, &h.value))
                .collect::<Result<_, _>>()?,
            add: edits
                .add
                .iter()
                .map(|h| header(&h.name, &h.value))
                .collect::<Result<_, _>>()?,
        })
    }

    fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.set.is_empty() && self.add.is_empty()
    }

    fn apply(&self, headers: &mut HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for (name, value) in &self.set {
            headers.insert(name.clone(), value.clone());
        }
        for (name, value) in &self.add {
            headers.append(name.clone(), value.clone());
        }
    }
}

impl HeaderPolicy {
    pub(crate) fn compile(name: &str, spec: &HeaderPolicySpec) -> Result<HeaderPolicy, String> {
        let label = format!("HeaderPolicy/{name}");
        Ok(HeaderPolicy {
            request: Edits::compile(&spec.request).map_err(|error| format!("{label}: {error}"))?,
            response: Edits::compile(&spec.response).map_err(|error| format!("{label}: {error}"))?,
            name: Arc::from(label),
        })
    }
}

impl Policy for HeaderPolicy {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn on_request<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        request: &'a mut Request<Body>,
    ) -> PolicyFuture<'a> {
        if !self.request.is_empty() {
            self.request.apply(request.headers_mut());
            ctx.decide(&self.name, "modified");
        }
        Box::pin(std::future::ready(Decision::Continue))
    }

    fn on_response<'a>(
        &'a self,
        _ctx: &'a mut RequestContext,
        response: &'a mut Response<Body>,
    ) -> PolicyFuture<'a> {
        self.response.apply(response.headers_mut());
        Box::pin(std::future::ready(Decision::Continue))
    }
}
