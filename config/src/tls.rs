//! TLS to an upstream: which certificate authorities a proxy trusts for it.

use rustls_pki_types::pem::{PemObject, SectionKind};
use rustls_pki_types::{CertificateDer, TrustAnchor};
use serde::{Deserialize, Serialize};

/// How a proxy verifies an `https://` upstream. Without it (or without
/// `caCertificates`), the server's certificate must chain to a root of the Mozilla set the
/// proxy is built with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct UpstreamTls {
    /// PEM certificates, the only roots trusted for this upstream (a private CA). Public
    /// material: no key belongs here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certificates: Option<String>,
}

/// The trust anchors of a PEM bundle of certificates, as rustls takes them; the error says
/// which certificate cannot be one, so a bundle a proxy would refuse is refused at apply. Any
/// other PEM section is refused too: a private key pasted along would otherwise be stored
/// and sent to every proxy.
pub fn trust_anchors(pem: &str) -> Result<Vec<TrustAnchor<'static>>, String> {
    let mut anchors = Vec::new();
    for (index, section) in <(SectionKind, Vec<u8>)>::pem_slice_iter(pem.as_bytes()).enumerate() {
        let (kind, der) =
            section.map_err(|error| format!("section {}: not valid PEM: {error}", index + 1))?;
        if kind != SectionKind::Certificate {
            return Err(format!(
                "section {}: only certificates belong here, not a {kind:?} section",
                index + 1
            ));
        }
        let anchor = webpki::anchor_from_trusted_cert(&CertificateDer::from(der))
            .map_err(|error| {
                format!(
                    "section {}: not a certificate rustls can trust: {error}",
                    index + 1
                )
            })?
            .to_owned();
        anchors.push(anchor);
    }
    if anchors.is_empty() {
        return Err("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into());
    }
    Ok(anchors)
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
        let garbled = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let error = trust_anchors(&format!("{ca}{garbled}")).unwrap_err();
        assert!(
            error.starts_with("section 2: not a certificate rustls can trust"),
            "{error}"
        );
    }
}
