//! NVIDIA reference integrity manifests: TCG PC Client RIM "SWID tag" XML (ISO/IEC 19770-2) with
//! an enveloped XML-DSig signature (ECDSA P-384 / SHA-384, Canonical XML 1.1), signed by a chain
//! to the pinned NVIDIA CoRIM signing root. A verified RIM yields golden measurements, which
//! [`compare`] matches against a verified GPU report index by index.
//!
//! Signature-wrapping defences: exactly one `Signature`, a direct child of the root; exactly one
//! `Reference`, with `URI=""` (the whole document) and exactly the transforms
//! enveloped-signature then c14n; golden values are read from the same parsed tree that was
//! digested.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::c14n::{self, Element};
use crate::crypto::{CryptoProvider, DigestAlg, SigAlg};
use crate::error::{ChainKind, Error, Result};
use crate::trust::NVIDIA_RIM_ROOTS;
use crate::x509;

const DSIG: &str = "http://www.w3.org/2000/09/xmldsig#";
const C14N11: &str = "http://www.w3.org/2006/12/xml-c14n11";
const C14N10: &str = "http://www.w3.org/TR/2001/REC-xml-c14n-20010315";
const ENVELOPED: &str = "http://www.w3.org/2000/09/xmldsig#enveloped-signature";
const ECDSA_SHA384: &str = "http://www.w3.org/2001/04/xmldsig-more#ecdsa-sha384";
const SHA384_URIS: [&str; 2] = [
    "http://www.w3.org/2001/04/xmldsig-more#sha384",
    "http://www.w3.org/2001/04/xmlenc#sha384",
];
const SWID: &str = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd";
/// Namespace of the `HashN` attributes of a `Resource`.
const HASH_NS: &str = "http://www.w3.org/2001/04/xmlenc#sha384";

/// How to verify RIM signer certificates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RimOptions {
    /// Accept signing-chain certificates (all but the root) past their `notAfter`. NVIDIA keeps
    /// serving RIMs whose signer certificates have expired; a caller that accepts them says so.
    pub ignore_signer_expiry: bool,
}

/// A RIM whose signature and chain verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifiedRim {
    /// `tagId` of the SoftwareIdentity.
    pub id: String,
    /// `name` (e.g. GH100).
    pub name: String,
    /// `Meta/@colloquialVersion` (VBIOS or driver version).
    pub version: String,
    /// `Meta/@product`, `Meta/@edition`.
    pub product: String,
    pub edition: String,
    /// Golden values of active measurements by SPDM block index (RIM index + 1): alternatives.
    pub golden: BTreeMap<u16, Vec<String>>,
    /// Signer certificate subject.
    pub signer: String,
    /// Whether an expired signing certificate was accepted under [`RimOptions`].
    pub signer_expired: bool,
}

fn rim_err(rim: &str, detail: impl Into<String>) -> Error {
    Error::Rim {
        rim: rim.to_string(),
        detail: detail.into(),
    }
}

fn algorithm<'a>(e: &'a Element, what: &str, rim: &str) -> Result<&'a str> {
    e.attr("Algorithm")
        .ok_or_else(|| rim_err(rim, format!("{what} has no Algorithm")))
}

