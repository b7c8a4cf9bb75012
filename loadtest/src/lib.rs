//! Test servers, load generators and benchmarks for Portcullis.
//!
//! `echo` and `http` run against real sockets on loopback; `floor` holds the reference
//! forwarders `http-bench.sh` measures beside Portcullis; `fanout` measures the control
//! plane's config stream against a running cluster; `guardrail` is the reference
//! guardrail checker (gRPC); `sim` simulates a vLLM fleet
//! in virtual time, `vllm` serves it over HTTP; `llm` is the load generator, which also drives
//! the `mcp` test server. Shared by several of them: `baseline` (ratios against the first
//! target, for `http` and `llm` reports) and `sse` (SSE framing, for the LLM and MCP clients
//! and the `vllm` tests); `plot` draws the SVG charts. Nothing here is imported by the control
//! plane or the proxy.

pub mod baseline;
pub mod echo;
pub mod fanout;
pub mod floor;
pub mod guardrail;
pub mod llm;
pub mod mcp;
pub mod plot;
pub mod sim;
pub mod sse;
pub mod vllm;
