//! Guardrails against the reference checker (`portcullis-loadtest`), served over real gRPC
//! on loopback, misbehaving the ways real checkers do.

use std::net::SocketAddr;
use std::time::Duration;

use portcullis_loadtest::guardrail::{serve, Behaviour, GuardrailServerArgs};
use serde_json::json;

use super::*;

/// A checker on its own port, stopped when dropped.
struct RunningChecker {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn checker(behave: Behaviour) -> RunningChecker {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    checker_on(addr, behave).await
}

async fn checker_on(addr: SocketAddr, behave: Behaviour) -> RunningChecker {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(GuardrailServerArgs { listen: addr, behave }, async {
        let _ = stopped.await;
    }));
    // Listening once a TCP connect succeeds.
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    RunningChecker { addr, _stop: stop }
}

/// An address nothing listens on.
fn closed_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

fn guard(spec: serde_json::Value) -> Guard {
    let spec: GuardrailSpec = serde_json::from_value(spec).unwrap();
    Guard::compile("g", &spec).unwrap()
}

fn service(replicas: &[SocketAddr], extra: serde_json::Value) -> serde_json::Value {
    let mut spec = json!({
        "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
        "phases": ["McpRequest"],
        "timeout": "2s",
        "service": {"replicas": replicas.iter().map(ToString::to_string).collect::<Vec<_>>()},
    });
    if let (Some(spec), serde_json::Value::Object(extra)) = (spec.as_object_mut(), extra) {
        for (key, value) in extra {
            match (key.as_str(), spec.get_mut("service")) {
                ("hedgeAfter" | "healthInterval" | "circuitBreaker" | "callerHeaders", Some(service)) => {
                    service[key.as_str()] = value;
                }
                _ => {
                    spec.insert(key, value);
                }
            }
        }
    }
    spec
}

fn asker() -> Asker {
    asker_limited(1 << 20)
}

/// On a route whose request bodies may be `max_request_bytes` long.
fn asker_limited(max_request_bytes: u64) -> Asker {
    Asker {
        request_id: "r".into(),
        route: "Route/mcp".into(),
        target: "McpBackend/tools".into(),
        address: "127.0.0.1".into(),
        headers: Arc::default(),
        max_request_bytes,
        log: GuardrailLog::default(),
    }
}

const SUM: Subject<'static> = Subject {
    phase: GuardrailPhase::McpRequest,
    server: "math",
    method: "tools/call",
    name: "get-sum",
    mutable: true,
};

async fn sum(guard: &Guard, a: i64) -> (Result<Decision, String>, Option<Arc<str>>, u32) {
    guard.ask(&asker(), &SUM, &json!({"a": a, "b": 2})).await
}

fn replica(checker: &RunningChecker) -> Option<Arc<str>> {
    Some(Arc::from(checker.addr.to_string()))
}

#[tokio::test]
async fn a_correct_replica_allows_and_denies_with_its_reason() {
    let good = checker(Behaviour::Correct).await;
    let guard = guard(service(&[good.addr], json!({})));
    assert_eq!(sum(&guard, 1).await, (Ok(Decision::Allow), replica(&good), 1));
    assert_eq!(
        sum(&guard, 2).await.0,
        Ok(Decision::Deny(
            "get-sum is allowed only with a == 1 (got a = 2)".into()
        ))
    );
}

#[tokio::test]
async fn a_hung_replica_times_out_and_the_other_answers() {
    let hung = checker(Behaviour::Hang).await;
    let good = checker(Behaviour::Correct).await;
    let guard = guard(service(&[hung.addr, good.addr], json!({})));
    // Each check starts on the next replica in turn: both orders are exercised.
    let mut attempts_seen = Vec::new();
    for _ in 0..4 {
        let (decision, answered, attempts) = sum(&guard, 1).await;
        assert_eq!(decision, Ok(Decision::Allow));
        assert_eq!(answered, replica(&good));
        attempts_seen.push(attempts);
    }
    attempts_seen.sort_unstable();
    assert_eq!(attempts_seen, [1, 1, 2, 2]);
}

