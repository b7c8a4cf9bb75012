//! Test servers, load generators and benchmarks for Portcullis.
//!
//! `echo` and `http` run against real sockets on loopback; `sim` simulates a vLLM fleet
//! in virtual time. Nothing here is imported by the control plane or the proxy.

pub mod echo;
pub mod http;
pub mod llm;
pub mod mcp;
pub mod plot;
pub mod sim;
pub mod vllm;
