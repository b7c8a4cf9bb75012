//! Secrets a proxy needs (session sealing keys, TLS client keys) never travel in config: an
//! object says where each proxy reads one, and only the proxy reads it.

use serde::{Deserialize, Serialize};

use crate::error::Checker;

/// Where a proxy reads a secret: the secret itself is never in the config.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub enum SecretSource {
    /// An environment variable of the proxy process.
    Env(String),
    /// A file on the proxy's disk (a mounted Kubernetes Secret); read again with each
    /// config version.
    File(String),
}

/// Where, never what: `env MCP_KEY`, `file /run/secrets/key.pem`.
impl std::fmt::Display for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretSource::Env(name) => write!(f, "env {name}"),
            SecretSource::File(path) => write!(f, "file {path}"),
        }
    }
}

impl SecretSource {
    /// Refuses a source no proxy could read from: an invalid variable name, a relative path.
    pub fn check(&self, checker: &mut Checker<'_>, field: &str) {
        match self {
            SecretSource::Env(name) => {
                let valid = !name.is_empty()
                    && !name.starts_with(|c: char| c.is_ascii_digit())
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    checker.fail(format!("{field}.env"), format!("invalid variable name {name:?}"));
                }
            }
            SecretSource::File(path) => {
                if !path.starts_with('/') {
                    checker.fail(
                        format!("{field}.file"),
                        format!("{path:?} is not an absolute path"),
                    );
                }
            }
        }
    }

    /// The secret, read by the proxy. The error names the source, never any content.
    pub fn read(&self) -> Result<String, String> {
        match self {
            SecretSource::Env(name) => std::env::var(name)
                .map_err(|_| format!("environment variable {name} is not set or not UTF-8")),
            SecretSource::File(path) => {
                std::fs::read_to_string(path).map_err(|error| format!("cannot read {path}: {}", error.kind()))
            }
        }
    }
}
