//! AMD SEV-SNP: report parsing ([`report`]) and verification against the AMD chain.
//!
//! Verification order: (1) the chain ARK → ASK/ASVK → VCEK/VLEK, ending at a pinned ARK, each link
//! an RSASSA-PSS signature, each certificate valid at `now`, intermediates and the signing key
//! checked against supplied CRLs; (2) the report's ECDSA P-384 signature over bytes 0x000–0x29F;
//! (3) the VCEK's TCB extensions against REPORTED_TCB and its hwID against CHIP_ID. Step (1) is
//! cached per (certificates, CRLs), in canonical form (DER leaf, canonical PEM ASK ‖ ARK, CRLs
//! without trailing bytes), and only once (2) and (3) have passed under it: a public chain with a
//! junk report makes no entry. On a hit only the time checks are redone — every certificate's
//! window and every CRL's thisUpdate..nextUpdate at the new `now` — so a verified chain costs one
//! P-384 verification per report. The VCEK's P-384 tables are built on the chain's first hit,
//! never for a chain seen once.

pub mod report;

use std::sync::{Arc, OnceLock};

use x509_parser::certificate::X509Certificate;

use crate::cache::ChainCache;
use crate::claims::{Claims, EvidenceKind, KindClaims, SnpClaims};
use crate::crypto::{CryptoProvider, PreparedKey, SigAlg};
use crate::error::{ChainKind, Error, Result};
use crate::trust::{AMD_ARKS, SIM_ROOT_CN_PREFIX, SimTrust};
use crate::x509::{self, CrlWindow, Window};

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
    /// The VCEK/VLEK's SEC1 point.
    public_key: Vec<u8>,
    /// Prepared (with tables) on the chain's first cache hit; `None` inside: the provider
    /// would not prepare it, so it verifies unprepared.
    key: OnceLock<Option<Box<dyn PreparedKey>>>,
    product: Product,
    sim: bool,
    signing_key: SigningKey,
    tcb: CertTcb,
    hw_id: Option<Vec<u8>>,
    /// Every certificate's (subject, window), rechecked at each `now`.
    windows: Vec<(String, Window)>,
    /// Every CRL's thisUpdate..nextUpdate, rechecked at each `now`: a CRL past its nextUpdate
    /// no longer vouches that the chain is unrevoked.
    crl_windows: Vec<CrlWindow>,
}

impl VerifiedChain {
    /// Check every window the chain's verdict relies on at `now`.
    fn check_windows(&self, now: i64) -> Result<()> {
        for (subject, window) in &self.windows {
            window.check(|| subject.clone(), now)?;
        }
        self.crl_windows.iter().try_for_each(|w| w.check(now))
    }

    /// Verify a report signature: with the prepared key once the chain is cached, else (a chain
    /// seen for the first time) unprepared, so no tables are built for a chain that may never
    /// be seen again or whose report is junk.
    fn verify_report(
        &self,
        provider: &dyn CryptoProvider,
        cached: bool,
        msg: &[u8],
        sig: &[u8],
    ) -> bool {
        const ALG: SigAlg = SigAlg::EcdsaP384Sha384Fixed;
        if cached
            && let Some(key) = self
                .key
                .get_or_init(|| provider.prepare(ALG, &self.public_key).ok())
        {
            return key.verify(msg, sig).is_ok();
        }
        provider.verify(ALG, &self.public_key, msg, sig).is_ok()
    }

    /// Heap bytes it holds (for the cache's budget; the tables are budgeted by the provider).
    fn heap_bytes(&self) -> usize {
        self.public_key.len()
            + self.hw_id.as_ref().map_or(0, Vec::len)
            + self
                .windows
                .iter()
                .map(|(s, _)| s.len() + 32)
                .sum::<usize>()
            + self.crl_windows.len() * std::mem::size_of::<CrlWindow>()
    }
}

