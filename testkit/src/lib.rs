//! Helpers shared by the tests of every crate. Only ever a dev-dependency.

mod ports;

pub use ports::free_port;