/// Parse and verify a RIM at Unix time `now`.
pub fn verify(
    xml: &[u8],
    provider: &dyn CryptoProvider,
    now: i64,
    opts: RimOptions,
) -> Result<VerifiedRim> {
    let root = c14n::parse(xml).map_err(|e| rim_err("?", e.to_string()))?;
    let id = root.attr("tagId").unwrap_or("?").to_string();
    let rim = id.as_str();
    if root.ns != SWID || root.local != "SoftwareIdentity" {
        return Err(rim_err(rim, "root is not a SWID SoftwareIdentity"));
    }
    let signature = root
        .only_child(DSIG, "Signature")
        .map_err(|e| rim_err(rim, e.to_string()))?;
    let signed_info = signature
        .only_child(DSIG, "SignedInfo")
        .map_err(|e| rim_err(rim, e.to_string()))?;
    let child = |parent: &Element, name: &str| -> Result<Element> {
        parent
            .only_child(DSIG, name)
            .cloned()
            .map_err(|e| rim_err(rim, e.to_string()))
    };
    let c14n_method = algorithm(
        &child(signed_info, "CanonicalizationMethod")?,
        "CanonicalizationMethod",
        rim,
    )?
    .to_string();
    if c14n_method != C14N11 && c14n_method != C14N10 {
        return Err(rim_err(
            rim,
            format!("canonicalization {c14n_method} is not supported"),
        ));
    }
    let sig_method = child(signed_info, "SignatureMethod")?;
    if algorithm(&sig_method, "SignatureMethod", rim)? != ECDSA_SHA384 {
        return Err(rim_err(rim, "signature method is not ECDSA-SHA384"));
    }
    let reference = child(signed_info, "Reference")?;
    if reference.attr("URI") != Some("") {
        return Err(rim_err(
            rim,
            "Reference must cover the whole document (URI=\"\")",
        ));
    }
    let transforms: Vec<String> = child(&reference, "Transforms")?
        .children_named(DSIG, "Transform")
        .map(|t| t.attr("Algorithm").unwrap_or("").to_string())
        .collect();
    let transforms_ok = transforms.len() == 2
        && transforms[0] == ENVELOPED
        && (transforms[1] == C14N11 || transforms[1] == C14N10);
    if !transforms_ok {
        return Err(rim_err(
            rim,
            format!("unexpected transforms {transforms:?}"),
        ));
    }
    let digest_method = child(&reference, "DigestMethod")?;
    if !SHA384_URIS.contains(&algorithm(&digest_method, "DigestMethod", rim)?) {
        return Err(rim_err(rim, "digest method is not SHA-384"));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let decode = |s: &str, what: &str| -> Result<Vec<u8>> {
        let clean: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        b64.decode(clean)
            .map_err(|_| rim_err(rim, format!("{what} is not base64")))
    };
    let digest_value = decode(&child(&reference, "DigestValue")?.text(), "DigestValue")?;
    let signature_value = decode(
        &child(signature, "SignatureValue")?.text(),
        "SignatureValue",
    )?;

    // 1. The document digest, enveloped signature removed.
    let document = c14n::canonicalize(&root, Some(signature));
    let digest = provider.digest(DigestAlg::Sha384, &[document.as_bytes()]);
    if digest != digest_value {
        return Err(Error::signature(format!("RIM {rim}: document digest")));
    }

    // 2. The signer chain.
    let certs_b64: Vec<String> = child(signature, "KeyInfo")?
        .only_child(DSIG, "X509Data")
        .map_err(|e| rim_err(rim, e.to_string()))?
        .children_named(DSIG, "X509Certificate")
        .map(Element::text)
        .collect();
    let ders = certs_b64
        .iter()
        .map(|c| decode(c, "X509Certificate"))
        .collect::<Result<Vec<_>>>()?;
    let certs = ders
        .iter()
        .map(|d| x509::parse_cert(d, "RIM signing certificate"))
        .collect::<Result<Vec<_>>>()?;
    const C: ChainKind = ChainKind::NvidiaRim;
    let (Some(signer), Some(root_cert)) = (certs.first(), certs.last()) else {
        return Err(rim_err(rim, "no signing certificate"));
    };
    if certs.len() < 2 || !x509::is_self_signed(root_cert, provider, C) {
        return Err(Error::UntrustedRoot {
            chain: C,
            detail: format!("RIM {rim}: chain does not end at a self-signed root"),
        });
    }
    if !NVIDIA_RIM_ROOTS.contains(&x509::spki_sha256(root_cert)) {
        return Err(Error::UntrustedRoot {
            chain: C,
            detail: format!(
                "RIM {rim}: '{}' is not the NVIDIA CoRIM signing root",
                x509::subject(root_cert)
            ),
        });
    }
    for pair in certs.windows(2) {
        x509::verify_issued_by(&pair[0], &pair[1], provider, C)?;
    }
    let mut signer_expired = false;
    for (i, cert) in certs.iter().enumerate() {
        match x509::check_validity(cert, now) {
            Ok(()) => {}
            Err(e) => {
                let is_root = i + 1 == certs.len();
                let expired_only = now > cert.validity().not_after.timestamp();
                if opts.ignore_signer_expiry && !is_root && expired_only {
                    signer_expired = true;
                } else {
                    return Err(e);
                }
            }
        }
    }

    // 3. The signature over the canonical SignedInfo.
    let key = x509::ec_public_key(signer, true, C)?;
    let signed = c14n::canonicalize(signed_info, None);
    provider
        .verify(
            SigAlg::EcdsaP384Sha384Fixed,
            key,
            signed.as_bytes(),
            &signature_value,
        )
        .map_err(|_| Error::signature(format!("RIM {rim}: SignedInfo")))?;

    // 4. Golden values from the verified tree.
    let meta = root.children_named(SWID, "Meta").next();
    let payload = root
        .only_child(SWID, "Payload")
        .map_err(|e| rim_err(rim, e.to_string()))?;
    let mut golden = BTreeMap::new();
    for res in payload.children_named(SWID, "Resource") {
        if res.attr("type") != Some("Measurement") {
            continue;
        }
        let index: u16 = res
            .attr("index")
            .and_then(|i| i.parse().ok())
            .ok_or_else(|| rim_err(rim, "Resource without a numeric index"))?;
        if !res
            .attr("active")
            .is_some_and(|a| a.eq_ignore_ascii_case("true"))
        {
            continue;
        }
        let n: usize = res
            .attr("alternatives")
            .and_then(|a| a.parse().ok())
            .unwrap_or(1);
        let mut alts = Vec::with_capacity(n);
        for i in 0..n {
            let h = res
                .attr_ns(HASH_NS, &format!("Hash{i}"))
                .ok_or_else(|| rim_err(rim, format!("measurement {index} lacks Hash{i}")))?;
            alts.push(h.to_ascii_lowercase());
        }
        let spdm_index = index
            .checked_add(1)
            .ok_or_else(|| rim_err(rim, "index out of range"))?;
        if golden.insert(spdm_index, alts).is_some() {
            return Err(rim_err(
                rim,
                format!("measurement index {index} appears twice"),
            ));
        }
    }
    let meta_attr = |name: &str| {
        meta.and_then(|m| m.attr(name))
            .unwrap_or_default()
            .to_string()
    };
    Ok(VerifiedRim {
        id: id.clone(),
        name: root.attr("name").unwrap_or_default().to_string(),
        version: meta_attr("colloquialVersion"),
        product: meta_attr("product"),
        edition: meta_attr("edition"),
        golden,
        signer: x509::subject(signer),
        signer_expired,
    })
}

/// One measurement that differs from its reference.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    pub index: u16,
    /// The measured value, or `None` when the report lacks an index the RIM requires.
    pub measured: Option<String>,
    pub expected: Vec<String>,
    pub rim: String,
}

