//! TLS to an upstream: which certificate authorities a proxy trusts for it.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
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

/// The DER certificates of a PEM bundle, each one usable as a trust anchor; the error says
/// which one is not, so a bundle a proxy would refuse is refused at apply.
pub fn trust_anchors(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut certificates = Vec::new();
    for (index, certificate) in CertificateDer::pem_slice_iter(pem.as_bytes()).enumerate() {
        let certificate =
            certificate.map_err(|error| format!("certificate {}: not valid PEM: {error}", index + 1))?;
        webpki::anchor_from_trusted_cert(&certificate)
            .map_err(|error| format!("certificate {}: not a usable CA certificate: {error}", index + 1))?;
        certificates.push(certificate);
    }
    if certificates.is_empty() {
        return Err("no PEM certificate (-----BEGIN CERTIFICATE-----) in it".into());
    }
    Ok(certificates)
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
        // A private key is not a certificate, and must not be taken for one.
        let only_key = key.serialize_pem();
        assert!(trust_anchors(&only_key)
            .unwrap_err()
            .contains("no PEM certificate"));
        let garbled = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let error = trust_anchors(&format!("{ca}{garbled}")).unwrap_err();
        assert!(
            error.starts_with("certificate 2: not a usable CA certificate"),
            "{error}"
        );
    }
}
