//! The last stage: sending a request to one of a target's endpoints, over pooled
//! connections shared by every config version, with retries where they are safe.

mod background;
mod connect_watch;
mod health;
mod http1;
mod http2;
mod request;
mod retry;
mod tls;

use std::error::Error as _;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Either};
use hyper::body::Incoming;
use portcullis_config::EjectionSpec;

pub(crate) use background::Background;
use connect_watch::ConnectWatch;
pub(crate) use health::{Endpoint, HealthRegistry};
use http1::Http1Error;
pub(crate) use http1::{Http1, Http1Body};
pub(crate) use retry::RetryPolicy;

use crate::body::{self, Body, BodyStatus, IdleTimeout};
use crate::placements::Outbox;
use crate::policy::RequestContext;
use crate::response;
use crate::route::Route;
use crate::target::{Cancellations, InputWaits, ListChanges, PinObservations, ServersInForce};
use crate::telemetry::Telemetry;

/// Request bodies up to this size are kept so a failed connect can be retried.
const REPLAYABLE_BODY_BYTES: u64 = 64 * 1024;
/// A connect that takes longer is a failed connect (retried elsewhere, counted toward
/// ejection): an endpoint that silently drops SYNs must not eat whole route timeouts.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// How a target's endpoints are reached.
pub(crate) struct Dispatch<'a> {
    pub(crate) target: &'a Arc<str>,
    /// In the order to try them.
    pub(crate) endpoints: Vec<&'a Endpoint>,
    pub(crate) http2: bool,
    pub(crate) ejection: &'a EjectionSpec,
    /// The endpoints are a picker's choice and its fallbacks: a failed connect (nothing
    /// sent) moves to the next one without counting as a route retry. The request body is
    /// then already in memory, so it is kept for resending whatever its size.
    pub(crate) connect_fallback: bool,
}

pub(crate) use tls::TlsClients;

/// The client for upstreams verified against the built-in roots. Its connections, like every
/// pool's here, outlive config versions; each thread has its own (see [`Http1`]), the main
/// runtime's threads theirs, for [`Background`] work: opening a session for a client costs
/// the connection to each server a worker would have reused, but the session is opened and
/// closed whatever becomes of the client or the worker.
static HTTP1: LazyLock<Http1> = LazyLock::new(tls::default_http1);

/// Upstream connections live as long as the proxy, so pools survive config changes.
pub(crate) struct Upstream {
    /// Shared by all threads: HTTP/2 multiplexes, so one connection per endpoint serves
    /// every worker.
    http2: http2::Connections,
    pub(crate) health: HealthRegistry,
    telemetry: Arc<Telemetry>,
    /// Where pickers post their placements for the other proxies: like the connections, it
    /// outlives config versions.
    pub(crate) placements: Outbox,
    /// Clients of `https://` upstreams with TLS settings of their own.
    pub(crate) tls_clients: TlsClients,
    /// Work that must outlive the worker that starts it (opening a session for a client
    /// that may leave, a session's DELETE when its client left during a drain), awaited at
    /// shutdown so a stopping proxy still ends the sessions it opened.
    pub(crate) background: Background,
    /// What MCP servers covered by McpToolPins listed, kept across versions.
    pub(crate) tool_pins: Arc<PinObservations>,
    /// How often MCP servers said their lists changed, kept across versions.
    pub(crate) list_changes: Arc<ListChanges>,
    /// Session-based MCP clients' answers to questions of 2026-07-28 servers, awaited by
    /// calls that may have begun in an earlier version.
    pub(crate) input_waits: Arc<InputWaits>,
    /// Requests session-based MCP clients sent on to 2026-07-28 servers, which their
    /// `notifications/cancelled` ends.
    pub(crate) cancellations: Arc<Cancellations>,
    /// The MCP servers of the version in force, for subscriptions held across versions.
    pub(crate) mcp_servers: ServersInForce,
}

/// A response body from an HTTP/1.1 or an HTTP/2 upstream.
type UpstreamBody = Either<Http1Body, Incoming>;

/// Why an [`Upstream::http1_exchange`] failed.
pub(crate) struct ExchangeFailure {
    /// What a client may read: for a TLS failure only its class.
    pub(crate) reason: String,
    /// rustls' full reason, which names the hosts a certificate is valid for: for the log.
    pub(crate) tls_detail: Option<String>,
}

enum Failure {
    /// Nothing of the request left the proxy.
    Connect(String),
    Exchange(hyper::Error),
    Http1(Http1Error),
}

