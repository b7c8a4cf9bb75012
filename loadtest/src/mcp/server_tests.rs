//! The test server over real TCP: raw HTTP exchanges of both eras, error handling, and the
//! official Rust SDK (`rmcp`) as a client.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::client::sse_messages;
use super::{start, McpServer, McpServerConfig, ServedEras};

async fn server(tools: usize, prefer_sse: bool) -> anyhow::Result<McpServer> {
    start(McpServerConfig {
        listen: "127.0.0.1:0".parse()?,
        tools,
        delay: Duration::ZERO,
        prefer_sse,
        era: ServedEras::Both,
    })
    .await
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    /// The JSON-RPC message in the body, JSON or SSE.
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|_| {
            sse_messages(self.body.as_bytes())
                .ok()
                .and_then(|mut m| m.pop())
                .unwrap_or(Value::Null)
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }
}

const ACCEPT_BOTH: (&str, &str) = ("accept", "application/json, text/event-stream");
const JSON_BODY: (&str, &str) = ("content-type", "application/json");

async fn send(
    server: &McpServer,
    method: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Answer> {
    let stream = TcpStream::connect(server.addr()).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let mut request = Request::builder()
        .method(method)
        .uri("/mcp")
        .header("host", server.addr().to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::from(body.to_string())))?)
        .await?;
    let status = response.status();
    let headers = response.headers().clone();
    let body = String::from_utf8(response.into_body().collect().await?.to_bytes().to_vec())?;
    Ok(Answer {
        status,
        headers,
        body,
    })
}

async fn post(server: &McpServer, headers: &[(&str, &str)], body: Value) -> anyhow::Result<Answer> {
    let mut all = vec![ACCEPT_BOTH, JSON_BODY];
    all.extend_from_slice(headers);
    send(server, "POST", &all, &body.to_string()).await
}

fn modern_params(mut params: Value) -> Value {
    params["_meta"] = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
    });
    params
}

/// Returns the session id after `initialize` + `notifications/initialized`.
async fn legacy_session(server: &McpServer, version: &str) -> anyhow::Result<String> {
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    let answer = post(server, &[], init).await?;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()["result"]["protocolVersion"], json!(version));
    let session = answer.header("mcp-session-id").map(str::to_string);
    let session = session.ok_or_else(|| anyhow::anyhow!("no session id"))?;
    assert!(session.len() >= 16 && session.bytes().all(|b| (0x21..=0x7e).contains(&b)));
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let answer = post(
        server,
        &[("mcp-session-id", &session), ("mcp-protocol-version", version)],
        initialized,
    )
    .await?;
    assert_eq!(answer.status, StatusCode::ACCEPTED);
    assert_eq!(answer.body, "");
    assert_eq!(answer.header("mcp-session-id"), Some(session.as_str()));
    Ok(session)
}

#[tokio::test]
async fn legacy_exchange_with_sessions_json_and_sse() -> anyhow::Result<()> {
    for prefer_sse in [false, true] {
        let server = server(8, prefer_sse).await?;
        let session = legacy_session(&server, "2025-11-25").await?;
        let headers = [
            ("mcp-session-id", session.as_str()),
            ("mcp-protocol-version", "2025-11-25"),
        ];
        let list = post(
            &server,
            &headers,
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        )
        .await?;
        let expected_type = if prefer_sse {
            "text/event-stream"
        } else {
            "application/json"
        };
        assert_eq!(list.header("content-type"), Some(expected_type));
        assert_eq!(list.json()["result"]["tools"].as_array().map(Vec::len), Some(10));
        assert!(
            list.json()["result"].get("resultType").is_none(),
            "legacy results carry no resultType"
        );
        let call = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "get-sum", "arguments": {"a": 2, "b": 3}}});
        let sum = post(&server, &headers, call).await?;
        assert_eq!(sum.json()["result"]["structuredContent"]["result"], json!(5));
        assert_eq!(sum.json()["id"], json!(3));
        let ping = post(
            &server,
            &headers,
            json!({"jsonrpc": "2.0", "id": 4, "method": "ping"}),
        )
        .await?;
        assert_eq!(ping.json()["result"], json!({}));

        // A client that only takes JSON gets JSON even from an SSE-preferring server.
        let json_only = [("accept", "application/json"), JSON_BODY, headers[0], headers[1]];
        let body = json!({"jsonrpc": "2.0", "id": 5, "method": "ping"}).to_string();
        let answer = send(&server, "POST", &json_only, &body).await?;
        assert_eq!(answer.header("content-type"), Some("application/json"));

        assert_eq!(
            send(&server, "DELETE", &headers, "").await?.status,
            StatusCode::OK
        );
        let after = post(
            &server,
            &headers,
            json!({"jsonrpc": "2.0", "id": 6, "method": "ping"}),
        )
        .await?;
        assert_eq!(after.status, StatusCode::NOT_FOUND);
        assert_eq!(after.json()["error"]["code"], json!(-32600));
    }
    Ok(())
}

