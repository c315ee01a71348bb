//! TLS for every listener: rustls on aws-lc-rs from PEM files, and a self-signed ECDSA P-256
//! certificate for development and tests (`cgx kbs dev-cert`): services serve TLS by default, so
//! even a laptop setup gets it. Production certificates come from the operator's CA.

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};

use std::path::PathBuf;
use std::sync::Arc;

use crate::ServiceError;
use cgx_protocol::kbs::der::{pem, seq, tlv};

/// A certificate chain and its key, PEM files.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The rustls server configuration for `files` (HTTP/1.1 by ALPN).
pub(crate) fn server_config(files: &TlsFiles) -> Result<rustls::ServerConfig, ServiceError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| ServiceError::Tls(format!("{}: {e}", files.cert.display())))?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| ServiceError::Tls(format!("{}: {e}", files.key.display())))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| ServiceError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| ServiceError::Tls(format!("certificate/key: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

fn oid(arcs: &[u8]) -> Vec<u8> {
    tlv(0x06, arcs)
}

/// `YYMMDDHHMMSSZ`.
fn utc_time(t: time::OffsetDateTime) -> Vec<u8> {
    let s = format!(
        "{:02}{:02}{:02}{:02}{:02}{:02}Z",
        t.year() % 100,
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    );
    tlv(0x17, s.as_bytes())
}

/// (certificate PEM, PKCS#8 key PEM) for `names` (DNS names or IP addresses), valid for a year.
pub fn self_signed(names: &[&str]) -> Result<(String, String), ServiceError> {
    let err = |w: &str| ServiceError::Tls(format!("self-signed certificate: {w}"));
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
        .map_err(|_| err("key generation"))?;
    let kp = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref())
        .map_err(|_| err("key"))?;
    // ecdsa-with-SHA256 1.2.840.10045.4.3.2
    let sig_alg = seq(&[oid(&[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x04, 0x03, 0x02])]);
    let cn = names.first().copied().unwrap_or("cgx-kbs");
    // CN (2.5.4.3)
    let name = seq(&[tlv(
        0x31,
        &seq(&[oid(&[0x55, 0x04, 0x03]), tlv(0x0C, cn.as_bytes())]),
    )]);
    let now = time::OffsetDateTime::now_utc();
    let validity = seq(&[
        utc_time(now - time::Duration::days(1)),
        utc_time(now + time::Duration::days(365)),
    ]);
    let spki = seq(&[
        seq(&[
            oid(&[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x02, 0x01]),
            oid(&[0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x03, 0x01, 0x07]),
        ]),
        tlv(0x03, &[&[0u8][..], kp.public_key().as_ref()].concat()),
    ]);
    let sans: Vec<u8> = names
        .iter()
        .map(|n| match n.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V4(a)) => tlv(0x87, &a.octets()),
            Ok(std::net::IpAddr::V6(a)) => tlv(0x87, &a.octets()),
            Err(_) => tlv(0x82, n.as_bytes()),
        })
        .collect::<Vec<_>>()
        .concat();
    let extensions = tlv(
        0xA3,
        &seq(&[
            // subjectAltName 2.5.29.17
            seq(&[oid(&[0x55, 0x1D, 0x11]), tlv(0x04, &tlv(0x30, &sans))]),
            // extKeyUsage 2.5.29.37: serverAuth 1.3.6.1.5.5.7.3.1
            seq(&[
                oid(&[0x55, 0x1D, 0x25]),
                tlv(
                    0x04,
                    &seq(&[oid(&[0x2B, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01])]),
                ),
            ]),
        ]),
    );
    let mut serial = [0u8; 16];
    aws_lc_rs::rand::fill(&mut serial).map_err(|_| err("random"))?;
    serial[0] &= 0x7F;
    serial[0] |= 0x01;
    let tbs = seq(&[
        tlv(0xA0, &tlv(0x02, &[2])),
        tlv(0x02, &serial),
        sig_alg.clone(),
        name.clone(),
        validity,
        name,
        spki,
        extensions,
    ]);
    let sig = kp.sign(&rng, &tbs).map_err(|_| err("signing"))?;
    let mut bits = vec![0u8];
    bits.extend_from_slice(sig.as_ref());
    let cert = seq(&[tbs, sig_alg, tlv(0x03, &bits)]);
    Ok((
        pem("CERTIFICATE", &cert),
        pem("PRIVATE KEY", pkcs8.as_ref()),
    ))
}
