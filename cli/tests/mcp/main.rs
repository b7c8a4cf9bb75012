//! The MCP gateway end to end: the real binary's control plane and proxy in front of MCP
//! servers built with the official Rust SDK (`rmcp`, from the crate registry), called by
//! `rmcp`'s client and, for exact wire checks, by raw HTTP. Covers two servers multiplexed
//! behind one route, a server-initiated request (sampling) through the multiplexed route,
//! SSE answers, CEL authorization at list and call time, sessions resumed on a second proxy
//! replica, bad input, and servers behind `https://`.

#![allow(deprecated)] // rmcp marks sampling deprecated (SEP-2577); legacy clients still use it.

mod peers;
mod streams;
#[path = "../support/mod.rs"]
mod support;
mod tls;
mod wire;

use std::net::SocketAddr;

use peers::*;
use rmcp::model::{CallToolRequestParams, ProtocolVersion};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientLifecycleMode, ClientServiceExt};
use serde_json::{json, Value};
use support::*;
use wire::*;

const HEADER: &str = "apiVersion: portcullis.dev/v1alpha1";

fn mcp_config(port: u16, servers: &[(&str, SocketAddr)], extra: &str) -> String {
    let servers: Vec<String> = servers
        .iter()
        .map(|(name, address)| format!("  - {{name: {name}, url: 'http://{address}/mcp', timeout: 3s}}"))
        .collect();
    format!(
        "{HEADER}\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         {HEADER}\nkind: McpBackend\nmetadata: {{name: tools}}\nspec:\n  servers:\n{}\n{extra}---\n\
         {HEADER}\nkind: Route\nmetadata: {{name: mcp}}\nspec: {{listeners: [gw], backends: [{{kind: McpBackend, name: tools}}]}}\n",
        servers.join("\n")
    )
}

#[test]
fn two_servers_behind_one_route_with_the_rmcp_client() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    // One answers in JSON, the other in SSE: the gateway relays both.
    let math = runtime.block_on(serve("math", true));
    let web = runtime.block_on(serve("web", false));
    let port = free_port();
    let _gateway = start_gateway(dir.path(), &mcp_config(port, &[("math", math), ("web", web)], ""));

    runtime.block_on(async {
        let client = rmcp_client(port).await;
        let names = tool_names(&client).await;
        assert_eq!(
            names,
            [
                "math__ask",
                "math__change",
                "math__echo",
                "math__get-sum",
                "math__traceparent",
                "web__ask",
                "web__change",
                "web__echo",
                "web__get-sum",
                "web__traceparent"
            ]
        );

        let sum = client
            .call_tool(
                CallToolRequestParams::new("math__get-sum")
                    .with_arguments(arguments(json!({"a": 2, "b": 3}))),
            )
            .await
            .unwrap();
        assert_eq!(text_of(&sum), "5");
        for server in ["math", "web"] {
            let echo = client
                .call_tool(
                    CallToolRequestParams::new(format!("{server}__echo"))
                        .with_arguments(arguments(json!({"text": "hi"}))),
                )
                .await
                .unwrap();
            assert_eq!(
                text_of(&echo),
                format!("{server}: hi"),
                "the call reached {server}"
            );
        }

        // Sampling: the server asks the client mid-call; over the multiplexed route the
        // request's id names its server and the client's answer goes back to it.
        for server in ["math", "web"] {
            let asked = client
                .call_tool(
                    CallToolRequestParams::new(format!("{server}__ask"))
                        .with_arguments(arguments(json!({"text": "2+2"}))),
                )
                .await
                .unwrap();
            assert_eq!(text_of(&asked), format!("{server} heard: model says 2+2"));
        }

        let unknown = client
            .call_tool(CallToolRequestParams::new("mail__send"))
            .await
            .expect_err("a tool of no server is an error");
        assert!(
            unknown.to_string().contains("Unknown tool: mail__send"),
            "{unknown}"
        );
        client.cancel().await.unwrap();
    });
}

fn authorization(rules: &str) -> String {
    format!("---\n{HEADER}\nkind: McpAuthorization\nmetadata: {{name: sums}}\nspec:\n  targetRefs: [{{kind: McpBackend, name: tools, sectionName: math}}]\n{rules}")
}