#[tokio::test]
async fn legacy_version_negotiation_and_session_errors() -> anyhow::Result<()> {
    let server = server(0, false).await?;
    legacy_session(&server, "2025-06-18").await?;
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "1999-01-01", "capabilities": {}}});
    assert_eq!(
        post(&server, &[], init).await?.json()["result"]["protocolVersion"],
        json!("2025-11-25")
    );

    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let missing = post(&server, &[], ping.clone()).await?;
    assert_eq!(
        (missing.status, missing.json()["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!(-32600))
    );
    let unknown = post(&server, &[("mcp-session-id", "nope")], ping.clone()).await?;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(
        send(&server, "DELETE", &[("mcp-session-id", "nope")], "")
            .await?
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send(&server, "DELETE", &[], "").await?.status,
        StatusCode::BAD_REQUEST
    );
    let session = legacy_session(&server, "2025-11-25").await?;
    let wrong_version = post(
        &server,
        &[
            ("mcp-session-id", &session),
            ("mcp-protocol-version", "2025-06-18"),
        ],
        ping,
    )
    .await?;
    assert_eq!(wrong_version.status, StatusCode::BAD_REQUEST);
    Ok(())
}

#[tokio::test]
async fn legacy_get_stream_is_held_until_delete() -> anyhow::Result<()> {
    let server = server(0, false).await?;
    let session = legacy_session(&server, "2025-11-25").await?;
    let stream = TcpStream::connect(server.addr()).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = Request::get("/mcp")
        .header("host", "x")
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &session)
        .body(Full::new(Bytes::new()))?;
    let response = sender.send_request(request).await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"text/event-stream"[..])
    );
    let mut body = response.into_body();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), body.frame())
            .await
            .is_err(),
        "held open"
    );
    assert_eq!(
        send(&server, "DELETE", &[("mcp-session-id", &session)], "")
            .await?
            .status,
        StatusCode::OK
    );
    let end = tokio::time::timeout(Duration::from_secs(5), body.frame()).await?;
    assert!(end.is_none(), "stream ends with the session");
    assert_eq!(
        send(&server, "GET", &[("accept", "text/event-stream")], "")
            .await?
            .status,
        StatusCode::BAD_REQUEST
    );
    Ok(())
}

