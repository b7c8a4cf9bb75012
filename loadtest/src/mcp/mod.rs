//! MCP over Streamable HTTP: a test server that speaks both protocol eras on one endpoint
//! (legacy 2025-06-18/2025-11-25 with sessions, and the stateless 2026-07-28), and a load
//! generator that drives it (or a gateway in front of it) with `tools/call`/`tools/list`.

mod client;
mod dispatch;
mod load;
mod protocol;
mod report;
mod server;
mod tools;

pub use client::Era;
pub use load::{run, run_and_print, Arrival, McpLoadArgs, Operation};
pub use report::{McpReport, McpTargetReport};
pub use server::{serve, start, McpServer, McpServerArgs, McpServerConfig, ENDPOINT};

#[cfg(test)]
mod load_tests;
#[cfg(test)]
mod server_tests;