#[test]
fn authorization_lists_what_may_be_called_and_decides_calls_on_their_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", false));
    let web = runtime.block_on(serve("web", true));
    let port = free_port();
    let rule = "  allow: ['mcp.tool.name == \"get-sum\" && mcp.tool.arguments.a == 1']\n";
    let gateway = start_gateway(
        dir.path(),
        &mcp_config(port, &[("math", math), ("web", web)], &authorization(rule)),
    );
    let wire = Wire::initialize(port);
    // get-sum's rule needs arguments: listed. echo and ask can never pass: hidden. The
    // policy is on server math only: web's tools are untouched.
    assert_eq!(
        wire.tools(),
        [
            "math__get-sum",
            "web__ask",
            "web__change",
            "web__echo",
            "web__get-sum",
            "web__traceparent"
        ]
    );

    let (status, allowed) = wire.call("math__get-sum", json!({"a": 1, "b": 2}));
    assert_eq!(
        (status, allowed["result"]["content"][0]["text"].clone()),
        (200, json!("3")),
        "{allowed}"
    );
    let (status, denied) = wire.call("math__get-sum", json!({"a": 2, "b": 2}));
    assert_eq!(status, 200);
    assert_eq!(denied["id"], 7);
    assert_eq!(denied["error"]["code"], -32010, "{denied}");
    assert_eq!(
        denied["error"]["message"],
        "McpAuthorization/sums: tools/call of math__get-sum is not allowed: no allow rule holds"
    );
    let (_, echo) = wire.call("math__echo", json!({"text": "x"}));
    assert_eq!(
        echo["error"]["code"], -32010,
        "not listed, and not callable: {echo}"
    );
    let (_, web_echo) = wire.call("web__echo", json!({"text": "x"}));
    assert_eq!(web_echo["result"]["content"][0]["text"], "web: x");

    // An incoming trace continues into the request's `_meta`: same trace, the proxy's span.
    let incoming = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
    let body = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "web__traceparent", "arguments": {}}});
    let headers = [
        ACCEPT_BOTH,
        ("Mcp-Session-Id", wire.session.as_str()),
        ("traceparent", incoming),
    ];
    let response = http_request_with(port, "POST", "/mcp", &headers, Some(&body.to_string())).unwrap();
    let seen = json_or_last_event(&response.body)["result"]["content"][0]["text"].clone();
    let seen = seen.as_str().unwrap_or_default();
    assert!(
        seen.starts_with("00-0af7651916cd43dd8448eb211c80319c-") && seen.len() == incoming.len(),
        "{seen}"
    );
    assert!(!seen.contains("00f067aa0ba902b7"), "a new span id: {seen}");

    // The same rule written to decide at list time on the absence of arguments.
    let rule = "  allow: ['!has(mcp.tool.arguments) || mcp.tool.arguments.a == 1']\n";
    gateway.apply(
        dir.path(),
        &mcp_config(port, &[("math", math), ("web", web)], &authorization(rule)),
    );
    let wire = Wire::initialize(port);
    assert_eq!(
        wire.tools().len(),
        10,
        "every tool may be called with the right arguments"
    );
    assert_eq!(
        wire.call("math__get-sum", json!({"a": 1, "b": 5})).1["result"]["content"][0]["text"],
        "6"
    );
    assert_eq!(
        wire.call("math__get-sum", json!({"a": 3, "b": 5})).1["error"]["code"],
        -32010
    );
    assert_eq!(
        wire.call("math__echo", json!({"text": "no a"})).1["error"]["code"],
        -32010,
        "a missing argument does not hold"
    );

    // Decisions and MCP outcomes reach the metrics.
    let mcp_requests = |labels: &[&str]| metric(gateway.admin, "portcullis_proxy_mcp_requests_total", labels);
    wait_for("decisions in the metrics", TIMEOUT, || {
        metric(
            gateway.admin,
            "portcullis_proxy_policy_decisions_total",
            &["deny"],
        ) >= 3.0
            && mcp_requests(&[
                "mcp_method_name=\"tools/call\"",
                "server=\"math\"",
                "outcome=\"-32010\"",
            ]) >= 3.0
            && mcp_requests(&["mcp_method_name=\"tools/list\"", "outcome=\"ok\""]) >= 2.0
    });

    // A rule that reads arguments judges each suggestion of a completion as a use with it:
    // suggestions could reveal what the rule guards.
    let rule = "  deny: ['mcp.prompt.name == \"salaries\" && mcp.prompt.arguments.emp != mcp.prompt.arguments.me']\n";
    gateway.apply(
        dir.path(),
        &mcp_config(port, &[("math", math), ("web", web)], &authorization(rule)),
    );
    let wire = Wire::initialize(port);
    let complete = |context: Value| {
        wire.post(
            &json!({"jsonrpc": "2.0", "id": 11, "method": "completion/complete", "params": {
            "ref": {"type": "ref/prompt", "name": "math__salaries"},
            "argument": {"name": "emp", "value": "e"},
            "context": {"arguments": context}}}),
        )
    };
    let (status, narrowed) = complete(json!({"me": "e7"}));
    assert_eq!(status, 200);
    assert_eq!(narrowed["id"], 11, "{narrowed}");
    assert_eq!(
        narrowed["result"]["completion"],
        json!({"values": ["e7"], "total": 1, "hasMore": false}),
        "{narrowed}"
    );
    // Without the argument the rule compares with, it fails, and a failing deny rule holds.
    let (_, none) = complete(json!({}));
    assert_eq!(none["result"]["completion"]["values"], json!([]), "{none}");
    // Another server's completions are not this policy's business.
    let web_body = json!({"jsonrpc": "2.0", "id": 12, "method": "completion/complete", "params": {
        "ref": {"type": "ref/prompt", "name": "web__salaries"},
        "argument": {"name": "emp", "value": "e"}}});
    let (_, untouched) = wire.post(&web_body);
    assert_eq!(
        untouched["result"]["completion"]["values"],
        json!(["e7", "e70", "x1"]),
        "{untouched}"
    );
    // A rule written to decide at list time (it allows the prompt) still judges each
    // suggestion as the use it would be.
    let rule = "  allow: ['!has(mcp.prompt.arguments) || mcp.prompt.arguments.emp == \"e70\"']\n";
    gateway.apply(
        dir.path(),
        &mcp_config(port, &[("math", math), ("web", web)], &authorization(rule)),
    );
    let wire = Wire::initialize(port);
    let (_, narrowed) = wire.post(&json!({"jsonrpc": "2.0", "id": 13, "method": "completion/complete",
        "params": {"ref": {"type": "ref/prompt", "name": "math__salaries"}, "argument": {"name": "emp", "value": ""}}}));
    assert_eq!(
        narrowed["result"]["completion"]["values"],
        json!(["e70"]),
        "{narrowed}"
    );
}

