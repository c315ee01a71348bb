//! Intel TDX quotes (v4 and v5; TD 1.0 and TD 1.5 bodies), verified by dcap-qvl against Intel
//! collateral passed in by the caller.
//!
//! dcap-qvl checks, at the given time: the PCK chain to the pinned Intel SGX Root CA and both
//! CRLs, the TCB info and QE identity signatures and validity windows, the QE report signature and
//! its binding of the attestation key, the quote signature, and matches the platform and QE TCB
//! levels to a status with advisory IDs. We add typed errors and the normalized claims. A debug
//! TD verifies (its DEBUG attribute is reported); policy refuses it.

use dcap_qvl::QuoteCollateralV3;
use dcap_qvl::quote::Report;
use dcap_qvl::verify::QuoteVerifier;
#[cfg(feature = "test-support")]
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cache::ChainCache;
use crate::claims::{Claims, EvidenceKind, KindClaims, TdxClaims};
use crate::error::{Error, Result};

/// TDX evidence as bytes.
#[derive(Debug, Clone, Copy)]
pub struct TdxEvidence<'a> {
    /// The quote (v4 or v5, certification data type 5 carrying the PCK chain).
    pub quote: &'a [u8],
    /// Intel collateral in dcap-qvl's `QuoteCollateralV3` JSON shape.
    pub collateral_json: &'a [u8],
}

/// dcap-qvl configured with aws-lc-rs, so TDX shares the crypto backend of every other verifier.
/// The vectors suite checks it against Intel-signed quotes.
struct AwsLcConfig;

impl dcap_qvl::config::Config for AwsLcConfig {
    type X509 = dcap_qvl::x509::X509CertBackend;
    type SigEncoder = dcap_qvl::signature::DerSigEncoder;
    type Crypto = AwsLcDcap;
}

struct AwsLcDcap;

/// P-256 verifications performed for TDX, process-wide: `cgx bench verify` reads it to learn
/// how many signature checks one quote costs, which sets the bound TDX throughput chases.
/// Counted only with the `test-support` feature (the benchmark's build).
#[cfg(feature = "test-support")]
static P256_VERIFICATIONS: AtomicU64 = AtomicU64::new(0);

/// Number of ECDSA P-256 verifications TDX verification has performed in this process.
#[cfg(feature = "test-support")]
pub fn p256_verifications() -> u64 {
    P256_VERIFICATIONS.load(Ordering::Relaxed)
}

#[derive(Debug)]
struct EcdsaP256Sha256;

static ECDSA_P256_SHA256: EcdsaP256Sha256 = EcdsaP256Sha256;

impl rustls_pki_types::SignatureVerificationAlgorithm for EcdsaP256Sha256 {
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> std::result::Result<(), rustls_pki_types::InvalidSignature> {
        // Inside a verifier's dcap-qvl call: a signature over Intel's collateral that this
        // verifier checked before is not checked again (see `SignatureScope`).
        let fact = SCOPE.with_borrow(|scope| {
            scope.as_ref().map(|scope| {
                let message = crate::crypto::sha256(message);
                let triple = signature_fact(public_key, signature, &message);
                (triple, message, scope.knows(&triple))
            })
        });
        if let Some((_, _, true)) = fact {
            return Ok(());
        }
        #[cfg(feature = "test-support")]
        P256_VERIFICATIONS.fetch_add(1, Ordering::Relaxed);
        aws_lc_rs::signature::UnparsedPublicKey::new(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1,
            public_key,
        )
        .verify(message, signature)
        .map_err(|_| rustls_pki_types::InvalidSignature)?;
        if let Some((triple, message, false)) = fact {
            SCOPE.with_borrow_mut(|scope| {
                if let Some(scope) = scope {
                    scope.verified.push((triple, message));
                }
            });
        }
        Ok(())
    }

    fn public_key_alg_id(&self) -> rustls_pki_types::AlgorithmIdentifier {
        rustls_pki_types::alg_id::ECDSA_P256
    }

    fn signature_alg_id(&self) -> rustls_pki_types::AlgorithmIdentifier {
        rustls_pki_types::alg_id::ECDSA_SHA256
    }
}

impl dcap_qvl::config::CryptoProvider for AwsLcDcap {
    fn sig_algo() -> &'static dyn rustls_pki_types::SignatureVerificationAlgorithm {
        &ECDSA_P256_SHA256
    }

    fn sha256(data: &[u8]) -> [u8; 32] {
        crate::crypto::sha256(data)
    }

    fn sha384(data: &[u8]) -> [u8; 48] {
        let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, data);
        let mut out = [0u8; 48];
        out.copy_from_slice(d.as_ref());
        out
    }
}

