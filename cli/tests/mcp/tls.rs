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

    /// A client certificate signed by this CA, as PEM, and its key as PEM.
    fn client(&self, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let certificate = params.signed_by(&key, &self.issuer).unwrap();
        (certificate.pem(), key.serialize_pem())
    }

    /// This CA as the only root a server trusts for client certificates.
    fn client_verifier(&self) -> Arc<dyn rustls::server::danger::ClientCertVerifier> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).unwrap();
        rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap()
    }
}

/// A TLS terminator in front of `backend` presenting `certificate`; returns its address and
/// how many handshakes completed.
async fn tls_front(
    backend: SocketAddr,
    certificate: (rustls::pki_types::CertificateDer<'static>, rcgen::KeyPair),
) -> (SocketAddr, Arc<AtomicUsize>) {
    tls_front_asking(backend, certificate, None).await
}

/// [`tls_front`] that asks for a client certificate of `clients`, when given, and completes
/// no handshake without one.
#[allow(deprecated)] // ring's provider: the one the proxy uses (see upstream/tls.rs).
async fn tls_front_asking(
    backend: SocketAddr,
    (certificate, key): (rustls::pki_types::CertificateDer<'static>, rcgen::KeyPair),
    clients: Option<&TestCa>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let builder =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap();
    let builder = match clients {
        Some(clients) => builder.with_client_cert_verifier(clients.client_verifier()),
        None => builder.with_no_client_auth(),
    };
    let config = builder
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

/// A server that asks for a client certificate gets the one its McpBackend names (the key read
/// by the proxy from a file, never in config), and one that must be reached by a name other
/// than the URL's host is verified for `serverName`. Without the certificate, or with a key the
/// proxy cannot read, nothing is sent to the server, and the reason names no key.
#[test]
fn a_server_asking_for_a_client_certificate_gets_the_proxy_s_and_a_server_name_can_be_set() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let math = runtime.block_on(serve("math", true));
    let (servers, clients) = (TestCa::new("servers"), TestCa::new("clients"));
    let (certificate, key) = clients.client("portcullis-proxy");
    let key_file = write_file(dir.path(), "proxy-key.pem", &key);
    let mutual_section = |key_file: &str| {
        format!(
            "    tls:\n      caCertificates: {:?}\n      clientCertificate:\n        certificates: {:?}\n        key: {{file: {:?}}}\n",
            servers.pem(),
            certificate,
            key_file
        )
    };
    let (mutual, mutual_handshakes) =
        runtime.block_on(tls_front_asking(math, servers.leaf("127.0.0.1"), Some(&clients)));
    let (named, named_handshakes) = runtime.block_on(tls_front(math, servers.leaf("mcp.internal")));
    let entries = vec![
        (
            "mutual",
            free_port(),
            mutual,
            mutual_section(key_file.to_str().unwrap()),
        ),
        ("nocert", free_port(), mutual, ca_section(&servers.pem())),
        (
            "named",
            free_port(),
            named,
            format!(
                "    tls: {{caCertificates: {:?}, serverName: mcp.internal}}\n",
                servers.pem()
            ),
        ),
    ];
    let gateway = start_gateway(dir.path(), &https_config(&entries));

    for (case, port, handshakes) in [
        ("mutual", entries[0].1, &mutual_handshakes),
        ("named", entries[2].1, &named_handshakes),
    ] {
        runtime.block_on(async {
            let client = rmcp_client(port).await;
            let sum = client
                .call_tool(
                    CallToolRequestParams::new("get-sum").with_arguments(arguments(json!({"a": 2, "b": 3}))),
                )
                .await
                .unwrap();
            assert_eq!(text_of(&sum), "5", "{case}");
            client.cancel().await.unwrap();
        });
        assert!(
            handshakes.load(Ordering::SeqCst) >= 1,
            "{case}: the gateway spoke TLS to it"
        );
    }
    // The same server without the proxy's certificate: the handshake fails, and the client
    // hears so by class.
    let before = mutual_handshakes.load(Ordering::SeqCst);
    let message = initialize_error(entries[1].1);
    assert!(
        message.contains("server math") && message.contains("TLS"),
        "{message}"
    );
    assert_eq!(
        mutual_handshakes.load(Ordering::SeqCst),
        before,
        "no handshake completed"
    );

    // A key pasted with the certificates is refused at apply, and the error shows none of it.
    let version = config_version(&gateway.address);
    let mut pasted = entries.clone();
    pasted[0].3 = mutual_section(key_file.to_str().unwrap()).replacen(
        &format!("{certificate:?}"),
        &format!("{:?}", format!("{certificate}{key}")),
        1,
    );
    let error = refused_apply(
        dir.path(),
        "pasted.yaml",
        &https_config(&pasted),
        &gateway.address,
    );
    assert!(
        error.contains("spec.servers[0].tls.clientCertificate.certificates")
            && error.contains("only certificates belong here"),
        "{error}"
    );
    assert!(!error.contains("PRIVATE KEY"), "{error}");
    let mut relative = entries.clone();
    relative[0].3 = mutual_section("proxy-key.pem");
    let error = refused_apply(
        dir.path(),
        "relative.yaml",
        &https_config(&relative),
        &gateway.address,
    );
    assert!(
        error.contains("spec.servers[0].tls.clientCertificate.key.file")
            && error.contains("not an absolute path"),
        "{error}"
    );
    assert_eq!(config_version(&gateway.address), version);

    // A key the proxy cannot read: the control plane accepts the object (the key is the
    // proxy's), the proxy refuses the version, saying where it looked, and keeps serving the
    // one in force.
    let mut unreadable = entries.clone();
    let missing = dir.path().join("no-such-key.pem");
    unreadable[0].3 = mutual_section(missing.to_str().unwrap());
    apply(
        dir.path(),
        "unreadable.yaml",
        &https_config(&unreadable),
        &gateway.address,
    );
    wait_for("the proxy refusing the version", TIMEOUT, || {
        proxy_applied(&gateway.address, "gw") == Some((version, false))
    });
    let last_error = || {
        status_json(&gateway.address)["proxies"][0]["lastError"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let reason = last_error();
    assert!(
        reason.contains("clientCertificate.key") && reason.contains("no-such-key.pem"),
        "{reason}"
    );
    // A key that is not the certificate's: refused the same way, naming where it was read.
    let (_, other_key) = clients.client("someone-else");
    let other_key_file = write_file(dir.path(), "other-key.pem", &other_key);
    let mut mismatched = entries.clone();
    mismatched[0].3 = mutual_section(other_key_file.to_str().unwrap());
    apply(
        dir.path(),
        "mismatched.yaml",
        &https_config(&mismatched),
        &gateway.address,
    );
    wait_for("the proxy refusing the mismatched key", TIMEOUT, || {
        last_error().contains("does not fit")
    });
    let reason = last_error();
    assert!(reason.contains("other-key.pem"), "{reason}");
    assert!(!reason.contains("PRIVATE KEY"), "{reason}");
    assert_eq!(proxy_applied(&gateway.address, "gw"), Some((version, false)));
    runtime.block_on(async {
        let client = rmcp_client(entries[0].1).await;
        assert!(
            tool_names(&client).await.contains(&"get-sum".to_string()),
            "the version in force serves"
        );
        client.cancel().await.unwrap();
    });
}
