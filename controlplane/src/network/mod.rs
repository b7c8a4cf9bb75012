//! Raft RPCs between control-plane nodes over the `Raft` gRPC service. Payloads are
//! openraft's own serde types as JSON: requests as-is, responses as the `Result` the
//! remote `Raft` handle returned, so remote Raft errors arrive typed.

mod client;
mod server;

pub use client::NetworkFactory;
pub use server::RaftService;
