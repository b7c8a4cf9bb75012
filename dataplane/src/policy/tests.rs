//! The seam itself: what a policy can do with a request and a response, shown by small
//! policies written here (the shipped ones are tested beside their code and end to end).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;

use super::*;
use crate::telemetry::RequestTrace;

fn context(max_body_bytes: u64) -> RequestContext {
    let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    RequestContext {
        llm: None,
        mcp: None,
        guardrails: Default::default(),
        route: Arc::from("r"),
        client_ip: peer.ip(),
        trace: RequestTrace::default(),
        decisions: Vec::new(),
        max_body_bytes,
        request_body: Arc::default(),
        target: None,
        endpoint: None,
        attempts: 0,
        upstream_headers: None,
    }
}

/// Replaces a JSON body with an upper-cased copy: reads and replaces a buffered body.
struct Shout(Arc<str>);

impl Policy for Shout {
    fn name(&self) -> &Arc<str> {
        &self.0
    }

    fn on_request<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        request: &'a mut Request<Body>,
    ) -> PolicyFuture<'a> {
        Box::pin(async move {
            match buffer_body(ctx, request).await {
                Err(answer) => Decision::Respond(answer),
                Ok(bytes) => {
                    replace_body(request, Bytes::from(bytes.to_ascii_uppercase()));
                    Decision::Continue
                }
            }
        })
    }
}

#[tokio::test]
async fn a_policy_reads_and_replaces_the_request_body() {
    let shout = Shout(Arc::from("Test/shout"));
    let mut ctx = context(1024);
    let mut request = Request::post("/").body(body::full("hello")).unwrap();
    assert!(matches!(
        shout.on_request(&mut ctx, &mut request).await,
        Decision::Continue
    ));
    assert_eq!(request.headers()["content-length"], "5");
    let sent = request.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(sent, "HELLO");
}

#[tokio::test]
async fn a_body_over_the_limit_is_answered_with_413() {
    let shout = Shout(Arc::from("Test/shout"));
    let mut ctx = context(4);
    let mut request = Request::post("/").body(body::full("too long")).unwrap();
    match shout.on_request(&mut ctx, &mut request).await {
        Decision::Respond(answer) => assert_eq!(answer.status(), StatusCode::PAYLOAD_TOO_LARGE),
        Decision::Continue => panic!("a body over the limit passed"),
    }
}

/// Cuts every response body after its first chunk with an error: sees the chunks and
/// ends the stream.
struct CutAfterFirstChunk(Arc<str>);

impl Policy for CutAfterFirstChunk {
    fn name(&self) -> &Arc<str> {
        &self.0
    }

    fn on_request<'a>(
        &'a self,
        _ctx: &'a mut RequestContext,
        _request: &'a mut Request<Body>,
    ) -> PolicyFuture<'a> {
        Box::pin(std::future::ready(Decision::Continue))
    }

    fn on_response<'a>(
        &'a self,
        _ctx: &'a mut RequestContext,
        response: &'a mut Response<Body>,
    ) -> PolicyFuture<'a> {
        let inner = std::mem::replace(response.body_mut(), body::empty());
        let stream = futures::stream::unfold((inner, 0), |(mut inner, seen)| async move {
            if seen == 1 {
                let error: crate::body::BoxError = "cut by policy".into();
                return Some((Err(error), (inner, 2)));
            }
            if seen > 1 {
                return None;
            }
            let frame = inner.frame().await?;
            Some((frame, (inner, seen + 1)))
        });
        *response.body_mut() = body::boxed(http_body_util::StreamBody::new(stream));
        Box::pin(std::future::ready(Decision::Continue))
    }
}

#[tokio::test]
async fn a_policy_sees_response_chunks_and_can_end_the_stream_with_an_error() {
    let policy = CutAfterFirstChunk(Arc::from("Test/cut"));
    let mut ctx = context(1024);
    let chunks = futures::stream::iter([
        Ok::<_, crate::body::BoxError>(http_body::Frame::data(Bytes::from("one"))),
        Ok(http_body::Frame::data(Bytes::from("two"))),
    ]);
    let mut response = Response::new(body::boxed(http_body_util::StreamBody::new(chunks)));
    assert!(matches!(
        policy.on_response(&mut ctx, &mut response).await,
        Decision::Continue
    ));
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "one");
    let error = body.frame().await.unwrap().unwrap_err();
    assert_eq!(error.to_string(), "cut by policy");
}
