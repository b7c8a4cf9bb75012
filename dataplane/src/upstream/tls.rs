//! TLS to upstreams: rustls (ring provider) under hyper's HTTP/1.1 client, so one client type
//! reaches `http://` and `https://` alike. Certificates are verified for the URL's host,
//! against the Mozilla roots built in or, where the config names them, only its own CAs.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::{ClientConfig, RootCertStore};

use super::{Http1, CONNECT_TIMEOUT};

static MOZILLA_ROOTS: LazyLock<Arc<ClientConfig>> = LazyLock::new(|| {
    let roots = RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    Arc::new(client_config(roots))
});

// ring has no post-quantum key exchange (hence rustls' deprecation); aws-lc-rs, which has,
// did not build on our build machines without cmake. Revisit when it does.
#[allow(deprecated)]
fn client_config(roots: RootCertStore) -> ClientConfig {
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        // Only fails for a provider without the default versions; ring has them all.
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// A pooled HTTP/1.1 client that speaks TLS to `https://` URIs with `tls`.
fn http1(tls: Arc<ClientConfig>) -> Http1 {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    // The TLS layer takes `https://`; the TCP layer must let it through.
    connector.enforce_http(false);
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(ClientConfig::clone(&tls))
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// The client for upstreams verified against the built-in roots.
pub(super) fn default_http1() -> Http1 {
    http1(MOZILLA_ROOTS.clone())
}

/// What a client may learn of a failed TLS connection: its class. rustls' own text names the
/// hosts a certificate is valid for, internal names a caller has no business seeing.
pub(super) fn failure_class(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::CertificateError as Certificate;
    // TLS errors reach hyper wrapped in `io::Error`s (tokio-rustls wraps, hyper-rustls wraps
    // again), whose `source()` skips the wrapped error itself.
    let mut error = error;
    while let Some(inner) = error
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
    {
        error = inner;
    }
    let tls = error.downcast_ref::<rustls::Error>()?;
    Some(match tls {
        rustls::Error::InvalidCertificate(Certificate::UnknownIssuer | Certificate::BadSignature) => {
            "TLS: the server's certificate does not chain to a trusted CA"
        }
        rustls::Error::InvalidCertificate(
            Certificate::NotValidForName | Certificate::NotValidForNameContext { .. },
        ) => "TLS: the server's certificate is not valid for its host",
        rustls::Error::InvalidCertificate(
            Certificate::Expired
            | Certificate::ExpiredContext { .. }
            | Certificate::NotValidYet
            | Certificate::NotValidYetContext { .. },
        ) => "TLS: the server's certificate is outside its validity period",
        rustls::Error::InvalidCertificate(_) => "TLS: the server's certificate was refused",
        _ => "TLS with the server failed",
    })
}

/// Clients for upstreams that trust only their own CAs, one per CA bundle, shared by every
/// server and version naming that bundle: its connections live while a version uses it.
#[derive(Default)]
pub(crate) struct PrivateCaClients {
    by_bundle: Mutex<HashMap<String, Weak<Http1>>>,
}

impl PrivateCaClients {
    pub(crate) fn client(&self, pem: &str) -> Result<Arc<Http1>, String> {
        let mut by_bundle = self.by_bundle.lock().unwrap_or_else(PoisonError::into_inner);
        by_bundle.retain(|_, client| client.strong_count() > 0);
        if let Some(client) = by_bundle.get(pem).and_then(Weak::upgrade) {
            return Ok(client);
        }
        let roots = RootCertStore {
            roots: portcullis_config::tls::trust_anchors(pem)?,
        };
        let client = Arc::new(http1(Arc::new(client_config(roots))));
        by_bundle.insert(pem.to_string(), Arc::downgrade(&client));
        Ok(client)
    }
}