#[test]
fn a_guardrail_on_prompt_arguments_also_checks_what_a_completion_sends() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let port = free_port();
    // Default methods: every one it can check, completion/complete among them.
    let guardrail = format!(
        "---\n{HEADER}\nkind: Guardrail\nmetadata: {{name: secrets}}\nspec:\n  targetRefs: [{{kind: McpBackend, name: tools}}]\n  phases: [McpRequest]\n  builtin: {{deny: [{{pattern: 'secret-[0-9]+', reason: no secrets}}]}}\n"
    );
    let _gateway = start_gateway(dir.path(), &mcp_config(port, &[("math", math)], &guardrail));
    let wire = Wire::initialize(port);
    let complete = |value: &str, context: Value| {
        wire.post(
            &json!({"jsonrpc": "2.0", "id": 21, "method": "completion/complete", "params": {
            "ref": {"type": "ref/prompt", "name": "salaries"},
            "argument": {"name": "emp", "value": value},
            "context": {"arguments": context}}}),
        )
    };
    let (status, passed) = complete("e", json!({"me": "e7"}));
    assert_eq!(status, 200);
    assert_eq!(
        passed["result"]["completion"]["values"],
        json!(["e7", "e70", "x1"]),
        "{passed}"
    );
    // What the client typed, or chose before, would reach the server as a prompts/get's
    // arguments would: the guard sees both.
    // The server receives context.arguments as sent, also when it names the argument
    // being completed: that value is checked too.
    for (value, context) in [
        ("secret-1", json!({})),
        ("e", json!({"me": "secret-2"})),
        ("e", json!({"emp": "secret-3"})),
    ] {
        let (status, denied) = complete(value, context);
        assert_eq!(status, 200);
        assert_eq!(denied["id"], 21, "{denied}");
        assert_eq!(denied["error"]["code"], -32012, "{denied}");
        assert_eq!(denied["error"]["data"]["reason"], "no secrets", "{denied}");
    }
    // A guarded completion must say what was typed, and hold what was chosen in an object.
    let (_, unreadable) = wire.post(
        &json!({"jsonrpc": "2.0", "id": 22, "method": "completion/complete",
        "params": {"ref": {"type": "ref/prompt", "name": "salaries"}, "argument": {"name": "emp"}}}),
    );
    assert_eq!(unreadable["error"]["code"], -32602, "{unreadable}");
    let (_, unreadable) = complete("e", json!("secret-4"));
    assert_eq!(unreadable["error"]["code"], -32602, "{unreadable}");
    let (_, none_chosen) = complete("e", Value::Null);
    assert_eq!(
        none_chosen["result"]["completion"]["values"],
        json!(["e7", "e70", "x1"]),
        "{none_chosen}"
    );
}

