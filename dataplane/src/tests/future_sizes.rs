//! The request path's futures stay small. hyper's HTTP/1.1 dispatcher keeps, for each
//! connection, a heap slot the size of the service's future (which wraps the handler's), and
//! a target boxes its exchange for each request; an `.await` written inline on a large future
//! makes the awaiting future at least that large, whether or not a request takes that path.
//! A connect inline made the HTTP/1.1 exchange over three times its size; an LLM route's
//! reading and completion check grew every request's handler future, LLM or not; and the
//! connect watch, as an `async fn`, held the exchange twice. Measured when this was written
//! (debug and release alike; `docs/benchmarks/http.md`, "The request's futures"): handle
//! 3,656 bytes, send 2,072, HTTP/1.1 exchange 936. The bounds leave room for compiler changes;
//! undoing any one of those boxes, or making `ConnectWatch::over` an `async fn` again, exceeds
//! them.

use std::future::Future;
use std::net::SocketAddr;

use http::Request;
use hyper::body::Incoming;

use crate::body::Body;
use crate::listener::Handler;
use crate::pipeline::Pipeline;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::{Dispatch, Http1, Upstream};

/// The size of the future `make` returns; `make` is never called.
fn future_size<Args, F: Future>(_make: impl FnOnce(Args) -> F) -> usize {
    std::mem::size_of::<F>()
}

#[test]
fn the_request_paths_futures_stay_small() {
    let handle = future_size(
        |(pipeline, peer, request): (&'static Pipeline, SocketAddr, Request<Incoming>)| {
            pipeline.handle(peer, request)
        },
    );
    let send = future_size(
        |(upstream, ctx, route, dispatch, request): (
            &'static Upstream,
            &'static mut RequestContext,
            &'static Route,
            Dispatch<'static>,
            Request<Body>,
        )| upstream.send(ctx, route, dispatch, request),
    );
    let http1 = future_size(|(client, request): (&'static Http1, Request<Body>)| client.request(request));
    println!("bytes: handle {handle}, send {send}, HTTP/1.1 exchange {http1}");
    assert!(handle <= 4096, "Pipeline::handle's future is {handle} bytes");
    assert!(send <= 2560, "Upstream::send's future is {send} bytes");
    assert!(http1 <= 1280, "Http1::request's future is {http1} bytes");
}