#[tokio::test]
async fn hedging_asks_a_second_replica_before_the_timeout() {
    let hung = checker(Behaviour::Hang).await;
    let good = checker(Behaviour::Correct).await;
    // A timeout no test waits out: only the hedge can answer in time.
    let guard = guard(service(
        &[hung.addr, good.addr],
        json!({"timeout": "60s", "hedgeAfter": "20ms", "circuitBreaker": {"consecutiveFailures": 2}}),
    ));
    let mut attempts = Vec::new();
    for _ in 0..6 {
        let answered = tokio::time::timeout(Duration::from_secs(20), sum(&guard, 1))
            .await
            .expect("the hedge answered");
        assert_eq!((answered.0, answered.1), (Ok(Decision::Allow), replica(&good)));
        attempts.push(answered.2);
    }
    // Outrun by the hedge on each of its turns (1, 3 and 5), the hung replica is taken out
    // after two: the last checks, also the one whose turn starts on it, go to the good one
    // alone (a slow good replica may draw a hedge earlier, never to a replica taken out).
    assert_eq!(attempts[4..], [1, 1], "{attempts:?}");
}

#[tokio::test]
async fn bad_verdicts_are_failed_checks_and_retried_elsewhere() {
    for behaviour in [Behaviour::NoDecision, Behaviour::InvalidMutation] {
        let bad = checker(behaviour).await;
        let alone = guard(service(&[bad.addr], json!({})));
        let (decision, _, _) = sum(&alone, 1).await;
        assert!(decision.is_err(), "{behaviour:?} gave {decision:?}");
        let good = checker(Behaviour::Correct).await;
        let paired = guard(service(&[bad.addr, good.addr], json!({})));
        for _ in 0..2 {
            assert_eq!(sum(&paired, 1).await.0, Ok(Decision::Allow), "{behaviour:?}");
        }
    }
}

#[tokio::test]
async fn no_replica_answering_is_a_failure_not_a_verdict() {
    let guard = guard(service(&[closed_port(), closed_port()], json!({})));
    let (decision, _, attempts) = sum(&guard, 1).await;
    assert!(decision.is_err());
    assert_eq!(attempts, 2);
}

#[tokio::test]
async fn the_breaker_takes_a_failing_replica_out_and_probes_it_back() {
    // Healthy by the health protocol (asked once, at start), failing every check.
    let failing = checker(Behaviour::NoDecision).await;
    let address = failing.addr;
    let good = checker(Behaviour::Correct).await;
    let guard = guard(service(
        &[address, good.addr],
        json!({"healthInterval": "1h", "circuitBreaker": {"consecutiveFailures": 1, "openFor": "5s"}}),
    ));
    // The first check on `failing` fails and opens its breaker; from then on only `good` is
    // asked, each check in one attempt.
    for _ in 0..2 {
        assert_eq!(sum(&guard, 1).await.0, Ok(Decision::Allow));
    }
    for _ in 0..4 {
        assert_eq!(sum(&guard, 1).await, (Ok(Decision::Allow), replica(&good), 1));
    }
    // Fixed: after `openFor`, a probe finds it answering and it takes checks again.
    drop(failing);
    while tokio::net::TcpStream::connect(address).await.is_ok() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fixed = checker_on(address, Behaviour::Correct).await;
    let mut answered_by_fixed = 0;
    for _ in 0..600 {
        let (decision, answered, _) = sum(&guard, 1).await;
        assert_eq!(decision, Ok(Decision::Allow));
        answered_by_fixed += usize::from(answered == replica(&fixed));
        if answered_by_fixed == 3 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the fixed replica answered {answered_by_fixed} checks in 30 s");
}

#[tokio::test]
async fn replicas_not_serving_are_avoided() {
    let sick = checker(Behaviour::NotServing).await;
    let good = checker(Behaviour::Correct).await;
    let guard = guard(service(
        &[sick.addr, good.addr],
        json!({"healthInterval": "100ms"}),
    ));
    let super::Checker::Service(replicas) = &guard.checker else {
        unreachable!("a service guard")
    };
    while replicas.is_healthy(&sick.addr.to_string()) != Some(false) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..6 {
        assert_eq!(sum(&guard, 1).await, (Ok(Decision::Allow), replica(&good), 1));
    }
}

#[tokio::test]
async fn failure_modes_and_records() {
    let down = [closed_port()];
    let closed = guard(service(&down, json!({})));
    let open = guard(service(&down, json!({"failureMode": "FailOpen"})));
    let builtin = guard(json!({
        "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
        "phases": ["McpRequest"],
        "builtin": {"redact": [{"pattern": "\\d{3}-\\d{4}"}], "deny": [{"pattern": "rm -rf", "reason": "no"}]},
    }));
    let asker = asker();
    let guards = |list: Vec<Guard>| Guards(list.into_iter().map(Arc::new).collect());
    let payload = json!({"a": 1, "note": "call 555-1234"});

    let passed = guards(vec![open, builtin])
        .check(&asker, &SUM, payload.clone())
        .await
        .unwrap();
    assert!(passed.mutated);
    assert_eq!(passed.payload, json!({"a": 1, "note": "call [REDACTED]"}));
    let stop = guards(vec![closed])
        .check(&asker, &SUM, payload)
        .await
        .unwrap_err();
    assert!(matches!(stop, Stop::Unavailable { ref guardrail } if &**guardrail == "Guardrail/g"));

    let log = asker.log.lock().unwrap();
    let decisions: Vec<_> = log
        .iter()
        .map(|record| (record.decision, record.replica.clone()))
        .collect();
    assert_eq!(
        decisions,
        [
            ("failed_open", Some(Arc::from(down[0].to_string()))),
            ("mutate", Some(Arc::from("builtin"))),
            ("failed_closed", Some(Arc::from(down[0].to_string()))),
        ]
    );
}

const SUM_RESULT: Subject<'static> = Subject {
    phase: GuardrailPhase::McpResponse,
    ..SUM
};

