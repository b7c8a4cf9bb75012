//! Test servers, load generators and benchmarks for Portcullis.
//!
//! Everything here runs against real sockets on loopback; nothing here is imported by the
//! control plane or the proxy.

pub mod echo;
pub mod http;
