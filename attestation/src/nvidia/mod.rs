//! NVIDIA Hopper GPU evidence: SPDM measurements signed by the GPU's device key ([`spdm`]),
//! the device certificate chain to the pinned NVIDIA Device Identity CA, and reference
//! integrity manifests ([`rim`]) to appraise the measurements against.
//!
//! Checks: the chain (each link ECDSA P-384, each certificate valid at `now`, root pinned), the
//! leaf's TCG DICE FWID extension equal to the FWID the GPU reports in its opaque data, the
//! SPDM signature over `request ‖ response`, and — when the caller supplies one — the requester
//! nonce. The chain is cached like the SNP chain: in canonical form (canonical PEM), only once an
//! SPDM signature has verified under it, its key's P-384 tables built on its first hit. When
//! OCSP responses come with the evidence, every certificate between leaf and root must be `good`
//! in one of them ([`ocsp`]), and every response must answer for one of them; verified answers
//! are cached by the canonical chain and the canonical responses. The claims say whether
//! revocation was checked.

pub mod c14n;
pub mod ocsp;
pub mod rim;
pub(crate) mod spdm;

pub use spdm::{CC_MODE_MPT, CC_MODE_ON, CC_MODE_PPCIE, CC_MODE_UNKNOWN};

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use crate::cache::ChainCache;
use crate::claims::{Claims, EvidenceKind, KindClaims, NvidiaClaims};
use crate::crypto::{CryptoProvider, PreparedKey, SigAlg};
use crate::error::{ChainKind, Error, Result};
use crate::trust::{NVIDIA_DEVICE_ROOTS, SIM_ROOT_CN_PREFIX, SimTrust};
use crate::x509::{self, Window};

use spdm::SpdmEvidence;

/// TCG DICE TcbInfo extension (TCG DICE Attestation Architecture, §6.1.1): NVIDIA puts the
/// firmware ID of the GSP FMC here.
const OID_TCG_DICE_TCB_INFO: &str = "2.23.133.5.4.1";

/// NVIDIA evidence as bytes.
#[derive(Debug, Clone, Copy)]
pub struct NvidiaEvidence<'a> {
    /// `request ‖ response` (binary).
    pub report: &'a [u8],
    /// Device chain, PEM, leaf first, NVIDIA Device Identity CA last.
    pub cert_chain: &'a [u8],
    /// The nonce the requester sent, when the caller knows it.
    pub expected_nonce: Option<&'a [u8]>,
    /// DER OCSP responses for the chain (collateral); empty: revocation not checked.
    pub ocsp: &'a [Vec<u8>],
}

#[derive(Debug)]
struct VerifiedChain {
    /// The leaf's SEC1 point.
    public_key: Vec<u8>,
    /// Prepared (with tables) on the chain's first cache hit (see the SNP verifier's).
    key: OnceLock<Option<Box<dyn PreparedKey>>>,
    fwids: Vec<Vec<u8>>,
    sim: bool,
    device_serial: String,
    chip: Option<String>,
    root: String,
    windows: Vec<(String, Window)>,
    /// The chain's certificates (DER, leaf first), for OCSP checks.
    ders: Vec<Vec<u8>>,
    /// The chain as canonical PEM: its cache key, and the OCSP cache's.
    canonical_pem: Vec<u8>,
}

impl VerifiedChain {
    fn check_windows(&self, now: i64) -> Result<()> {
        for (subject, w) in &self.windows {
            w.check(|| subject.clone(), now)?;
        }
        Ok(())
    }

