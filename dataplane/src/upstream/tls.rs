//! TLS to upstreams: rustls (ring provider) under the HTTP/1.1 client, so one client type
//! reaches `http://` and `https://` alike. Certificates are verified for the URL's host (or
//! the configured server name), against the Mozilla roots built in or, where the config names
//! them, only its own CAs; where the config gives one, the proxy presents a client certificate.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use portcullis_config::tls::UpstreamTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use sha2::{Digest, Sha256};

use super::{Http1, CONNECT_TIMEOUT};

static MOZILLA_ROOTS: LazyLock<Arc<ClientConfig>> = LazyLock::new(|| {
    let roots = RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    Arc::new(client_config(roots).with_no_client_auth())
});

// ring has no post-quantum key exchange (hence rustls' deprecation); aws-lc-rs, which has,
// did not build on our build machines without cmake. Revisit when it does.
#[allow(deprecated)]
fn client_config(
    roots: RootCertStore,
) -> rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert> {
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        // Only fails for a provider without the default versions; ring has them all.
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
}

/// A pooled HTTP/1.1 client that speaks TLS to `https://` URIs with `tls`, verifying the
/// server for `server_name` instead of the URI's host where one is given.
fn http1(tls: Arc<ClientConfig>, server_name: Option<ServerName<'static>>) -> Http1 {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    // The TLS layer takes `https://`; the TCP layer must let it through.
    connector.enforce_http(false);
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(ClientConfig::clone(&tls))
        .https_or_http();
    let builder = match server_name {
        Some(name) => builder.with_server_name_resolver(FixedServerNameResolver::new(name)),
        None => builder,
    };
    Http1::new(builder.enable_http1().wrap_connector(connector))
}

/// The client for upstreams verified against the built-in roots.
pub(super) fn default_http1() -> Http1 {
    http1(MOZILLA_ROOTS.clone(), None)
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

/// Clients for upstreams with TLS settings of their own (a private CA, a server name, a client
/// certificate), one per setting, shared by every server and version naming it: its
/// connections live while a version uses it.
#[derive(Default)]
pub(crate) struct TlsClients {
    by_setting: Mutex<HashMap<Setting, Weak<Http1>>>,
}

/// One client's setting: the config's section and, when it has a client certificate, a digest
/// of the key read for it (a renewed key gets a new client; the key itself is not kept here).
#[derive(PartialEq, Eq, Hash)]
struct Setting {
    tls: UpstreamTls,
    key: Option<[u8; 32]>,
}

impl TlsClients {
    /// The client for `tls`. A client certificate's key is read here, from where the config
    /// says; an error names the setting and the source, never any of the key.
    pub(crate) fn client(&self, tls: &UpstreamTls) -> Result<Arc<Http1>, String> {
        let key = match &tls.client_certificate {
            Some(client) => Some(
                client
                    .key
                    .read()
                    .map_err(|problem| format!("clientCertificate.key: {problem}"))?,
            ),
            None => None,
        };
        let setting = Setting {
            tls: tls.clone(),
            key: key.as_ref().map(|key| Sha256::digest(key.as_bytes()).into()),
        };
        let mut by_setting = self.by_setting.lock().unwrap_or_else(PoisonError::into_inner);
        by_setting.retain(|_, client| client.strong_count() > 0);
        if let Some(client) = by_setting.get(&setting).and_then(Weak::upgrade) {
            return Ok(client);
        }
        let roots = match &tls.ca_certificates {
            Some(pem) => RootCertStore {
                roots: portcullis_config::tls::trust_anchors(pem)
                    .map_err(|problem| format!("caCertificates: {problem}"))?,
            },
            None => RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            },
        };
        let config = match (&tls.client_certificate, key) {
            (Some(client), Some(key)) => {
                let chain = portcullis_config::tls::certificate_chain(&client.certificates)
                    .map_err(|problem| format!("clientCertificate.certificates: {problem}"))?;
                let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|_| {
                    format!(
                        "clientCertificate.key: no PEM private key (PKCS#8, PKCS#1 or SEC1) in {}",
                        client.key
                    )
                })?;
                client_config(roots)
                    .with_client_auth_cert(chain, key)
                    .map_err(|error| match error {
                        rustls::Error::InconsistentKeys(_) => format!(
                            "clientCertificate.key: the key in {} does not fit the certificates",
                            client.key
                        ),
                        error => format!(
                            "clientCertificate.key: the key in {} cannot be used: {error}",
                            client.key
                        ),
                    })?
            }
            _ => client_config(roots).with_no_client_auth(),
        };
        let server_name = match &tls.server_name {
            Some(name) => Some(
                portcullis_config::tls::server_name(name)
                    .map_err(|problem| format!("serverName: {problem}"))?,
            ),
            None => None,
        };
        let client = Arc::new(http1(Arc::new(config), server_name));
        by_setting.insert(setting, Arc::downgrade(&client));
        Ok(client)
    }
}