#[test]
fn rules_that_cannot_work_are_refused_at_apply_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let port = free_port();
    let gateway = start_gateway(
        dir.path(),
        &mcp_config(port, &[("math", math), ("web", math)], ""),
    );
    let cases = [
        (
            "mcp.tool.name == \"math__get-sum\"",
            "prefixed name \"math__get-sum\"",
        ),
        ("tool.name == \"echo\"", "unknown variable `tool`"),
        ("mcp.tool.nam == \"echo\"", "unknown field `mcp.tool.nam`"),
        ("mcp.server == \"mail\"", "not a server it applies to"),
        ("mcp.tool.name > 3", "cannot be evaluated"),
    ];
    for (rule, reason) in cases {
        let rules = format!("  allow: ['{}']\n", rule.replace('\'', "''"));
        let error = refused_apply(
            dir.path(),
            "bad.yaml",
            &mcp_config(port, &[("math", math), ("web", math)], &authorization(&rules)),
            &gateway.address,
        );
        assert!(
            error.contains("spec.allow[0]") && error.contains(reason),
            "{rule}: {error}"
        );
    }
    let unknown_section = mcp_config(
        port,
        &[("math", math)],
        &authorization("  allow: ['true']\n").replace("sectionName: math", "sectionName: mail"),
    );
    let error = refused_apply(dir.path(), "bad.yaml", &unknown_section, &gateway.address);
    assert!(
        error.contains("McpBackend/tools has no server \"mail\""),
        "{error}"
    );
}

#[test]
fn a_session_opened_on_one_replica_continues_on_another() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", false));
    let key = write_file(dir.path(), "session.key", &"5a".repeat(32));
    let (port_a, port_b) = (free_port(), free_port());
    // Two replicas, each serving its own listener of the same McpBackend.
    let keys = format!("  sessionKeys: [{{file: {}}}]\n", key.display());
    let replica_b = format!(
        "---\n{HEADER}\nkind: Listener\nmetadata: {{name: gw-b, labels: {{replica: b}}}}\nspec: {{address: 127.0.0.1, port: {port_b}}}\n---\n\
         {HEADER}\nkind: Route\nmetadata: {{name: mcp-b}}\nspec: {{listeners: [gw-b], backends: [{{kind: McpBackend, name: tools}}]}}\n"
    );
    let config = mcp_config(port_a, &[("math", math)], &keys)
        .replace("name: gw}", "name: gw, labels: {replica: a}}")
        + &replica_b;
    let cp_port = free_port();
    let controlplane = format!("127.0.0.1:{cp_port}");
    let _controlplane = start_controlplane(dir.path(), cp_port);
    let (admin_a, admin_b) = (free_port(), free_port());
    let _proxy_a = start_proxy(dir.path(), "a", &controlplane, admin_a, &["--shard", "replica=a"]);
    let _proxy_b = start_proxy(dir.path(), "b", &controlplane, admin_b, &["--shard", "replica=b"]);
    apply(dir.path(), "replicas.yaml", &config, &controlplane);
    let version = config_version(&controlplane);
    for replica in ["a", "b"] {
        wait_for("both replicas on the config", TIMEOUT, || {
            proxy_applied(&controlplane, replica) == Some((version, true))
        });
    }

    let on_a = Wire::initialize(port_a);
    let on_b = Wire {
        port: port_b,
        session: on_a.session.clone(),
        authorization: None,
    };
    let (status, sum) = on_b.call("get-sum", json!({"a": 20, "b": 22}));
    assert_eq!(
        (status, sum["result"]["content"][0]["text"].clone()),
        (200, json!("42")),
        "{sum}"
    );

    // A forged or foreign id is no session: 404 tells the client to initialize again.
    let forged = Wire {
        port: port_b,
        session: format!("{}x", on_a.session),
        authorization: None,
    };
    let (status, answer) = forged.call("get-sum", json!({"a": 1, "b": 1}));
    assert_eq!((status, answer["error"]["code"].clone()), (404, json!(-32600)));

    // A session answers only to the caller that opened it: an id that leaks is no use with
    // other credentials, or none, on any replica.
    let alice = Wire::initialize_as(port_a, Some("Bearer alice"));
    let (status, sum) = alice.call("get-sum", json!({"a": 1, "b": 2}));
    assert_eq!(
        (status, sum["result"]["content"][0]["text"].clone()),
        (200, json!("3")),
        "{sum}"
    );
    for (port, authorization) in [
        (port_a, Some("Bearer mallory")),
        (port_b, Some("Bearer mallory")),
        (port_b, None),
    ] {
        let stolen = Wire {
            port,
            session: alice.session.clone(),
            authorization: authorization.map(str::to_string),
        };
        let (status, answer) = stolen.call("get-sum", json!({"a": 1, "b": 2}));
        assert_eq!(
            (status, answer["error"]["code"].clone()),
            (404, json!(-32600)),
            "{answer}"
        );
    }
    let on_b_as_alice = Wire {
        port: port_b,
        session: alice.session.clone(),
        authorization: Some("Bearer alice".into()),
    };
    assert_eq!(on_b_as_alice.call("get-sum", json!({"a": 2, "b": 2})).0, 200);
}

