//! LLM routes end to end: the real binary's control plane and proxy in front of simulated
//! vLLM pods (`portcullis sim vllm`, separate processes on loopback). Routing by the body's
//! model (aliases, rewrites), `/v1/models`, OpenAI-shaped errors, the picker's prefix
//! affinity, round-robin as a selectable strategy, and the fallback to the next pod when the
//! chosen one refuses connections.

mod support;

use support::*;

struct Fleet {
    _sims: Vec<Process>,
    gateway: Gateway,
    pods: Vec<u16>,
    /// Listener of the route to the scored pool, and of the one to the round-robin pool.
    scored: u16,
    round_robin: u16,
}

/// Three simulated pods; a scored pool over them, and a round-robin pool over a port where
/// nothing listens and the first pod. The scored pool trusts signals for 2 s: on a loaded
/// test machine a 50 ms read can run late, and a pod whose reading went stale while the
/// others' did not counts as saturated, which would break the prefix assertions below.
fn fleet(dir: &std::path::Path) -> Fleet {
    // One simulator process per pod: each on a port known to be free.
    let pods: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let sims = pods.iter().map(|&pod| start_sim(dir, 1, pod, "20")).collect();
    let (scored, round_robin, dead) = (free_port(), free_port(), free_port());
    let endpoints: Vec<String> = pods.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let config = format!(
        "{header}\nkind: Listener\nmetadata: {{name: scored}}\nspec: {{address: 127.0.0.1, port: {scored}}}\n---\n\
         {header}\nkind: Listener\nmetadata: {{name: rr}}\nspec: {{address: 127.0.0.1, port: {round_robin}}}\n---\n\
         {header}\nkind: InferencePool\nmetadata: {{name: qwen}}\nspec:\n  endpoints: [{}]\n  models:\n  - {{name: Qwen/Qwen3-32B, aliases: [qwen]}}\n  rewrites:\n  - {{model: chat, targets: [{{model: Qwen/Qwen3-32B, weight: 1}}]}}\n  picker: {{staleness: 2s}}\n---\n\
         {header}\nkind: InferencePool\nmetadata: {{name: rotating}}\nspec:\n  endpoints: ['127.0.0.1:{dead}', '127.0.0.1:{}']\n  models: [{{name: Qwen/Qwen3-32B}}]\n  picker: {{strategy: RoundRobin}}\n---\n\
         {header}\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [scored], backends: [{{kind: InferencePool, name: qwen}}], timeout: 60s}}\n---\n\
         {header}\nkind: Route\nmetadata: {{name: llm-rr}}\nspec: {{listeners: [rr], backends: [{{kind: InferencePool, name: rotating}}], timeout: 60s}}\n",
        endpoints.join(", "),
        pods[0],
    );
    Fleet {
        _sims: sims,
        gateway: start_gateway(dir, &config),
        pods,
        scored,
        round_robin,
    }
}

/// A gateway with one LLM route (`llm`, on listener `gw`) to an InferencePool `pool` with
/// `pool_spec`, plus any `extra` documents; the listener's port.
fn pool_gateway(dir: &std::path::Path, pool_spec: &str, extra: &str) -> (Gateway, u16) {
    let port = free_port();
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let config = format!(
        "{header}\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         {header}\nkind: InferencePool\nmetadata: {{name: pool}}\nspec: {pool_spec}\n---\n\
         {header}\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [gw], backends: [{{kind: InferencePool, name: pool}}], timeout: 60s}}\n{extra}"
    );
    (start_gateway(dir, &config), port)
}

fn completion(port: u16, model: &str, prompt: &str) -> HttpResponse {
    let body = serde_json::json!({ "model": model, "prompt": prompt, "max_tokens": 3 }).to_string();
    http_request(port, "POST", "/v1/completions", Some(&body)).expect("the proxy answers")
}

/// Requests each pod has completed, from its vLLM metrics.
fn served(pods: &[u16]) -> Vec<u64> {
    pods.iter()
        .map(|&pod| metric(pod, "vllm:request_success_total", &[]) as u64)
        .collect()
}

fn error_of(response: &HttpResponse) -> serde_json::Value {
    let json: serde_json::Value =
        serde_json::from_str(&response.body).unwrap_or_else(|_| panic!("not JSON: {}", response.body));
    json["error"].clone()
}

