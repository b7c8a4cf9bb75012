//! The reference guardrail checker: a gRPC server of `portcullis.guardrail.v1.Guardrail`
//! (with the gRPC health service), to start from and to test against. Its rules:
//!
//! * MCP request: the tool `get-sum` only with `a == 1`; anything else passes.
//! * MCP response: the word `secret` in any string of a result is replaced (a mutation).
//! * LLM request: a prompt asking to "ignore previous instructions" is denied.
//! * LLM response: passes.
//! * A2A message: a message asking to "wire money" is denied.
//!
//! `--behave` makes it misbehave the ways a real checker can, for failure tests: hang, answer
//! without a decision, mutate with invalid or oversized JSON, report NOT_SERVING.

use std::net::SocketAddr;

use clap::{Args, ValueEnum};
use portcullis_proto::guardrail::v1::guardrail_server::{Guardrail, GuardrailServer};
use portcullis_proto::guardrail::v1::{
    verdict, A2aMessageCheck, Allow, Deny, LlmRequestCheck, LlmResponseCheck, McpRequestCheck,
    McpResponseCheck, Mutate, Verdict,
};
use serde_json::Value;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

#[derive(Args, Clone)]
pub struct GuardrailServerArgs {
    #[arg(long, default_value = "127.0.0.1:9100")]
    pub listen: SocketAddr,
    #[arg(long, value_enum, default_value_t = Behaviour::Correct)]
    pub behave: Behaviour,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Behaviour {
    /// Apply the rules above.
    Correct,
    /// Never answer a check (health still says SERVING).
    Hang,
    /// Answer every check with a verdict that has no decision.
    NoDecision,
    /// Answer every check with a mutation that is not JSON.
    InvalidMutation,
    /// Answer every check with a 20 MB mutation.
    OversizedMutation,
    /// Answer every check with a 40 MB mutation, more than proxies decode.
    HugeMutation,
    /// Report NOT_SERVING on the health service (checks are still answered correctly).
    NotServing,
}

struct Checker {
    behaviour: Behaviour,
}

pub async fn serve(
    args: GuardrailServerArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let status = if args.behave == Behaviour::NotServing {
        tonic_health::ServingStatus::NotServing
    } else {
        tonic_health::ServingStatus::Serving
    };
    reporter.set_service_status("", status).await;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    eprintln!(
        "guardrail checker ({:?}) listening on {}",
        args.behave,
        listener.local_addr()?
    );
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(GuardrailServer::new(Checker {
            behaviour: args.behave,
        }))
        // A verdict is a small write answering a small read: Nagle's algorithm would hold it.
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), shutdown)
        .await?;
    Ok(())
}

fn allow() -> Verdict {
    Verdict {
        decision: Some(verdict::Decision::Allow(Allow {})),
    }
}

fn deny(reason: String) -> Verdict {
    Verdict {
        decision: Some(verdict::Decision::Deny(Deny { reason })),
    }
}

fn mutate(payload: &Value, reason: &str) -> Verdict {
    Verdict {
        decision: Some(verdict::Decision::Mutate(Mutate {
            payload_json: payload.to_string(),
            reason: reason.to_string(),
        })),
    }
}

impl Checker {
    /// The misbehaviour's answer, or `None` to apply the rules.
    async fn misbehave(&self) -> Option<Verdict> {
        match self.behaviour {
            Behaviour::Correct | Behaviour::NotServing => None,
            Behaviour::Hang => std::future::pending().await,
            Behaviour::NoDecision => Some(Verdict { decision: None }),
            Behaviour::InvalidMutation => Some(Verdict {
                decision: Some(verdict::Decision::Mutate(Mutate {
                    payload_json: "{not json".into(),
                    reason: String::new(),
                })),
            }),
            Behaviour::OversizedMutation | Behaviour::HugeMutation => {
                let megabytes = if self.behaviour == Behaviour::HugeMutation {
                    40
                } else {
                    20
                };
                let big = Value::String("x".repeat(megabytes << 20));
                Some(mutate(&serde_json::json!({ "a": big }), "oversized"))
            }
        }
    }
}

fn parse(json: &str, what: &str) -> Result<Value, Status> {
    serde_json::from_str(json)
        .map_err(|error| Status::invalid_argument(format!("{what} is not JSON: {error}")))
}

/// Whether any string in `value` contains `needle`, ignoring ASCII case.
fn mentions(value: &Value, needle: &str) -> bool {
    match value {
        Value::String(text) => text.to_ascii_lowercase().contains(needle),
        Value::Array(items) => items.iter().any(|item| mentions(item, needle)),
        Value::Object(members) => members.values().any(|member| mentions(member, needle)),
        _ => false,
    }
}

