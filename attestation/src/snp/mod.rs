//! AMD SEV-SNP: report parsing ([`report`]) and verification against the AMD chain.
//!
//! Verification order: (1) the chain ARK → ASK/ASVK → VCEK/VLEK, ending at a pinned ARK, each link
//! an RSASSA-PSS signature, each certificate valid at `now`, intermediates and the signing key
//! checked against supplied CRLs; (2) the report's ECDSA P-384 signature over bytes 0x000–0x29F;
//! (3) the VCEK's TCB extensions against REPORTED_TCB and its hwID against CHIP_ID. Step (1) is
//! cached per (certificates, CRLs): only the time checks are redone on a hit, so a verified chain
//! costs one P-384 verification per report.

pub mod report;

use std::sync::Arc;

use x509_parser::certificate::X509Certificate;

use crate::cache::ChainCache;
use crate::claims::{Claims, EvidenceKind, KindClaims, SnpClaims};
use crate::crypto::{CryptoProvider, PreparedKey, SigAlg};
use crate::error::{ChainKind, Error, Result};
use crate::trust::{AMD_ARKS, SIM_ROOT_CN_PREFIX, SimTrust};
use crate::x509::{self, Window};

pub use report::{AttestationReport, Product, SigningKey, TcbVersion};

/// VCEK/VLEK X.509 extensions (AMD "Versioned Chip Endorsement Key (VCEK) Certificate and KDS
/// Interface Specification", publication 57230, Table 8).
mod oid {
    pub const PRODUCT_NAME: &str = "1.3.6.1.4.1.3704.1.2";
    pub const BL_SPL: &str = "1.3.6.1.4.1.3704.1.3.1";
    pub const TEE_SPL: &str = "1.3.6.1.4.1.3704.1.3.2";
    pub const SNP_SPL: &str = "1.3.6.1.4.1.3704.1.3.3";
    pub const UCODE_SPL: &str = "1.3.6.1.4.1.3704.1.3.8";
    pub const FMC_SPL: &str = "1.3.6.1.4.1.3704.1.3.9";
    pub const HW_ID: &str = "1.3.6.1.4.1.3704.1.4";
}

/// SNP evidence as bytes: the report, the signing certificate and its chain, optional CRLs.
#[derive(Debug, Clone, Copy)]
pub struct SnpEvidence<'a> {
    /// The 1184-byte attestation report.
    pub report: &'a [u8],
    /// VCEK or VLEK certificate, DER or PEM.
    pub signing_cert: &'a [u8],
    /// What the bundle says the signing certificate is (from its file name), if it says.
    pub signing_cert_kind: Option<SigningKey>,
    /// The KDS `cert_chain` (ASK or ASVK, then ARK), PEM or concatenated.
    pub cert_chain: &'a [u8],
    /// AMD CRLs (DER) signed by the ARK, if supplied.
    pub crls: &'a [Vec<u8>],
}

/// TCB values the signing certificate was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CertTcb {
    bootloader: Option<u64>,
    tee: Option<u64>,
    snp: Option<u64>,
    microcode: Option<u64>,
    fmc: Option<u64>,
}

/// A chain that verified once: what later reports need from it.
#[derive(Debug)]
struct VerifiedChain {
    key: Box<dyn PreparedKey>,
    product: Product,
    sim: bool,
    signing_key: SigningKey,
    tcb: CertTcb,
    hw_id: Option<Vec<u8>>,
    /// Every certificate's (subject, window) and every CRL's window, rechecked at each `now`.
    windows: Vec<(String, Window)>,
}

/// Verifies SNP reports. Holds a cache of verified chains; no I/O, no clock.
#[derive(Debug)]
pub(crate) struct SnpVerifier {
    provider: &'static dyn CryptoProvider,
    sim: SimTrust,
    cache: ChainCache<VerifiedChain>,
}

impl SnpVerifier {
    pub fn new(provider: &'static dyn CryptoProvider, sim: SimTrust) -> Self {
        SnpVerifier {
            provider,
            sim,
            cache: ChainCache::new(),
        }
    }

