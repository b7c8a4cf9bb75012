//! The Portcullis control plane: config objects replicated with Raft (openraft on sled),
//! served to operators through the Admin gRPC API and to proxies through ConfigStream.

mod admin;
mod command;
mod metrics;
mod network;
mod node;
mod placements;
mod registry;
mod signals;
mod store;
mod stream;
mod types;
mod view;

pub use node::{ControlPlane, ControlPlaneConfig};
pub use registry::DEFAULT_FORGET_AFTER;

#[cfg(test)]
mod testutil;