#[test]
fn llm_routes_choose_by_model_keep_prefixes_together_and_fall_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = fleet(dir.path());
    wait_for("the pods' signals on the proxy", TIMEOUT, || {
        let report = pool_report(fleet.gateway.admin, "qwen");
        fleet
            .pods
            .iter()
            .all(|pod| !report["endpoints"][format!("127.0.0.1:{pod}")]["signals"].is_null())
    });

    // Aliases and rewrites reach the pods as the served name: a pod knows no "qwen".
    assert_eq!(completion(fleet.pods[0], "qwen", "hi").status, 404);
    for model in ["Qwen/Qwen3-32B", "qwen", "chat"] {
        let answer = completion(fleet.scored, model, "hi");
        assert_eq!(answer.status, 200, "{model}: {}", answer.body);
    }

    let listing = http_get(fleet.scored, "/v1/models").unwrap();
    assert_eq!(listing.status, 200);
    let listing: serde_json::Value = serde_json::from_str(&listing.body).unwrap();
    let ids: Vec<&str> = listing["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["Qwen/Qwen3-32B", "qwen", "chat"]);
    let one = http_get(fleet.scored, "/v1/models/Qwen/Qwen3-32B").unwrap();
    assert_eq!(one.status, 200, "{}", one.body);
    assert!(
        one.body.contains("\"owned_by\":\"InferencePool/qwen\""),
        "{}",
        one.body
    );
    let encoded = http_get(fleet.scored, "/v1/models/Qwen%2FQwen3-32B").unwrap();
    assert_eq!(
        encoded.status, 200,
        "an encoded slash names the same model: {}",
        encoded.body
    );
    let none = http_get(fleet.scored, "/v1/models/gpt-4o").unwrap();
    assert_eq!(none.status, 404);
    assert_eq!(error_of(&none)["code"], "model_not_found");

    // Errors in OpenAI's shape, from the gateway itself: nothing reaches a pod.
    let before = served(&fleet.pods);
    let unknown = completion(fleet.scored, "gpt-4o", "hi");
    assert_eq!(unknown.status, 404);
    assert_eq!(error_of(&unknown)["code"], "model_not_found");
    assert!(error_of(&unknown)["message"]
        .as_str()
        .unwrap()
        .contains("\"gpt-4o\" does not exist"));
    let malformed = http_request(fleet.scored, "POST", "/v1/completions", Some("{\"model\": ")).unwrap();
    assert_eq!(malformed.status, 400);
    assert_eq!(error_of(&malformed)["type"], "invalid_request_error");
    let nameless = http_request(
        fleet.scored,
        "POST",
        "/v1/chat/completions",
        Some("{\"messages\": []}"),
    )
    .unwrap();
    assert_eq!(nameless.status, 400);
    assert!(error_of(&nameless)["message"]
        .as_str()
        .unwrap()
        .contains("\"model\" is required"));
    let wrong_method = http_get(fleet.scored, "/v1/completions").unwrap();
    assert_eq!(wrong_method.status, 405);
    assert!(
        wrong_method.head.to_ascii_lowercase().contains("allow: post"),
        "{}",
        wrong_method.head
    );
    assert_eq!(served(&fleet.pods), before);

    // Prompts sharing a long prefix go where the first one went; unrelated ones spread.
    let system = "You are a careful assistant for the routing team. ".repeat(80);
    let before = served(&fleet.pods);
    for question in 0..6 {
        let answer = completion(fleet.scored, "qwen", &format!("{system}Question {question}?"));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let after = served(&fleet.pods);
    let gained: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        gained.contains(&6),
        "one pod should have served all six: {gained:?}"
    );
    let before = after;
    for topic in 0..12 {
        let answer = completion(
            fleet.scored,
            "qwen",
            &format!("unrelated topic {topic} {}", "x".repeat(300)),
        );
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let gained: Vec<u64> = served(&fleet.pods)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    assert!(
        gained.iter().filter(|&&n| n > 0).count() >= 2,
        "unrelated prompts should spread: {gained:?}"
    );

    // Round-robin over a dead port and a pod: every other pick refuses the connection and
    // the request moves to the next endpoint; the client never notices.
    let before = served(&fleet.pods[..1]);
    for i in 0..4 {
        let answer = completion(fleet.round_robin, "Qwen/Qwen3-32B", &format!("n{i}"));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    assert_eq!(served(&fleet.pods[..1])[0] - before[0], 4);
    let admin = fleet.gateway.admin;
    assert!(
        metric(
            admin,
            "portcullis_proxy_upstream_errors_total",
            &["kind=\"connect\""]
        ) >= 1.0,
        "the dead endpoint's refusals are counted"
    );

    // A streamed answer passes event by event and is measured on the way: usage, time to
    // first token, time per output token, the picker's basis, in GenAI naming.
    let body = serde_json::json!({
        "model": "qwen", "prompt": "count to five", "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}
    })
    .to_string();
    let streamed = http_request(fleet.scored, "POST", "/v1/completions", Some(&body)).unwrap();
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let events = streamed.body.matches("data: ").count();
    assert!(
        events >= 6,
        "five tokens, usage and [DONE] as separate events: {}",
        streamed.body
    );
    assert!(
        streamed.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.body
    );
    let gen_ai =
        |name: &str, labels: &[&str]| metric(admin, &format!("portcullis_proxy_gen_ai_{name}"), labels);
    let qwen = "pool=\"InferencePool/qwen\"";
    // 3 model names + 6 with a shared prefix + 12 unrelated + 1 streamed.
    assert_eq!(gen_ai("requests_total", &[qwen]), 22.0);
    assert_eq!(
        gen_ai("token_usage_total", &["gen_ai_token_type=\"output\""]),
        (21 * 3 + 5 + 4 * 3) as f64,
        "every answer's completion tokens, from the servers' usage"
    );
    assert!(gen_ai("token_usage_total", &["gen_ai_token_type=\"input\""]) > 0.0);
    assert_eq!(gen_ai("server_time_to_first_token_seconds_count", &[qwen]), 1.0);
    assert_eq!(gen_ai("server_time_per_output_token_seconds_count", &[qwen]), 1.0);
    let decisions = |decision: &str| {
        metric(
            admin,
            "portcullis_proxy_policy_decisions_total",
            &[&format!("decision=\"{decision}\"")],
        )
    };
    // Every scored pick ran on replicated signals, or on the proxy's own counts for a pod
    // whose reading was late (a loaded test machine can delay a 50 ms scrape).
    assert_eq!(decisions("signals") + decisions("own_counts"), 22.0);
    assert!(decisions("signals") >= 1.0, "the pods' signals steered picks");
    assert_eq!(decisions("round_robin"), 4.0);

    // Without the control plane the proxy keeps routing on what it holds.
    fleet.gateway.controlplane.kill();
    for i in 0..3 {
        let answer = completion(fleet.scored, "qwen", &format!("{system}Still there {i}?"));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
}

#[test]
fn a_pod_killed_mid_stream_ends_the_stream_with_an_error_event_and_new_requests_avoid_it() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let (doomed, survivor) = (free_port(), free_port());
    // Two simulator processes, so one can die alone; real time, so a stream lasts seconds.
    let mut doomed_pod = start_sim(dir.path(), 1, doomed, "1");
    let _survivor_pod = start_sim(dir.path(), 1, survivor, "1");
    // Round-robin, so the first request deterministically goes to the doomed pod.
    let (_gateway, port) = pool_gateway(
        dir.path(),
        &format!(
            "{{endpoints: ['127.0.0.1:{doomed}', '127.0.0.1:{survivor}'], models: [{{name: Qwen/Qwen3-32B}}], picker: {{strategy: RoundRobin}}}}"
        ),
        "",
    );

    let body = serde_json::json!({
        "model": "Qwen/Qwen3-32B", "prompt": "tell a long story", "max_tokens": 2000, "stream": true
    })
    .to_string();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "the stream ended before its first event");
        received.extend_from_slice(&chunk[..n]);
    }
    doomed_pod.kill();
    stream.read_to_end(&mut received).unwrap();
    let text = String::from_utf8_lossy(&received);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let last_event = text.lines().rfind(|line| line.starts_with("data: ")).unwrap();
    let error: serde_json::Value = serde_json::from_str(&last_event["data: ".len()..]).unwrap();
    assert_eq!(error["error"]["code"], "upstream_stream_error", "{text}");
    assert!(
        text.ends_with("0\r\n\r\n"),
        "a clean end of the chunked body: {text:?}"
    );

    // Every new request is served: the dead pod refuses connections, each refusal moves the
    // request to the survivor, and after three the dead pod is ejected.
    for i in 0..6 {
        let answer = completion(port, "Qwen/Qwen3-32B", &format!("after {i}"));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
}

#[test]
fn a_client_that_leaves_before_the_answer_gives_its_pod_back_and_policies_still_apply() {
    let dir = tempfile::tempdir().unwrap();
    let pods = [free_port(), free_port()];
    // The first endpoint is a simulated pod in real time: its 2,000-token answers take far
    // longer than the clients below wait. The second is the echo server, which answers at
    // once. A credit leaked by a departed client would pile up on the pod only, and
    // least-request would shun it from then on.
    let _sim = start_sim(dir.path(), 1, pods[0], "1");
    let _echo = start_echo(dir.path(), "echo", pods[1]);
    wait_for("echo", TIMEOUT, || http_get(pods[1], "/").is_some());
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let policies = format!(
        "---\n{header}\nkind: HeaderPolicy\nmetadata: {{name: tag}}\nspec: {{targetRefs: [{{kind: Route, name: llm}}], response: {{set: [{{name: x-gateway, value: portcullis}}]}}}}\n---\n\
         {header}\nkind: RateLimitPolicy\nmetadata: {{name: listings}}\nspec: {{targetRefs: [{{kind: Listener, name: gw}}], requestsPerSecond: 0.001, burst: 40, key: {{header: x-tenant}}}}\n"
    );
    let (gateway, port) = pool_gateway(
        dir.path(),
        &format!(
            "{{endpoints: ['127.0.0.1:{}', '127.0.0.1:{}'], models: [{{name: Qwen/Qwen3-32B}}], picker: {{strategy: LeastRequest}}}}",
            pods[0], pods[1]
        ),
        &policies,
    );
    let admin = gateway.admin;
    let pool_requests = |labels: &[&str]| {
        let mut labels = labels.to_vec();
        labels.push("pool=\"InferencePool/pool\"");
        metric(admin, "portcullis_proxy_gen_ai_requests_total", &labels)
    };

    // Twenty clients each ask for a long, non-streamed answer (headers come only at its end)
    // and hang up once it is placed: answered by the echo server, or being prefilled at the
    // pod. Each pick credited an endpoint; each departure must give the credit back, or
    // least-request would avoid that endpoint for good. Each request's record is awaited
    // before the next: it is written when the proxy lets go of the request, credit included.
    // (That all twenty go to the echo server, leaving nothing to check, has odds of one in a
    // million.)
    let body = serde_json::json!({"model": "Qwen/Qwen3-32B", "prompt": "a long story", "max_tokens": 2000})
        .to_string();
    for sent in 1..=20 {
        use std::io::{Read, Write};
        let prefilled = metric(pods[0], "vllm:prompt_tokens_total", &[]);
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            stream,
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_millis(20)))
            .unwrap();
        wait_for("the request placed", TIMEOUT, || {
            let mut first = [0u8; 1];
            matches!(stream.read(&mut first), Ok(1))
                || metric(pods[0], "vllm:prompt_tokens_total", &[]) > prefilled
        });
        drop(stream);
        wait_for("the request's record", TIMEOUT, || {
            pool_requests(&[]) >= sent as f64
        });
    }
    assert!(
        pool_requests(&["gen_ai_request_model=\"Qwen/Qwen3-32B\"", "status=\"499\""]) >= 1.0,
        "the departures are on record as 499s of the pool, with the model they asked for"
    );
    // With every credit back, least-request spreads sequential requests over both
    // endpoints; a leak of even one would send all 16 to the echo server.
    let per_endpoint = |port: u16| pool_requests(&[&format!("endpoint=\"127.0.0.1:{port}\"")]);
    let before = [per_endpoint(pods[0]), per_endpoint(pods[1])];
    for i in 0..16 {
        let answer = completion(port, "Qwen/Qwen3-32B", &format!("short {i}"));
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            answer.head.to_ascii_lowercase().contains("x-gateway: portcullis"),
            "{}",
            answer.head
        );
    }
    let gained = [
        per_endpoint(pods[0]) - before[0],
        per_endpoint(pods[1]) - before[1],
    ];
    assert!(
        gained.iter().all(|&n| n > 0.0),
        "both endpoints serve again: {gained:?}"
    );

    // The LLM stage's own answers go through the policies too: /v1/models is tagged by the
    // route's HeaderPolicy and rate limited (40 a burst for this tenant) by the listener's.
    let statuses: Vec<u16> = (0..45)
        .map(|_| {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(
                stream,
                "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nx-tenant: limited\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut text = String::new();
            stream.read_to_string(&mut text).unwrap();
            let status: u16 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
            // The 429 comes from the listener's policy, which runs before the route's
            // HeaderPolicy and so never reaches it.
            if status == 200 {
                assert!(
                    text.to_ascii_lowercase().contains("x-gateway: portcullis"),
                    "{text}"
                );
            }
            status
        })
        .collect();
    assert_eq!(statuses[0], 200);
    let limited = statuses.contains(&429);
    assert!(limited, "the listener's rate limit applies to /v1/models");
}