    /// Verify `ev` at Unix time `now`.
    pub fn verify(&self, ev: &SnpEvidence<'_>, now: i64) -> Result<Claims> {
        let report = AttestationReport::parse(ev.report)?;
        let signing_key = report.signing_key()?;
        if let Some(bundle_kind) = ev.signing_cert_kind
            && bundle_kind != signing_key
        {
            return Err(Error::SigningKeyMismatch {
                report: signing_key.name(),
                bundle: bundle_kind.name(),
            });
        }
        if report.mask_chip_key() {
            return Err(Error::invalid(
                "MASK_CHIP_KEY",
                "set: the firmware did not sign this report",
            ));
        }
        let chain = self.chain(ev, signing_key, now)?;
        if chain.signing_key != signing_key {
            return Err(Error::SigningKeyMismatch {
                report: signing_key.name(),
                bundle: chain.signing_key.name(),
            });
        }
        if let Some(cpuid) = report.cpuid_product() {
            if cpuid != chain.product {
                return Err(Error::invalid(
                    "CPUID_FAM_ID/CPUID_MOD_ID",
                    format!(
                        "report is from a {} but the chain is {}'s",
                        cpuid.name(),
                        chain.product.name()
                    ),
                ));
            }
        } else if report.version >= 3 {
            return Err(Error::invalid(
                "CPUID_FAM_ID/CPUID_MOD_ID",
                format!(
                    "family {:#x} model {:#x} is no known SNP product",
                    report.cpuid_fam_id.unwrap_or(0),
                    report.cpuid_mod_id.unwrap_or(0)
                ),
            ));
        }
        chain
            .key
            .verify(
                &ev.report[..report::SIGNED_LEN],
                &report.signature_fixed_be(),
            )
            .map_err(|_| Error::signature("SNP attestation report"))?;
        check_tcb(&chain, &report)?;
        check_hw_id(&chain, &report)?;
        Ok(claims(&report, &chain))
    }

    /// The verified chain for this evidence, from the cache or verified now; its validity
    /// windows are checked against `now` either way.
    fn chain(
        &self,
        ev: &SnpEvidence<'_>,
        signing_key: SigningKey,
        now: i64,
    ) -> Result<Arc<VerifiedChain>> {
        let mut rest: Vec<&[u8]> = vec![ev.cert_chain];
        rest.extend(ev.crls.iter().map(Vec::as_slice));
        let chain = match self.cache.get(ev.signing_cert, &rest) {
            Some(chain) => chain,
            None => {
                let chain = Arc::new(self.verify_chain(ev, signing_key, now)?);
                self.cache.insert(ev.signing_cert, &rest, chain.clone());
                chain
            }
        };
        for (subject, window) in &chain.windows {
            window.check(|| subject.clone(), now)?;
        }
        Ok(chain)
    }

