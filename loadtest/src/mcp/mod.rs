//! MCP over Streamable HTTP: a test server that speaks both protocol eras on one endpoint
//! (legacy 2025-06-18/2025-11-25 with sessions, and the stateless 2026-07-28), and the calls
//! `portcullis loadtest` (api type `mcp`) drives it with, or a gateway in front of it.
//!
//! `protocol` holds the wire constants and framing both sides share; `server`, `dispatch` and
//! `tools` are the test server; `client` is one MCP connection (SSE answers go through the
//! crate's [`crate::sse`] parser; `portcullis mcp pin` lists tools with it too) and `caller`
//! the load generator's "next call".

mod caller;
mod client;
mod dispatch;
mod protocol;
mod server;
mod tools;

pub use caller::{McpCaller, CORE_FAILURE_KINDS};
pub use client::{Connection, Endpoint, Era};
pub use server::{serve, start, McpServer, McpServerArgs, McpServerConfig, ServedEras, ENDPOINT};

#[cfg(test)]
mod load_tests;
#[cfg(test)]
mod server_tests;
