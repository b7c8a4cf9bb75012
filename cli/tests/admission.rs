//! Priority classes at saturation, end to end: one simulated pod that runs one request at a
//! time, and a pool whose pods count as saturated at one waiting request. While requests
//! sent straight to the pod keep it saturated, the proxy refuses sheddable requests with 429
//! and `Retry-After`, holds the others, and lets them in highest class first and tenants in
//! turn once the pod has room; a request that waits past `maxWait` is refused.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use support::*;

const MODEL: &str = "Qwen/Qwen3-32B";

fn completion(port: u16, headers: &[(&str, &str)], max_tokens: u32) -> HttpResponse {
    let body = serde_json::json!({ "model": MODEL, "prompt": "hello", "max_tokens": max_tokens }).to_string();
    http_request_with(port, "POST", "/v1/completions", headers, Some(&body)).expect("an answer")
}

/// Sends a request from a thread of its own and forgets it: what these requests do is keep
/// the pod busy (or wait in the proxy), not answer while the test runs. The pod's process
/// ends with the test, and so do they.
fn send_and_forget(port: u16, max_tokens: u32) {
    std::thread::spawn(move || {
        let body =
            serde_json::json!({ "model": MODEL, "prompt": "hello", "max_tokens": max_tokens }).to_string();
        let _ = http_request(port, "POST", "/v1/completions", Some(&body));
    });
}

fn error_code(response: &HttpResponse) -> String {
    let json: serde_json::Value = serde_json::from_str(&response.body).unwrap_or_default();
    json["error"]["code"].as_str().unwrap_or_default().to_string()
}

#[test]
fn saturated_pools_shed_low_classes_and_let_waiting_requests_in_by_class_and_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _pod = single_seat_pod(dir.path(), pod);
    let (main, bulk, strict) = (free_port(), free_port(), free_port());
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let pool = |name: &str, max_wait: &str| {
        format!(
            "{header}\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec:\n  endpoints: ['127.0.0.1:{pod}']\n  \
             models: [{{name: {MODEL}}}]\n  picker: {{queueThreshold: 1, staleness: 1s}}\n  \
             priority:\n    classes: [{{name: interactive, value: 10}}, {{name: standard, value: 0}}, {{name: batch, value: -1}}]\n    \
             default: standard\n    tenantHeader: x-tenant\n    maxWait: {max_wait}\n    retryAfter: 2s\n---\n"
        )
    };
    let listener_and_route = |name: &str, port: u16, pool: &str, class: &str| {
        format!(
            "{header}\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
             {header}\nkind: Route\nmetadata: {{name: {name}}}\nspec: {{listeners: [{name}], backends: [{{kind: InferencePool, name: {pool}{class}}}], timeout: 60s}}\n---\n"
        )
    };
    let config = format!(
        "{}{}{}{}{}",
        pool("main", "60s"),
        pool("strict", "300ms"),
        listener_and_route("main", main, "main", ""),
        listener_and_route("bulk", bulk, "main", ", priorityClass: batch"),
        listener_and_route("strict", strict, "strict", ""),
    );
    let gateway = start_gateway(dir.path(), &config);
    let admin = gateway.admin;

    // Not saturated: every class goes straight through.
    assert_eq!(completion(bulk, &[], 2).status, 200);

    // Saturate the pod: one request running and three waiting, sent to it directly (about
    // 3 s each, so about ten seconds of saturation), until the proxy's signals show the queue.
    let direct: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || completion(pod, &[], 250)))
        .collect();
    wait_for("the pod's queue in the proxy's signals", TIMEOUT, || {
        pool_report(admin, "main")["endpoints"][format!("127.0.0.1:{pod}")]["signals"]["waiting"]
            .as_u64()
            .is_some_and(|waiting| waiting >= 1)
    });

    // Sheddable: the route's class, and the header's on a route without one.
    let shed = completion(bulk, &[("x-portcullis-priority", "interactive")], 2);
    assert_eq!(
        shed.status, 429,
        "the route's class wins over the header: {}",
        shed.body
    );
    assert_eq!(error_code(&shed), "pool_saturated", "{}", shed.body);
    assert!(
        shed.head.to_ascii_lowercase().contains("retry-after: 2"),
        "{}",
        shed.head
    );
    let shed = completion(main, &[("x-portcullis-priority", "batch")], 2);
    assert_eq!(shed.status, 429, "{}", shed.body);
    let unknown = completion(main, &[("x-portcullis-priority", "urgent")], 2);
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    assert_eq!(error_code(&unknown), "unknown_priority_class");
    assert!(
        unknown.body.contains("batch, interactive, standard"),
        "{}",
        unknown.body
    );

    // A request that waits longer than its pool's maxWait is refused.
    let started = Instant::now();
    let late = completion(strict, &[], 2);
    assert_eq!(late.status, 429, "{}", late.body);
    assert_eq!(error_code(&late), "queue_timeout", "{}", late.body);
    assert!(started.elapsed().as_millis() >= 300);

    // Queue four requests of tenant a, then two of tenant b, then one interactive request.
    let finished: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut waiting = Vec::new();
    let mut enqueue = |label: &'static str, tenant: &'static str, class: &'static str, queued: u64| {
        let finished = finished.clone();
        waiting.push(std::thread::spawn(move || {
            let answer = completion(main, &[("x-tenant", tenant), ("x-portcullis-priority", class)], 2);
            finished.lock().unwrap().push(label.to_string());
            answer
        }));
        wait_for("the request in the proxy's queue", TIMEOUT, || {
            pool_report(admin, "main")["queued"].as_u64() == Some(queued)
        });
    };
    for (n, label) in ["a1", "a2", "a3", "a4"].into_iter().enumerate() {
        enqueue(label, "a", "standard", n as u64 + 1);
    }
    enqueue("b1", "b", "standard", 5);
    enqueue("b2", "b", "standard", 6);
    enqueue("urgent", "c", "interactive", 7);

    for answer in waiting {
        let answer = answer.join().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    for answer in direct {
        assert_eq!(answer.join().unwrap().status, 200);
    }
    // One request at a time runs on the single-seat pod, so answers finish about in the order
    // the proxy let them in: the interactive class first, then tenants a and b in turn. Two
    // let in at nearly the same moment may reach the pod (or their clients' threads finish)
    // in either order, so each may be one place off; first come, first served would put b1
    // three places late.
    let order = finished.lock().unwrap().clone();
    let expected = ["urgent", "a1", "b1", "a2", "b2", "a3", "a4"];
    for (place, label) in expected.iter().enumerate() {
        let at = order.iter().position(|done| done == label).unwrap();
        assert!(at.abs_diff(place) <= 1, "{label} finished {at}th: {order:?}");
    }
    assert_eq!(pool_report(admin, "main")["queued"], 0);
    let decisions = |decision: &str| {
        metric(
            admin,
            "portcullis_proxy_policy_decisions_total",
            &[&format!("decision=\"{decision}\"")],
        )
    };
    assert_eq!(decisions("queued"), 8.0, "seven waited here, and the late one");
    assert_eq!(decisions("shed"), 3.0, "two sheddable, one late");
}

