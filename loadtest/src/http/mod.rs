//! Plain-HTTP benchmark: the same closed-loop load against several targets in one run
//! (e.g. straight to the upstream, and through the proxy), reported as ratios against the
//! first target so that the noise of a shared machine cancels out.

mod compare;
mod loadgen;

pub use compare::{compare, CompareOptions, Report, TargetReport};
pub use loadgen::{closed_loop, Measurement};