fn decisions(asker: &Asker) -> Vec<&'static str> {
    let log = asker.log.lock().unwrap();
    log.iter().map(|record| record.decision).collect()
}

#[tokio::test]
async fn a_result_may_be_mutated_past_the_routes_request_limit() {
    let good = checker(Behaviour::Correct).await;
    let guard = guard(service(
        &[good.addr],
        json!({"phases": ["McpResponse"], "failureMode": "FailOpen"}),
    ));
    // The route takes requests of 64 bytes; the result, and its redaction, are larger.
    let asker = asker_limited(64);
    let result = json!({"content": [{"type": "text", "text": "secret ".repeat(40)}]});
    let passed = Guards(vec![Arc::new(guard)].into())
        .check(&asker, &SUM_RESULT, result)
        .await
        .unwrap();
    assert!(passed.mutated, "{passed:?}");
    let text = passed.payload["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("[redacted] [redacted]") && !text.contains("secret"),
        "{text}"
    );
    assert_eq!(decisions(&asker), ["mutate"]);
}

#[tokio::test]
async fn an_oversized_mutation_is_denied_even_under_fail_open() {
    // Answers every check with a 20 MiB mutation (over a request's limit and a result's), or a
    // 40 MiB one (over what the proxy decodes at all).
    for behaviour in [Behaviour::OversizedMutation, Behaviour::HugeMutation] {
        oversized_is_denied(behaviour).await;
    }
}

async fn oversized_is_denied(behaviour: Behaviour) {
    let big = checker(behaviour).await;
    let good = checker(Behaviour::Correct).await;
    // A timeout no check waits out: on a busy machine a debug build can take seconds over a
    // 40 MiB message, and a timed-out check would pass under fail-open, not be denied.
    let guard = guard(service(
        &[big.addr, good.addr],
        json!({"phases": ["McpRequest", "McpResponse"], "failureMode": "FailOpen", "timeout": "60s"}),
    ));
    let guards = Guards(vec![Arc::new(guard)].into());
    for subject in [&SUM, &SUM_RESULT] {
        let asker = asker();
        // Each check starts on the next replica: two checks, one of them on the big one.
        let mut denied = Vec::new();
        for _ in 0..2 {
            match guards.check(&asker, subject, json!({"a": 1, "b": 2})).await {
                Ok(passed) => assert!(!passed.mutated, "{passed:?}"),
                Err(stop) => denied.push(stop),
            }
        }
        let [Stop::Denied { guardrail, reason }] = &denied[..] else {
            panic!("{:?}: one denial, not {denied:?}", subject.phase)
        };
        assert_eq!(&**guardrail, "Guardrail/g");
        assert!(reason.contains("over the limit of"), "{reason}");
        // The checker answered: its verdict is not retried on another replica.
        let log = asker.log.lock().unwrap();
        let denial = log.iter().find(|record| record.decision == "deny").unwrap();
        assert_eq!((denial.replica.clone(), denial.attempts), (replica(&big), 1));
    }
}

