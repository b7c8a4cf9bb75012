//! The request path, stage by stage: normalize → route → policy chain (listener's, then
//! route's) → target → upstream, and back through the policies in reverse. Every request
//! ends in exactly one telemetry record, written when its response body has ended.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;

use crate::body::{self, Body, BodyFailure, BodyStatus, BoxError, ClientBody, IdleTimeout};
use crate::config_state::{ListenerTable, Snapshot};
use crate::listener::Handler;
use crate::llm::Prepared;
use crate::normalize;
use crate::policy::{Decision, RequestContext};
use crate::response::{self, ProxyError};
use crate::route::{request_host, Route};
use crate::telemetry::{RequestRecord, Telemetry};
use crate::upstream::Upstream;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Recorded for a request whose client left before the response started.
const CLIENT_CLOSED: u16 = 499;

static DRAINING: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from(crate::telemetry::REMOVED_LISTENER));

/// Serves the requests arriving on one listener, always against the latest config.
#[derive(Clone)]
pub(crate) struct Pipeline {
    pub(crate) snapshots: Arc<ArcSwap<Snapshot>>,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) telemetry: Arc<Telemetry>,
    /// The listener's configured address: its key in the snapshot's tables.
    pub(crate) listener: SocketAddr,
}

impl Handler for Pipeline {
    async fn handle(&self, peer: SocketAddr, request: Request<Incoming>) -> Response<Body> {
        let start = Instant::now();
        let trace = self.telemetry.start(
            request.headers().get(&TRACEPARENT),
            request.headers().get(&TRACESTATE),
        );
        // Loaded once: the request completes on the version it started on.
        let snapshot = self.snapshots.load_full();
        let (parts, incoming) = request.into_parts();
        let request_body = Arc::new(BodyStatus::default());
        let table = snapshot.tables.get(&self.listener);
        let record = RequestRecord {
            trace,
            client: peer,
            listener: table.map_or_else(|| DRAINING.clone(), |table| table.name.clone()),
            method: parts.method.clone(),
            // Replaced by the normalized path once there is one.
            path: String::new(),
            host: None,
            route: None,
            target: None,
            endpoint: None,
            attempts: 0,
            status: 0,
            error: None,
            decisions: Vec::new(),
            start,
            upstream_headers: None,
            bytes_received: 0,
            bytes_sent: 0,
            completed: false,
            llm: None,
            mcp: None,
            guardrails: Default::default(),
        };
        // Written even if the client leaves before the response starts (this future is
        // then dropped): every request ends in exactly one record.
        let mut pending = PendingRecord {
            record: Some(record),
            telemetry: self.telemetry.clone(),
            request_body: request_body.clone(),
        };
        let Some(record) = pending.record.as_mut() else {
            return response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "no request record");
        };
        let response = match table {
            // A request that slipped onto a connection of a listener the new version removed.
            None => {
                record.path = parts.uri.path().to_string();
                response::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "listener_draining",
                    "this listener was removed from the config and is draining",
                )
            }
            Some(table) => {
                self.serve(table, peer, parts, incoming, &request_body, record)
                    .await
            }
        };
        match pending.record.take() {
            Some(record) => self.finish(response, record, request_body),
            None => response,
        }
    }
}

/// The record of a request still being served; written as "client closed" (status 499,
/// as nginx logs it) if the request is abandoned before its response starts.
struct PendingRecord {
    record: Option<RequestRecord>,
    telemetry: Arc<Telemetry>,
    request_body: Arc<BodyStatus>,
}

impl Drop for PendingRecord {
    fn drop(&mut self) {
        if let Some(mut record) = self.record.take() {
            record.status = CLIENT_CLOSED;
            record.error = Some("client_closed");
            record.bytes_received = self.request_body.received();
            record.completed = false;
            self.telemetry.finish(record);
        }
    }
}

impl Pipeline {
    async fn serve(
        &self,
        table: &ListenerTable,
        peer: SocketAddr,
        mut parts: http::request::Parts,
        incoming: Incoming,
        request_body: &Arc<BodyStatus>,
        record: &mut RequestRecord,
    ) -> Response<Body> {
        let client_ip = match normalize::request(&mut parts, table.merge_slashes, &table.forwarding, peer) {
            Ok(client_ip) => client_ip,
            Err(answer) => {
                record.path = parts.uri.path().to_string();
                return *answer;
            }
        };
        record.path = parts.uri.path().to_string();
        let probe = Request::from_parts(parts, ());
        record.host = request_host(&probe);
        let Some(route) = table.routes.find(record.host.as_deref(), &probe) else {
            return response::error(
                StatusCode::NOT_FOUND,
                "route_not_found",
                format!(
                    "no route for {} {}{}",
                    probe.method(),
                    record.host.as_deref().unwrap_or_default(),
                    probe.uri().path()
                ),
            );
        };
        let (parts, ()) = probe.into_parts();
        record.route = Some(route.name.clone());

        let declared = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse::<u64>().ok());
        if declared.is_some_and(|length| length > route.max_request_body_bytes) {
            let answer = BodyStatus::answer(Some(BodyFailure::TooLarge), route.max_request_body_bytes);
            return in_route_shape(route, answer);
        }
        let limit = usize::try_from(route.max_request_body_bytes).unwrap_or(usize::MAX);
        let body = ClientBody {
            inner: http_body_util::Limited::new(IdleTimeout::new(incoming, route.body_idle_timeout), limit),
            status: request_body.clone(),
        };
        let mut request = Request::from_parts(parts, body::boxed(body));