#[test]
fn bad_input_gets_the_protocol_error_and_reaches_no_server() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    // A server that accepts connections and never answers, and one that answers garbage.
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let garbage = runtime.block_on(garbage_server());
    let port = free_port();
    let config = mcp_config(port, &[("math", math)], "").replace(
        "kind: Route\nmetadata: {name: mcp}\nspec: {listeners: [gw],",
        "kind: Route\nmetadata: {name: mcp}\nspec: {limits: {maxRequestBodyBytes: 4096}, listeners: [gw],",
    );
    let _gateway = start_gateway(dir.path(), &config);
    let wire = Wire::initialize(port);
    let session = ("Mcp-Session-Id", wire.session.as_str());

    let cases: [Case; 11] = [
        (&[ACCEPT_BOTH, session], "{not json", 400, -32700),
        // An answer to a question no call of this proxy asked.
        (
            &[ACCEPT_BOTH, session],
            r#"{"jsonrpc":"2.0","id":"portcullis:input:0","result":{"action":"accept"}}"#,
            400,
            -32600,
        ),
        (
            &[ACCEPT_BOTH, session],
            r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#,
            400,
            -32600,
        ),
        (
            &[ACCEPT_BOTH, session],
            r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#,
            400,
            -32600,
        ),
        (
            &[ACCEPT_BOTH, session],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":[]}"#,
            400,
            -32602,
        ),
        (
            &[("Accept", "application/json"), session],
            r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#,
            406,
            -32600,
        ),
        (
            &[ACCEPT_BOTH],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            400,
            -32600,
        ),
        (
            &[ACCEPT_BOTH, ("Mcp-Session-Id", "forged")],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            404,
            -32600,
        ),
        // 2026-07-28: `_meta` is required, the headers must match the body, and a version
        // nobody speaks is refused with the versions there are.
        (
            &[
                ACCEPT_BOTH,
                ("MCP-Protocol-Version", "2026-07-28"),
                ("Mcp-Method", "server/discover"),
            ],
            r#"{"jsonrpc":"2.0","id":1,"method":"server/discover"}"#,
            400,
            -32602,
        ),
        (
            &[
                ACCEPT_BOTH,
                ("MCP-Protocol-Version", "2026-07-28"),
                ("Mcp-Method", "tools/call"),
                ("Mcp-Name", "echo"),
            ],
            MODERN_GET_SUM,
            400,
            -32020,
        ),
        (
            &[ACCEPT_BOTH, ("MCP-Protocol-Version", "2099-01-01")],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            400,
            -32022,
        ),
    ];
    for (headers, body, status, code) in cases {
        let response = http_request_with(port, "POST", "/mcp", headers, Some(body)).unwrap();
        let answer: Value =
            serde_json::from_str(&response.body).unwrap_or_else(|_| panic!("{body}: {}", response.body));
        assert_eq!(
            (response.status, answer["error"]["code"].as_i64()),
            (status, Some(code)),
            "{body}: {answer}"
        );
    }
    // Wrong content type, and a body over the route's limit.
    let raw = "POST /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: application/json, text/event-stream\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}";
    assert!(raw_request(port, raw).starts_with("HTTP/1.1 415"));
    let huge = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "x".repeat(10_000)}}});
    let response = http_request_with(
        port,
        "POST",
        "/mcp",
        &[ACCEPT_BOTH, session],
        Some(&huge.to_string()),
    )
    .unwrap();
    assert_eq!(response.status, 413);
    // The server saw none of it: the session still works.
    assert_eq!(
        wire.call("echo", json!({"text": "still here"})).1["result"]["content"][0]["text"],
        "math: still here"
    );

    // Upstreams that hang or answer garbage: a JSON-RPC error naming the server.
    let config = mcp_config(
        port,
        &[
            ("math", math),
            ("hangs", hanging.local_addr().unwrap()),
            ("garbage", garbage),
        ],
        "",
    )
    .replace("name: hangs, url:", "name: hangs, failureMode: Omit, url:");
    let gateway = _gateway;
    gateway.apply(dir.path(), &config);
    let body = json!({"jsonrpc": "2.0", "id": 3, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "wire", "version": "0"}}});
    let response = http_request_with(port, "POST", "/mcp", &[ACCEPT_BOTH], Some(&body.to_string())).unwrap();
    let answer: Value = serde_json::from_str(&response.body).unwrap();
    assert_eq!(answer["error"]["code"], -32011, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("server garbage") && message.contains("not a JSON-RPC response"),
        "{message}"
    );

    // Methods a client makes up are counted as `other`: no new metric series per string.
    let made_up = json!({"jsonrpc": "2.0", "id": 1, "method": "zz/made-up-12345"}).to_string();
    http_request_with(port, "POST", "/mcp", &[ACCEPT_BOTH], Some(&made_up)).unwrap();
    wait_for("the made-up method counted", TIMEOUT, || {
        metric(
            gateway.admin,
            "portcullis_proxy_mcp_requests_total",
            &["mcp_method_name=\"other\""],
        ) >= 1.0
    });
    let exposition = http_get(gateway.admin, "/metrics").unwrap().body;
    assert!(
        !exposition.contains("zz/made-up"),
        "a client's string became a label"
    );
}

