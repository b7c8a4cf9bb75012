//! Sessions' streams and ends: list changes and resource updates on a session's stream, a
//! 2026-07-28 client's subscription to a server that predates that revision, and the
//! sessions of a client that left.

use rmcp::model::{CallToolRequestParams, SubscribeRequestParams};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientLifecycleMode, ClientServiceExt};
use serde_json::json;

use crate::mcp_config;
use crate::peers::*;
use crate::support::*;
use crate::wire::*;

#[test]
fn a_server_s_list_changes_and_resource_updates_reach_the_client_on_the_session_stream() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    // JSON answers only: a notification of math's can reach the client on no request's
    // answer, only on the session's own stream (GET).
    let math = runtime.block_on(serve("math", true));
    let web = runtime.block_on(serve("web", true));
    let port = free_port();
    let _gateway = start_gateway(dir.path(), &mcp_config(port, &[("math", math), ("web", web)], ""));

    runtime.block_on(async {
        let (changes, mut changed) = tokio::sync::mpsc::unbounded_channel();
        let transport = StreamableHttpClientTransport::from_uri(format!("http://127.0.0.1:{port}/mcp"));
        let client = ChangeListener { changes }
            .serve_with_lifecycle(transport, ClientLifecycleMode::Initialize)
            .await
            .expect("the client initializes through the gateway");
        let offered = client
            .peer_info()
            .and_then(|info| info.capabilities.tools.clone())
            .and_then(|tools| tools.list_changed);
        assert_eq!(offered, Some(true), "the servers' listChanged is offered");
        let subscribable = client
            .peer_info()
            .and_then(|info| info.capabilities.resources.clone())
            .and_then(|resources| resources.subscribe);
        assert_eq!(subscribable, Some(true), "resource subscriptions are offered");
        #[allow(deprecated)] // the session-based way, which this client speaks
        client
            .subscribe(SubscribeRequestParams::new("math+mem://note"))
            .await
            .expect("a subscription to math's resource, by the URI the client knows");
        // math says its tools changed (and its resource was updated), web its prompts: each
        // is heard as its own.
        for (server, list) in [
            ("math", "tools"),
            ("math", "updated math+mem://note"),
            ("web", "prompts"),
        ] {
            // The client opens its stream in the background: ask again until it is there.
            let mut heard = false;
            for _ in 0..20 {
                let told = client
                    .call_tool(CallToolRequestParams::new(format!("{server}__change")))
                    .await
                    .expect("the change tool answers");
                assert_eq!(text_of(&told), "told");
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
                while let Ok(Some(changed)) = tokio::time::timeout_at(deadline, changed.recv()).await {
                    heard |= changed == list;
                }
                if heard {
                    break;
                }
            }
            assert!(heard, "{server}'s {list} list change reached the client");
        }
        client.cancel().await.unwrap();
    });

    // On the wire: the stream needs a session, one of ours, and an Accept for events.
    let wire = Wire::initialize(port);
    let get = |headers: &[(&str, &str)]| http_request_with(port, "GET", "/mcp", headers, None).unwrap();
    let no_session = get(&[("Accept", "text/event-stream")]);
    assert_eq!(no_session.status, 400, "{}", no_session.body);
    let forged = get(&[("Accept", "text/event-stream"), ("Mcp-Session-Id", "forged")]);
    assert_eq!(forged.status, 404, "{}", forged.body);
    let json_only = get(&[("Accept", "application/json"), ("Mcp-Session-Id", &wire.session)]);
    assert_eq!(json_only.status, 406, "{}", json_only.body);
}

/// A 2026-07-28 client's call to a server that predates that revision runs in a session the
/// gateway opens for it. A client that leaves while the server is still answering
/// `initialize` leaves no session behind: the opening runs to its end in the background, and
/// the session nobody wants is closed.
#[test]
fn a_session_opened_for_a_bridged_call_whose_client_left_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let (_server, old) = era_server(dir.path(), "legacy");
    let slow = runtime.block_on(slow_answers(old, std::time::Duration::from_millis(500)));
    let port = free_port();
    // Each exchange through the relay takes a second or so: a timeout with room to spare.
    let config = mcp_config(port, &[("old", slow)], "").replace("timeout: 3s", "timeout: 20s");
    assert!(config.contains("timeout: 20s"), "{config}");
    let _gateway = start_gateway(dir.path(), &config);
    let open_sessions =
        || http_get(old.port(), "/sessions").and_then(|response| response.body.trim().parse::<usize>().ok());
    assert_eq!(open_sessions(), Some(0));

    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "hi"}, "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}}});
    let headers = [
        ACCEPT_BOTH,
        ("MCP-Protocol-Version", "2026-07-28"),
        ("Mcp-Method", "tools/call"),
        ("Mcp-Name", "echo"),
    ];
    let client = Streaming::post(port, &headers, &call.to_string());
    wait_for("the server's session for the call", TIMEOUT, || {
        open_sessions() == Some(1)
    });
    drop(client);
    wait_for("the session of the client that left closed", TIMEOUT, || {
        open_sessions() == Some(0)
    });
}