/// The digest that names one verified ECDSA P-256/SHA-256 signature: the public key, the
/// signature (each length-prefixed) and the message's SHA-256. ECDSA verification is a function
/// of exactly these, so an equal digest is an equal verdict.
fn signature_fact(public_key: &[u8], signature: &[u8], message_sha256: &[u8; 32]) -> [u8; 32] {
    use crate::crypto::CryptoProvider;
    let mut out = [0u8; 32];
    let key_len = (public_key.len() as u64).to_be_bytes();
    let sig_len = (signature.len() as u64).to_be_bytes();
    out.copy_from_slice(&crate::crypto::DEFAULT_PROVIDER.digest(
        crate::crypto::DigestAlg::Sha256,
        &[
            b"cgx tdx ecdsa-p256-sha256 verified\0",
            &key_len,
            public_key,
            &sig_len,
            signature,
            message_sha256,
        ],
    ));
    out
}

thread_local! {
    /// The signature scope of the dcap-qvl call running on this thread, if any.
    static SCOPE: std::cell::RefCell<Option<SignatureScope>> = const { std::cell::RefCell::new(None) };
}

/// What one dcap-qvl call may skip and what it verified. dcap-qvl's crypto provider is static,
/// so a verifier hands its facts to the call through this thread's scope: the signatures over
/// the collateral it presents that this verifier verified before, and, back, the signatures the
/// call verified (with their messages' digests, so the verifier can keep those over Intel's
/// collateral only — never one over a quote, a QE report or a PCK certificate, which a new
/// platform brings). Outside a scope every signature is verified.
struct SignatureScope {
    known: Option<std::sync::Arc<KnownCollateral>>,
    verified: Vec<([u8; 32], [u8; 32])>,
}

impl SignatureScope {
    fn knows(&self, triple: &[u8; 32]) -> bool {
        self.known
            .as_ref()
            .is_some_and(|k| k.signatures.contains(triple))
    }
}

/// Holds this thread's scope for one dcap-qvl call; dropping it (an early return, a panic)
/// closes the scope.
struct ScopeGuard;

impl ScopeGuard {
    fn enter(known: Option<std::sync::Arc<KnownCollateral>>) -> Self {
        SCOPE.with_borrow_mut(|scope| {
            *scope = Some(SignatureScope {
                known,
                verified: Vec::new(),
            });
        });
        ScopeGuard
    }

    /// Close the scope: the signatures verified inside it, with their messages' digests.
    fn finish(self) -> Vec<([u8; 32], [u8; 32])> {
        SCOPE.with_borrow_mut(|scope| scope.take().map(|s| s.verified).unwrap_or_default())
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPE.with_borrow_mut(|scope| *scope = None);
    }
}

/// Intel's collateral as this verifier once verified it in full. One TCB info per FMSPC, one QE
/// identity, the two CRLs and their signing chains serve a whole fleet, so a platform seen for
/// the first time usually presents collateral seen before: it is not parsed again, and the
/// signatures over it (TCB info, QE identity, both CRLs, the issuer certificates: six of a
/// quote's nine) are not verified again — dcap-qvl still checks every window, revocation and
/// TCB level against `now`, and the platform's PCK certificate, QE report and quote signatures
/// are always verified.
#[derive(Debug)]
struct KnownCollateral {
    parsed: QuoteCollateralV3,
    /// The end of the earliest window of the collateral itself: its issuer certificates, both
    /// CRLs' next update, the TCB info's and QE identity's `nextUpdate`.
    until: i64,
    /// SHA-256 of each issuer-chain certificate (their windows are in `until`).
    certs: Vec<[u8; 32]>,
    /// [`signature_fact`]s of the signatures over the collateral that verified.
    signatures: Vec<[u8; 32]>,
}

/// Verifies TDX quotes.
///
/// **Known collateral** ([`KnownCollateral`]). A platform seen for the first time is verified in
/// full by dcap-qvl, but collateral this verifier verified before (by the SHA-256 of its exact
/// bytes) is taken as parsed then, and its own signatures are not checked again: a new platform
/// costs its PCK certificate's, QE report's and quote's signatures (three of nine). Collateral
/// is remembered only after a whole quote verified with it, so re-spaced or junk collateral
/// JSON makes no entries.
///
/// **Known platforms.** A fleet re-attests constantly, and a TD's next quote differs from its
/// last only in REPORTDATA (the nonce binding) and the quote signature. So a quote whose every
/// other byte — header, body, attestation key, QE report and its signature, QE auth data, PCK
/// chain — and whose collateral are exactly those of a quote fully verified before (by
/// dcap-qvl: PCK chain, CRLs, TCB info, QE identity, QE report signature, TCB levels) needs one
/// check: the quote's signature under that same, already certified, attestation key. The
/// earlier verdict holds only while `now` is within every window it relied on (certificates,
/// CRLs, TCB info and QE identity `nextUpdate`) and not before it was reached; otherwise the
/// quote is verified in full again.
///
/// Known platforms are keyed by the quote's canonical bytes (REPORTDATA, the signature, the
/// certification data's sizes and its NUL padding left out), so one quote padded many ways is
/// one entry, and only after dcap-qvl verified it in full; the collateral's SHA-256 is compared,
/// so collateral re-spaced or otherwise re-encoded replaces that one entry rather than adding
/// to the cache.
#[derive(Debug)]
pub(crate) struct TdxVerifier {
    known: ChainCache<Known>,
    /// Collateral verified in full before, by the SHA-256 of its exact bytes.
    collateral: ChainCache<KnownCollateral>,
}