    /// Verify an SPDM signature: prepared once the chain is cached, unprepared (no tables built)
    /// for a chain seen for the first time.
    fn verify_spdm(
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

    fn heap_bytes(&self) -> usize {
        self.public_key.len()
            + self.fwids.iter().map(Vec::len).sum::<usize>()
            + self.device_serial.len()
            + self.chip.as_ref().map_or(0, String::len)
            + self.root.len()
            + self
                .windows
                .iter()
                .map(|(s, _)| s.len() + 32)
                .sum::<usize>()
            + self.ders.iter().map(Vec::len).sum::<usize>()
            + self.canonical_pem.len()
    }
}

/// Canonical PEM of a chain's certificates (64-column base64, LF), leaf first.
fn canonical_pem(ders: &[Vec<u8>]) -> Vec<u8> {
    ders.iter()
        .map(|d| x509::to_pem("CERTIFICATE", d))
        .collect::<String>()
        .into_bytes()
}

/// `ocsp` claim: every certificate between leaf and root was `good` in a supplied response.
pub const OCSP_GOOD: &str = "good";
/// `ocsp` claim: no OCSP responses came with the evidence.
pub const OCSP_NOT_CHECKED: &str = "not_checked";

/// Verifies NVIDIA SPDM evidence.
#[derive(Debug)]
pub(crate) struct NvidiaVerifier {
    provider: &'static dyn CryptoProvider,
    sim: SimTrust,
    cache: ChainCache<VerifiedChain>,
    /// Verified OCSP answers by (chain, responses).
    ocsp_cache: ChainCache<Vec<ocsp::Attested>>,
}

impl NvidiaVerifier {
    pub fn new(provider: &'static dyn CryptoProvider, sim: SimTrust) -> Self {
        NvidiaVerifier {
            provider,
            sim,
            cache: ChainCache::new(),
            ocsp_cache: ChainCache::new(),
        }
    }

    pub fn verify(&self, ev: &NvidiaEvidence<'_>, now: i64) -> Result<Claims> {
        let spdm = SpdmEvidence::parse(ev.report)?;
        if let Some(expected) = ev.expected_nonce
            && expected != spdm.request.nonce
        {
            return Err(Error::NonceMismatch {
                expected: hex::encode(expected),
                actual: hex::encode(spdm.request.nonce),
            });
        }
        let (chain, fresh) = self.chain(ev.cert_chain, now)?;
        let fwid = spdm
            .opaque(spdm::opaque_type::FWID)
            .ok_or_else(|| Error::malformed("SPDM opaque data", "no FWID field"))?;
        if !chain.fwids.iter().any(|f| f.as_slice() == fwid) {
            return Err(Error::FwidMismatch {
                certificate: chain
                    .fwids
                    .first()
                    .map(hex::encode)
                    .unwrap_or_else(|| "none".into()),
                opaque: hex::encode(fwid),
            });
        }
        if !chain.verify_spdm(
            self.provider,
            !fresh,
            &ev.report[..spdm.signed_len],
            &spdm.response.signature,
        ) {
            return Err(Error::signature("SPDM measurements (request ‖ response)"));
        }
        // Only now, with measurements verified under it, does the chain earn a cache entry.
        if fresh {
            let bytes = chain.heap_bytes();
            self.cache
                .insert(&chain.canonical_pem, &[], chain.clone(), bytes);
        }
        let ocsp = if ev.ocsp.is_empty() {
            OCSP_NOT_CHECKED
        } else {
            self.check_revocation(ev.cert_chain, &chain, ev.ocsp, now)?;
            OCSP_GOOD
        };
        let measurements: BTreeMap<String, String> = spdm
            .response
            .blocks
            .iter()
            .map(|b| (b.index.to_string(), hex::encode(&b.value)))
            .collect();
        Ok(Claims {
            schema: crate::claims::CLAIMS_SCHEMA.into(),
            kind: EvidenceKind::Nvidia,
            sim: chain.sim,
            debug: false,
            detail: KindClaims::Nvidia(NvidiaClaims {
                spdm_version: format!(
                    "{}.{}",
                    spdm.request.version >> 4,
                    spdm.request.version & 0xF
                ),
                nonce: hex::encode(spdm.request.nonce),
                measurement_count: spdm.response.blocks.len(),
                measurements,
                fwid: hex::encode(fwid),
                driver_version: spdm
                    .opaque(spdm::opaque_type::DRIVER_VERSION)
                    .map(spdm::ascii_field),
                vbios_version: spdm
                    .opaque(spdm::opaque_type::VBIOS_VERSION)
                    .and_then(spdm::format_vbios_version),
                device_serial: chain.device_serial.clone(),
                chip: chain.chip.clone(),
                cc_mode: Some(spdm::cc_mode(&spdm).into()),
                root: chain.root.clone(),
                ocsp: ocsp.into(),
            }),
        })
    }