/// Two proxies of one control plane, each serving its own listener (shards `side=a` and
/// `side=b`) with a route to the same pool of four pods: a prompt family that one proxy
/// placed goes to the same pod through the other, which learned the placement through the
/// control plane. Learning nothing, the second proxy would land on the first one's pod by
/// chance one time in four per family.
#[test]
fn a_prompt_family_goes_where_another_proxy_placed_it() {
    let dir = tempfile::tempdir().unwrap();
    let pods: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let _sims: Vec<Process> = pods
        .iter()
        .map(|&pod| start_sim(dir.path(), 1, pod, "20"))
        .collect();
    let ports = [free_port(), free_port()];
    let admins = [free_port(), free_port()];
    let endpoints: Vec<String> = pods.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let mut config = format!(
        "{header}\nkind: InferencePool\nmetadata: {{name: qwen}}\nspec:\n  endpoints: [{}]\n  models: [{{name: Qwen/Qwen3-32B}}]\n  picker: {{staleness: 2s}}\n",
        endpoints.join(", ")
    );
    for (side, port) in ["a", "b"].iter().zip(ports) {
        config.push_str(&format!(
            "---\n{header}\nkind: Listener\nmetadata: {{name: {side}, labels: {{side: {side}}}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n\
             ---\n{header}\nkind: Route\nmetadata: {{name: llm-{side}}}\nspec: {{listeners: [{side}], backends: [{{kind: InferencePool, name: qwen}}], timeout: 60s}}\n"
        ));
    }
    let cp_port = free_port();
    let controlplane = format!("127.0.0.1:{cp_port}");
    let _cp = start_controlplane(dir.path(), cp_port);
    let _proxies: Vec<Process> = ["a", "b"]
        .iter()
        .zip(admins)
        .map(|(side, admin)| {
            let shard = format!("side={side}");
            start_proxy(
                dir.path(),
                &format!("proxy-{side}"),
                &controlplane,
                admin,
                &["--shard", &shard],
            )
        })
        .collect();
    apply(dir.path(), "pool.yaml", &config, &controlplane);
    for admin in admins {
        wait_for("the pods' signals on both proxies", TIMEOUT, || {
            let report = pool_report(admin, "qwen");
            pods.iter()
                .all(|pod| report["endpoints"][format!("127.0.0.1:{pod}")]["signals"]["fresh"] == true)
        });
    }
    let placements =
        |admin: u16, what: &str| pool_report(admin, "qwen")["placements"][what].as_u64().unwrap();
    // The pod that served the one request sent through `port`.
    let served_one = |port: u16, prompt: &str| {
        let before = served(&pods);
        let answer = completion(port, "Qwen/Qwen3-32B", prompt);
        assert_eq!(answer.status, 200, "{}", answer.body);
        let gained: Vec<u64> = served(&pods).iter().zip(&before).map(|(a, b)| a - b).collect();
        gained
            .iter()
            .position(|&n| n == 1)
            .unwrap_or_else(|| panic!("one pod should have served it: {gained:?}"))
    };

    for family in 0..6 {
        // Families alternate which proxy places them first.
        let (first, then) = if family % 2 == 0 { (0, 1) } else { (1, 0) };
        let system = format!("Family {family}: you answer for team {family} and nobody else. ").repeat(50);
        let learned = placements(admins[then], "learned");
        let placed = served_one(ports[first], &format!("{system}First question?"));
        wait_for("the other proxy to learn the placement", TIMEOUT, || {
            placements(admins[then], "learned") > learned
        });
        let followed = served_one(ports[then], &format!("{system}Second question?"));
        assert_eq!(
            followed, placed,
            "family {family}: the second proxy should send it where the first did"
        );
    }
    assert!(placements(admins[0], "posted") >= 3 && placements(admins[1], "posted") >= 3);
}