/// Bytes the verified-collateral cache may hold: a collateral set is about 20 KiB parsed, and a
/// fleet presents a few per FMSPC.
const COLLATERAL_BUDGET: usize = 8 << 20;

/// A fully verified quote's verdict, keyed by its bytes with REPORTDATA and the signature
/// blanked (and the SHA-256 of its collateral's exact bytes).
#[derive(Debug)]
struct Known {
    claims: Claims,
    /// When the full verification was made; a verification "before" it is made in full.
    from: i64,
    /// The end of the earliest window the verdict relied on.
    until: i64,
}

impl Default for TdxVerifier {
    fn default() -> Self {
        TdxVerifier {
            known: ChainCache::new(),
            collateral: ChainCache::with_budget(COLLATERAL_BUDGET),
        }
    }
}

/// Where the signed part, REPORTDATA, the quote signature and the attestation key lie in a
/// canonical quote (Intel TDX DCAP Quoting Library API, Appendix A: the v4 header is 48 bytes
/// and the TD 1.0 body 584; v5 puts a body descriptor — type u16, size u32 — before the body).
/// REPORTDATA is at body offset 520 in TD 1.0 and 1.5 bodies alike.
#[derive(Debug, Clone)]
struct Layout {
    signed: usize,
    report_data: std::ops::Range<usize>,
    signature: std::ops::Range<usize>,
    attestation_key: std::ops::Range<usize>,
}

fn layout(bytes: &[u8], version: u16) -> Option<Layout> {
    let (body_start, body_len) = match version {
        4 => (48usize, 584usize),
        5 => (
            54,
            u32::from_le_bytes(bytes.get(50..54)?.try_into().ok()?) as usize,
        ),
        _ => return None,
    };
    if body_len < 584 {
        return None;
    }
    let signed = body_start.checked_add(body_len)?;
    let l = Layout {
        signed,
        report_data: body_start + 520..body_start + 584,
        signature: signed + 4..signed + 68,
        attestation_key: signed + 68..signed + 132,
    };
    bytes.get(l.attestation_key.clone())?;
    Some(l)
}

/// The cache key: the quote with REPORTDATA and the signature zeroed, and the certification
/// data's three sizes (signature data, outer and inner certification data) zeroed and the PCK
/// chain's NUL padding cut, so that padding, which nothing signs, cannot make new keys. The
/// inner certification data is the quote's last field (`inner_len` bytes); every other field
/// is fixed-size or keeps its own length (QE auth data), so the key still determines the quote
/// but for what it leaves out.
fn masked(quote: &[u8], l: &Layout, inner_len: usize) -> Vec<u8> {
    let inner_start = quote.len().saturating_sub(inner_len);
    let kept = inner_start + trimmed(&quote[inner_start..]).len();
    let mut m = quote[..kept].to_vec();
    m[l.report_data.clone()].fill(0);
    m[l.signature.clone()].fill(0);
    let sizes = [
        l.signed..l.signed + 4,
        l.attestation_key.end + 2..l.attestation_key.end + 6,
        inner_start.saturating_sub(4)..inner_start,
    ];
    for r in sizes {
        if let Some(b) = m.get_mut(r) {
            b.fill(0);
        }
    }
    m
}

