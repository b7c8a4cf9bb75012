//! gRPC contracts of Portcullis. This crate depends on none of the other Portcullis crates:
//! it is the only thing the control plane and the data plane share on the wire.

pub mod v1 {
    tonic::include_proto!("portcullis.v1");
}

/// The guardrail contract: what proxies ask external checking services (any language).
pub mod guardrail {
    pub mod v1 {
        tonic::include_proto!("portcullis.guardrail.v1");
    }
}

/// Largest message the control plane's gRPC services accept or send, and the limit their
/// clients must set too: well above tonic's 4 MiB default, since a whole config (a proxy's
/// snapshot, a `list`) or a Raft message carrying one travels in one message.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Most placements one PlacementBatch may carry; the control plane refuses larger ones.
pub const MAX_PLACEMENTS_PER_BATCH: usize = 256;

/// Most prompt hashes one Placement may carry; the control plane refuses longer ones.
pub const MAX_PROMPT_HASHES: usize = 256;

/// Metadata key a follower sets, on UNAVAILABLE, to the admin address of the current leader.
pub const LEADER_METADATA_KEY: &str = "x-portcullis-leader";