    /// Every certificate strictly between leaf and root must be `good` at `now` (NVIDIA's
    /// verifier skips the leaf too: the FMC attestation certificate is minted at boot).
    ///
    /// Signature checks are cached by the exact chain and response bytes (responses are reused
    /// for days); freshness and status are judged at `now` on every call.
    fn check_revocation(
        &self,
        pem: &[u8],
        chain: &VerifiedChain,
        responses: &[Vec<u8>],
        now: i64,
    ) -> Result<()> {
        let rest: Vec<&[u8]> = responses.iter().map(Vec::as_slice).collect();
        if let Some(a) = self.ocsp_cache.get(pem, &rest) {
            return a.iter().try_for_each(|a| a.judge(now));
        }
        // Not under the bytes as given: under their canonical form? Every response must parse.
        let canonical = responses
            .iter()
            .map(|r| ocsp::canonical(r, self.provider))
            .collect::<Result<Vec<_>>>()?;
        let canonical_rest: Vec<&[u8]> = canonical.iter().map(Vec::as_slice).collect();
        if let Some(a) = self.ocsp_cache.get(&chain.canonical_pem, &canonical_rest) {
            return a.iter().try_for_each(|a| a.judge(now));
        }
        self.ocsp_cache.note_miss();
        let certs = chain
            .ders
            .iter()
            .map(|d| x509::parse_cert(d, "NVIDIA device certificate"))
            .collect::<Result<Vec<_>>>()?;
        let attested = (1..certs.len().saturating_sub(1))
            .map(|i| ocsp::attest(responses, &certs[i], &certs[i + 1], self.provider, None))
            .collect::<Result<Vec<_>>>()?;
        // A response that answers for no certificate of the chain is refused, not carried: it
        // would be bytes no check covers (and a new cache key per copy).
        if let Some(unused) =
            (0..responses.len()).find(|i| attested.iter().all(|a| a.response != *i))
        {
            return Err(Error::Ocsp {
                detail: format!(
                    "response {unused} answers for no certificate between the leaf and the root"
                ),
            });
        }
        attested.iter().try_for_each(|a| a.judge(now))?;
        let bytes = canonical.iter().map(Vec::len).sum::<usize>()
            + attested.len() * std::mem::size_of::<ocsp::Attested>();
        self.ocsp_cache.insert(
            &chain.canonical_pem,
            &canonical_rest,
            Arc::new(attested),
            bytes,
        );
        Ok(())
    }

    /// What the chain and OCSP caches hold (tests and benchmarks).
    pub(crate) fn cache_stats(&self) -> [crate::cache::CacheStats; 2] {
        [self.cache.stats(), self.ocsp_cache.stats()]
    }

    /// The verified chain, from the cache (`false`) or verified now (`true`: the caller caches
    /// it once an SPDM signature verifies under it); its windows checked at `now` either way.
    fn chain(&self, pem: &[u8], now: i64) -> Result<(Arc<VerifiedChain>, bool)> {
        let cached = self.cache.get(pem, &[]).or_else(|| {
            // Text around the PEM blocks, other line lengths: the canonical form may be cached.
            let ders = x509::pem_certs(pem, "NVIDIA device certificate chain").ok()?;
            self.cache.get(&canonical_pem(&ders), &[])
        });
        let (chain, fresh) = match cached {
            Some(c) => (c, false),
            None => {
                self.cache.note_miss();
                (Arc::new(self.verify_chain(pem, now)?), true)
            }
        };
        chain.check_windows(now)?;
        Ok((chain, fresh))
    }