/// What this verifier keeps of collateral that just verified in full: the collateral, the end
/// of its earliest window, its issuer certificates' digests, and of the signatures the call
/// verified (`verified`: fact and message digest) those over the collateral's own messages —
/// the TCB info and QE identity JSON, each CRL's and each issuer certificate's TBS. `None`:
/// something could not be read (nothing is then remembered).
fn collateral_facts(
    c: QuoteCollateralV3,
    verified: &[([u8; 32], [u8; 32])],
) -> Option<KnownCollateral> {
    use time::format_description::well_known::Rfc3339;
    /// Only `nextUpdate` is read (serde skips the rest without building values).
    #[derive(serde::Deserialize)]
    struct Signed {
        #[serde(rename = "tcbInfo", alias = "enclaveIdentity")]
        inner: Option<Next>,
        #[serde(rename = "nextUpdate")]
        next_update: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Next {
        #[serde(rename = "nextUpdate")]
        next_update: String,
    }
    let mut until = i64::MAX;
    let mut messages: Vec<[u8; 32]> = Vec::with_capacity(8);
    for json in [&c.tcb_info, &c.qe_identity] {
        let v: Signed = serde_json::from_str(json).ok()?;
        let next = match (v.inner, v.next_update) {
            (Some(inner), _) => inner.next_update,
            (None, Some(next)) => next,
            (None, None) => return None,
        };
        until = until.min(
            time::OffsetDateTime::parse(&next, &Rfc3339)
                .ok()?
                .unix_timestamp(),
        );
        messages.push(crate::crypto::sha256(json.as_bytes()));
    }
    for crl in [&c.root_ca_crl, &c.pck_crl] {
        let (_, parsed) =
            <x509_parser::revocation_list::CertificateRevocationList as x509_parser::prelude::FromDer<_>>::from_der(crl).ok()?;
        // A CRL is stale from its nextUpdate on (webpki: `time >= next_update`).
        until = until.min(parsed.next_update()?.timestamp().checked_sub(1)?);
        messages.push(crate::crypto::sha256(tbs(crl)?));
    }
    // The chains share certificates (Intel's root in each, the TCB signing chain twice):
    // each distinct one is read once.
    let mut certs: Vec<[u8; 32]> = Vec::with_capacity(4);
    let mut seen_chains: Vec<&str> = Vec::with_capacity(3);
    for pem in [
        &c.pck_crl_issuer_chain,
        &c.tcb_info_issuer_chain,
        &c.qe_identity_issuer_chain,
    ] {
        if seen_chains.contains(&pem.as_str()) {
            continue;
        }
        seen_chains.push(pem);
        for der in crate::x509::pem_certs(pem.as_bytes(), "certificate chain").ok()? {
            let digest = crate::crypto::sha256(&der);
            if certs.contains(&digest) {
                continue;
            }
            certs.push(digest);
            let cert = crate::x509::parse_cert(&der, "certificate").ok()?;
            until = until.min(cert.validity().not_after.timestamp());
            messages.push(crate::crypto::sha256(tbs(&der)?));
        }
    }
    let mut signatures: Vec<[u8; 32]> = Vec::with_capacity(8);
    for (fact, message) in verified {
        if messages.contains(message) && !signatures.contains(fact) {
            signatures.push(*fact);
        }
    }
    Some(KnownCollateral {
        parsed: c,
        until,
        certs,
        signatures,
    })
}

/// The signed part of a certificate or CRL (`tbsCertificate`, `tbsCertList`: the first
/// element of the outer SEQUENCE, whole), as webpki hands it to the signature check.
fn tbs(der: &[u8]) -> Option<&[u8]> {
    let (0x30, body, _) = crate::der::read_tlv(der)? else {
        return None;
    };
    let (0x30, _, raw, _) = crate::der::read_tlv_raw(body)? else {
        return None;
    };
    Some(raw)
}

/// The end of the earliest window a verdict on this quote relied on: the collateral's, the PCK
/// leaf's (`leaf_until`), and that of any other certificate of the quote's chain that is not
/// one of the collateral's issuer certificates. `None`: a certificate could not be read.
fn platform_until(known: &KnownCollateral, pck_ders: &[Vec<u8>], leaf_until: i64) -> Option<i64> {
    let mut until = known.until.min(leaf_until);
    for der in pck_ders.iter().skip(1) {
        if known.certs.contains(&crate::crypto::sha256(der)) {
            continue;
        }
        let cert = crate::x509::parse_cert(der, "certificate").ok()?;
        until = until.min(cert.validity().not_after.timestamp());
    }
    Some(until)
}

/// The quote's own signature: ECDSA P-256 (`r ‖ s`) by the attestation key over header and body.
fn quote_signature_ok(quote: &[u8], l: &Layout) -> bool {
    #[cfg(feature = "test-support")]
    P256_VERIFICATIONS.fetch_add(1, Ordering::Relaxed);
    let mut key = [0u8; 65];
    key[0] = 0x04;
    key[1..].copy_from_slice(&quote[l.attestation_key.clone()]);
    aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED,
        &key[..],
    )
    .verify(&quote[..l.signed], &quote[l.signature.clone()])
    .is_ok()
}

/// Smallest quote: 48-byte header + 584-byte TD 1.0 body + 4-byte signature length.
const MIN_QUOTE_LEN: usize = 48 + 584 + 4;