/// Result of comparing a report's measurements with RIMs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RimComparison {
    pub matched: Vec<u16>,
    pub mismatched: Vec<Mismatch>,
    pub no_reference: Vec<u16>,
}

impl RimComparison {
    pub fn all_match(&self) -> bool {
        self.mismatched.is_empty()
    }
}

/// Compare measurements (index → hex, as in the claims) against verified RIMs. An index defined
/// by two RIMs is an error: the manifests would contradict each other.
pub fn compare(
    measurements: &BTreeMap<String, String>,
    rims: &[&VerifiedRim],
) -> Result<RimComparison> {
    let mut reference: BTreeMap<u16, (&Vec<String>, &str)> = BTreeMap::new();
    for r in rims {
        for (idx, alts) in &r.golden {
            if reference.insert(*idx, (alts, r.id.as_str())).is_some() {
                return Err(rim_err(
                    &r.id,
                    format!("index {idx} is also defined by another RIM"),
                ));
            }
        }
    }
    let mut measured: BTreeMap<u16, &str> = BTreeMap::new();
    for (k, v) in measurements {
        let idx: u16 = k
            .parse()
            .map_err(|_| Error::invalid("measurement index", k.clone()))?;
        measured.insert(idx, v.as_str());
    }
    let mut out = RimComparison::default();
    for (idx, value) in &measured {
        match reference.get(idx) {
            None => out.no_reference.push(*idx),
            Some((alts, _)) if alts.iter().any(|a| a.eq_ignore_ascii_case(value)) => {
                out.matched.push(*idx)
            }
            Some((alts, rim)) => out.mismatched.push(Mismatch {
                index: *idx,
                measured: Some(value.to_string()),
                expected: (*alts).clone(),
                rim: rim.to_string(),
            }),
        }
    }
    for (idx, (alts, rim)) in &reference {
        if !measured.contains_key(idx) {
            out.mismatched.push(Mismatch {
                index: *idx,
                measured: None,
                expected: (*alts).clone(),
                rim: rim.to_string(),
            });
        }
    }
    Ok(out)
}