#[tokio::test]
async fn modern_stateless_exchange() -> anyhow::Result<()> {
    let server = server(100, false).await?;
    let v = ("mcp-protocol-version", "2026-07-28");
    let discover =
        json!({"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": modern_params(json!({}))});
    let answer = post(&server, &[v, ("mcp-method", "server/discover")], discover).await?;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.header("mcp-session-id").is_none(),
        "modern answers never carry a session"
    );
    let result = &answer.json()["result"];
    assert_eq!(result["supportedVersions"], json!(["2026-07-28"]));
    assert_eq!(result["resultType"], json!("complete"));
    assert!(result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"].is_string());

    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": modern_params(json!({}))});
    let answer = post(&server, &[v, ("mcp-method", "tools/list")], list).await?;
    let result = &answer.json()["result"];
    assert_eq!(result["tools"].as_array().map(Vec::len), Some(102));
    assert!(result["ttlMs"].is_u64() && result["cacheScope"].is_string());

    let call = json!({"jsonrpc": "2.0", "id": "c", "method": "tools/call",
        "params": modern_params(json!({"name": "echo", "arguments": {"message": "hi"}}))});
    let answer = post(
        &server,
        &[
            v,
            ("mcp-method", "tools/call"),
            ("mcp-name", "echo"),
            ("mcp-session-id", "ignored"),
        ],
        call.clone(),
    )
    .await?;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()["result"]["content"][0]["text"], json!("hi"));
    assert_eq!(answer.json()["id"], json!("c"));
    assert!(answer.header("mcp-session-id").is_none());

    // SSE when that is all the client takes.
    let sse_only = [
        ("accept", "text/event-stream"),
        JSON_BODY,
        v,
        ("mcp-method", "tools/call"),
        ("mcp-name", "echo"),
    ];
    let answer = send(&server, "POST", &sse_only, &call.to_string()).await?;
    assert_eq!(answer.header("content-type"), Some("text/event-stream"));
    assert_eq!(answer.header("x-accel-buffering"), Some("no"));
    assert_eq!(answer.json()["result"]["content"][0]["text"], json!("hi"));

    let notification =
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": modern_params(json!({}))});
    assert_eq!(
        post(
            &server,
            &[v, ("mcp-method", "notifications/cancelled")],
            notification
        )
        .await?
        .status,
        StatusCode::ACCEPTED
    );
    assert_eq!(
        send(&server, "GET", &[v, ("accept", "text/event-stream")], "")
            .await?
            .status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(
        send(&server, "DELETE", &[v], "").await?.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    Ok(())
}

#[tokio::test]
async fn modern_errors_per_spec() -> anyhow::Result<()> {
    let server = server(0, false).await?;
    let v = ("mcp-protocol-version", "2026-07-28");
    let call = |name: &str| json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": modern_params(json!({"name": name, "arguments": {"message": "x"}}))});
    let code = |answer: &Answer| (answer.status, answer.json()["error"]["code"].as_i64());

    let mismatch = post(
        &server,
        &[v, ("mcp-method", "tools/call"), ("mcp-name", "get-sum")],
        call("echo"),
    )
    .await?;
    assert_eq!(code(&mismatch), (StatusCode::BAD_REQUEST, Some(-32020)));
    let no_method_header = post(&server, &[v, ("mcp-name", "echo")], call("echo")).await?;
    assert_eq!(code(&no_method_header), (StatusCode::BAD_REQUEST, Some(-32020)));
    let no_version_header = post(
        &server,
        &[("mcp-method", "tools/call"), ("mcp-name", "echo")],
        call("echo"),
    )
    .await?;
    assert_eq!(code(&no_version_header), (StatusCode::BAD_REQUEST, Some(-32020)));

    let future = post(&server, &[("mcp-protocol-version", "2099-01-01")], call("echo")).await?;
    assert_eq!(code(&future), (StatusCode::BAD_REQUEST, Some(-32022)));
    assert_eq!(
        future.json()["error"]["data"],
        json!({"supported": ["2026-07-28"], "requested": "2099-01-01"})
    );

    let no_meta = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}});
    assert_eq!(
        code(&post(&server, &[v, ("mcp-method", "tools/list")], no_meta).await?),
        (StatusCode::BAD_REQUEST, Some(-32602))
    );

    let unknown_method =
        json!({"jsonrpc": "2.0", "id": 1, "method": "foo/bar", "params": modern_params(json!({}))});
    let answer = post(&server, &[v, ("mcp-method", "foo/bar")], unknown_method).await?;
    assert_eq!(code(&answer), (StatusCode::NOT_FOUND, Some(-32601)));
    // `ping` went away with the handshake.
    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": modern_params(json!({}))});
    assert_eq!(
        code(&post(&server, &[v, ("mcp-method", "ping")], ping).await?),
        (StatusCode::NOT_FOUND, Some(-32601))
    );

    let unknown_tool = post(
        &server,
        &[v, ("mcp-method", "tools/call"), ("mcp-name", "nope")],
        call("nope"),
    )
    .await?;
    assert_eq!(code(&unknown_tool), (StatusCode::OK, Some(-32602)));
    let bad_args = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": modern_params(json!({"name": "get-sum", "arguments": {"a": "x", "b": 1}}))});
    let answer = post(
        &server,
        &[v, ("mcp-method", "tools/call"), ("mcp-name", "get-sum")],
        bad_args,
    )
    .await?;
    assert_eq!(code(&answer), (StatusCode::OK, Some(-32602)));
    Ok(())
}