const MODERN_GET_SUM: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get-sum","arguments":{"a":1,"b":2},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{}}}}"#;

#[test]
fn clients_of_either_revision_reach_servers_of_either_revision_on_one_route() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let dual = runtime.block_on(serve("dual", true));
    let (_old_process, old) = era_server(dir.path(), "legacy");
    let (_new_process, new) = era_server(dir.path(), "modern");
    let port = free_port();
    let _gateway = start_gateway(
        dir.path(),
        &mcp_config(port, &[("dual", dual), ("old", old), ("new", new)], ""),
    );
    let modern = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    for (lifecycle, revision) in [
        (ClientLifecycleMode::Initialize, ProtocolVersion::V_2025_11_25),
        (modern, ProtocolVersion::V_2026_07_28),
    ] {
        runtime.block_on(async {
            let transport = StreamableHttpClientTransport::from_uri(format!("http://127.0.0.1:{port}/mcp"));
            let client = Sampler
                .serve_with_lifecycle(transport, lifecycle)
                .await
                .expect("the client starts through the gateway");
            assert_eq!(
                client.peer_info().map(|info| info.protocol_version.clone()),
                Some(revision.clone())
            );
            let names = tool_names(&client).await;
            assert_eq!(
                names,
                [
                    "dual__ask",
                    "dual__change",
                    "dual__echo",
                    "dual__get-sum",
                    "dual__traceparent",
                    "new__echo",
                    "new__get-sum",
                    "old__echo",
                    "old__get-sum"
                ],
                "{revision:?}"
            );
            for server in ["dual", "old", "new"] {
                let sum = client
                    .call_tool(
                        CallToolRequestParams::new(format!("{server}__get-sum"))
                            .with_arguments(arguments(json!({"a": 40, "b": 2}))),
                    )
                    .await
                    .unwrap_or_else(|error| panic!("{revision:?} → {server}: {error}"));
                assert_eq!(text_of(&sum), "42", "{revision:?} → {server}");
            }
            client.cancel().await.unwrap();
        });
    }

    // Portcullis' test servers offer no `logging`; the 2026-07-28 one has no
    // logging/setLevel at all. A level goes only to `dual`: either of the others would
    // answer "method not found" and fail the client's request.
    let wire = Wire::initialize(port);
    let set_level = |level: &str| {
        wire.post(
            &json!({"jsonrpc": "2.0", "id": 3, "method": "logging/setLevel", "params": {"level": level}}),
        )
    };
    let (status, answer) = set_level("info");
    assert_eq!((status, &answer["result"]), (200, &json!({})), "{answer}");
    // The server that offered `logging` was asked: it refuses this level, and says so.
    let (_, refused) = set_level("emergency");
    assert_eq!(refused["error"]["code"], -32011, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|message| message.contains("server dual")),
        "{refused}"
    );
}