/// The canonical form a verified chain is cached under: the leaf's DER and the canonical PEM of
/// ASK ‖ ARK (the CRLs are DER, refused with trailing bytes).
#[derive(Debug)]
struct CanonicalChain {
    leaf: Vec<u8>,
    chain_pem: Vec<u8>,
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
        let (chain, fresh) = self.chain(ev, signing_key, now)?;
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
        if !chain.verify_report(
            self.provider,
            fresh.is_none(),
            &ev.report[..report::SIGNED_LEN],
            &report.signature_fixed_be(),
        ) {
            return Err(Error::signature("SNP attestation report"));
        }
        check_tcb(&chain, &report)?;
        check_hw_id(&chain, &report)?;
        // Only now, with a report verified under it, does the chain earn a cache entry.
        if let Some(canonical) = fresh {
            let rest = rest_of(&canonical.chain_pem, ev.crls);
            let bytes = chain.heap_bytes();
            self.cache
                .insert(&canonical.leaf, &rest, chain.clone(), bytes);
        }
        Ok(claims(&report, &chain))
    }

    /// The verified chain for this evidence, from the cache or verified now (then with the
    /// canonical form to cache it under once the report verifies); its certificates' and CRLs'
    /// windows are checked against `now` either way.
    fn chain(
        &self,
        ev: &SnpEvidence<'_>,
        signing_key: SigningKey,
        now: i64,
    ) -> Result<(Arc<VerifiedChain>, Option<CanonicalChain>)> {
        let cached = self
            .cache
            .get(ev.signing_cert, &rest_of(ev.cert_chain, ev.crls))
            .or_else(|| self.cached_canonical(ev));
        let (chain, fresh) = match cached {
            Some(chain) => (chain, None),
            None => {
                self.cache.note_miss();
                let (chain, canonical) = self.verify_chain(ev, signing_key, now)?;
                (Arc::new(chain), Some(canonical))
            }
        };
        chain.check_windows(now)?;
        Ok((chain, fresh))
    }

    /// A cache hit for evidence whose bytes are not in canonical form (PEM for the leaf, text
    /// around the PEM blocks, ARK before ASK): re-encoded, no signature checked. Anything that
    /// does not decode is left to the full verification to refuse.
    fn cached_canonical(&self, ev: &SnpEvidence<'_>) -> Option<Arc<VerifiedChain>> {
        let leaf = x509::der_or_pem_certs(ev.signing_cert, "VCEK/VLEK certificate").ok()?;
        let [leaf] = leaf.as_slice() else {
            return None;
        };
        let chain = x509::pem_certs(ev.cert_chain, "AMD cert_chain").ok()?;
        let [a, b] = chain.as_slice() else {
            return None;
        };
        // Which one is the ARK is decided by a signature at verification; try both orders.
        [(a, b), (b, a)].into_iter().find_map(|(ask, ark)| {
            let pem = canonical_chain_pem(ask, ark);
            self.cache.get(leaf, &rest_of(&pem, ev.crls))
        })
    }

    fn verify_chain(
        &self,
        ev: &SnpEvidence<'_>,
        signing_key: SigningKey,
        now: i64,
    ) -> Result<(VerifiedChain, CanonicalChain)> {
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
        let (ask, ark, chain_pem) = if x509::is_self_signed(&b, self.provider, C) {
            (a, b, canonical_chain_pem(&chain_der[0], &chain_der[1]))
        } else if x509::is_self_signed(&a, self.provider, C) {
            (b, a, canonical_chain_pem(&chain_der[1], &chain_der[0]))
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
        let mut crl_windows = Vec::with_capacity(ev.crls.len());
        for crl in ev.crls {
            let (revoked, window) = x509::checked_crl_serials(crl, &ark, self.provider, now, C)?;
            crl_windows.push(window);
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
        let public_key = x509::ec_public_key(&leaf, true, C)?.to_vec();
        let chain = VerifiedChain {
            public_key,
            key: OnceLock::new(),
            product,
            sim,
            signing_key,
            tcb,
            hw_id,
            windows,
            crl_windows,
        };
        let canonical = CanonicalChain {
            leaf: leaf_der.clone(),
            chain_pem,
        };
        Ok((chain, canonical))
    }

    /// What the chain cache holds (tests and benchmarks).
    pub(crate) fn cache_stats(&self) -> crate::cache::CacheStats {
        self.cache.stats()
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

/// The cache's other key parts: the chain's bytes, then each CRL's.
fn rest_of<'a>(chain: &'a [u8], crls: &'a [Vec<u8>]) -> Vec<&'a [u8]> {
    let mut rest = Vec::with_capacity(1 + crls.len());
    rest.push(chain);
    rest.extend(crls.iter().map(Vec::as_slice));
    rest
}

/// ASK ‖ ARK as canonical PEM (64-column base64, LF), the form AMD KDS serves.
fn canonical_chain_pem(ask: &[u8], ark: &[u8]) -> Vec<u8> {
    let mut pem = x509::to_pem("CERTIFICATE", ask);
    pem.push_str(&x509::to_pem("CERTIFICATE", ark));
    pem.into_bytes()
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