#[tokio::test]
async fn malformed_input_gets_json_rpc_errors_and_the_server_keeps_serving() -> anyhow::Result<()> {
    let server = server(0, false).await?;
    let code = |answer: &Answer| (answer.status, answer.json()["error"]["code"].as_i64());
    let both = [ACCEPT_BOTH, JSON_BODY];
    for (body, expected) in [
        ("{not json", -32700),
        ("", -32700),
        ("[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}]", -32600),
        ("{\"jsonrpc\":\"1.0\",\"id\":1,\"method\":\"ping\"}", -32600),
        ("{\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"ping\"}", -32600),
        ("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}", -32600),
        ("42", -32600),
    ] {
        let answer = send(&server, "POST", &both, body).await?;
        assert_eq!(code(&answer), (StatusCode::BAD_REQUEST, Some(expected)), "{body}");
    }
    let parse = send(&server, "POST", &both, "{").await?;
    assert_eq!(parse.json()["id"], Value::Null);

    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}).to_string();
    let text = send(
        &server,
        "POST",
        &[ACCEPT_BOTH, ("content-type", "text/plain")],
        &ping,
    )
    .await?;
    assert_eq!(text.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let html = send(&server, "POST", &[("accept", "text/html"), JSON_BODY], &ping).await?;
    assert_eq!(html.status, StatusCode::NOT_ACCEPTABLE);
    let evil = send(
        &server,
        "POST",
        &[ACCEPT_BOTH, JSON_BODY, ("origin", "http://evil.example")],
        &ping,
    )
    .await?;
    assert_eq!(evil.status, StatusCode::FORBIDDEN);
    assert_eq!(
        send(&server, "PUT", &[], "").await?.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    let huge = "x".repeat(5 << 20);
    assert_eq!(
        send(&server, "POST", &both, &huge).await?.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    let binary = String::from_utf8_lossy(&[0xff, 0xfe, 0x00, 0x7b]).into_owned();
    assert_eq!(
        send(&server, "POST", &both, &binary).await?.status,
        StatusCode::BAD_REQUEST
    );

    // Still serving.
    legacy_session(&server, "2025-11-25").await?;
    Ok(())
}

#[tokio::test]
async fn processing_delay_applies_to_tool_calls() -> anyhow::Result<()> {
    let server = start(McpServerConfig {
        listen: "127.0.0.1:0".parse()?,
        tools: 0,
        delay: Duration::from_millis(50),
        prefer_sse: true,
        era: ServedEras::Both,
    })
    .await?;
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": modern_params(json!({"name": "echo", "arguments": {"message": "x"}}))});
    let started = std::time::Instant::now();
    let headers = [
        ("mcp-protocol-version", "2026-07-28"),
        ("mcp-method", "tools/call"),
        ("mcp-name", "echo"),
    ];
    let answer = post(&server, &headers, call).await?;
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(answer.json()["result"]["content"][0]["text"], json!("x"));
    Ok(())
}

mod rmcp_client {
    use rmcp::model::{CallToolRequestParams, ClientConfig, ProtocolVersion};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::{ClientLifecycleMode, ClientServiceExt};

    use super::*;

    async fn exercise(
        server: &McpServer,
        lifecycle: ClientLifecycleMode,
        tools: usize,
        era: ProtocolVersion,
    ) -> anyhow::Result<()> {
        let transport = StreamableHttpClientTransport::from_uri(server.url());
        let client = ClientConfig::default()
            .serve_with_lifecycle(transport, lifecycle)
            .await?;
        assert_eq!(
            client.peer_info().map(|info| info.protocol_version.clone()),
            Some(era)
        );
        let listed = client.list_all_tools().await?;
        assert_eq!(listed.len(), tools + 2);
        let arguments = json!({"a": 2, "b": 3}).as_object().cloned().unwrap_or_default();
        let sum = client
            .call_tool(CallToolRequestParams::new("get-sum").with_arguments(arguments))
            .await?;
        assert_eq!(sum.structured_content, Some(json!({"result": 5})));
        let arguments = json!({"message": "hello"})
            .as_object()
            .cloned()
            .unwrap_or_default();
        let echo = client
            .call_tool(CallToolRequestParams::new("echo").with_arguments(arguments))
            .await?;
        assert_eq!(
            serde_json::to_value(&echo.content)?,
            json!([{"type": "text", "text": "hello"}])
        );
        assert_ne!(echo.is_error, Some(true));
        let unknown = client.call_tool(CallToolRequestParams::new("nope")).await;
        assert!(unknown.is_err(), "unknown tool is a JSON-RPC error");
        client.cancel().await?;
        Ok(())
    }

    #[tokio::test]
    async fn rmcp_legacy_client_json_and_sse() -> anyhow::Result<()> {
        for prefer_sse in [false, true] {
            let server = server(8, prefer_sse).await?;
            exercise(
                &server,
                ClientLifecycleMode::Initialize,
                8,
                ProtocolVersion::V_2025_11_25,
            )
            .await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn rmcp_modern_client() -> anyhow::Result<()> {
        let server = server(500, false).await?;
        let modern = ClientLifecycleMode::Discover {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        };
        exercise(&server, modern, 500, ProtocolVersion::V_2026_07_28).await
    }

    #[tokio::test]
    async fn rmcp_auto_client_picks_modern() -> anyhow::Result<()> {
        let server = server(8, true).await?;
        let auto = ClientLifecycleMode::Auto {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            legacy_version: None,
        };
        exercise(&server, auto, 8, ProtocolVersion::V_2026_07_28).await
    }
}
