//! TLS to an upstream: which certificate authorities a proxy trusts for it, the name it
//! verifies, and the certificate it presents of its own.

use rustls_pki_types::pem::{PemObject, SectionKind};
use rustls_pki_types::{CertificateDer, ServerName, TrustAnchor};
use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::SecretSource;

/// How a proxy verifies an `https://` upstream, and proves itself to it. Without
/// `caCertificates`, the server's certificate must chain to a root of the Mozilla set the
/// proxy is built with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct UpstreamTls {
    /// PEM certificates, the only roots trusted for this upstream (a private CA). Public
    /// material: no key belongs here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certificates: Option<String>,
    /// The name sent in SNI and that the server's certificate must be valid for, when it is
    /// not the URL's host (a server reached by IP address, or through a tunnel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// The certificate the proxy presents to a server that asks for one (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_certificate: Option<ClientCertificate>,
}

/// A client certificate: the chain in config, the private key only on the proxies' side.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientCertificate {
    /// PEM certificates, the proxy's own first, then any intermediates. Public material.
    pub certificates: String,
    /// Where each proxy reads the certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: SecretSource,
}

impl UpstreamTls {
    /// Refuses what no proxy could use, naming the field (`field` is this section's).
    pub fn check(&self, checker: &mut Checker<'_>, field: &str) {
        if let Some(pem) = &self.ca_certificates {
            if let Err(problem) = trust_anchors(pem) {
                checker.fail(format!("{field}.caCertificates"), problem);
            }
        }
        if let Some(name) = &self.server_name {
            if let Err(problem) = server_name(name) {
                checker.fail(format!("{field}.serverName"), problem);
            }
        }
        if let Some(client) = &self.client_certificate {
            if let Err(problem) = certificate_chain(&client.certificates) {
                checker.fail(format!("{field}.clientCertificate.certificates"), problem);
            }
            client
                .key
                .check(checker, &format!("{field}.clientCertificate.key"));
        }
    }
}

/// A name to verify a server's certificate for: a DNS name or an IP address.
pub fn server_name(name: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(name.to_string())
        .map_err(|_| format!("{name:?} is neither a DNS name nor an IP address"))
}

/// The certificates of a client certificate's chain, the first one its own. Like a CA bundle,
/// it holds certificates only: a private key pasted along would be stored and sent to every
/// proxy (the key is read by each proxy from `key`).
pub fn certificate_chain(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    certificates(pem, |certificate| {
        match webpki::EndEntityCert::try_from(&certificate) {
            Ok(_) => Ok(certificate),
            Err(error) => Err(format!("not a certificate rustls can use: {error}")),
        }
    })
}

/// The trust anchors of a PEM bundle of certificates, as rustls takes them; the error says
/// which certificate cannot be one, so a bundle a proxy would refuse is refused at apply. Any
/// other PEM section is refused too: a private key pasted along would otherwise be stored
/// and sent to every proxy.
pub fn trust_anchors(pem: &str) -> Result<Vec<TrustAnchor<'static>>, String> {
    certificates(pem, |certificate| {
        webpki::anchor_from_trusted_cert(&certificate)
            .map(|anchor| anchor.to_owned())
            .map_err(|error| format!("not a certificate rustls can trust: {error}"))
    })
}