#[test]
fn waiting_requests_outlive_a_pool_change_and_go_at_once_when_priority_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _pod = single_seat_pod(dir.path(), pod);
    let port = free_port();
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let config = |priority: &str| {
        format!(
            "{header}\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
             {header}\nkind: InferencePool\nmetadata: {{name: pool}}\nspec:\n  endpoints: ['127.0.0.1:{pod}']\n  \
             models: [{{name: {MODEL}}}]\n  picker: {{queueThreshold: 1, staleness: 500ms}}\n{priority}---\n\
             {header}\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [gw], backends: [{{kind: InferencePool, name: pool}}], timeout: 60s}}\n"
        )
    };
    let priority = |max_wait: &str| {
        format!("  priority: {{classes: [{{name: standard, value: 0}}], default: standard, maxWait: {max_wait}}}\n")
    };
    let gateway = start_gateway(dir.path(), &config(&priority("60s")));
    let admin = gateway.admin;
    let pod_waiting = || {
        pool_report(admin, "pool")["endpoints"][format!("127.0.0.1:{pod}")]["signals"]["waiting"]
            .as_u64()
            .unwrap_or_default()
    };

    // Four long requests straight to the pod keep it saturated for over a minute, far
    // longer than this test runs.
    for _ in 0..4 {
        send_and_forget(pod, 2000);
    }
    wait_for("the pod's queue in the proxy's signals", TIMEOUT, || {
        pod_waiting() >= 1
    });
    for _ in 0..2 {
        send_and_forget(port, 2);
    }
    wait_for("two requests in the proxy's queue", TIMEOUT, || {
        pool_report(admin, "pool")["queued"] == 2
    });

    // A changed spec compiles a new picker; the queue moves with the pool. Were it left with
    // the retired picker, that one's signals would go stale (500 ms) and, knowing nothing,
    // it would let both in while the pod is still saturated.
    // Three times the staleness is ample for that to happen, were it going to.
    gateway.apply(dir.path(), &config(&priority("50s")));
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(pool_report(admin, "pool")["queued"], 2);

    // Without priority classes nothing is held: the waiting requests go at once, saturated
    // pod or not.
    gateway.apply(dir.path(), &config(""));
    wait_for("the queue let go", TIMEOUT, || {
        pool_report(admin, "pool")["queued"] == 0
    });
    assert!(pod_waiting() >= 1, "let go while the pod is still saturated");
}

#[test]
fn waiting_requests_are_let_in_when_signals_stop_and_nothing_else_would_wake_them() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _pod = single_seat_pod(dir.path(), pod);
    let port = free_port();
    let header = "apiVersion: portcullis.dev/v1alpha1";
    let config = format!(
        "{header}\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         {header}\nkind: InferencePool\nmetadata: {{name: pool}}\nspec:\n  endpoints: ['127.0.0.1:{pod}']\n  \
         models: [{{name: {MODEL}}}]\n  picker: {{queueThreshold: 1, staleness: 500ms}}\n  \
         priority: {{classes: [{{name: standard, value: 0}}], default: standard, maxWait: 60s}}\n---\n\
         {header}\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [gw], backends: [{{kind: InferencePool, name: pool}}], timeout: 60s}}\n"
    );
    let mut gateway = start_gateway(dir.path(), &config);
    let admin = gateway.admin;
    // Long requests straight to the pod keep it saturated for longer than the test runs.
    for _ in 0..4 {
        send_and_forget(pod, 2000);
    }
    wait_for("the pod's queue in the proxy's signals", TIMEOUT, || {
        pool_report(admin, "pool")["endpoints"][format!("127.0.0.1:{pod}")]["signals"]["waiting"]
            .as_u64()
            .is_some_and(|waiting| waiting >= 1)
    });
    send_and_forget(port, 2);
    wait_for("the request in the proxy's queue", TIMEOUT, || {
        pool_report(admin, "pool")["queued"] == 1
    });

    // No signals any more, and none of this proxy's requests in flight: no event would let
    // the waiting request in. The room's own check does, once the picker has fallen back to
    // its own counts (which know of no saturation), long before maxWait.
    // (TIMEOUT, 30 s, is half of maxWait: a request let go here was let in, not timed out.)
    gateway.controlplane.kill();
    wait_for("the queue let go", TIMEOUT, || {
        pool_report(admin, "pool")["queued"] == 0
    });
}
