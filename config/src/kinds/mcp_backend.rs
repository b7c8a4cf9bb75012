use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::kind::{KindInfo, KindSpec};
use crate::tls::UpstreamTls;
use crate::{HumanDuration, SecretSource};

/// Several MCP servers behind one route (Streamable HTTP). Their tools, prompts, resources
/// and resource templates are merged; with more than one server each name is prefixed
/// with its server's name and [`MCP_NAME_SEPARATOR`] (`math__add`), resource URIs with
/// the server's name and `+` (`math+file:///notes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct McpBackendSpec {
    pub servers: Vec<McpServerSpec>,
    /// Keys that seal session ids, so that any proxy replica can serve any session: the
    /// first seals new sessions, every one opens them (rotate by putting a new key first and
    /// dropping the old one once its sessions are gone). Each is 32 bytes, hex or base64,
    /// read by the proxy from its own environment or disk: keys never travel in config.
    /// Without keys, each proxy seals with a random key of its own, so a session works
    /// only on the replica that created it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub session_keys: Vec<SecretSource>,
    /// How long a client's session id stays valid after `initialize`; then it gets 404 and
    /// initializes again (the sealed id carries its own age, so no proxy keeps state).
    /// Default and longest: 24 h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_ttl: Option<HumanDuration>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct McpServerSpec {
    /// Lowercase letters, digits and `-`, starting with a letter: the prefix of its names.
    pub name: String,
    /// `http://host:port/path` or `https://host:port/path` of the server's MCP endpoint.
    pub url: String,
    /// How an `https://` server's certificate is verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<UpstreamTls>,
    /// Longest wait for this server's answer to one request (the headers of a streamed
    /// answer). Default 30 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<HumanDuration>,
    /// What a request that fans out to every server (initialize, the lists) does when this
    /// one fails: `Fail` the request (default) or `Omit` this server from the answer.
    #[serde(default, skip_serializing_if = "McpFailureMode::is_fail")]
    pub failure_mode: McpFailureMode,
    /// How long this server's list pages (tools, prompts, resources, templates) are reused
    /// for every client when the server says nothing itself (a 2026-07-28 server's `ttlMs`
    /// and `cacheScope` decide for it). Set it only for a server whose lists are the same
    /// in every session. Default: not reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub list_ttl: Option<HumanDuration>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum McpFailureMode {
    #[default]
    Fail,
    Omit,
}

impl McpFailureMode {
    fn is_fail(&self) -> bool {
        *self == McpFailureMode::Fail
    }
}

/// Between a server's name and one of its tool or prompt names.
pub const MCP_NAME_SEPARATOR: &str = "__";
pub const DEFAULT_MCP_SERVER_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_SERVER_NAME: usize = 32;
const MAX_SESSION_KEYS: usize = 4;

impl McpServerSpec {
    pub fn timeout(&self) -> Duration {
        self.timeout.map_or(DEFAULT_MCP_SERVER_TIMEOUT, |timeout| timeout.0)
    }
}

impl McpBackendSpec {
    pub fn session_ttl(&self) -> Duration {
        self.session_ttl.map_or(crate::duration::MAX_DURATION, |ttl| ttl.0)
    }

    /// Whether names and URIs carry their server's prefix.
    pub fn multiplexed(&self) -> bool {
        self.servers.len() > 1
    }

    pub fn server(&self, name: &str) -> Option<&McpServerSpec> {
        self.servers.iter().find(|server| server.name == name)
    }
}

/// The parts of an MCP server URL a proxy connects with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpUrl {
    /// `host:port`, the port filled in: what the proxy connects to and pools by.
    pub authority: String,
    /// For the `Host` header: the port only when it is not the scheme's default (RFC 9110
    /// §7.2), as servers that check `Host` expect.
    pub host: String,
    /// `https`: TLS to the server, verified for the URL's host.
    pub tls: bool,
    /// Path and query, at least `/`.
    pub path_and_query: String,
}

/// Parses `http[s]://host[:port][/path][?query]`; the proxy speaks HTTP/1.1 upstream.
pub fn parse_mcp_url(url: &str) -> Result<McpUrl, String> {
    let uri: http::Uri = url.parse().map_err(|error| format!("invalid URL {url:?}: {error}"))?;
    let (tls, default_port) = match uri.scheme_str() {
        Some("http") => (false, 80),
        Some("https") => (true, 443),
        Some(other) => return Err(format!("scheme {other:?} is not supported: use http or https")),
        None => return Err(format!("{url:?} is not an absolute http:// or https:// URL")),
    };
    let Some(authority) = uri.authority() else {
        return Err(format!("{url:?} has no host"));
    };
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".into());
    }
    let host = authority.host();
    if host.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    // `http` takes any text after the colon for a port (and then reports none).
    let port = match authority.as_str().get(host.len()..).unwrap_or_default() {
        "" => default_port,
        written => match written.strip_prefix(':').map(str::parse::<u16>) {
            Some(Ok(port)) if port > 0 => port,
            _ => return Err(format!("{url:?}: the port must be a number from 1 to 65535")),
        },
    };
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let authority = format!("{host}:{port}");
    // As hyper writes it: the port only when it is not the scheme's default.
    let host = if port == default_port {
        host
    } else {
        authority.clone()
    };
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| "/".to_string(), |path| path.as_str().to_string());
    Ok(McpUrl {
        authority,
        host,
        tls,
        path_and_query: if path_and_query.is_empty() {
            "/".to_string()
        } else {
            path_and_query
        },
    })
}