impl TdxVerifier {
    pub fn verify(&self, ev: &TdxEvidence<'_>, now: i64) -> Result<Claims> {
        let quote = parse_quote(ev.quote)?;
        if quote.header.tee_type != 0x81 {
            return Err(Error::invalid(
                "tee_type",
                format!("{:#x} is not TDX (0x81)", quote.header.tee_type),
            ));
        }
        let (pck_ders, quote_len) = check_canonical(ev.quote, &quote)?;
        let bytes = &ev.quote[..quote_len];
        let layout = layout(bytes, quote.header.version);
        let key = layout
            .as_ref()
            .map(|l| masked(bytes, l, quote.inner_cert_data().len()));
        let collateral_digest = crate::crypto::sha256(ev.collateral_json);
        // A quote from a known platform: one signature check.
        if let (Some(l), Some(k)) = (&layout, &key)
            && let Some(known) = self.known.get(k, &[&collateral_digest])
            && (known.from..=known.until).contains(&now)
            && quote_signature_ok(bytes, l)
        {
            let mut claims = known.claims.clone();
            if let KindClaims::Tdx(t) = &mut claims.detail {
                t.report_data = hex::encode(&bytes[l.report_data.clone()]);
            }
            return Ok(claims);
        }
        let pck_leaf = pck_ders
            .first()
            .ok_or_else(|| Error::malformed("PCK certificate chain", "empty"))?;
        let (fmspc, leaf_until) = pck_leaf_facts(pck_leaf)?;
        self.known.note_miss();
        // Collateral verified before is taken as parsed then; other collateral is parsed here
        // and remembered only once the whole quote has verified with it.
        let known_collateral = self.collateral.get(&collateral_digest, &[]);
        if known_collateral.is_none() {
            self.collateral.note_miss();
        }
        let mut parsed_here: Option<QuoteCollateralV3> = None;
        let collateral: &QuoteCollateralV3 = match &known_collateral {
            Some(known) => &known.parsed,
            None => {
                parsed_here.insert(serde_json::from_slice(ev.collateral_json).map_err(|e| {
                    Error::Collateral {
                        detail: format!("collateral JSON: {e}"),
                    }
                })?)
            }
        };
        // dcap-qvl verifies the collateral's PCK chain instead of the quote's when it carries
        // one: only the quote's own chain is accepted (the FMSPC and the windows read it).
        if let Some(chain) = &collateral.pck_certificate_chain
            && trimmed(chain.as_bytes()) != trimmed(quote.inner_cert_data())
        {
            return Err(Error::Collateral {
                detail: "the collateral's PCK chain is not the quote's".into(),
            });
        }
        let at = u64::try_from(now).map_err(|_| Error::invalid("time", "before 1970"))?;
        let scope = ScopeGuard::enter(known_collateral.clone());
        let verified = QuoteVerifier::new_prod()
            .with_config::<AwsLcConfig>()
            .allow_debug(true)
            .allow_service_td(true)
            .verify(ev.quote, collateral, at);
        let signatures = scope.finish();
        let verified = verified.map_err(|e| classify(&format!("{e:#}")))?;
        let (base, td15) = td_body(&verified.report)?;
        let claims = Claims {
            schema: crate::claims::CLAIMS_SCHEMA.into(),
            kind: EvidenceKind::Tdx,
            sim: false,
            // TD_ATTRIBUTES bit 0: DEBUG (TDX module ABI, TDATTRIBUTES table).
            debug: base.td_attributes[0] & 1 != 0,
            detail: KindClaims::Tdx(TdxClaims {
                quote_version: quote.header.version,
                body: if td15.is_some() { "td15" } else { "td10" }.into(),
                tcb_status: verified.status.clone(),
                advisory_ids: verified.advisory_ids.clone(),
                mr_td: hex::encode(base.mr_td),
                mr_config_id: hex::encode(base.mr_config_id),
                mr_owner: hex::encode(base.mr_owner),
                mr_owner_config: hex::encode(base.mr_owner_config),
                mr_seam: hex::encode(base.mr_seam),
                mr_signer_seam: hex::encode(base.mr_signer_seam),
                rtmr: [base.rt_mr0, base.rt_mr1, base.rt_mr2, base.rt_mr3]
                    .iter()
                    .map(hex::encode)
                    .collect(),
                report_data: hex::encode(base.report_data),
                td_attributes: hex::encode(base.td_attributes),
                xfam: hex::encode(base.xfam),
                tee_tcb_svn: hex::encode(base.tee_tcb_svn),
                seam_attributes: hex::encode(base.seam_attributes),
                tee_tcb_svn2: td15.map(|r| hex::encode(r.tee_tcb_svn2)),
                mr_service_td: td15.map(|r| hex::encode(r.mr_service_td)),
                fmspc: hex::encode(fmspc),
            }),
        };
        // Remember the collateral, the first time it verified.
        let known_collateral = match (known_collateral, parsed_here) {
            (Some(known), _) => Some(known),
            (None, Some(parsed)) => collateral_facts(parsed, &signatures).map(|known| {
                let known = std::sync::Arc::new(known);
                // Parsed, it holds about what its JSON does (the CRLs' hex halved).
                self.collateral.insert(
                    &collateral_digest,
                    &[],
                    known.clone(),
                    ev.collateral_json.len(),
                );
                known
            }),
            (None, None) => None,
        };
        // Remember the verdict (the layout agreeing with what dcap-qvl parsed).
        if let (Some(l), Some(k), Some(c)) = (&layout, key, &known_collateral)
            && bytes[l.report_data.clone()] == base.report_data[..]
            && let Some(until) = platform_until(c, &pck_ders, leaf_until)
        {
            // The claims are about 1.5 KiB of hex.
            self.known.insert(
                &k,
                &[&collateral_digest],
                std::sync::Arc::new(Known {
                    claims: claims.clone(),
                    from: now,
                    until,
                }),
                2048,
            );
        }
        Ok(claims)
    }

