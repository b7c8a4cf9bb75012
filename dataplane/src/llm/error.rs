//! Errors in the OpenAI API's shape, so OpenAI SDKs raise their usual exceptions with our
//! message: `{"error": {"message", "type", "param", "code"}}`.

use http::{Response, StatusCode};

use crate::body::Body;
use crate::policy::guardrail::Stop;
use crate::response::{json, ErrorMessage, ProxyError};

/// `code` is also what the access log and metrics record as the request's error.
pub(crate) fn error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response<Body> {
    let kind = error_type(status);
    let body = serde_json::json!({
        "error": { "message": message.into(), "type": kind, "param": null, "code": code }
    });
    let mut response = json(status, &body);
    response.extensions_mut().insert(ProxyError(code));
    response
}

/// An error the proxy wrote in its generic shape on an LLM route (a policy's 429, a body
/// limit's 413, an upstream failure's 502 or 504, ...), restated in OpenAI's, so that clients
/// reading `error.code` find it there too. Headers (`Retry-After`, a HeaderPolicy's edits)
/// stay; any other response passes as it is.
pub(crate) fn restated(response: Response<Body>) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    let (Some(ProxyError(code)), Some(ErrorMessage(message))) = (
        parts.extensions.get::<ProxyError>().copied(),
        parts.extensions.remove::<ErrorMessage>(),
    ) else {
        return Response::from_parts(parts, body);
    };
    let restated = serde_json::json!({
        "error": { "message": &*message, "type": error_type(parts.status), "param": null, "code": code }
    });
    // Still JSON: the type it was written with (or a HeaderPolicy's) holds.
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, crate::body::full(restated.to_string()))
}

/// How a guardrail's stop of `what` (the prompt, the completion) is answered: status, code
/// and message.
pub(crate) fn stopped(stop: Stop, what: &str) -> (StatusCode, &'static str, String) {
    match stop {
        Stop::Denied { guardrail, reason } => (
            StatusCode::FORBIDDEN,
            "guardrail_denied",
            format!("{guardrail} denied the {what}: {reason}"),
        ),
        Stop::Unavailable { guardrail } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "guardrail_unavailable",
            format!(
                "{guardrail} could not check the {what}: no verdict could be had, so it was not \
                 let through (try again later)"
            ),
        ),
    }
}

/// The `type` OpenAI's errors carry for `status`.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;

    use crate::tests::support::*;

    #[tokio::test]
    async fn the_proxys_own_errors_on_an_llm_route_are_in_openais_shape() {
        let port = free_port();
        // No pod is asked: a refusal comes first.
        // One token every 1,000 s: the bucket does not refill during the test.
        let rate_limit = "apiVersion: portcullis.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: one}
spec: {targetRefs: [{kind: Route, name: llm}], requestsPerSecond: 0.001, burst: 1}
";
        let proxy = start_proxy(None, Duration::from_secs(1)).await;
        let limits = "limits: {maxRequestBodyBytes: 64}";
        proxy
            .state
            .apply(1, llm_config(port, "127.0.0.1:9", limits, rate_limit))
            .await
            .unwrap();
        let post = |body: String| {
            let request = http::Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap();
            http1_client().request(request)
        };
        let large = format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
            "x".repeat(100)
        );
        let (status, text) = status_and_text(post(large).await.unwrap()).await;
        assert_eq!(status, 413, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (
                &error["error"]["code"],
                &error["error"]["type"],
                &error["error"]["param"]
            ),
            (
                &Value::from("request_too_large"),
                &Value::from("invalid_request_error"),
                &Value::Null
            ),
            "{text}"
        );
        assert!(error["error"]["message"]
            .as_str()
            .is_some_and(|message| !message.is_empty()));
        // Refused before the policies, it took no token. The next takes the bucket's one
        // token and finds no pod listening.
        let small = || post(r#"{"model": "m", "messages": []}"#.to_string());
        let (status, text) = status_and_text(small().await.unwrap()).await;
        assert_eq!(status, 502, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (&error["error"]["code"], &error["error"]["type"]),
            (
                &Value::from("upstream_connect_error"),
                &Value::from("server_error")
            ),
            "{text}"
        );
        // The one after is refused, and keeps its Retry-After.
        let response = small().await.unwrap();
        assert!(response.headers().contains_key(http::header::RETRY_AFTER));
        let (status, text) = status_and_text(response).await;
        assert_eq!(status, 429, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "rate_limited", "{text}");
        proxy.shutdown().await.unwrap();
    }
}
