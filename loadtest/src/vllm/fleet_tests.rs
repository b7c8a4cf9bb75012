//! Fleet-level tests over real HTTP: `/metrics` against engine state, several pods, LoRA.

use http::{Method, StatusCode};
use serde_json::{json, Value};

use super::start;
use super::test_client::{config, fleet, metrics, post, text, Sse, MODEL};
use crate::sim::tokenizer::encode;

#[tokio::test]
async fn metrics_parse_and_match_the_engine_after_requests() {
    let fleet = fleet(1, 20.0).await;
    let addr = fleet.addrs()[0];
    let idle = metrics(addr).await;
    assert_eq!(idle.get("vllm:generation_tokens_total"), 0.0);
    let cache = idle.labels("vllm:cache_config_info");
    assert!(cache.contains("block_size=\"16\""), "{cache}");
    assert!(cache.contains("num_gpu_blocks=\"20000\""), "{cache}");
    assert_eq!(
        idle.labels("vllm:num_requests_running"),
        format!("model_name=\"{MODEL}\",engine=\"0\"")
    );

    let prompts = ["alpha beta gamma", "one two three four five", "x"];
    let outputs = [5, 7, 9];
    let requests = prompts.iter().zip(outputs).map(|(prompt, max_tokens)| {
        let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": max_tokens });
        async move { post(addr, "/v1/completions", &body).await }
    });
    for (status, body) in futures::future::join_all(requests).await {
        assert_eq!(status, StatusCode::OK, "{body}");
    }

    let m = metrics(addr).await;
    assert_eq!(m.get("vllm:num_requests_running"), 0.0);
    assert_eq!(m.get("vllm:num_requests_waiting"), 0.0);
    assert_eq!(m.get("vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(m.get("vllm:gpu_cache_usage_perc"), 0.0);
    assert_eq!(m.get("vllm:generation_tokens_total"), 21.0);
    let prompt_tokens: usize = prompts.iter().map(|p| encode(p).len()).sum();
    assert_eq!(m.get("vllm:prompt_tokens_total"), prompt_tokens as f64);
    assert_eq!(m.get("vllm:prefix_cache_queries_total"), prompt_tokens as f64);
    assert_eq!(m.get("vllm:request_success_total"), 3.0);
    assert_eq!(m.get("vllm:num_preemptions_total"), 0.0);
    assert_eq!(m.get("vllm:time_to_first_token_seconds_count"), 3.0);
    assert_eq!(m.get("vllm:inter_token_latency_seconds_count"), 18.0);
    let key =
        format!("vllm:inter_token_latency_seconds_bucket{{model_name=\"{MODEL}\",engine=\"0\",le=\"+Inf\"}}");
    assert_eq!(m.0[&key], 18.0);
    // Simulated ITL: a decode step of a few sequences is priced ≈ 13 ms by the profile,
    // however fast (time scale 20) or late (a loaded machine) the wall clock runs.
    let mean_itl = m.get("vllm:inter_token_latency_seconds_sum") / 18.0;
    assert!((0.010..0.020).contains(&mean_itl), "{mean_itl}");
    let lora = m.labels("vllm:lora_requests_info");
    assert_eq!(
        lora,
        "max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\""
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn pods_on_consecutive_ports_answer_independently() {
    let fleet = fleet(3, 50.0).await;
    let ports = fleet.ports();
    assert_eq!(ports, vec![ports[0], ports[0] + 1, ports[0] + 2]);
    let addrs = fleet.addrs().to_vec();
    let request = json!({ "prompt": "hello there", "max_tokens": 4 });
    let (status, _) = post(addrs[1], "/v1/completions", &request).await;
    assert_eq!(status, StatusCode::OK);
    for (i, addr) in addrs.iter().enumerate() {
        let (status, _) = text(*addr, Method::GET, "/health", "").await;
        assert_eq!(status, StatusCode::OK);
        let expected = if i == 1 { 4.0 } else { 0.0 };
        assert_eq!(metrics(*addr).await.get("vllm:generation_tokens_total"), expected);
    }
    fleet.shutdown().await;
}

async fn model_ids(addr: std::net::SocketAddr) -> Vec<Value> {
    let (status, body) = text(addr, Method::GET, "/v1/models", "").await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_str(&body).unwrap();
    body["data"].as_array().unwrap().clone()
}

#[tokio::test]
async fn lora_adapters_load_serve_and_unload() {
    let mut config = config(1, 2.0);
    config.loras = vec![("preloaded".into(), "/adapters/pre".into())];
    let fleet = start(config).await.unwrap();
    let addr = fleet.addrs()[0];
    let models = model_ids(addr).await;
    assert_eq!(models[0]["id"], MODEL);
    assert_eq!(models[1]["id"], "preloaded");
    assert_eq!(models[1]["parent"], MODEL);

    let load = json!({ "lora_name": "sql", "lora_path": "/adapters/sql" });
    let (status, body) = text(addr, Method::POST, "/v1/load_lora_adapter", &load.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "Success: LoRA adapter 'sql' added successfully.");
    let (status, _) = post(addr, "/v1/load_lora_adapter", &load).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = post(addr, "/v1/load_lora_adapter", &json!({ "lora_name": "x" })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let ids: Vec<Value> = model_ids(addr).await.iter().map(|m| m["id"].clone()).collect();
    assert_eq!(ids, vec![json!(MODEL), json!("preloaded"), json!("sql")]);

    // While an adapter request runs, the LoRA info metric names it.
    let request = json!({ "model": "sql", "max_tokens": 30, "stream": true,
                          "messages": [{ "role": "user", "content": "count rows" }] });
    let mut sse = Sse::open(addr, "/v1/chat/completions", &request).await;
    let role: Value = serde_json::from_str(&sse.next().await.unwrap()).unwrap();
    assert_eq!(role["model"], "sql");
    let lora = metrics(addr).await.labels("vllm:lora_requests_info");
    assert!(lora.contains("running_lora_adapters=\"sql\""), "{lora}");
    while sse.next().await.is_some() {}
    let lora = metrics(addr).await.labels("vllm:lora_requests_info");
    assert!(lora.contains("running_lora_adapters=\"\""), "{lora}");

    let unload = json!({ "lora_name": "sql" });
    let (status, body) = text(addr, Method::POST, "/v1/unload_lora_adapter", &unload.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = post(addr, "/v1/unload_lora_adapter", &unload).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = post(addr, "/v1/completions", &json!({ "model": "sql", "prompt": "q" })).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(model_ids(addr).await.len(), 2);
    fleet.shutdown().await;
}