/// Each PEM section of `pem` as `take` makes it of a certificate, at least one; an error
/// names the section, never its content.
fn certificates<T>(
    pem: &str,
    take: impl Fn(CertificateDer<'static>) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    // The PEM reader skips sections of labels it does not know (`ENCRYPTED PRIVATE KEY`,
    // `OPENSSH PRIVATE KEY`, ...), so every label is looked at here first.
    let mut labels = pem
        .lines()
        .filter_map(|line| line.trim().strip_prefix("-----BEGIN "))
        .map(|rest| rest.trim_end_matches('-'));
    // The label is not echoed: what was pasted here by mistake is nobody's business.
    if let Some(index) = labels.position(|label| label != "CERTIFICATE") {
        return Err(format!(
            "section {}: only certificates belong here, not another kind of PEM section",
            index + 1
        ));
    }
    let mut taken = Vec::new();
    for (index, section) in <(SectionKind, Vec<u8>)>::pem_slice_iter(pem.as_bytes()).enumerate() {
        let section_number = index + 1;
        let (kind, der) =
            section.map_err(|error| format!("section {section_number}: not valid PEM: {error}"))?;
        if kind != SectionKind::Certificate {
            return Err(format!(
                "section {section_number}: only certificates belong here, not a {kind:?} section"
            ));
        }
        taken.push(
            take(CertificateDer::from(der))
                .map_err(|problem| format!("section {section_number}: {problem}"))?,
        );
    }
    if taken.is_empty() {
        return Err("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into());
    }
    Ok(taken)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bundles_of_usable_certificates_are_accepted() {
        let key = rcgen::KeyPair::generate().unwrap();
        let ca = rcgen::CertificateParams::new(vec!["ca.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem();
        assert_eq!(trust_anchors(&ca).unwrap().len(), 1);
        assert_eq!(trust_anchors(&format!("{ca}{ca}")).unwrap().len(), 2);

        assert!(trust_anchors("").unwrap_err().contains("no PEM certificate"));
        // A private key must never be stored with the certificates, alone or along.
        let key_pem = key.serialize_pem();
        for bundle in [key_pem.clone(), format!("{ca}{key_pem}")] {
            let error = trust_anchors(&bundle).unwrap_err();
            assert!(error.contains("only certificates belong here"), "{error}");
            assert!(!error.contains("BEGIN"), "the error echoes no content: {error}");
        }
        // Also a key in a format the PEM reader does not know (it would skip the section).
        for label in ["ENCRYPTED PRIVATE KEY", "OPENSSH PRIVATE KEY", "DSA PRIVATE KEY"] {
            let foreign = format!("-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n");
            let error = trust_anchors(&format!("{ca}{foreign}")).unwrap_err();
            assert_eq!(
                error,
                "section 2: only certificates belong here, not another kind of PEM section"
            );
        }
        let garbled = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let error = trust_anchors(&format!("{ca}{garbled}")).unwrap_err();
        assert!(
            error.starts_with("section 2: not a certificate rustls can trust"),
            "{error}"
        );
    }

    #[test]
    fn a_client_certificate_is_a_chain_of_certificates_with_its_key_elsewhere() {
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["proxy.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem();
        assert_eq!(certificate_chain(&leaf).unwrap().len(), 1);
        assert_eq!(certificate_chain(&format!("{leaf}{leaf}")).unwrap().len(), 2);
        let key_pem = key.serialize_pem();
        let error = certificate_chain(&format!("{leaf}{key_pem}")).unwrap_err();
        assert!(error.contains("only certificates belong here"), "{error}");
        assert!(!error.contains("BEGIN"), "the error echoes no content: {error}");
        assert!(certificate_chain("").unwrap_err().contains("no PEM certificate"));
        // Also a key in a format the PEM reader does not know (it would skip the section).
        for label in ["ENCRYPTED PRIVATE KEY", "OPENSSH PRIVATE KEY", "DSA PRIVATE KEY"] {
            let foreign = format!("-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n");
            let error = certificate_chain(&format!("{leaf}{foreign}")).unwrap_err();
            assert_eq!(
                error,
                "section 2: only certificates belong here, not another kind of PEM section"
            );
        }
        let garbled = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(certificate_chain(garbled)
            .unwrap_err()
            .starts_with("section 1: not a certificate rustls can use"));
    }

    #[test]
    fn a_server_name_is_a_dns_name_or_an_ip_address() {
        for name in ["mcp.internal", "localhost", "10.0.0.7", "::1"] {
            assert!(server_name(name).is_ok(), "{name}");
        }
        for name in ["", "two words", "host:443", "https://mcp.internal"] {
            let error = server_name(name).unwrap_err();
            assert!(
                error.contains("neither a DNS name nor an IP address"),
                "{name}: {error}"
            );
        }
    }

    #[test]
    fn each_field_of_a_tls_section_is_checked_where_it_is() {
        let tls = UpstreamTls {
            ca_certificates: Some("not pem".into()),
            server_name: Some("no such name!".into()),
            client_certificate: Some(ClientCertificate {
                certificates: String::new(),
                key: SecretSource::File("relative/key.pem".into()),
            }),
        };
        let mut checker = Checker::new("McpBackend/tools");
        tls.check(&mut checker, "spec.servers[0].tls");
        let fields: Vec<&str> = checker.errors.iter().map(|error| error.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.servers[0].tls.caCertificates",
                "spec.servers[0].tls.serverName",
                "spec.servers[0].tls.clientCertificate.certificates",
                "spec.servers[0].tls.clientCertificate.key.file",
            ]
        );
    }
}