#[test]
fn lists_are_reused_for_the_configured_time_and_filtered_per_caller() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let web = runtime.block_on(serve("web", true));
    let port = free_port();
    let rule = "  allow: ['mcp.tool.name == \"echo\" || request.headers[\"x-team\"] == \"admin\"']\n";
    let config = |math_ttl: &str| {
        mcp_config(port, &[("math", math), ("web", web)], &authorization(rule))
            .replace(
                "name: math, url:",
                &format!("name: math, {math_ttl}failureMode: Omit, url:"),
            )
            .replace("name: web, url:", "name: web, failureMode: Omit, url:")
    };
    let gateway = start_gateway(dir.path(), &config("listTtl: 60s, "));
    let wire = Wire::initialize(port);
    assert_eq!(wire.tools().len(), 6, "math's echo, and web's five tools");

    // The servers go away. Math's page is reused, and still filtered per caller; web's was
    // not kept, so web is left out.
    drop(runtime);
    assert_eq!(wire.tools(), ["math__echo"]);
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string();
    let admin = [
        ACCEPT_BOTH,
        ("Mcp-Session-Id", wire.session.as_str()),
        ("x-team", "admin"),
    ];
    let response = http_request_with(port, "POST", "/mcp", &admin, Some(&list)).unwrap();
    let answer = json_or_last_event(&response.body);
    assert_eq!(
        answer["result"]["tools"].as_array().map(Vec::len),
        Some(5),
        "{answer}"
    );

    // A new config version starts with an empty cache: nothing is left to list.
    gateway.apply(dir.path(), &config(""));
    assert_eq!(wire.tools(), Vec::<String>::new());
}

/// Calls that find a pinned tool unchecked at the same moment (a fresh proxy, a list change,
/// or what was seen older than `recheckAfter`) wait for one list of its server, instead of
/// each listing it: the server is asked once, and every call goes ahead.
#[test]
fn calls_that_find_a_pinned_tool_unchecked_together_share_one_list() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let (math, count) = runtime.block_on(serve_eras("math", true, false));
    let port = free_port();
    let gateway = start_gateway(dir.path(), &mcp_config(port, &[("math", math)], ""));
    let output = cli(&["mcp", "pin", "tools", "--controlplane", &gateway.address]);
    assert!(output.status.success(), "mcp pin: {}", stderr(&output));
    gateway.apply(dir.path(), &stdout(&output));
    let wire = Wire::initialize(port);
    let before = count.tool_lists();

    const CALLS: usize = 8;
    let start = std::sync::Barrier::new(CALLS);
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..CALLS)
            .map(|id| {
                let (start, wire) = (&start, &wire);
                scope.spawn(move || {
                    start.wait();
                    wire.post(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                        "params": {"name": "get-sum", "arguments": {"a": 1, "b": 2}}}))
                })
            })
            .collect();
        calls.into_iter().map(|call| call.join().unwrap()).collect()
    });
    for (status, answer) in &answers {
        assert_eq!(
            (*status, &answer["result"]["content"][0]["text"]),
            (200, &json!("3")),
            "{answer}"
        );
    }
    assert_eq!(count.tool_lists() - before, 1, "one list for {CALLS} calls");
}