    fn verify_chain(
        &self,
        ev: &SnpEvidence<'_>,
        signing_key: SigningKey,
        now: i64,
    ) -> Result<VerifiedChain> {
        const C: ChainKind = ChainKind::Amd;
        let leaf_der = x509::der_or_pem_certs(ev.signing_cert, "VCEK/VLEK certificate")?;
        let [leaf_der] = leaf_der.as_slice() else {
            return Err(Error::malformed(
                "VCEK/VLEK certificate",
                "expected exactly one certificate",
            ));
        };
        let leaf = x509::parse_cert(leaf_der, "VCEK/VLEK certificate")?;
        let chain_der = x509::pem_certs(ev.cert_chain, "AMD cert_chain")?;
        if chain_der.len() != 2 {
            return Err(Error::chain(
                C,
                format!(
                    "cert_chain holds {} certificates, expected ASK/ASVK and ARK",
                    chain_der.len()
                ),
            ));
        }
        let a = x509::parse_cert(&chain_der[0], "AMD cert_chain")?;
        let b = x509::parse_cert(&chain_der[1], "AMD cert_chain")?;
        // KDS serves ASK then ARK; accept either order, decided by which one is self-signed.
        let (ask, ark) = if x509::is_self_signed(&b, self.provider, C) {
            (a, b)
        } else if x509::is_self_signed(&a, self.provider, C) {
            (b, a)
        } else {
            return Err(Error::UntrustedRoot {
                chain: C,
                detail: "no self-signed ARK in cert_chain".into(),
            });
        };
        let (product, sim) = self.identify_ark(&ark)?;
        x509::verify_issued_by(&ask, &ark, self.provider, C)?;
        x509::verify_issued_by(&leaf, &ask, self.provider, C)?;
        // The ASVK (CN "SEV-VLEK-<product>") certifies VLEKs only; the ASK certifies VCEKs only.
        let ask_is_asvk = x509::subject(&ask).contains("VLEK");
        let leaf_kind = if ask_is_asvk {
            SigningKey::Vlek
        } else {
            SigningKey::Vcek
        };
        if leaf_kind != signing_key {
            return Err(Error::SigningKeyMismatch {
                report: signing_key.name(),
                bundle: leaf_kind.name(),
            });
        }
        let mut windows = Vec::new();
        for cert in [&ark, &ask, &leaf] {
            x509::check_validity(cert, now)?;
            windows.push((x509::subject(cert), Window::of(cert)));
        }
        for crl in ev.crls {
            let revoked = x509::checked_crl_serials(crl, &ark, self.provider, now, C)?;
            for cert in [&ask, &leaf] {
                if revoked.iter().any(|s| s.as_slice() == cert.raw_serial()) {
                    return Err(Error::Revoked {
                        subject: x509::subject(cert),
                        serial: cert.raw_serial_as_string(),
                    });
                }
            }
        }
        if let Some(name) = x509::extension(&leaf, oid::PRODUCT_NAME, C)? {
            let name = String::from_utf8_lossy(der_string(name));
            if !name.starts_with(product.name()) {
                return Err(Error::chain(
                    C,
                    format!(
                        "signing certificate is for product '{name}' but chains to ARK-{}",
                        product.name()
                    ),
                ));
            }
        }
        let tcb = CertTcb {
            bootloader: spl(&leaf, oid::BL_SPL)?,
            tee: spl(&leaf, oid::TEE_SPL)?,
            snp: spl(&leaf, oid::SNP_SPL)?,
            microcode: spl(&leaf, oid::UCODE_SPL)?,
            fmc: spl(&leaf, oid::FMC_SPL)?,
        };
        let hw_id = x509::extension(&leaf, oid::HW_ID, C)?.map(|v| der_octets(v).to_vec());
        if signing_key == SigningKey::Vcek && hw_id.is_none() {
            return Err(Error::chain(C, "VCEK has no hwID extension"));
        }
        let public_key = x509::ec_public_key(&leaf, true, C)?;
        let key = self
            .provider
            .prepare(SigAlg::EcdsaP384Sha384Fixed, public_key)
            .map_err(|_| Error::chain(C, "VCEK/VLEK public key does not parse"))?;
        Ok(VerifiedChain {
            key,
            product,
            sim,
            signing_key,
            tcb,
            hw_id,
            windows,
        })
    }

    /// Which pinned ARK (or trusted sim root) this is.
    fn identify_ark(&self, ark: &X509Certificate<'_>) -> Result<(Product, bool)> {
        let pin = x509::spki_sha256(ark);
        if let Some((product, _)) = AMD_ARKS.iter().find(|(_, p)| *p == pin) {
            return Ok((*product, false));
        }
        let subject = x509::subject(ark);
        let cn = ark
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or("");
        if let Some(rest) = cn.strip_prefix(SIM_ROOT_CN_PREFIX) {
            if !self.sim.trusts(&pin) {
                return Err(Error::UntrustedRoot {
                    chain: ChainKind::Amd,
                    detail: format!(
                        "'{subject}' is a simulator root and sim roots are not trusted"
                    ),
                });
            }
            let product = match rest {
                "ARK-Milan" => Product::Milan,
                "ARK-Genoa" => Product::Genoa,
                "ARK-Turin" => Product::Turin,
                _ => {
                    return Err(Error::chain(
                        ChainKind::Amd,
                        format!("sim root '{cn}' names no product"),
                    ));
                }
            };
            return Ok((product, true));
        }
        Err(Error::UntrustedRoot {
            chain: ChainKind::Amd,
            detail: format!(
                "'{subject}' (SPKI sha256 {}) is not AMD's ARK for Milan, Genoa or Turin",
                hex::encode(pin)
            ),
        })
    }
}

/// The contents of a DER string value (UTF8String/IA5String/...), or the bytes as they are.
fn der_string(v: &[u8]) -> &[u8] {
    match crate::der::read_tlv(v) {
        Some((tag, body, rest)) if rest.is_empty() && matches!(tag, 0x0C | 0x13 | 0x16) => body,
        _ => v,
    }
}

/// hwID is an OCTET STRING in current certificates and raw bytes in early ones.
fn der_octets(v: &[u8]) -> &[u8] {
    match crate::der::read_tlv(v) {
        Some((0x04, body, [])) => body,
        _ => v,
    }
}