fn check_server_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_SERVER_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "invalid server name {name:?}: 1–{MAX_SERVER_NAME} lowercase letters, digits and \
             `-`, starting with a letter (it prefixes tool names and resource URIs)"
        ))
    }
}

impl KindSpec for McpBackendSpec {
    const INFO: &'static KindInfo = &KindInfo::of::<McpBackendSpec>("McpBackend", "mcpbackends", &["mcp"]);

    fn check(&self, checker: &mut Checker<'_>) {
        if self.servers.is_empty() {
            checker.fail("spec.servers", "at least one server is required");
        }
        for (index, server) in self.servers.iter().enumerate() {
            let field = format!("spec.servers[{index}]");
            if let Err(problem) = check_server_name(&server.name) {
                checker.fail(format!("{field}.name"), problem);
            }
            if self.servers[..index].iter().any(|other| other.name == server.name) {
                checker.fail(
                    format!("{field}.name"),
                    format!("server {:?} is listed twice", server.name),
                );
            }
            match parse_mcp_url(&server.url) {
                Err(problem) => checker.fail(format!("{field}.url"), problem),
                Ok(url) if !url.tls && server.tls.is_some() => checker.fail(
                    format!("{field}.tls"),
                    "only an https:// server takes tls (this url is http://)",
                ),
                Ok(_) => {}
            }
            if let Some(tls) = &server.tls {
                tls.check(checker, &format!("{field}.tls"));
            }
            if server.timeout.is_some_and(|timeout| timeout.0.is_zero()) {
                checker.fail(format!("{field}.timeout"), "must be above 0");
            }
            if server.list_ttl.is_some_and(|ttl| ttl.0.is_zero()) {
                checker.fail(format!("{field}.listTtl"), "must be above 0 (leave it out not to reuse lists)");
            }
        }
        if self.session_ttl.is_some_and(|ttl| ttl.0.is_zero()) {
            checker.fail("spec.sessionTtl", "must be above 0");
        }
        if self.session_keys.len() > MAX_SESSION_KEYS {
            checker.fail(
                "spec.sessionKeys",
                format!("at most {MAX_SESSION_KEYS} keys (the sealing one and those being retired)"),
            );
        }
        for (index, source) in self.session_keys.iter().enumerate() {
            let field = format!("spec.sessionKeys[{index}]");
            source.check(checker, &field);
            if self.session_keys[..index].contains(source) {
                checker.fail(field, "this key is listed twice");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_split_for_connecting() {
        let url = parse_mcp_url("http://127.0.0.1:9001/mcp").unwrap();
        assert_eq!(url.authority, "127.0.0.1:9001");
        assert_eq!(url.host, "127.0.0.1:9001");
        assert_eq!(url.path_and_query, "/mcp");
        let url = parse_mcp_url("http://tools.internal").unwrap();
        assert_eq!(url.authority, "tools.internal:80");
        assert_eq!(url.host, "tools.internal");
        assert_eq!(url.path_and_query, "/");
        let url = parse_mcp_url("http://[::1]:7/a?b=c").unwrap();
        assert_eq!(url.authority, "[::1]:7");
        assert_eq!(url.path_and_query, "/a?b=c");
        let url = parse_mcp_url("https://tools.example/mcp").unwrap();
        assert_eq!(url.authority, "tools.example:443");
        assert_eq!(url.host, "tools.example");
        assert!(url.tls);
        assert_eq!(parse_mcp_url("https://tools.example:443/").unwrap().host, "tools.example");
        assert_eq!(parse_mcp_url("https://tools.example:8443/").unwrap().host, "tools.example:8443");
        for bad in ["http://tools:abc/mcp", "http://tools:/mcp", "http://tools:99999/mcp", "http://tools:0/mcp"] {
            assert!(parse_mcp_url(bad).is_err(), "{bad}");
        }
        assert!(!parse_mcp_url("http://x:8443/mcp").unwrap().tls);
        assert!(parse_mcp_url("ftp://x/mcp").unwrap_err().contains("use http or https"));
        assert!(parse_mcp_url("/mcp").is_err());
        assert!(parse_mcp_url("http://user:pw@x/mcp").is_err());
    }

    #[test]
    fn server_names_must_make_clean_prefixes() {
        assert!(check_server_name("math").is_ok());
        assert!(check_server_name("web-search2").is_ok());
        for bad in ["", "Math", "2fa", "a_b", "a.b", &"x".repeat(33)] {
            assert!(check_server_name(bad).is_err(), "{bad:?}");
        }
    }
}
