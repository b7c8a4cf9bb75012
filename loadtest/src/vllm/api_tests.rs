//! OpenAI-surface tests over real HTTP: streaming, usage, prefix caching, bad input.

use http::{Method, StatusCode};
use serde_json::{json, Value};

use super::start;
use super::test_client::{config, fleet, metrics, post, text, Sse, MODEL};
use crate::sim::tokenizer::encode;

#[tokio::test]
async fn streaming_chat_is_incremental_and_ends_with_usage_and_done() {
    // Slow enough (≈ 6 ms per decode step) that the stream visibly outlasts its first token.
    let fleet = fleet(1, 2.0).await;
    let addr = fleet.addrs()[0];
    let request = json!({
        "model": MODEL, "stream": true, "max_completion_tokens": 40,
        "stream_options": { "include_usage": true },
        "messages": [{ "role": "system", "content": "Be brief." },
                     { "role": "user", "content": [{ "type": "text", "text": "Say hi." }] }],
    });
    let mut sse = Sse::open(addr, "/v1/chat/completions", &request).await;

    let role: Value = serde_json::from_str(&sse.next().await.unwrap()).unwrap();
    assert_eq!(role["object"], "chat.completion.chunk");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let first: Value = serde_json::from_str(&sse.next().await.unwrap()).unwrap();
    assert!(!first["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    // The first token reached us while the engine was still generating the rest.
    let during = metrics(addr).await;
    assert_eq!(during.get("vllm:num_requests_running"), 1.0);
    assert!(during.get("vllm:generation_tokens_total") < 40.0);

    let mut content = first["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut events = vec![];
    while let Some(data) = sse.next().await {
        events.push(data);
    }
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (usage, tokens) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 40);
    assert_eq!(tokens.len(), 39);
    for chunk in tokens {
        assert_eq!(chunk["id"], role["id"]);
        content.push_str(chunk["choices"][0]["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(tokens[38]["choices"][0]["finish_reason"], "length");
    assert!(tokens[..38]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert_eq!(content.split(' ').count(), 40);
    let prompt_tokens = usage["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["usage"]["total_tokens"], prompt_tokens + 40);
    fleet.shutdown().await;
}

#[tokio::test]
async fn completion_reports_exact_usage_and_streams_without_usage_by_default() {
    let fleet = fleet(1, 50.0).await;
    let addr = fleet.addrs()[0];
    let prompt = "The quick brown fox jumps over the lazy dog";
    let (status, body) = post(
        addr,
        "/v1/completions",
        &json!({ "model": MODEL, "prompt": prompt, "max_tokens": 7 }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    let n = encode(prompt).len();
    assert_eq!(
        body["usage"],
        json!({ "prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7,
                "prompt_tokens_details": { "cached_tokens": 0 } })
    );
    assert_eq!(body["choices"][0]["text"].as_str().unwrap().split(' ').count(), 7);
    // Default max_tokens is 16, like vLLM's completions endpoint.
    let (_, body) = post(addr, "/v1/completions", &json!({ "prompt": [1, 2, 3] })).await;
    assert_eq!(body["usage"]["completion_tokens"], 16);

    let stream = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": true });
    let mut sse = Sse::open(addr, "/v1/completions", &stream).await;
    let mut events = vec![];
    while let Some(data) = sse.next().await {
        events.push(data);
    }
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[3], "[DONE]");
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none());
    fleet.shutdown().await;
}

/// Wall time from sending `prompt` to its first streamed token.
/// Streams one completion and returns the prompt tokens it reported as cached.
async fn cached_tokens(addr: std::net::SocketAddr, prompt: &str) -> u64 {
    let request = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true,
                          "stream_options": { "include_usage": true } });
    let mut sse = Sse::open(addr, "/v1/completions", &request).await;
    let mut usage = Value::Null;
    while let Some(data) = sse.next().await {
        if let Ok(chunk) = serde_json::from_str::<Value>(&data) {
            usage = chunk["usage"].clone();
        }
    }
    usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn shared_prefix_is_served_from_cache() {
    // That a cache hit also cuts prefill time is shown in virtual time (sim engine tests):
    // comparing two wall-clock TTFTs here would flake on a loaded machine.
    let fleet = fleet(1, 4.0).await;
    let addr = fleet.addrs()[0];
    let shared: Vec<String> = (0..3000).map(|i| format!("t{}", i % 997)).collect();
    let shared = shared.join(" ");
    assert_eq!(cached_tokens(addr, &format!("{shared} first question")).await, 0);
    let cached = cached_tokens(addr, &format!("{shared} another one")).await;
    assert!(cached > 0 && cached % 16 == 0 && cached <= 3000, "{cached}");
    assert!(cached >= 2976, "the whole shared prefix is reused: {cached}");
    let m = metrics(addr).await;
    assert_eq!(m.get("vllm:prefix_cache_hits_total"), cached as f64);
    fleet.shutdown().await;
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, kind: &str) {
    assert_eq!(status, want, "{body}");
    let error = body["error"].as_object().unwrap_or_else(|| panic!("{body}"));
    assert_eq!(error.len(), 4, "{body}");
    assert_eq!(error["type"], kind, "{body}");
    assert_eq!(error["code"], want.as_u16(), "{body}");
    assert!(error["param"].is_null());
    assert!(!error["message"].as_str().unwrap().is_empty());
}

#[tokio::test]
async fn bad_input_gets_vllm_errors_and_the_server_keeps_serving() {
    let mut config = config(1, 50.0);
    config.profile.max_model_len = 64;
    let fleet = start(config).await.unwrap();
    let addr = fleet.addrs()[0];
    let chat = "/v1/chat/completions";
    let cmpl = "/v1/completions";
    let (status, body) = text(addr, Method::POST, chat, "{not json").await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_error(status, &body, StatusCode::BAD_REQUEST, "BadRequestError");

    let user = json!([{ "role": "user", "content": "hi" }]);
    let long = "word ".repeat(100);
    let bad_requests = [
        (chat, json!({ "model": MODEL })),
        (cmpl, json!({ "model": MODEL, "max_tokens": 3 })),
        (chat, json!({ "model": MODEL, "messages": user, "max_tokens": 0 })),
        (cmpl, json!({ "model": MODEL, "prompt": "hi", "max_tokens": -5 })),
        (chat, json!({ "model": MODEL, "messages": "not a list" })),
        (cmpl, json!({ "model": MODEL, "prompt": "" })),
        (cmpl, json!({ "model": MODEL, "prompt": ["a", "b"] })),
        (chat, json!({ "model": MODEL, "messages": user, "n": 2 })),
        (
            cmpl,
            json!({ "model": MODEL, "prompt": "hi", "max_tokens": 1000 }),
        ),
        (
            chat,
            json!({ "model": MODEL, "messages": [{ "role": "user", "content": long }] }),
        ),
    ];
    for (path, request) in bad_requests {
        let (status, body) = post(addr, path, &request).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "BadRequestError");
    }
    let (_, body) = post(addr, cmpl, &json!({ "prompt": long })).await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("maximum context length is 64 tokens"),
        "{message}"
    );
    assert!(message.contains("100 tokens in the prompt"), "{message}");

    let (status, body) = post(addr, chat, &json!({ "model": "nope", "messages": user })).await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "NotFoundError");
    assert_eq!(body["error"]["message"], "The model `nope` does not exist.");
    for (method, path, want) in [
        (Method::GET, chat, StatusCode::METHOD_NOT_ALLOWED),
        (Method::POST, "/metrics", StatusCode::METHOD_NOT_ALLOWED),
        (Method::DELETE, "/health", StatusCode::METHOD_NOT_ALLOWED),
        (Method::GET, "/v2/nothing", StatusCode::NOT_FOUND),
    ] {
        let (status, body) = text(addr, method, path, "").await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_error(status, &body, want, want.canonical_reason().unwrap());
    }

    // Still serving, and nothing was queued by the refused requests.
    let (status, body) = post(addr, chat, &json!({ "messages": user, "max_tokens": 2 })).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    // Without max_tokens a chat gets the rest of the context.
    let (_, body) = post(addr, chat, &json!({ "messages": user })).await;
    assert_eq!(body["usage"]["total_tokens"], 64);
    assert_eq!(metrics(addr).await.get("vllm:request_success_total"), 2.0);
    fleet.shutdown().await;
}
