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

/// A TLS terminator in front of `backend`, with a fresh self-signed certificate for
/// 127.0.0.1; returns its address, the certificate (PEM) and how many handshakes completed.
#[allow(deprecated)] // ring's provider: the one the proxy uses (see upstream/tls.rs).
async fn tls_front(backend: SocketAddr) -> (SocketAddr, String, Arc<AtomicUsize>) {
    let key = rcgen::KeyPair::generate().unwrap();
    let certificate = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![certificate.der().clone()],
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
    (address, certificate.pem(), handshakes)
}

/// Two listeners: `trusted` to the server with its CA named, `untrusted` to the same server
/// relying on the built-in roots, which do not hold the test's certificate.
fn https_config(trusted: u16, untrusted: u16, server: SocketAddr, tls: &str) -> String {
    let mut config = String::new();
    for (name, port, tls) in [("trusted", trusted, tls), ("untrusted", untrusted, "")] {
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

#[test]
fn an_https_server_is_reached_with_its_ca_and_refused_without() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let (front, pem, handshakes) = runtime.block_on(tls_front(math));
    let (trusted, untrusted) = (free_port(), free_port());
    let gateway = start_gateway(
        dir.path(),
        &https_config(trusted, untrusted, front, &ca_section(&pem)),
    );

    runtime.block_on(async {
        let client = rmcp_client(trusted).await;
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
        handshakes.load(Ordering::SeqCst) >= 1,
        "the gateway spoke TLS to the server"
    );

    // The built-in roots do not hold the test's certificate: the gateway refuses to talk to
    // the server, and says why in the protocol's shape.
    let before = handshakes.load(Ordering::SeqCst);
    let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "wire", "version": "0"}}});
    let response =
        http_request_with(untrusted, "POST", "/mcp", &[ACCEPT_BOTH], Some(&body.to_string())).unwrap();
    let answer = json_or_last_event(&response.body);
    assert_eq!(response.status, 200, "{}", response.body);
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("server math") && message.contains("certificate"),
        "{answer}"
    );
    assert_eq!(
        handshakes.load(Ordering::SeqCst),
        before,
        "no handshake completed with an untrusted certificate"
    );

    // Bundles that cannot work are refused at apply, naming the field; the version in force
    // stays.
    let version = config_version(&gateway.address);
    let http_with_tls = https_config(trusted, untrusted, front, &ca_section(&pem)).replacen(
        &format!("https://{front}"),
        &format!("http://{front}"),
        1,
    );
    let not_pem = https_config(trusted, untrusted, front, &ca_section("not a certificate"));
    let truncated = https_config(
        trusted,
        untrusted,
        front,
        &ca_section(&pem.replacen("-----END CERTIFICATE-----", "", 1)),
    );
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
