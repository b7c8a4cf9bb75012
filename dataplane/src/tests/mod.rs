//! End-to-end tests across modules: real sockets, real hyper upstreams and clients.

mod admin;
mod apply;
mod future_sizes;
mod pipeline;
mod property;
mod proxying;
mod subscription;
pub(crate) mod support;
mod telemetry;
