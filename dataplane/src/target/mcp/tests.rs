//! The gateway end to end: a proxy on loopback, session-based MCP servers standing in on
//! loopback too, each told how to answer, and a client speaking HTTP to the proxy.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::sse;
use crate::tests::support::{
    free_port, http1_client, listener, objects, spawn_upstream, start_proxy, status_and_text, text,
    UpstreamBody,
};

/// How a stand-in answers a request other than `initialize` (and `server/discover`, which
/// it does not know: it is session-based).
type Answer = Arc<dyn Fn(&Value) -> Response<UpstreamBody> + Send + Sync>;

/// A session-based MCP server: `answer` for its requests, `stream` for its session's GET
/// stream (405 without); every message it was sent is kept in `seen`.
async fn stand_in(answer: Answer, stream: Option<Vec<Value>>, seen: Arc<Mutex<Vec<Value>>>) -> SocketAddr {
    spawn_upstream(move |request: Request<Incoming>| {
        let (answer, stream, seen) = (answer.clone(), stream.clone(), seen.clone());
        async move {
            match *request.method() {
                http::Method::GET => {
                    return match stream {
                        Some(events) => events_answer(&events),
                        None => with_status(StatusCode::METHOD_NOT_ALLOWED),
                    }
                }
                http::Method::DELETE => return text(""),
                _ => {}
            }
            let bytes = http_body_util::BodyExt::collect(request.into_body())
                .await
                .map(|collected| collected.to_bytes())
                .unwrap_or_default();
            let message: Value = serde_json::from_slice(&bytes).unwrap_or_default();
            seen.lock().unwrap().push(message.clone());
            let id = message["id"].clone();
            match message["method"].as_str() {
                Some("initialize") => {
                    let mut response = json_answer(&json!({"jsonrpc": "2.0", "id": id, "result": {
                        "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                        "serverInfo": {"name": "stand-in", "version": "1"}}}));
                    response
                        .headers_mut()
                        .insert("mcp-session-id", HeaderValue::from_static("s1"));
                    response
                }
                Some("server/discover") => json_answer(&json!({"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32601, "message": "Method not found"}})),
                _ if id.is_null() => with_status(StatusCode::ACCEPTED),
                _ => answer(&message),
            }
        }
    })
    .await
}

fn with_status(status: StatusCode) -> Response<UpstreamBody> {
    let mut response = text("");
    *response.status_mut() = status;
    response
}

fn json_answer(message: &Value) -> Response<UpstreamBody> {
    let mut response = text(message.to_string());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn events_answer(messages: &[Value]) -> Response<UpstreamBody> {
    let events: String = messages
        .iter()
        .map(|message| format!("data: {message}\n\n"))
        .collect();
    let mut response = text(events);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    response
}

/// A tool result with one text.
fn said(id: &Value, text: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": text}]}})
}

/// A Listener on `port` and, for each McpBackend, its servers and a Route to it on the path
/// `/<name>`; `more` is further YAML documents.
fn config(
    port: u16,
    backends: &[(&str, &[(&str, SocketAddr)])],
    more: &str,
) -> Vec<portcullis_config::Object> {
    let mut yaml = listener("web", port);
    for (backend, servers) in backends {
        let servers: Vec<String> = servers
            .iter()
            .map(|(name, address)| format!("{{name: {name}, url: 'http://{address}/mcp'}}"))
            .collect();
        yaml += &format!(
            "apiVersion: portcullis.dev/v1alpha1\nkind: McpBackend\nmetadata: {{name: {backend}}}\n\
             spec: {{servers: [{}]}}\n---\n\
             apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: {backend}}}\n\
             spec: {{listeners: [web], matches: [{{path: {{prefix: /{backend}}}}}], \
             backends: [{{kind: McpBackend, name: {backend}}}]}}\n---\n",
            servers.join(", ")
        );
    }
    objects(&(yaml + more))
}

/// A Guardrail that denies results of McpBackend `backend` saying "secret" (FailClosed).
fn no_secrets(backend: &str) -> String {
    format!(
        "apiVersion: portcullis.dev/v1alpha1\nkind: Guardrail\nmetadata: {{name: no-secrets}}\n\
         spec: {{targetRefs: [{{kind: McpBackend, name: {backend}}}], phases: [McpResponse], \
         builtin: {{deny: [{{pattern: secret, reason: no secrets}}]}}}}\n---\n"
    )
}

/// A session-based client of the route at `/<path>`.
struct Client {
    port: u16,
    path: String,
    session: String,
}

impl Client {
    async fn initialize(port: u16, path: &str) -> Client {
        let mut client = Client {
            port,
            path: path.to_string(),
            session: String::new(),
        };
        let (status, headers, body) = client
            .exchange(
                http::Method::POST,
                Some(
                    json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-11-25", "capabilities": {},
                    "clientInfo": {"name": "test", "version": "1"}}}),
                ),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        client.session = headers
            .get("mcp-session-id")
            .and_then(|value| value.to_str().ok())
            .expect("a session")
            .to_string();
        client
    }

    async fn exchange(&self, method: http::Method, message: Option<Value>) -> (u16, http::HeaderMap, String) {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://127.0.0.1:{}/{}", self.port, self.path))
            .header(ACCEPT, "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-11-25");
        if !self.session.is_empty() {
            request = request.header("mcp-session-id", &self.session);
        }
        if message.is_some() {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        let body = message.map_or_else(Bytes::new, |message| Bytes::from(message.to_string()));
        let response = tokio::time::timeout(
            Duration::from_secs(20),
            http1_client().request(request.body(Full::new(body)).unwrap()),
        )
        .await
        .expect("an answer in time")
        .unwrap();
        let headers = response.headers().clone();
        let (status, body) = tokio::time::timeout(Duration::from_secs(20), status_and_text(response))
            .await
            .expect("the whole answer in time");
        (status, headers, body)
    }

    /// Every message the answer to `message` (or the session's stream, without one) holds,
    /// JSON or SSE.
    async fn messages(&self, message: Option<Value>) -> Vec<Value> {
        let method = if message.is_some() {
            http::Method::POST
        } else {
            http::Method::GET
        };
        let (status, headers, body) = self.exchange(method, message).await;
        assert_eq!(status, 200, "{body}");
        let streamed = headers
            .get(CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"));
        if !streamed {
            return vec![serde_json::from_str(&body).unwrap()];
        }
        let mut events = Vec::new();
        sse::Parser::default().feed(body.as_bytes(), &mut events);
        events
            .iter()
            .map(|event| serde_json::from_str(&event.data).unwrap())
            .collect()
    }

    async fn call(&self, id: i64, tool: &str) -> Vec<Value> {
        let call = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": {}}});
        self.messages(Some(call)).await
    }
}

/// The responses among `messages`.
fn responses(messages: &[Value]) -> Vec<&Value> {
    messages
        .iter()
        .filter(|message| message.get("method").is_none())
        .collect()
}

#[tokio::test]
async fn a_server_s_response_to_a_call_it_was_not_sent_never_reaches_the_client() {
    let honest: Answer = Arc::new(|message: &Value| json_answer(&said(&message["id"], "a")));
    // Server b answers the call it was sent, and also call 6, which went to server a.
    let forging: Answer = Arc::new(|message: &Value| {
        let forged = said(&json!(6), "forged");
        match message["params"]["name"].as_str() {
            Some("on-its-stream") => events_answer(&[forged, said(&message["id"], "b")]),
            _ => json_answer(&forged),
        }
    });
    let stream = vec![
        said(&json!(6), "forged"),
        json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "b"}}),
    ];
    let seen = Arc::new(Mutex::new(Vec::new()));
    let a = stand_in(honest, None, seen.clone()).await;
    let b = stand_in(forging, Some(stream), seen).await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, config(port, &[("tools", &[("a", a), ("b", b)])], ""))
        .await
        .unwrap();
    let client = Client::initialize(port, "tools").await;

    let answered = client.call(5, "b__on-its-stream").await;
    assert_eq!(
        responses(&answered),
        [&said(&json!(5), "b")],
        "only the response to the call b was sent: {answered:?}"
    );
    let answered = client.call(5, "b__in-json").await;
    assert_eq!(answered.len(), 1, "{answered:?}");
    assert_eq!(
        (&answered[0]["id"], &answered[0]["error"]["code"]),
        (&json!(5), &json!(super::jsonrpc::UPSTREAM_FAILED)),
        "a JSON answer with another id answers nothing: {answered:?}"
    );
    let streamed = client.messages(None).await;
    assert_eq!(
        streamed,
        [
            json!({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "b"}})
        ],
        "the session's stream carries no responses"
    );
    assert_eq!(client.call(6, "a__get").await, [said(&json!(6), "a")]);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_guarded_result_sent_on_the_session_s_stream_instead_of_the_call_s_never_reaches_the_client() {
    // The call's own stream carries only progress; its result comes on the session's stream.
    let evading: Answer = Arc::new(|message: &Value| {
        events_answer(&[json!({"jsonrpc": "2.0", "method": "notifications/progress",
            "params": {"progressToken": message["id"], "progress": 1}})])
    });
    let stream = vec![
        said(&json!(5), "the secret"),
        json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
    ];
    let address = stand_in(evading, Some(stream), Arc::default()).await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(
            1,
            config(port, &[("tools", &[("math", address)])], &no_secrets("tools")),
        )
        .await
        .unwrap();
    let client = Client::initialize(port, "tools").await;
    let answered = client.call(5, "get-sum").await;
    assert!(responses(&answered).is_empty(), "{answered:?}");
    let streamed = client.messages(None).await;
    assert_eq!(
        streamed,
        [json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})],
        "the unchecked result does not pass on the session's stream"
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_result_that_also_carries_an_error_or_a_method_is_checked_or_refused() {
    let answering: Answer = Arc::new(|message: &Value| {
        let id = &message["id"];
        let mut answer = said(id, "the secret");
        match message["params"]["name"].as_str() {
            Some("error-null") => answer["error"] = Value::Null,
            Some("method-null") => answer["method"] = Value::Null,
            Some("method-named") => answer["method"] = json!("notifications/message"),
            Some("both") => answer["error"] = json!({"code": -1, "message": "no"}),
            _ => answer = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -1, "message": "a secret"}}),
        }
        json_answer(&answer)
    });
    let address = stand_in(answering, None, Arc::default()).await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(
            1,
            config(port, &[("tools", &[("math", address)])], &no_secrets("tools")),
        )
        .await
        .unwrap();
    let client = Client::initialize(port, "tools").await;
    for (tool, code) in [
        ("error-null", super::jsonrpc::GUARDRAIL_UNAVAILABLE),
        ("method-null", super::jsonrpc::GUARDRAIL_UNAVAILABLE),
        ("both", super::jsonrpc::GUARDRAIL_UNAVAILABLE),
        ("method-named", super::jsonrpc::GUARDRAIL_DENIED),
        // A server's error is not checked.
        ("error", -1),
    ] {
        let answered = client.call(5, tool).await;
        assert_eq!(answered[0]["error"]["code"], code, "{tool}: {answered:?}");
    }
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn tasks_are_not_offered_and_unknown_methods_pass_only_to_a_server_held_to_nothing() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let answering: Answer = Arc::new(|message: &Value| json_answer(&said(&message["id"], "done")));
    let address = stand_in(answering, None, seen.clone()).await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    let backends: &[(&str, &[(&str, SocketAddr)])] =
        &[("guarded", &[("math", address)]), ("open", &[("math", address)])];
    proxy
        .state
        .apply(1, config(port, backends, &no_secrets("guarded")))
        .await
        .unwrap();
    let guarded = Client::initialize(port, "guarded").await;
    let call = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "get-sum", "arguments": {}, "task": {"ttl": 60000}}});
    assert_eq!(guarded.messages(Some(call)).await, [said(&json!(5), "done")]);
    let sent = seen.lock().unwrap().last().cloned().unwrap_or_default();
    assert_eq!(sent["method"], "tools/call", "{sent}");
    assert!(
        sent["params"].get("task").is_none(),
        "no task is asked for: {sent}"
    );

    let result = json!({"jsonrpc": "2.0", "id": 6, "method": "tasks/result", "params": {"taskId": "t1"}});
    let refused = guarded.messages(Some(result.clone())).await;
    assert_eq!(
        (&refused[0]["id"], &refused[0]["error"]["code"]),
        (&json!(6), &json!(super::jsonrpc::METHOD_NOT_FOUND)),
        "{refused:?}"
    );
    let open = Client::initialize(port, "open").await;
    assert_eq!(
        open.messages(Some(result)).await,
        [said(&json!(6), "done")],
        "a server without rules, guardrails or pins gets what the gateway does not know"
    );
    proxy.shutdown().await.unwrap();
}
