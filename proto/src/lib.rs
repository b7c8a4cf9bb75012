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

/// Bounds on what a ConfigStream Hello may carry: a node keeps it for `portcullis status` until
/// the proxy is forgotten. A shard selector's keys and values are bounded as config labels
/// are: a longer one could match no object.
pub const MAX_HELLO_ID_BYTES: usize = 256;
pub const MAX_SHARD_LABELS: usize = 16;
pub const MAX_LABEL_BYTES: usize = 63;

/// Why a Hello is refused, if it is: the control plane refuses it, and a proxy checks its own
/// before it starts rather than be refused by every node.
pub fn hello_problem(hello: &v1::Hello) -> Option<String> {
    if hello.proxy_id.is_empty() {
        return Some("Hello.proxy_id is empty".into());
    }
    for (field, value) in [("proxy_id", &hello.proxy_id), ("instance", &hello.instance)] {
        if value.len() > MAX_HELLO_ID_BYTES {
            return Some(format!(
                "Hello.{field} is {} bytes; at most {MAX_HELLO_ID_BYTES} are accepted",
                value.len()
            ));
        }
    }
    if hello.shard.len() > MAX_SHARD_LABELS {
        return Some(format!(
            "Hello.shard has {} labels; at most {MAX_SHARD_LABELS} are accepted",
            hello.shard.len()
        ));
    }
    hello
        .shard
        .iter()
        .find(|(key, value)| key.len() > MAX_LABEL_BYTES || value.len() > MAX_LABEL_BYTES)
        .map(|(key, _)| {
            let shown: String = key.chars().take(MAX_LABEL_BYTES).collect();
            format!("Hello.shard label {shown:?}: keys and values are at most {MAX_LABEL_BYTES} bytes, as in config labels")
        })
}