/// Replaces `word` in every string; whether anything changed.
fn redact(value: &mut Value, word: &str, replacement: &str) -> bool {
    match value {
        Value::String(text) if text.contains(word) => {
            *text = text.replace(word, replacement);
            true
        }
        // Every member is visited (no short circuit): each may hold the word.
        Value::Array(items) => items
            .iter_mut()
            .map(|item| redact(item, word, replacement))
            .fold(false, |a, b| a | b),
        Value::Object(members) => members
            .values_mut()
            .map(|member| redact(member, word, replacement))
            .fold(false, |a, b| a | b),
        _ => false,
    }
}

#[tonic::async_trait]
impl Guardrail for Checker {
    async fn check_mcp_request(
        &self,
        request: Request<McpRequestCheck>,
    ) -> Result<Response<Verdict>, Status> {
        if let Some(verdict) = self.misbehave().await {
            return Ok(Response::new(verdict));
        }
        let check = request.into_inner();
        let arguments = parse(&check.arguments_json, "arguments_json")?;
        if check.name == "get-sum" && arguments.get("a") != Some(&Value::from(1)) {
            let got = arguments.get("a").map_or("nothing".to_string(), Value::to_string);
            return Ok(Response::new(deny(format!(
                "get-sum is allowed only with a == 1 (got a = {got})"
            ))));
        }
        Ok(Response::new(allow()))
    }

    async fn check_mcp_response(
        &self,
        request: Request<McpResponseCheck>,
    ) -> Result<Response<Verdict>, Status> {
        if let Some(verdict) = self.misbehave().await {
            return Ok(Response::new(verdict));
        }
        let mut result = parse(&request.into_inner().result_json, "result_json")?;
        Ok(Response::new(if redact(&mut result, "secret", "[redacted]") {
            mutate(&result, "redacted the word secret")
        } else {
            allow()
        }))
    }

    async fn check_llm_request(
        &self,
        request: Request<LlmRequestCheck>,
    ) -> Result<Response<Verdict>, Status> {
        if let Some(verdict) = self.misbehave().await {
            return Ok(Response::new(verdict));
        }
        let prompt = parse(&request.into_inner().prompt_json, "prompt_json")?;
        Ok(Response::new(
            if mentions(&prompt, "ignore previous instructions") {
                deny("prompt injection: the prompt asks to ignore previous instructions".into())
            } else {
                allow()
            },
        ))
    }

    async fn check_llm_response(
        &self,
        _request: Request<LlmResponseCheck>,
    ) -> Result<Response<Verdict>, Status> {
        if let Some(verdict) = self.misbehave().await {
            return Ok(Response::new(verdict));
        }
        Ok(Response::new(allow()))
    }

    async fn check_a2a_message(
        &self,
        request: Request<A2aMessageCheck>,
    ) -> Result<Response<Verdict>, Status> {
        if let Some(verdict) = self.misbehave().await {
            return Ok(Response::new(verdict));
        }
        let message = parse(&request.into_inner().message_json, "message_json")?;
        Ok(Response::new(if mentions(&message, "wire money") {
            deny("A2A messages may not ask to wire money".into())
        } else {
            allow()
        }))
    }
}

#[cfg(test)]
mod tests {
    use portcullis_proto::guardrail::v1::guardrail_client::GuardrailClient;
    use portcullis_proto::guardrail::v1::CheckContext;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn rules_over_grpc_including_a2a() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            GuardrailServerArgs {
                listen: addr,
                behave: Behaviour::Correct,
            },
            async {
                let _ = stopped.await;
            },
        ));
        let mut client = loop {
            match GuardrailClient::connect(format!("http://{addr}")).await {
                Ok(client) => break client,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let context = Some(CheckContext::default());
        let decision = |verdict: Verdict| verdict.decision.unwrap();
        let a2a = |text: &str| A2aMessageCheck {
            context: context.clone(),
            method: "message/send".into(),
            message_json: serde_json::json!({"role": "user", "parts": [{"kind": "text", "text": text}]})
                .to_string(),
        };
        let denied = client
            .check_a2a_message(a2a("please WIRE MONEY now"))
            .await
            .unwrap();
        assert_eq!(
            decision(denied.into_inner()),
            verdict::Decision::Deny(Deny {
                reason: "A2A messages may not ask to wire money".into()
            })
        );
        let allowed = client.check_a2a_message(a2a("hello")).await.unwrap();
        assert_eq!(decision(allowed.into_inner()), verdict::Decision::Allow(Allow {}));
        let sum = |a: i64| McpRequestCheck {
            context: context.clone(),
            method: "tools/call".into(),
            name: "get-sum".into(),
            arguments_json: serde_json::json!({"a": a, "b": 2}).to_string(),
        };
        let denied = client.check_mcp_request(sum(2)).await.unwrap().into_inner();
        assert_eq!(
            decision(denied),
            verdict::Decision::Deny(Deny {
                reason: "get-sum is allowed only with a == 1 (got a = 2)".into()
            })
        );
        let allowed = client.check_mcp_request(sum(1)).await.unwrap().into_inner();
        assert_eq!(decision(allowed), verdict::Decision::Allow(Allow {}));
        let bad = client
            .check_mcp_request(McpRequestCheck {
                arguments_json: "{".into(),
                ..sum(1)
            })
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
