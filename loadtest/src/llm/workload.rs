//! What one target is sent: LLM requests (prompts drawn in order from the seeded generator)
//! or MCP calls. The runner only asks for "the next request" and gets a [`Trace`] back, so
//! open and closed loops, the report and the charts are the same for both.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use futures::future::BoxFuture;
use futures::FutureExt;

use super::client::{Sender, Trace};
use super::config::{ApiConfig, LoadtestConfig, Target};
use super::prompts::{text_of, PromptGen};
use crate::mcp::McpCaller;

#[derive(Clone)]
pub enum Workload {
    Llm {
        sender: Arc<Sender>,
        /// Shared by the closed-loop clients; draws stay in call order.
        prompts: Arc<Mutex<PromptGen>>,
    },
    Mcp(Arc<McpCaller>),
}

impl Workload {
    pub fn new(config: &LoadtestConfig, target: &Target) -> anyhow::Result<Workload> {
        let timeout = config.request_timeout;
        Ok(match config.api {
            ApiConfig::Llm(api) => {
                // `validate` requires both for LLM apis; these errors only guard callers
                // that skipped it.
                let model = config.model.as_deref().context("model: required for LLM apis")?;
                let data = config.data.as_ref().context("data: required for LLM apis")?;
                // A fresh generator per target: every target gets the same prompts in order.
                Workload::Llm {
                    sender: Arc::new(Sender::new(&target.url, api, model, timeout)?),
                    prompts: Arc::new(Mutex::new(PromptGen::new(data, config.load.seed))),
                }
            }
            ApiConfig::Mcp(api) => Workload::Mcp(Arc::new(McpCaller::new(&target.url, api, timeout)?)),
        })
    }

    /// Whether the token metrics apply to this workload's stages.
    pub fn has_tokens(&self) -> bool {
        matches!(self, Workload::Llm { .. })
    }

    /// Draws the next request now (so draw order is call order) and returns the future that
    /// sends it; times in the trace are seconds since `epoch`.
    pub fn next(&self, epoch: Instant) -> BoxFuture<'static, Trace> {
        match self {
            Workload::Llm { sender, prompts } => {
                // Only the prompt generator lives behind the lock; a panicked holder leaves
                // it usable.
                let (ids, max_tokens) = prompts
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .next_prompt();
                let sender = sender.clone();
                async move {
                    let prompt = ids.ids();
                    sender
                        .send(&text_of(prompt), prompt.len(), max_tokens, epoch)
                        .await
                }
                .boxed()
            }
            Workload::Mcp(caller) => {
                let caller = caller.clone();
                async move { caller.call(epoch).await }.boxed()
            }
        }
    }

    /// Releases what outlives a request: the pooled MCP sessions.
    pub async fn finish(&self) {
        if let Workload::Mcp(caller) = self {
            caller.close_idle().await;
        }
    }
}