    /// What the known-platform and verified-collateral caches hold (tests and benchmarks).
    pub(crate) fn cache_stats(&self) -> [crate::cache::CacheStats; 2] {
        [self.known.stats(), self.collateral.stats()]
    }

    /// Forget every known platform, keeping the verified collateral: the next quote from any
    /// platform is verified as one seen for the first time (benchmarks and tests).
    #[cfg(feature = "test-support")]
    pub(crate) fn forget_platforms(&self) {
        self.known.clear();
    }
}

/// Certification data without its NUL padding.
fn trimmed(data: &[u8]) -> &[u8] {
    let end = data.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    &data[..end]
}

/// A TD quote's MRTD and RTMR[0]–RTMR[3], parsed only — whether the quote is genuine is
/// [`TdxVerifier::verify`]'s question. For comparing a quote with an image's measurements.
pub fn td_measurements(quote_bytes: &[u8]) -> Result<([u8; 48], [[u8; 48]; 4])> {
    let quote = parse_quote(quote_bytes)?;
    let (base, _) = td_body(&quote.report)?;
    Ok((
        base.mr_td,
        [base.rt_mr0, base.rt_mr1, base.rt_mr2, base.rt_mr3],
    ))
}

/// A quote at least as long as a TD quote can be, parsed (not verified).
fn parse_quote(bytes: &[u8]) -> Result<dcap_qvl::quote::Quote> {
    if bytes.len() < MIN_QUOTE_LEN {
        return Err(Error::Length {
            what: "TDX quote",
            expected: format!("at least {MIN_QUOTE_LEN}"),
            actual: bytes.len(),
        });
    }
    dcap_qvl::quote::Quote::parse(bytes)
        .map_err(|e| Error::malformed("TDX quote", format!("{e:#}")))
}

/// The TD 1.0 body every TD report has, and the TD 1.5 fields where it has them.
fn td_body(
    report: &Report,
) -> Result<(
    &dcap_qvl::quote::TDReport10,
    Option<&dcap_qvl::quote::TDReport15>,
)> {
    match report {
        Report::TD10(r) => Ok((r, None)),
        Report::TD15(r) => Ok((&r.base, Some(r))),
        Report::TD15Ex(r) => Ok((&r.base.base, Some(&r.base))),
        Report::SgxEnclave(_) => Err(Error::invalid("body", "SGX enclave report in a TDX quote")),
    }
}

/// What Intel collateral a quote needs: its FMSPC and the CA (`platform` or `processor`) that
/// issued its PCK certificate — the inputs of PCS's TCB-info and PCK-CRL requests.
pub fn collateral_ids(quote_bytes: &[u8]) -> Result<([u8; 6], &'static str)> {
    let quote = dcap_qvl::quote::Quote::parse(quote_bytes)
        .map_err(|e| Error::malformed("TDX quote", format!("{e:#}")))?;
    let (ders, _) = check_canonical(quote_bytes, &quote)?;
    let leaf = ders
        .first()
        .ok_or_else(|| Error::malformed("PCK certificate chain", "empty"))?;
    let fmspc = fmspc_of(leaf)?;
    let cert = crate::x509::parse_cert(leaf, "PCK certificate")?;
    let ca = if cert.issuer().to_string().contains("Platform") {
        "platform"
    } else {
        "processor"
    };
    Ok((fmspc, ca))
}