impl Upstream {
    /// `peer_address`: where other replicas reach this proxy's admin port (see [`InputWaits`]).
    pub(crate) fn new(
        telemetry: Arc<Telemetry>,
        placements: Outbox,
        peer_address: Option<String>,
    ) -> Upstream {
        Upstream {
            http2: http2::Connections::default(),
            tls_clients: TlsClients::default(),
            background: Background::on_current_runtime(),
            health: HealthRegistry::default(),
            tool_pins: Arc::new(PinObservations::new(telemetry.clone())),
            list_changes: Arc::default(),
            input_waits: Arc::new(InputWaits::new(peer_address)),
            cancellations: Arc::default(),
            mcp_servers: ServersInForce::default(),
            telemetry,
            placements,
        }
    }

    /// Closes HTTP/2 connections to endpoints no target of the live config uses.
    pub(crate) fn retain_endpoints(&self, in_use: &std::collections::HashSet<http::uri::Authority>) {
        self.http2.retain(in_use);
    }

    /// Sends `request` to the first endpoint of `dispatch`, moving on to the next one on a
    /// retryable failure. Always answers: proxy errors come back as error responses.
    pub(crate) async fn send(
        &self,
        ctx: &mut RequestContext,
        route: &Route,
        dispatch: Dispatch<'_>,
        request: Request<Body>,
    ) -> Response<Body> {
        if dispatch.endpoints.is_empty() {
            return response::error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_endpoint",
                format!("{} has no endpoints", dispatch.target),
            );
        }
        route.retry.deposit();
        let (parts, body) = request.into_parts();
        let (replay, mut body) = match replayable(&parts, body, ctx, route, dispatch.connect_fallback).await {
            Ok(split) => split,
            Err(answer) => return answer,
        };
        // The upstream's time starts once it can have the whole request: reading a small
        // body from a slow client is the body idle timeout's business.
        let deadline = tokio::time::Instant::now() + route.timeout;
        let max_attempts = 1 + route.retry.attempts as usize;
        let mut attempt = 0;
        loop {
            let endpoint = dispatch.endpoints[attempt % dispatch.endpoints.len()];
            attempt += 1;
            ctx.attempts = attempt as u32;
            ctx.endpoint = Some(endpoint.label.clone());
            let attempt_body = match &replay {
                Some(bytes) => body::full(bytes.clone()),
                None => std::mem::replace(&mut body, body::empty()),
            };
            let upstream_request = match request::for_upstream(
                &parts,
                attempt_body,
                &endpoint.authority,
                dispatch.http2,
                &ctx.trace,
            ) {
                Ok(upstream_request) => upstream_request,
                Err(error) => {
                    return response::error(StatusCode::BAD_REQUEST, "invalid_request", error.to_string());
                }
            };
            let may_retry = attempt < max_attempts && replay.is_some();
            let started = Instant::now();
            let connects = Arc::new(ConnectWatch::default());
            let outcome = tokio::time::timeout_at(
                deadline,
                connects.over(self.exchange(endpoint, dispatch.http2, upstream_request)),
            )
            .await;
            match outcome {
                Err(_) if connects.connecting() => {
                    self.connect_failed(ctx, &dispatch, endpoint);
                    tracing::warn!(route = %ctx.route, endpoint = %endpoint.authority, timeout = ?route.timeout, "no connection to the upstream within the route's timeout");
                    return response::error(
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream_timeout",
                        format!(
                            "{} accepted no connection within {:?} (Route/{} timeout)",
                            dispatch.target, route.timeout, ctx.route
                        ),
                    );
                }
                Err(_) => {
                    self.telemetry
                        .upstream_error(&ctx.route, dispatch.target, "timeout");
                    tracing::warn!(route = %ctx.route, endpoint = %endpoint.authority, timeout = ?route.timeout, "upstream timed out");
                    return response::error(
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream_timeout",
                        format!(
                            "{} sent no response headers within {:?} (Route/{} timeout)",
                            dispatch.target, route.timeout, ctx.route
                        ),
                    );
                }
                Ok(Ok(upstream_response)) => {
                    endpoint.health.record_success();
                    ctx.upstream_headers = Some(started.elapsed());
                    let status = upstream_response.status();
                    if may_retry
                        && route.retry.retries_status(&parts.method, status)
                        && route.retry.try_spend()
                    {
                        tracing::debug!(route = %ctx.route, endpoint = %endpoint.authority, %status, "retrying on status");
                        continue;
                    }
                    return finish_response(upstream_response, route);
                }
                Ok(Err(Failure::Connect(message))) => {
                    self.connect_failed(ctx, &dispatch, endpoint);
                    if dispatch.connect_fallback && replay.is_some() && attempt < dispatch.endpoints.len() {
                        tracing::debug!(route = %ctx.route, endpoint = %endpoint.authority, %message, "connect failed, trying the picker's next endpoint");
                        continue;
                    }
                    if may_retry && route.retry.try_spend() {
                        tracing::debug!(route = %ctx.route, endpoint = %endpoint.authority, %message, "connect failed, retrying");
                        continue;
                    }
                    tracing::warn!(route = %ctx.route, endpoint = %endpoint.authority, %message, "upstream connect failed");
                    return response::error(
                        StatusCode::BAD_GATEWAY,
                        "upstream_connect_error",
                        format!("{}: could not connect to an endpoint: {message}", dispatch.target),
                    );
                }
                Ok(Err(failure)) => return self.exchange_failed(ctx, route, &dispatch, endpoint, failure),
            }
        }
    }

    /// Counts a connect that failed, or that the route's timeout cut short, toward ejecting
    /// `endpoint`.
    fn connect_failed(&self, ctx: &RequestContext, dispatch: &Dispatch<'_>, endpoint: &Endpoint) {
        if let Some(ejected_for) = endpoint.health.record_connect_failure(dispatch.ejection) {
            tracing::warn!(target = %dispatch.target, endpoint = %endpoint.authority, ?ejected_for, "endpoint ejected after repeated connect failures");
        }
        self.telemetry
            .upstream_error(&ctx.route, dispatch.target, "connect");
    }

    fn exchange_failed(
        &self,
        ctx: &RequestContext,
        route: &Route,
        dispatch: &Dispatch<'_>,
        endpoint: &Endpoint,
        failure: Failure,
    ) -> Response<Body> {
        let error: Box<dyn std::error::Error + Send + Sync> = match failure {
            Failure::Exchange(error) => Box::new(error),
            Failure::Http1(error) => Box::new(error),
            Failure::Connect(message) => message.into(),
        };
        // The client's own body failed (too large, stalled, cut off): its fault, not the
        // upstream's, whatever error the exchange surfaced.
        if let Some(failure) = ctx.request_body.failure() {
            return BodyStatus::answer(Some(failure), route.max_request_body_bytes);
        }
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        self.telemetry
            .upstream_error(&ctx.route, dispatch.target, "exchange");
        // The endpoint goes to the log only: clients need not learn internal addresses.
        tracing::warn!(route = %ctx.route, endpoint = %endpoint.authority, %message, "upstream request failed");
        response::error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("{}: {message}", dispatch.target),
        )
    }

    /// The pooled HTTP/1.1 client for upstreams without TLS settings of their own.
    pub(crate) fn http1() -> Http1 {
        Http1::clone(&HTTP1)
    }

    /// One HTTP/1.1 exchange on `client`, for a target that talks to its upstreams itself
    /// (MCP fans out and reads answers): no retries, the caller knows what is safe. The
    /// error says what failed, without the body of anything.
    pub(crate) async fn http1_exchange(
        client: &Http1,
        request: Request<Body>,
    ) -> Result<Response<Http1Body>, ExchangeFailure> {
        client.request(request).await.map_err(|error| {
            let mut message = error.to_string();
            let mut tls_failure = None;
            let mut source = error.source();
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                tls_failure = tls_failure.or_else(|| tls::failure_class(cause));
                source = cause.source();
            }
            match tls_failure {
                Some(class) => ExchangeFailure {
                    reason: class.to_string(),
                    tls_detail: Some(message),
                },
                None => ExchangeFailure {
                    reason: message,
                    tls_detail: None,
                },
            }
        })
    }

    async fn exchange(
        &self,
        endpoint: &Endpoint,
        http2: bool,
        request: Request<Body>,
    ) -> Result<Response<UpstreamBody>, Failure> {
        if http2 {
            let response = self
                .http2
                .send(&endpoint.authority, request, CONNECT_TIMEOUT)
                .await?;
            Ok(response.map(Either::Right))
        } else {
            match HTTP1.request(request).await {
                Ok(response) => Ok(response.map(Either::Left)),
                Err(Http1Error::Connect(cause)) => Err(Failure::Connect(cause.to_string())),
                Err(error) => Err(Failure::Http1(error)),
            }
        }
    }
}

/// Splits off a copy of the body when it is small enough to resend.
async fn replayable(
    parts: &http::request::Parts,
    body: Body,
    ctx: &RequestContext,
    route: &Route,
    buffered: bool,
) -> Result<(Option<Bytes>, Body), Response<Body>> {
    use http_body::Body as _;
    if body.is_end_stream() {
        return Ok((Some(Bytes::new()), body::empty()));
    }
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    match declared {
        Some(length) if length <= REPLAYABLE_BODY_BYTES || buffered => match body.collect().await {
            Ok(collected) => Ok((Some(collected.to_bytes()), body::empty())),
            Err(_) => Err(BodyStatus::answer(
                ctx.request_body.failure(),
                route.max_request_body_bytes,
            )),
        },
        _ => Ok((None, body)),
    }
}

fn finish_response(upstream_response: Response<UpstreamBody>, route: &Route) -> Response<Body> {
    let (mut parts, body) = upstream_response.into_parts();
    crate::normalize::strip_hop_by_hop(&mut parts.headers, false);
    Response::from_parts(
        parts,
        body::boxed(IdleTimeout::new(body, route.body_idle_timeout)),
    )
}