#[tokio::test]
async fn the_builtin_guards_mutation_has_the_same_limit() {
    let redacting = || {
        guard(json!({
            "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
            "phases": ["McpRequest", "McpResponse"],
            "failureMode": "FailOpen",
            "builtin": {"redact": [{"pattern": "\\d"}]},
        }))
    };
    // Just under the route's limit, and made far longer by the redaction.
    let arguments = json!({"n": "1 2 3 4 5 6 7 8 9"});
    let limit = arguments.to_string().len() as u64 + 1;
    let asker = asker_limited(limit);
    let guards = Guards(vec![Arc::new(redacting())].into());
    let stop = guards.check(&asker, &SUM, arguments.clone()).await.unwrap_err();
    let Stop::Denied { reason, .. } = stop else {
        panic!("{stop:?}")
    };
    assert!(reason.contains(&format!("over the limit of {limit}")), "{reason}");
    // A result has a result's limit, whatever the route lets a request be.
    let passed = guards.check(&asker, &SUM_RESULT, arguments).await.unwrap();
    assert!(passed.mutated);
    assert_eq!(decisions(&asker), ["deny", "mutate"]);
}

#[tokio::test(start_paused = true)]
async fn failed_checks_are_logged_through_the_guards_throttle() {
    let guard = Arc::new(guard(json!({
        "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
        "phases": ["McpRequest"],
        "failureMode": "FailOpen",
        "builtin": {"deny": [{"pattern": "x"}], "maxBytes": 4},
    })));
    let guards = Guards(vec![guard.clone()].into());
    let asker = asker();
    for _ in 0..3 {
        let passed = guards.check(&asker, &SUM, json!({"a": 1, "b": 2})).await.unwrap();
        assert!(!passed.mutated);
    }
    assert_eq!(decisions(&asker), ["failed_open"; 3]);
    // The clock is paused: only the first failure took the interval's one line, and the
    // next line counts the two left out.
    tokio::time::advance(FAILURE_WARN_INTERVAL).await;
    assert_eq!(guard.failure_warnings.admit(), Some(2));
}

#[test]
fn selection_follows_methods_and_name_patterns() {
    let spec: GuardrailSpec = serde_json::from_value(json!({
        "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
        "phases": ["McpRequest"],
        "methods": ["tools/call"],
        "names": ["get-*"],
        "builtin": {"deny": [{"pattern": "x"}]},
    }))
    .unwrap();
    assert!(spec.selects(GuardrailPhase::McpRequest, "tools/call", "get-sum"));
    assert!(!spec.selects(GuardrailPhase::McpRequest, "tools/call", "echo"));
    assert!(!spec.selects(GuardrailPhase::McpRequest, "prompts/get", "get-sum"));

    // By default every method it can check: a completion's request, never its suggestions.
    let every_method: GuardrailSpec = serde_json::from_value(json!({
        "targetRefs": [{"kind": "McpBackend", "name": "tools"}],
        "phases": ["McpRequest", "McpResponse"],
        "builtin": {"deny": [{"pattern": "x"}]},
    }))
    .unwrap();
    assert!(every_method.selects(GuardrailPhase::McpRequest, "completion/complete", "salaries"));
    assert!(!every_method.selects(GuardrailPhase::McpResponse, "completion/complete", "salaries"));
    assert!(every_method.selects(GuardrailPhase::McpResponse, "prompts/get", "salaries"));
}

/// A checker hears of the caller's headers only those its Guardrail lists.
#[tokio::test]
async fn checks_carry_only_the_caller_headers_a_guardrail_lists() {
    let mut headers = http::HeaderMap::new();
    for (name, value) in [
        ("authorization", "Bearer alice"),
        ("x-user", "alice"),
        ("x-user", "admin"),
        ("user-agent", "client/1"),
        ("x-team", "blue"),
    ] {
        headers.append(name, http::HeaderValue::from_static(value));
    }
    let asker = Asker {
        headers: Arc::new(headers),
        ..asker()
    };
    let listing = guard(service(
        &[closed_port()],
        json!({"callerHeaders": ["X-User", "user-agent", "x-absent"]}),
    ));
    let caller = asker.caller(&listing);
    assert_eq!(caller.address, "127.0.0.1");
    let mut heard: Vec<_> = caller.headers.into_iter().collect();
    heard.sort();
    assert_eq!(
        heard,
        [
            ("user-agent".to_string(), "client/1".to_string()),
            ("x-user".to_string(), "alice, admin".to_string()),
        ]
    );
    let silent = guard(service(&[closed_port()], json!({})));
    assert!(asker.caller(&silent).headers.is_empty(), "none unless listed");
}
