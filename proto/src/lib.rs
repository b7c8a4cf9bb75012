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

/// Metadata key a follower sets, on UNAVAILABLE, to the admin address of the current leader.
pub const LEADER_METADATA_KEY: &str = "x-portcullis-leader";