        let mut ctx = RequestContext {
            route: route.name.clone(),
            client_ip,
            trace: std::mem::take(&mut record.trace),
            decisions: Vec::new(),
            max_body_bytes: route.max_request_body_bytes,
            request_body: request_body.clone(),
            target: None,
            endpoint: None,
            attempts: 0,
            upstream_headers: None,
            llm: None,
            mcp: None,
            // Shared with the record from the start: a client that leaves during a check
            // still gets the decisions taken so far in its record.
            guardrails: record.guardrails.clone(),
        };
        // A policy attached to both the listener and the route runs once, as the
        // listener's.
        let route_only = route
            .policies
            .iter()
            .filter(|policy| !table.policies.iter().any(|other| other.name() == policy.name()));
        let policies: Vec<_> = table.policies.iter().chain(route_only).cloned().collect();
        let mut ran = 0;
        let mut answer = None;
        for policy in &policies {
            ran += 1;
            if let Decision::Respond(response) = policy.on_request(&mut ctx, &mut request).await {
                answer = Some(response);
                break;
            }
        }
        // An LLM route reads the request once the policies have admitted it (a refused
        // request is not buffered); its answers (`/v1/models`, errors) go back through the
        // policies' response hooks like any other.
        let mut llm_target = None;
        if let (None, Some(models)) = (&answer, &route.llm) {
            // Boxed, as is the completion check below: inline, each would make the future of
            // every request, on any route, at least its size
            // (`dataplane/src/tests/future_sizes.rs`).
            match Box::pin(models.prepare(&mut ctx, &mut request)).await {
                Prepared::Forward(target) => llm_target = Some(target),
                Prepared::Answer(llm_answer) => answer = Some(llm_answer),
            }
        }
        let mut response = match answer {
            Some(response) => response,
            None => match llm_target.as_ref().or_else(|| route.targets.pick()) {
                None => response::error(
                    StatusCode::BAD_GATEWAY,
                    "no_backend",
                    format!("Route/{} has no backend with a weight above 0", route.name),
                ),
                Some(target) => {
                    ctx.target = Some(target.name().clone());
                    // Known before the exchange, so a record written because the client left
                    // (499) still says where the request was going.
                    record.target = ctx.target.clone();
                    record.llm = ctx.llm.as_ref().map(|llm| llm.record.clone());
                    let response = target.forward(&mut ctx, route, &self.upstream, request).await;
                    match ctx.llm.as_mut().and_then(|llm| llm.completion.take()) {
                        Some(check) => Box::pin(crate::llm::check_completion(response, check)).await,
                        None => response,
                    }
                }
            },
        };
        for policy in policies[..ran].iter().rev() {
            if let Decision::Respond(replacement) = policy.on_response(&mut ctx, &mut response).await {
                response = replacement;
            }
        }
        let response = in_route_shape(route, response);
        record.trace = ctx.trace;
        record.decisions = ctx.decisions;
        record.target = ctx.target;
        record.endpoint = ctx.endpoint;
        record.attempts = ctx.attempts;
        record.upstream_headers = ctx.upstream_headers;
        record.llm = ctx.llm.as_ref().map(|llm| llm.record.clone());
        record.mcp = ctx.mcp;
        response
    }

    /// Hands the response to the client with a body that writes the record when it ends.
    fn finish(
        &self,
        response: Response<Body>,
        mut record: RequestRecord,
        request_body: Arc<BodyStatus>,
    ) -> Response<Body> {
        record.status = response.status().as_u16();
        record.error = response.extensions().get::<ProxyError>().map(|error| error.0);
        let (parts, inner) = response.into_parts();
        let body = Recorded {
            inner,
            sent: 0,
            request_body,
            finish: Some((record, self.telemetry.clone())),
        };
        Response::from_parts(parts, body::boxed(body))
    }
}

/// The proxy's own errors in the shape the route's clients parse: OpenAI's on an LLM route.
fn in_route_shape(route: &Route, response: Response<Body>) -> Response<Body> {
    if route.llm.is_some() {
        crate::llm::restated(response)
    } else {
        response
    }
}

/// The response body on its way to the client; writes the request's record once, when
/// the body ends, fails, or is dropped unfinished (client gone).
struct Recorded {
    inner: Body,
    sent: u64,
    request_body: Arc<BodyStatus>,
    finish: Option<(RequestRecord, Arc<Telemetry>)>,
}

impl Recorded {
    fn complete(&mut self, completed: bool) {
        if let Some((mut record, telemetry)) = self.finish.take() {
            record.bytes_sent = self.sent;
            record.bytes_received = self.request_body.received();
            record.completed = completed;
            telemetry.finish(record);
        }
    }
}

impl HttpBody for Recorded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.sent += data.len() as u64;
                }
                if body::ended_with(&this.inner, frame) {
                    this.complete(true);
                }
            }
            Poll::Ready(Some(Err(_))) => this.complete(false),
            Poll::Ready(None) => this.complete(true),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let finished = self.inner.is_end_stream();
        self.complete(finished);
    }
}
