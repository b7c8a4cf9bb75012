//! MCP servers behind `https://`: the gateway verifies each server's certificate against the
//! CAs its McpBackend names (or the built-in roots), and a bundle that cannot work is refused
//! at apply. The server is the rmcp one behind a rustls terminator with a certificate made
//! for the test.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rmcp::model::CallToolRequestParams;
use serde_json::json;

use crate::peers::*;
use crate::support::*;
use crate::wire::*;
use crate::HEADER;

/// A certificate authority made for the test.
struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for `host`, signed by this CA, and its key.
    fn leaf(&self, host: &str) -> (rustls::pki_types::CertificateDer<'static>, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = rcgen::CertificateParams::new(vec![host.to_string()])
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        (certificate.der().clone(), key)
    }
}

/// A TLS terminator in front of `backend` presenting `certificate`; returns its address and
/// how many handshakes completed.
#[allow(deprecated)] // ring's provider: the one the proxy uses (see upstream/tls.rs).
async fn tls_front(
    backend: SocketAddr,
    (certificate, key): (rustls::pki_types::CertificateDer<'static>, rcgen::KeyPair),
) -> (SocketAddr, Arc<AtomicUsize>) {
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![certificate],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let counted = handshakes.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, counted) = (acceptor.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                if let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    (address, handshakes)
}

/// One listener, McpBackend and route per entry: `(name, port, server, tls section)`.
fn https_config(entries: &[(&str, u16, SocketAddr, String)]) -> String {
    let mut config = String::new();
    for (name, port, server, tls) in entries {
        config.push_str(&format!(
            "{HEADER}\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
             {HEADER}\nkind: McpBackend\nmetadata: {{name: {name}}}\nspec:\n  servers:\n  - name: math\n    url: 'https://{server}/mcp'\n    timeout: 3s\n{tls}---\n\
             {HEADER}\nkind: Route\nmetadata: {{name: {name}}}\nspec: {{listeners: [{name}], backends: [{{kind: McpBackend, name: {name}}}]}}\n---\n"
        ));
    }
    config
}

fn ca_section(pem: &str) -> String {
    // A YAML double-quoted scalar: the PEM's newlines as `\n`.
    format!("    tls: {{caCertificates: {:?}}}\n", pem)
}

/// The JSON-RPC error message a client gets for `initialize` through `port`.
fn initialize_error(port: u16) -> String {
    let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "wire", "version": "0"}}});
    let response = http_request_with(port, "POST", "/mcp", &[ACCEPT_BOTH], Some(&body.to_string())).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    let answer = json_or_last_event(&response.body);
    answer["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("not a JSON-RPC error: {answer}"))
        .to_string()
}

#[test]
fn an_https_server_is_reached_only_with_a_certificate_its_backend_trusts() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let (ours, other) = (TestCa::new("ours"), TestCa::new("other"));
    // One front per case, so each counts its own handshakes.
    let (trusted_front, trusted_handshakes) = runtime.block_on(tls_front(math, ours.leaf("127.0.0.1")));
    let refused = [
        // (case, the CAs its backend trusts, the certificate presented, the reason given)
        (
            "otherca",
            ca_section(&other.pem()),
            ours.leaf("127.0.0.1"),
            "does not chain to a trusted CA",
        ),
        (
            "builtin",
            String::new(),
            ours.leaf("127.0.0.1"),
            "does not chain to a trusted CA",
        ),
        (
            "wronghost",
            ca_section(&ours.pem()),
            ours.leaf("elsewhere.test"),
            "not valid for its host",
        ),
    ];
    let mut entries = vec![("trusted", free_port(), trusted_front, ca_section(&ours.pem()))];
    let mut refused_fronts = Vec::new();
    for (case, tls, certificate, reason) in refused {
        let (front, handshakes) = runtime.block_on(tls_front(math, certificate));
        entries.push((case, free_port(), front, tls));
        refused_fronts.push((entries.len() - 1, handshakes, reason));
    }
    let config = https_config(&entries);
    let gateway = start_gateway(dir.path(), &config);

    // A certificate issued by the backend's CA for the URL's host: the server is reached.
    runtime.block_on(async {
        let client = rmcp_client(entries[0].1).await;
        assert!(
            tool_names(&client).await.contains(&"get-sum".to_string()),
            "the server's tools are listed over TLS"
        );
        let sum = client
            .call_tool(
                CallToolRequestParams::new("get-sum").with_arguments(arguments(json!({"a": 2, "b": 3}))),
            )
            .await
            .unwrap();
        assert_eq!(text_of(&sum), "5");
        client.cancel().await.unwrap();
    });
    assert!(
        trusted_handshakes.load(Ordering::SeqCst) >= 1,
        "the gateway spoke TLS to the server"
    );

    // Another CA, the built-in roots, a certificate for another host: the gateway refuses
    // to talk to the server, and says why in the protocol's shape, by class only: the
    // hosts a certificate names stay in the proxy's log.
    for (index, handshakes, reason) in refused_fronts {
        let (case, port, ..) = &entries[index];
        let message = initialize_error(*port);
        assert!(
            message.contains("server math") && message.contains(reason),
            "{case}: {message}"
        );
        assert!(!message.contains("elsewhere.test"), "{case}: {message}");
        assert_eq!(
            handshakes.load(Ordering::SeqCst),
            0,
            "{case}: no handshake completed"
        );
    }

    // Bundles that cannot work are refused at apply, naming the field; the version in force
    // stays.
    let version = config_version(&gateway.address);
    let with_tls = |tls: String| {
        let mut entries = entries.clone();
        entries[0].3 = tls;
        https_config(&entries)
    };
    let http_with_tls = config.replacen(
        &format!("https://{trusted_front}"),
        &format!("http://{trusted_front}"),
        1,
    );
    let not_pem = with_tls(ca_section("not a certificate"));
    let truncated = with_tls(ca_section(&ours.pem().replacen(
        "-----END CERTIFICATE-----",
        "",
        1,
    )));
    for (config, field, reason) in [
        (
            http_with_tls,
            "spec.servers[0].tls",
            "only an https:// server takes tls",
        ),
        (
            not_pem,
            "spec.servers[0].tls.caCertificates",
            "no PEM certificate",
        ),
        (truncated, "spec.servers[0].tls.caCertificates", "not valid PEM"),
    ] {
        let error = refused_apply(dir.path(), "bad.yaml", &config, &gateway.address);
        assert!(error.contains(field) && error.contains(reason), "{error}");
    }
    assert_eq!(config_version(&gateway.address), version);
}