/// An SPL extension: a DER INTEGER (0..=255 in practice).
fn spl(cert: &X509Certificate<'_>, oid: &str) -> Result<Option<u64>> {
    let Some(v) = x509::extension(cert, oid, ChainKind::Amd)? else {
        return Ok(None);
    };
    match crate::der::read_tlv(v) {
        Some((0x02, body, rest)) if rest.is_empty() && !body.is_empty() && body.len() <= 9 => {
            if body[0] & 0x80 != 0 {
                return Err(Error::chain(
                    ChainKind::Amd,
                    format!("SPL {oid} is negative"),
                ));
            }
            Ok(Some(
                body.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b)),
            ))
        }
        _ => Err(Error::chain(
            ChainKind::Amd,
            format!("SPL extension {oid} is not a DER INTEGER"),
        )),
    }
}

fn check_tcb(chain: &VerifiedChain, report: &AttestationReport) -> Result<()> {
    let tcb = TcbVersion::decode(report.reported_tcb, chain.product);
    let pairs: [(&'static str, Option<u64>, Option<u8>); 5] = [
        (
            "bootloader (blSPL)",
            chain.tcb.bootloader,
            Some(tcb.bootloader),
        ),
        ("tee (teeSPL)", chain.tcb.tee, Some(tcb.tee)),
        ("snp (snpSPL)", chain.tcb.snp, Some(tcb.snp)),
        (
            "microcode (ucodeSPL)",
            chain.tcb.microcode,
            Some(tcb.microcode),
        ),
        ("fmc (fmcSPL)", chain.tcb.fmc, tcb.fmc),
    ];
    for (field, cert, rep) in pairs {
        match (cert, rep) {
            (Some(c), Some(r)) if c != u64::from(r) => {
                return Err(Error::TcbMismatch {
                    field,
                    certificate: c,
                    report: r.into(),
                });
            }
            // Every SPL of the product's layout must be certified.
            (None, Some(_)) => {
                return Err(Error::chain(
                    ChainKind::Amd,
                    format!("signing certificate lacks the {field} extension"),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

fn check_hw_id(chain: &VerifiedChain, report: &AttestationReport) -> Result<()> {
    let Some(hw_id) = &chain.hw_id else {
        return Ok(()); // VLEK: not chip-specific.
    };
    // Turin VCEKs carry the 8-byte hwID = CHIP_ID[0..8]; earlier products the full 64 bytes.
    let expected: &[u8] = if chain.product == Product::Turin {
        &report.chip_id[..8]
    } else {
        &report.chip_id
    };
    if hw_id.as_slice() != expected {
        return Err(Error::ChipIdMismatch {
            certificate: hex::encode(hw_id),
            report: hex::encode(expected),
        });
    }
    Ok(())
}

fn claims(r: &AttestationReport, chain: &VerifiedChain) -> Claims {
    let p = chain.product;
    let (maj, min, build) = (
        r.current_version.2,
        r.current_version.1,
        r.current_version.0,
    );
    Claims {
        schema: crate::claims::CLAIMS_SCHEMA.into(),
        kind: EvidenceKind::Snp,
        sim: chain.sim,
        debug: r.debug_allowed(),
        detail: KindClaims::Snp(SnpClaims {
            version: r.version,
            product: p,
            signing_key: chain.signing_key,
            measurement: hex::encode(r.measurement),
            report_data: hex::encode(r.report_data),
            host_data: hex::encode(r.host_data),
            chip_id: hex::encode(r.chip_id),
            reported_tcb: TcbVersion::decode(r.reported_tcb, p),
            current_tcb: TcbVersion::decode(r.current_tcb, p),
            committed_tcb: TcbVersion::decode(r.committed_tcb, p),
            launch_tcb: TcbVersion::decode(r.launch_tcb, p),
            policy: format!("{:#x}", r.policy),
            guest_svn: r.guest_svn,
            vmpl: r.vmpl,
            family_id: hex::encode(r.family_id),
            image_id: hex::encode(r.image_id),
            id_key_digest: hex::encode(r.id_key_digest),
            author_key_digest: hex::encode(r.author_key_digest),
            report_id: hex::encode(r.report_id),
            report_id_ma: hex::encode(r.report_id_ma),
            platform_info: format!("{:#x}", r.platform_info),
            smt_enabled: r.platform_info & 1 != 0,
            // Policy bit 18 MIGRATE_MA: a migration agent may be associated with the guest.
            migration_agent_allowed: r.policy & (1 << 18) != 0,
            firmware: format!("{maj}.{min}.{build}"),
        }),
    }
}