/// A 2026-07-28 client listens to a server that predates that revision: the gateway opens a
/// session for the subscription, subscribes to the resource in it, and passes on what comes
/// on the session's stream, tagged as the subscription's.
#[test]
fn a_2026_client_listens_to_a_session_based_server_through_a_session_opened_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let (math, math_sessions) = runtime.block_on(serve_eras("math", true, true));
    let web = runtime.block_on(serve("web", true));
    let port = free_port();
    let _gateway = start_gateway(dir.path(), &mcp_config(port, &[("math", math), ("web", web)], ""));
    let meta = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}});
    let listen = json!({"jsonrpc": "2.0", "id": "sub-1", "method": "subscriptions/listen", "params": {
        "notifications": {"toolsListChanged": true, "resourceSubscriptions": ["math+mem://note"]},
        "_meta": meta,
    }});
    let modern = |method| {
        [
            ACCEPT_BOTH,
            ("MCP-Protocol-Version", "2026-07-28"),
            ("Mcp-Method", method),
        ]
    };
    let mut stream = Streaming::post(port, &modern("subscriptions/listen"), &listen.to_string());
    let acknowledged = events(stream.until("notifications/subscriptions/acknowledged"))
        .into_iter()
        .find(|message| message["method"] == "notifications/subscriptions/acknowledged")
        .unwrap();
    assert_eq!(
        acknowledged["params"]["notifications"],
        json!({"toolsListChanged": true, "resourceSubscriptions": ["math+mem://note"]}),
        "math honors the resource in its session's terms (and web, an rmcp server of either \
         revision, tool list changes at most): {acknowledged}"
    );

    // A call in a session of its own (bridged): math tells every session of the change.
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "math__change", "arguments": {}, "_meta": meta}});
    let mut headers = modern("tools/call").to_vec();
    headers.push(("Mcp-Name", "math__change"));
    let told = http_request_with(port, "POST", "/mcp", &headers, Some(&call.to_string())).unwrap();
    assert_eq!(
        json_or_last_event(&told.body)["result"]["content"][0]["text"],
        "told",
        "{}",
        told.body
    );

    stream.until("notifications/tools/list_changed");
    let heard = events(stream.until("notifications/resources/updated"));
    for method in [
        "notifications/tools/list_changed",
        "notifications/resources/updated",
    ] {
        let message = heard.iter().find(|message| message["method"] == method).unwrap();
        assert_eq!(
            message["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"], "sub-1",
            "{message}"
        );
    }
    let updated = heard
        .iter()
        .find(|message| message["method"] == "notifications/resources/updated")
        .unwrap();
    assert_eq!(updated["params"]["uri"], "math+mem://note", "{updated}");

    // The call's session has ended; the subscription's ends with it.
    wait_for("only the subscription's session at math", TIMEOUT, || {
        math_sessions.open() == 1
    });
    drop(stream);
    wait_for("the subscription's session ended", TIMEOUT, || {
        math_sessions.open() == 0
    });
}

#[test]
fn sessions_opened_for_a_client_that_left_mid_initialize_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let silent = runtime.block_on(silent_server());
    let (_server, fast) = era_server(dir.path(), "legacy");
    let port = free_port();
    // The silent server holds initialize up for 30 s; the client leaves long before.
    let config = mcp_config(port, &[("fast", fast), ("slow", silent)], "").replace(
        &format!("name: slow, url: 'http://{silent}/mcp', timeout: 3s"),
        &format!("name: slow, url: 'http://{silent}/mcp', timeout: 30s"),
    );
    assert!(config.contains("timeout: 30s"), "{config}");
    let _gateway = start_gateway(dir.path(), &config);
    let open_sessions =
        || http_get(fast.port(), "/sessions").and_then(|response| response.body.trim().parse::<usize>().ok());
    assert_eq!(open_sessions(), Some(0));

    let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "leaver", "version": "0"}}})
    .to_string();
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::io::Write::write_all(
        &mut client,
        format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    wait_for("the fast server's session", TIMEOUT, || {
        open_sessions() == Some(1)
    });
    drop(client);
    wait_for("the session of the client that left closed", TIMEOUT, || {
        open_sessions() == Some(0)
    });
}
