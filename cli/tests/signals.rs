//! Pod signals end to end: the control plane reads the simulated vLLM pods' `/metrics`,
//! replicates the readings and streams them to the proxy, whose picker steers requests away
//! from a pod with a queue; when the control plane dies the signals go stale, a FailClose
//! pool answers 503 with the reason and a FailOpen pool keeps routing on the proxy's own
//! counts.

mod support;

use support::*;

const MODEL: &str = "Qwen/Qwen3-32B";

/// A pod's signals as the proxy's picker holds them.
fn proxy_signals(admin: u16, pool: &str, pod: u16) -> serde_json::Value {
    pool_report(admin, pool)["endpoints"][format!("127.0.0.1:{pod}")]["signals"].clone()
}

fn completion(port: u16, max_tokens: u32) -> HttpResponse {
    let body = serde_json::json!({ "model": MODEL, "prompt": "hello", "max_tokens": max_tokens }).to_string();
    http_request(port, "POST", "/v1/completions", Some(&body)).expect("an answer")
}

#[test]
fn signals_steer_picks_and_stale_signals_fail_open_or_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (busy, idle) = (free_port(), free_port());
    let (mut busy_pod, _idle_pod) = (
        single_seat_pod(dir.path(), busy),
        single_seat_pod(dir.path(), idle),
    );
    let (closed, open) = (free_port(), free_port());
    let header = "apiVersion: portcullis.dev/v1alpha1";
    // Reads every 100 ms and trusts them for 1 s: slack for a loaded test machine.
    let pool = |name: &str, failure_mode: &str| {
        format!(
            "{header}\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec:\n  endpoints: ['127.0.0.1:{busy}', '127.0.0.1:{idle}']\n  \
             models: [{{name: {MODEL}}}]\n  signals: {{interval: 100ms}}\n  picker: {{staleness: 1s}}\n  failureMode: {failure_mode}\n---\n"
        )
    };
    let listener_and_route = |name: &str, port: u16| {
        format!(
            "{header}\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
             {header}\nkind: Route\nmetadata: {{name: {name}}}\nspec: {{listeners: [{name}], backends: [{{kind: InferencePool, name: {name}}}], timeout: 60s}}\n---\n"
        )
    };
    let config = format!(
        "{}{}{}{}",
        pool("closed", "FailClose"),
        pool("open", "FailOpen"),
        listener_and_route("closed", closed),
        listener_and_route("open", open)
    );
    let mut gateway = start_gateway(dir.path(), &config);

    // Both pods' signals reach the proxy.
    for pod in [busy, idle] {
        wait_for("fresh signals on the proxy", TIMEOUT, || {
            proxy_signals(gateway.admin, "closed", pod)["fresh"] == true
        });
    }
    // A queue builds on one pod (requests sent to it directly, each taking minutes), and the
    // proxy learns it from the replicated signals.
    let _queue: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || http_request(busy, "POST", "/v1/completions", Some(&long_request())))
        })
        .collect();
    wait_for("the queue in the proxy's signals", TIMEOUT, || {
        proxy_signals(gateway.admin, "closed", busy)["waiting"]
            .as_u64()
            .is_some_and(|waiting| waiting >= 5)
    });
    let before = metric(idle, "vllm:request_success_total", &[]);
    for _ in 0..10 {
        let response = completion(closed, 2);
        assert_eq!(response.status, 200, "{}", response.body);
    }
    assert_eq!(
        metric(idle, "vllm:request_success_total", &[]) - before,
        10.0,
        "every request avoided the pod with the queue"
    );

    // Without the control plane, signals age past the staleness limit. The busy pod goes
    // too: a FailOpen pick knows only this proxy's own (equal) counts and may choose it,
    // then falls back to the next pod when it refuses the connection.
    gateway.controlplane.kill();
    busy_pod.kill();
    wait_for("stale signals on the proxy", TIMEOUT, || {
        proxy_signals(gateway.admin, "closed", idle)["fresh"] == false
    });
    let refused = completion(closed, 2);
    assert_eq!(refused.status, 503, "{}", refused.body);
    let error: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(error["error"]["code"], "signals_unavailable", "{}", refused.body);
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("InferencePool/closed: "), "{message}");
    let routed = completion(open, 2);
    assert_eq!(
        routed.status, 200,
        "FailOpen keeps routing on its own counts: {}",
        routed.body
    );
}

fn long_request() -> String {
    serde_json::json!({ "model": MODEL, "prompt": "queue", "max_tokens": 4000 }).to_string()
}