    fn verify_chain(&self, pem: &[u8], now: i64) -> Result<VerifiedChain> {
        const C: ChainKind = ChainKind::NvidiaDevice;
        let ders = x509::pem_certs(pem, "NVIDIA device certificate chain")?;
        if ders.len() < 2 {
            return Err(Error::chain(C, "chain needs a leaf and a root"));
        }
        let certs = ders
            .iter()
            .map(|d| x509::parse_cert(d, "NVIDIA device certificate"))
            .collect::<Result<Vec<_>>>()?;
        let (root, _) = certs
            .split_last()
            .ok_or_else(|| Error::chain(C, "empty chain"))?;
        if !x509::is_self_signed(root, self.provider, C) {
            return Err(Error::UntrustedRoot {
                chain: C,
                detail: format!(
                    "last certificate '{}' is not self-signed",
                    x509::subject(root)
                ),
            });
        }
        let pin = x509::spki_sha256(root);
        let sim = if NVIDIA_DEVICE_ROOTS.contains(&pin) {
            false
        } else if root_cn(root).starts_with(SIM_ROOT_CN_PREFIX) {
            if !self.sim.trusts(&pin) {
                return Err(Error::UntrustedRoot {
                    chain: C,
                    detail: format!(
                        "'{}' is a simulator root and sim roots are not trusted",
                        x509::subject(root)
                    ),
                });
            }
            true
        } else {
            return Err(Error::UntrustedRoot {
                chain: C,
                detail: format!(
                    "'{}' (SPKI sha256 {}) is not the NVIDIA Device Identity CA",
                    x509::subject(root),
                    hex::encode(pin)
                ),
            });
        };
        for pair in certs.windows(2) {
            x509::verify_issued_by(&pair[0], &pair[1], self.provider, C)?;
        }
        let mut windows = Vec::new();
        for cert in &certs {
            x509::check_validity(cert, now)?;
            windows.push((x509::subject(cert), Window::of(cert)));
        }
        let leaf = &certs[0];
        let fwids = match x509::extension(leaf, OID_TCG_DICE_TCB_INFO, C)? {
            Some(v) => fwids_of(v),
            None => Vec::new(),
        };
        if fwids.is_empty() {
            return Err(Error::chain(
                C,
                format!("leaf '{}' carries no TCG DICE FWID", x509::subject(leaf)),
            ));
        }
        let public_key = x509::ec_public_key(leaf, true, C)?.to_vec();
        let device_serial = leaf
            .subject()
            .iter_by_oid(&x509_parser::oid_registry::OID_X509_SERIALNUMBER)
            .next()
            .and_then(|a| a.as_str().ok())
            .unwrap_or_default()
            .to_string();
        let chip = leaf_chip(leaf, sim);
        Ok(VerifiedChain {
            public_key,
            key: OnceLock::new(),
            canonical_pem: canonical_pem(&ders),
            fwids,
            sim,
            device_serial,
            chip,
            root: x509::subject(root),
            windows,
            ders: ders.clone(),
        })
    }
}

/// The GPU chip the verified leaf certificate names: the first word of its common name
/// (`GH100 A01 GSP FMC LF` → `GH100`; the simulator's prefix removed). NVIDIA names each
/// device's attestation leaf after its silicon, and the chain above it vouches for that name.
fn leaf_chip(leaf: &x509_parser::certificate::X509Certificate<'_>, sim: bool) -> Option<String> {
    let cn = leaf.subject().iter_common_name().next()?.as_str().ok()?;
    let cn = if sim {
        cn.strip_prefix(SIM_ROOT_CN_PREFIX).unwrap_or(cn)
    } else {
        cn
    };
    let word = cn.split_whitespace().next()?;
    (word.len() <= 16 && word.bytes().all(|b| b.is_ascii_alphanumeric())).then(|| word.to_string())
}

fn root_cn(cert: &x509_parser::certificate::X509Certificate<'_>) -> String {
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// FWID digests in a TcbInfo extension value. The value is a SEQUENCE; NVIDIA's holds, among
/// others, `SEQUENCE { hashAlg OID, digest OCTET STRING }` directly, while the TCG layout wraps
/// the list in `[6] IMPLICIT SEQUENCE OF FWID`. Both are read; nothing else is guessed at.
pub(crate) fn fwids_of(ext_value: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let Some((0x30, body, _)) = crate::der::read_tlv(ext_value) else {
        return out;
    };
    fn fwid(seq: &[u8]) -> Option<Vec<u8>> {
        let mut it = crate::der::children(seq);
        match (it.next(), it.next(), it.next()) {
            (Some((0x06, _)), Some((0x04, digest)), None) => Some(digest.to_vec()),
            _ => None,
        }
    }
    for (tag, value) in crate::der::children(body) {
        match tag {
            0x30 => out.extend(fwid(value)),
            0xA6 => {
                for (t, v) in crate::der::children(value) {
                    if t == 0x30 {
                        out.extend(fwid(v));
                    }
                }
            }
            _ => {}
        }
    }
    out
}