/// Certification data type 6: QE report certification data; its inner type 5: PCK chain (PEM).
const CERT_TYPE_QE_REPORT: u16 = 6;
const CERT_TYPE_PCK_CHAIN: u16 = 5;

/// Refuse any byte of the quote that no check would otherwise cover. Signatures cover the header,
/// body and QE report; dcap-qvl verifies the PCK leaf and intermediate but substitutes its pinned
/// root for the root the quote carries and tolerates slack around the PEM. So: the quote must be
/// exactly its own encoding (zero padding after it allowed), the certification data types must be
/// 6 then 5, the PCK chain must be canonical PEM (64-column lines; NUL padding allowed), and the
/// root it carries must be Intel's exact certificate.
/// Returns the PCK chain's certificates (DER, leaf first) and the quote's length without padding.
fn check_canonical(bytes: &[u8], quote: &dcap_qvl::quote::Quote) -> Result<(Vec<Vec<u8>>, usize)> {
    use dcap_qvl::quote::AuthData;
    use parity_scale_codec::Encode;
    let encoded = quote.encode();
    if bytes.len() < encoded.len()
        || bytes[..encoded.len()] != encoded[..]
        || bytes[encoded.len()..].iter().any(|&b| b != 0)
    {
        return Err(Error::malformed(
            "TDX quote",
            "bytes outside the quote structure, or a non-canonical encoding",
        ));
    }
    let outer = match &quote.auth_data {
        AuthData::V4(v4) => v4.certification_data.cert_type,
        _ => 0,
    };
    if outer != CERT_TYPE_QE_REPORT || quote.inner_cert_type() != CERT_TYPE_PCK_CHAIN {
        return Err(Error::invalid(
            "certification data type",
            format!(
                "outer {outer}, inner {}: expected 6 (QE report) holding 5 (PCK chain)",
                quote.inner_cert_type()
            ),
        ));
    }
    let ders = canonical_pem_certs(trimmed(quote.inner_cert_data())).ok_or_else(|| {
        Error::malformed(
            "PCK certificate chain",
            "not canonical PEM (64-column base64, LF line ends)",
        )
    })?;
    let root = ders.last().map(|d| crate::crypto::sha256(d));
    if root != Some(crate::trust::INTEL_SGX_ROOT_CA_SHA256) {
        return Err(Error::UntrustedRoot {
            chain: crate::error::ChainKind::Intel,
            detail: "the quote's PCK chain does not end at the Intel SGX Root CA".into(),
        });
    }
    Ok((ders, encoded.len()))
}

/// The certificates of `data` if it is exactly canonical PEM — `CERTIFICATE` blocks only, each
/// its base64 in 64-column lines (the last one shorter or full), LF line ends, canonical base64
/// (padding, no stray bits), nothing between or around the blocks — i.e. if `data` is
/// `to_pem("CERTIFICATE", der)` of each certificate in turn. One pass and one decode per block:
/// the check runs on every quote verified in full.
fn canonical_pem_certs(data: &[u8]) -> Option<Vec<Vec<u8>>> {
    use base64::Engine;
    const BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----\n";
    const END: &[u8] = b"-----END CERTIFICATE-----\n";
    let mut rest = data;
    let mut out = Vec::new();
    while !rest.is_empty() {
        rest = rest.strip_prefix(BEGIN)?;
        let mut b64 = Vec::with_capacity(2048);
        loop {
            if let Some(after) = rest.strip_prefix(END) {
                rest = after;
                break;
            }
            let nl = rest.iter().position(|&b| b == b'\n')?;
            let line = &rest[..nl];
            // Every line but the block's last is full; the last is 1..=64 characters.
            let last = rest[nl + 1..].starts_with(END);
            if line.is_empty() || line.len() > 64 || (!last && line.len() != 64) {
                return None;
            }
            b64.extend_from_slice(line);
            rest = &rest[nl + 1..];
        }
        let der = base64::engine::general_purpose::STANDARD
            .decode(&b64)
            .ok()?;
        // The base64 engine refuses non-canonical padding and trailing bits, so `der` encodes
        // back to exactly these lines.
        out.push(der);
    }
    (!out.is_empty()).then_some(out)
}

/// Intel SGX extensions of a PCK certificate (Intel SGX PCK Certificate and CRL Profile, §1.3.5).
const OID_SGX_EXTENSIONS: &str = "1.2.840.113741.1.13.1";
/// DER body of the FMSPC OID 1.2.840.113741.1.13.1.4 inside them.
const FMSPC_OID_BODY: [u8; 10] = [0x2A, 0x86, 0x48, 0x86, 0xF8, 0x4D, 0x01, 0x0D, 0x01, 0x04];

