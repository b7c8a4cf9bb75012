//! One pod's HTTP/1.1 server: connection handling, routing, `/health`, `/metrics`,
//! `/v1/models` and the runtime LoRA endpoints.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::metrics;
use super::openai::{generate, Endpoint};
use super::pod::Pod;
use super::reply::{bad_request, error, http_status, json, unix_now, with_type, Body};

/// Largest request body accepted; far above any prompt that fits the context window.
const MAX_BODY_BYTES: usize = 64 << 20;

/// Serves `listener` until `shutdown` fires; open connections are dropped with it.
pub(super) async fn serve(listener: TcpListener, pod: Arc<Pod>, mut shutdown: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Streamed tokens are small writes that must leave immediately.
                    if let Err(error) = stream.set_nodelay(true) {
                        tracing::debug!(%error, "cannot set TCP_NODELAY");
                    }
                    let pod = pod.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |request| route(request, pod.clone()));
                        if let Err(error) = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await
                        {
                            tracing::debug!(%error, "connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // Typically out of file descriptors: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = shutdown.changed() => return,
        }
    }
}

async fn route(request: Request<Incoming>, pod: Arc<Pod>) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_string();
    let allowed = match path.as_str() {
        "/v1/completions" | "/v1/chat/completions" | "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" => {
            Method::POST
        }
        "/v1/models" | "/health" | "/metrics" => Method::GET,
        _ => return Ok(http_status(StatusCode::NOT_FOUND)),
    };
    if request.method() != allowed {
        let mut response = http_status(StatusCode::METHOD_NOT_ALLOWED);
        response.headers_mut().insert(
            header::ALLOW,
            HeaderValue::from_static(if allowed == Method::GET { "GET" } else { "POST" }),
        );
        return Ok(response);
    }
    Ok(match path.as_str() {
        "/health" => with_type(StatusCode::OK, Bytes::new(), "application/json"),
        "/metrics" => with_type(
            StatusCode::OK,
            metrics::render(&pod.settings, &pod.snapshot()),
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        "/v1/models" => models(&pod),
        _ => {
            let body = match Limited::new(request.into_body(), MAX_BODY_BYTES).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => return Ok(bad_request(format!("cannot read request body: {e}"))),
            };
            match path.as_str() {
                "/v1/completions" => generate(pod, Endpoint::Completions, body).await,
                "/v1/chat/completions" => generate(pod, Endpoint::Chat, body).await,
                "/v1/load_lora_adapter" => load_lora(&pod, &body),
                _ => unload_lora(&pod, &body),
            }
        }
    })
}

/// vLLM's model card: the base model, then every adapter with the base as its parent.
fn models(pod: &Pod) -> Response<Body> {
    let created = unix_now();
    let base = &pod.settings.model;
    let card = |id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>| {
        json!({
            "id": id, "object": "model", "created": created, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": max_model_len, "permission": [],
        })
    };
    let mut data = vec![card(base, base, None, Some(pod.settings.max_model_len))];
    for (name, path) in pod.adapters() {
        data.push(card(&name, &path, Some(base), None));
    }
    json(StatusCode::OK, &json!({ "object": "list", "data": data }))
}

#[derive(Deserialize)]
struct LoraRequest {
    lora_name: Option<String>,
    lora_path: Option<String>,
}

fn parse_lora(body: &[u8]) -> Result<LoraRequest, String> {
    serde_json::from_slice(body).map_err(|e| format!("Invalid JSON body: {e}"))
}

/// `POST /v1/load_lora_adapter`, answered with vLLM's plain-text success message.
fn load_lora(pod: &Pod, body: &[u8]) -> Response<Body> {
    let request = match parse_lora(body) {
        Ok(request) => request,
        Err(message) => return bad_request(message),
    };
    let (Some(name), Some(path)) = (request.lora_name, request.lora_path) else {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.",
        );
    };
    if name.is_empty() || name == pod.settings.model || !pod.load_adapter(&name, &path) {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            format!("The lora adapter '{name}' has already been loaded."),
        );
    }
    with_type(
        StatusCode::OK,
        format!("Success: LoRA adapter '{name}' added successfully."),
        "text/plain; charset=utf-8",
    )
}

/// `POST /v1/unload_lora_adapter`.
fn unload_lora(pod: &Pod, body: &[u8]) -> Response<Body> {
    let request = match parse_lora(body) {
        Ok(request) => request,
        Err(message) => return bad_request(message),
    };
    let Some(name) = request.lora_name else {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        );
    };
    if !pod.unload_adapter(&name) {
        return error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The lora adapter '{name}' cannot be found."),
        );
    }
    with_type(
        StatusCode::OK,
        format!("Success: LoRA adapter '{name}' removed successfully."),
        "text/plain; charset=utf-8",
    )
}