/// The FMSPC and the end of the validity of a PCK leaf, read in one parse.
fn pck_leaf_facts(pck_leaf: &[u8]) -> Result<([u8; 6], i64)> {
    let cert = crate::x509::parse_cert(pck_leaf, "PCK certificate")?;
    Ok((fmspc_in(&cert)?, cert.validity().not_after.timestamp()))
}

/// The FMSPC (6 bytes) from the PCK leaf: `SEQUENCE OF SEQUENCE { OID, value }`. dcap-qvl has
/// already used it to select the TCB info; we only report it.
fn fmspc_of(pck_leaf: &[u8]) -> Result<[u8; 6]> {
    fmspc_in(&crate::x509::parse_cert(pck_leaf, "PCK certificate")?)
}

fn fmspc_in(cert: &x509_parser::certificate::X509Certificate<'_>) -> Result<[u8; 6]> {
    let bad = || Error::malformed("PCK certificate", "no FMSPC in the SGX extensions");
    let ext = crate::x509::extension(cert, OID_SGX_EXTENSIONS, crate::error::ChainKind::Intel)?
        .ok_or_else(bad)?;
    let Some((0x30, body, _)) = crate::der::read_tlv(ext) else {
        return Err(bad());
    };
    for (tag, item) in crate::der::children(body) {
        if tag != 0x30 {
            continue;
        }
        let mut it = crate::der::children(item);
        if let (Some((0x06, oid)), Some((0x04, value))) = (it.next(), it.next())
            && oid == FMSPC_OID_BODY
            && let Ok(fmspc) = <[u8; 6]>::try_from(value)
        {
            return Ok(fmspc);
        }
    }
    Err(bad())
}

/// Map dcap-qvl's error text to a typed refusal. The message is kept verbatim for operators.
fn classify(msg: &str) -> Error {
    let lower = msg.to_ascii_lowercase();
    let detail = msg.to_string();
    if lower.contains("no matching tcb level") || lower.contains("tcb status") {
        Error::TcbLevel { detail }
    } else if lower.contains("expired")
        || lower.contains("not yet valid")
        || lower.contains("next update")
        || lower.contains("nextupdate")
        || lower.contains("issue date")
        || lower.contains("not valid")
    {
        Error::CollateralExpired { detail }
    } else if lower.contains("revoked") {
        Error::Revoked {
            subject: "Intel PCK chain".into(),
            serial: detail,
        }
    } else if lower.contains("signature") || lower.contains("mismatch") || lower.contains("hash") {
        Error::signature(format!("TDX quote or collateral ({msg})"))
    } else if lower.contains("decode") || lower.contains("parse") || lower.contains("invalid") {
        Error::malformed("TDX quote or collateral", detail)
    } else {
        Error::Collateral { detail }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The one-pass check accepts exactly what `to_pem` writes, block by block.
    #[test]
    fn canonical_pem_is_exactly_to_pem() {
        let ders: Vec<Vec<u8>> = [1usize, 47, 48, 49, 700]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
            .collect();
        let pem: String = ders
            .iter()
            .map(|d| crate::x509::to_pem("CERTIFICATE", d))
            .collect();
        assert_eq!(canonical_pem_certs(pem.as_bytes()).unwrap(), ders);
        let one = crate::x509::to_pem("CERTIFICATE", &ders[4]);
        for bad in [
            one.replace('\n', "\r\n"),
            format!("junk\n{one}"),
            format!("{one}junk\n"),
            format!("{one}\n"),
            one.replacen("-----END", "\n-----END", 1),
            one.replace("CERTIFICATE", "X509 CRL"),
            one.trim_end().to_string(),
            String::new(),
        ] {
            assert!(canonical_pem_certs(bad.as_bytes()).is_none(), "{bad:?}");
        }
        // 76-column lines (the same base64, other wrapping) are not canonical.
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&ders[4]);
        let mut wrapped = String::from("-----BEGIN CERTIFICATE-----\n");
        for c in b64.as_bytes().chunks(76) {
            wrapped.push_str(std::str::from_utf8(c).unwrap());
            wrapped.push('\n');
        }
        wrapped.push_str("-----END CERTIFICATE-----\n");
        assert!(canonical_pem_certs(wrapped.as_bytes()).is_none());
        // A stray bit in the last base64 character (decodes to the same bytes leniently).
        let der = vec![0xFFu8; 4]; // "/////w==": the last data character carries 4 spare bits
        let pem = crate::x509::to_pem("CERTIFICATE", &der);
        assert!(canonical_pem_certs(pem.as_bytes()).is_some());
        let stray = pem.replace("/////w==", "/////x==");
        assert!(canonical_pem_certs(stray.as_bytes()).is_none());
    }
}
