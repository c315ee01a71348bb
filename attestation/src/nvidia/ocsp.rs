//! OCSP (RFC 6960) for the NVIDIA device chain, sans-IO: build a request, parse a response,
//! check it against the certificate and its issuer at an explicit time.
//!
//! NVIDIA's verifier asks `ocsp.ndis.nvidia.com` about every certificate of the device chain
//! except the leaf (the GSP FMC attestation certificate is made at boot and never registered)
//! and the root; so does [`super::NvidiaVerifier`] when responses come with the evidence. We ask
//! without a request nonce (RFC 5019 style): a response is then cacheable and freshness comes from
//! its signed `thisUpdate`/`nextUpdate`, which lets the collateral store serve it while NVIDIA's
//! responder is down.
//!
//! ```text
//! OCSPResponse ::= SEQUENCE { responseStatus ENUMERATED, responseBytes [0] EXPLICIT SEQUENCE {
//!     responseType OID (id-pkix-ocsp-basic), response OCTET STRING } OPTIONAL }
//! BasicOCSPResponse ::= SEQUENCE { tbsResponseData ResponseData, signatureAlgorithm
//!     AlgorithmIdentifier, signature BIT STRING, certs [0] EXPLICIT SEQUENCE OF Certificate OPTIONAL }
//! ResponseData ::= SEQUENCE { version [0] EXPLICIT INTEGER DEFAULT v1, responderID
//!     ([1] EXPLICIT Name | [2] EXPLICIT KeyHash), producedAt GeneralizedTime,
//!     responses SEQUENCE OF SingleResponse, responseExtensions [1] EXPLICIT Extensions OPTIONAL }
//! SingleResponse ::= SEQUENCE { certID CertID, certStatus CHOICE { good [0] IMPLICIT NULL,
//!     revoked [1] IMPLICIT RevokedInfo, unknown [2] IMPLICIT NULL }, thisUpdate GeneralizedTime,
//!     nextUpdate [0] EXPLICIT GeneralizedTime OPTIONAL, singleExtensions [1] EXPLICIT … OPTIONAL }
//! CertID ::= SEQUENCE { hashAlgorithm AlgorithmIdentifier, issuerNameHash OCTET STRING,
//!     issuerKeyHash OCTET STRING, serialNumber CertificateSerialNumber }
//! ```

use x509_parser::certificate::X509Certificate;

use crate::crypto::{CryptoProvider, DigestAlg};
use crate::der::{children, read_tlv, read_tlv_raw, write as w};
use crate::error::{ChainKind, Error, Result};
use crate::x509;

const OID_SHA1: &str = "1.3.14.3.2.26";
const OID_SHA256: &str = "2.16.840.1.101.3.4.2.1";
const OID_SHA384: &str = "2.16.840.1.101.3.4.2.2";
const OID_OCSP_BASIC: &str = "1.3.6.1.5.5.7.48.1.1";
const OID_OCSP_NONCE: &str = "1.3.6.1.5.5.7.48.1.2";

/// Clock skew tolerated on `thisUpdate`.
pub const MAX_SKEW_SECS: i64 = 300;
/// Oldest acceptable response that carries no `nextUpdate`.
pub const MAX_AGE_WITHOUT_NEXT_UPDATE_SECS: i64 = 24 * 3600;

fn bad(detail: impl Into<String>) -> Error {
    Error::Ocsp {
        detail: detail.into(),
    }
}

/// Hash algorithm of a [`CertId`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CertIdHash {
    Sha1,
    Sha256,
    Sha384,
}

impl CertIdHash {
    fn oid(self) -> &'static str {
        match self {
            CertIdHash::Sha1 => OID_SHA1,
            CertIdHash::Sha256 => OID_SHA256,
            CertIdHash::Sha384 => OID_SHA384,
        }
    }

    fn digest(self, provider: &dyn CryptoProvider, data: &[u8]) -> Vec<u8> {
        provider.digest(
            match self {
                CertIdHash::Sha1 => DigestAlg::Sha1,
                CertIdHash::Sha256 => DigestAlg::Sha256,
                CertIdHash::Sha384 => DigestAlg::Sha384,
            },
            &[data],
        )
    }
}

/// Which certificate a request or a single response is about (RFC 6960 §4.1.1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CertId {
    pub hash: CertIdHash,
    /// Hash of the issuer's subject Name DER.
    pub issuer_name_hash: Vec<u8>,
    /// Hash of the issuer's public key (the BIT STRING contents, without the unused-bits byte).
    pub issuer_key_hash: Vec<u8>,
    /// The certificate's serial number, big-endian as encoded (leading zero kept).
    pub serial: Vec<u8>,
}

impl CertId {
    /// The id of `cert` issued by `issuer` (both DER).
    pub fn new(cert_der: &[u8], issuer_der: &[u8], hash: CertIdHash) -> Result<Self> {
        let cert = x509::parse_cert(cert_der, "OCSP subject certificate")?;
        let issuer = x509::parse_cert(issuer_der, "OCSP issuer certificate")?;
        Ok(Self::of(
            &cert,
            &issuer,
            hash,
            &crate::crypto::DEFAULT_PROVIDER,
        ))
    }

    pub(crate) fn of(
        cert: &X509Certificate<'_>,
        issuer: &X509Certificate<'_>,
        hash: CertIdHash,
        provider: &dyn CryptoProvider,
    ) -> Self {
        CertId {
            hash,
            issuer_name_hash: hash.digest(provider, issuer.subject().as_raw()),
            issuer_key_hash: hash.digest(provider, &issuer.public_key().subject_public_key.data),
            serial: cert.raw_serial().to_vec(),
        }
    }

    pub fn to_der(&self) -> Vec<u8> {
        w::seq(&[
            w::seq(&[w::oid(self.hash.oid()), w::null()]),
            w::octets(&self.issuer_name_hash),
            w::octets(&self.issuer_key_hash),
            w::tlv(0x02, &self.serial),
        ])
    }

    fn parse(der: &[u8]) -> Option<Self> {
        let mut it = children(der);
        let (0x30, alg) = it.next()? else {
            return None;
        };
        let (0x04, name) = it.next()? else {
            return None;
        };
        let (0x04, key) = it.next()? else {
            return None;
        };
        let (0x02, serial) = it.next()? else {
            return None;
        };
        if it.next().is_some() {
            return None;
        }
        let (0x06, oid, params) = read_tlv(alg)? else {
            return None;
        };
        if !(params.is_empty() || params == [0x05, 0x00]) {
            return None;
        }
        let hash = [CertIdHash::Sha1, CertIdHash::Sha256, CertIdHash::Sha384]
            .into_iter()
            .find(|h| oid_is(oid, h.oid()))?;
        Some(CertId {
            hash,
            issuer_name_hash: name.to_vec(),
            issuer_key_hash: key.to_vec(),
            serial: serial.to_vec(),
        })
    }

    /// Serial number as lowercase hex without leading zero bytes (for messages and keys).
    pub fn serial_hex(&self) -> String {
        let skip = self
            .serial
            .iter()
            .take_while(|&&b| b == 0)
            .count()
            .min(self.serial.len().saturating_sub(1));
        hex::encode(&self.serial[skip..])
    }
}

/// The ids to ask about for a PEM device chain (leaf first): every certificate strictly between
/// leaf and root, each with its issuer, hashed with SHA-384 as NVIDIA's verifier asks.
pub fn chain_cert_ids(chain_pem: &[u8]) -> Result<Vec<CertId>> {
    let ders = x509::pem_certs(chain_pem, "NVIDIA device certificate chain")?;
    (1..ders.len().saturating_sub(1))
        .map(|i| CertId::new(&ders[i], &ders[i + 1], CertIdHash::Sha384))
        .collect()
}

/// A DER `OCSPRequest` for `ids`, optionally with a nonce extension.
pub fn request(ids: &[CertId], nonce: Option<&[u8]>) -> Vec<u8> {
    let list: Vec<Vec<u8>> = ids.iter().map(|id| w::seq(&[id.to_der()])).collect();
    let mut tbs = vec![w::seq(&list)];
    if let Some(n) = nonce {
        let ext = w::seq(&[w::oid(OID_OCSP_NONCE), w::octets(&w::octets(n))]);
        tbs.push(w::ctx(2, &w::seq(&[ext])));
    }
    w::seq(&[w::seq(&tbs)])
}

/// `certStatus` of one certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertStatus {
    Good,
    Revoked {
        at: i64,
        /// CRLReason (RFC 5280 §5.3.1), when given.
        reason: Option<u8>,
    },
    Unknown,
}

/// One `SingleResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SingleResponse {
    pub cert_id: CertId,
    pub status: CertStatus,
    pub this_update: i64,
    pub next_update: Option<i64>,
}

/// `ResponderID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponderId {
    /// The responder's subject Name DER.
    ByName(Vec<u8>),
    /// SHA-1 of the responder's public key.
    ByKey(Vec<u8>),
}

/// A parsed, not yet checked, successful OCSP response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OcspResponse {
    /// `tbsResponseData` as signed.
    pub tbs: Vec<u8>,
    /// `signatureAlgorithm` DER.
    pub signature_algorithm: Vec<u8>,
    pub signature: Vec<u8>,
    /// Certificates the responder included (a delegated responder's, when it is one).
    pub certs: Vec<Vec<u8>>,
    pub responder: ResponderId,
    pub produced_at: i64,
    pub responses: Vec<SingleResponse>,
    pub nonce: Option<Vec<u8>>,
}

/// `OCSPResponseStatus` names (RFC 6960 §4.2.1).
fn status_name(s: u8) -> &'static str {
    match s {
        0 => "successful",
        1 => "malformedRequest",
        2 => "internalError",
        3 => "tryLater",
        5 => "sigRequired",
        6 => "unauthorized",
        _ => "an unknown status",
    }
}

/// Is the OID content `body` exactly the DER of `dotted`? Compared as bytes: a lenient decoder
/// would read some malformed encodings as the same arcs.
fn oid_is(body: &[u8], dotted: &str) -> bool {
    w::oid(dotted).get(2..) == Some(body)
}

/// `YYYYMMDDHHMMSS[.f*]Z` → Unix seconds.
fn generalized_time(tlv_tag: u8, body: &[u8]) -> Option<i64> {
    if tlv_tag != 0x18 {
        return None;
    }
    let s = std::str::from_utf8(body).ok()?;
    let s = s.strip_suffix('Z')?;
    let (main, frac) = match s.split_once('.') {
        Some((m, f)) if !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()) => (m, Some(f)),
        Some(_) => return None,
        None => (s, None),
    };
    let _ = frac;
    if main.len() != 14 || !main.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n = |r: std::ops::Range<usize>| main[r].parse::<u32>().ok();
    let month = time::Month::try_from(u8::try_from(n(4..6)?).ok()?).ok()?;
    let date = time::Date::from_calendar_date(
        i32::try_from(n(0..4)?).ok()?,
        month,
        u8::try_from(n(6..8)?).ok()?,
    )
    .ok()?;
    let t = time::Time::from_hms(
        u8::try_from(n(8..10)?).ok()?,
        u8::try_from(n(10..12)?).ok()?,
        u8::try_from(n(12..14)?).ok()?,
    )
    .ok()?;
    Some(
        time::PrimitiveDateTime::new(date, t)
            .assume_utc()
            .unix_timestamp(),
    )
}

fn parse_single(body: &[u8]) -> Option<SingleResponse> {
    let (0x30, cert_id, rest) = read_tlv(body)? else {
        return None;
    };
    let cert_id = CertId::parse(cert_id)?;
    let (tag, status_body, rest) = read_tlv(rest)?;
    let status = match tag {
        0x80 if status_body.is_empty() => CertStatus::Good,
        0xA1 => {
            let (t, v, more) = read_tlv(status_body)?;
            let at = generalized_time(t, v)?;
            let reason = match read_tlv(more) {
                Some((0xA0, r, [])) => match read_tlv(r)? {
                    (0x0A, [code], []) => Some(*code),
                    _ => return None,
                },
                None if more.is_empty() => None,
                _ => return None,
            };
            CertStatus::Revoked { at, reason }
        }
        0x82 if status_body.is_empty() => CertStatus::Unknown,
        _ => return None,
    };
    let (t, v, mut rest) = read_tlv(rest)?;
    let this_update = generalized_time(t, v)?;
    let mut next_update = None;
    if let Some((0xA0, inner, r)) = read_tlv(rest) {
        let (t, v, []) = read_tlv(inner)? else {
            return None;
        };
        next_update = Some(generalized_time(t, v)?);
        rest = r;
    }
    if let Some((0xA1, _, r)) = read_tlv(rest) {
        rest = r;
    }
    rest.is_empty().then_some(SingleResponse {
        cert_id,
        status,
        this_update,
        next_update,
    })
}

/// The nonce extension's value (the inner OCTET STRING's contents, or the raw value when a
/// responder did not wrap it).
fn nonce_of(exts: &[u8]) -> Option<Vec<u8>> {
    let (0x30, list, _) = read_tlv(exts)? else {
        return None;
    };
    for (tag, ext) in children(list) {
        if tag != 0x30 {
            continue;
        }
        let mut it = children(ext);
        let Some((0x06, oid)) = it.next() else {
            continue;
        };
        if !oid_is(oid, OID_OCSP_NONCE) {
            continue;
        }
        let mut value = it.next()?;
        if value.0 == 0x01 {
            value = it.next()?; // critical flag
        }
        let (0x04, v) = value else {
            return None;
        };
        return Some(match read_tlv(v) {
            Some((0x04, inner, [])) => inner.to_vec(),
            _ => v.to_vec(),
        });
    }
    None
}

impl OcspResponse {
    /// Parse a DER `OCSPResponse`. A non-successful `responseStatus` is an error naming it.
    pub fn parse(der: &[u8]) -> Result<Self> {
        let malformed = || bad("response does not parse as an RFC 6960 OCSPResponse");
        let (0x30, body, []) = read_tlv(der).ok_or_else(malformed)? else {
            return Err(malformed());
        };
        let (0x0A, status, rest) = read_tlv(body).ok_or_else(malformed)? else {
            return Err(malformed());
        };
        let &[status] = status else {
            return Err(malformed());
        };
        if status != 0 {
            return Err(bad(format!(
                "responder answered {} ({status})",
                status_name(status)
            )));
        }
        let (0xA0, bytes, []) = read_tlv(rest).ok_or_else(malformed)? else {
            return Err(malformed());
        };
        let (0x30, bytes, []) = read_tlv(bytes).ok_or_else(malformed)? else {
            return Err(malformed());
        };
        let mut it = children(bytes);
        let (Some((0x06, kind)), Some((0x04, basic)), None) = (it.next(), it.next(), it.next())
        else {
            return Err(malformed());
        };
        if !oid_is(kind, OID_OCSP_BASIC) {
            return Err(bad("response type is not id-pkix-ocsp-basic"));
        }
        Self::parse_basic(basic).ok_or_else(malformed)
    }

    fn parse_basic(der: &[u8]) -> Option<Self> {
        let (0x30, body, []) = read_tlv(der)? else {
            return None;
        };
        let (0x30, tbs_body, tbs, rest) = read_tlv_raw(body)? else {
            return None;
        };
        let (0x30, _, alg, rest) = read_tlv_raw(rest)? else {
            return None;
        };
        let (0x03, sig, mut rest) = read_tlv(rest)? else {
            return None;
        };
        let (&0, signature) = sig.split_first()? else {
            return None; // unused bits in a signature
        };
        let mut certs = Vec::new();
        if let Some((0xA0, list, r)) = read_tlv(rest) {
            let (0x30, list, []) = read_tlv(list)? else {
                return None;
            };
            let mut l = list;
            while !l.is_empty() {
                let (0x30, _, raw, more) = read_tlv_raw(l)? else {
                    return None;
                };
                certs.push(raw.to_vec());
                l = more;
            }
            rest = r;
        }
        if !rest.is_empty() {
            return None;
        }
        // ResponseData
        let mut r = tbs_body;
        if let Some((0xA0, v, more)) = read_tlv(r) {
            if v != [0x02, 0x01, 0x00] {
                return None; // only v1 exists
            }
            r = more;
        }
        let (tag, rid, r) = read_tlv(r)?;
        let responder = match tag {
            0xA1 => {
                let (0x30, _, raw, []) = read_tlv_raw(rid)? else {
                    return None;
                };
                ResponderId::ByName(raw.to_vec())
            }
            0xA2 => {
                let (0x04, h, []) = read_tlv(rid)? else {
                    return None;
                };
                ResponderId::ByKey(h.to_vec())
            }
            _ => return None,
        };
        let (t, v, r) = read_tlv(r)?;
        let produced_at = generalized_time(t, v)?;
        let (0x30, list, r) = read_tlv(r)? else {
            return None;
        };
        let mut responses = Vec::new();
        for (tag, single) in children(list) {
            if tag != 0x30 {
                return None;
            }
            responses.push(parse_single(single)?);
        }
        let mut nonce = None;
        match read_tlv(r) {
            Some((0xA1, exts, [])) => nonce = nonce_of(exts),
            None if r.is_empty() => {}
            _ => return None,
        }
        Some(OcspResponse {
            tbs: tbs.to_vec(),
            signature_algorithm: alg.to_vec(),
            signature: signature.to_vec(),
            certs,
            responder,
            produced_at,
            responses,
            nonce,
        })
    }

    /// The single response about `id`, if any.
    pub fn find(&self, id: &CertId) -> Option<&SingleResponse> {
        self.responses.iter().find(|s| &s.cert_id == id)
    }
}

/// Does `cert` match a `ResponderID`?
fn is_responder(cert: &X509Certificate<'_>, id: &ResponderId, p: &dyn CryptoProvider) -> bool {
    match id {
        ResponderId::ByName(name) => cert.subject().as_raw() == name.as_slice(),
        ResponderId::ByKey(hash) => {
            CertIdHash::Sha1.digest(p, &cert.public_key().subject_public_key.data) == *hash
        }
    }
}

/// A single response whose signature and signer were verified, about `subject`. Judging it
/// ([`Attested::judge`]) needs only a time, so verifiers cache these.
#[derive(Debug, Clone)]
pub(crate) struct Attested {
    subject: String,
    single: SingleResponse,
    /// A delegated responder's validity window, rechecked at every use.
    responder: Option<(String, x509::Window)>,
    /// Which of the supplied responses it came from.
    pub(crate) response: usize,
}

impl Attested {
    /// Fresh at `now` and `good`; otherwise the precise refusal.
    pub(crate) fn judge(&self, now: i64) -> Result<()> {
        let who = &self.subject;
        let single = &self.single;
        if let Some((name, w)) = &self.responder {
            w.check(|| name.clone(), now)
                .map_err(|e| bad(format!("responder certificate: {e}")))?;
        }
        if single.this_update > now + MAX_SKEW_SECS {
            return Err(bad(format!(
                "status for '{who}' is from the future ({})",
                x509::rfc3339(single.this_update)
            )));
        }
        match single.next_update {
            Some(next) if now > next => {
                return Err(bad(format!(
                    "status for '{who}' expired at {}",
                    x509::rfc3339(next)
                )));
            }
            None if now - single.this_update > MAX_AGE_WITHOUT_NEXT_UPDATE_SECS => {
                return Err(bad(format!(
                    "status for '{who}' from {} is too old and names no next update",
                    x509::rfc3339(single.this_update)
                )));
            }
            _ => {}
        }
        match single.status {
            CertStatus::Good => Ok(()),
            CertStatus::Revoked { at, reason } => Err(Error::Revoked {
                subject: format!(
                    "{who} (OCSP: revoked at {}{})",
                    x509::rfc3339(at),
                    reason.map(|r| format!(", reason {r}")).unwrap_or_default()
                ),
                serial: single.cert_id.serial_hex(),
            }),
            CertStatus::Unknown => Err(bad(format!("responder does not know '{who}'"))),
        }
    }
}

/// Find the status of `cert` (issued by `issuer`) in whichever of `responses` (DER
/// `OCSPResponse`s) speaks of it, and verify that the issuer or a responder it delegated to
/// (id-kp-OCSPSigning) signed it. A response that does not parse is an error, not skipped.
/// When `nonce` is given, the response must echo it. Time is judged by [`Attested::judge`].
pub(crate) fn attest(
    responses: &[Vec<u8>],
    cert: &X509Certificate<'_>,
    issuer: &X509Certificate<'_>,
    provider: &dyn CryptoProvider,
    nonce: Option<&[u8]>,
) -> Result<Attested> {
    const C: ChainKind = ChainKind::NvidiaDevice;
    let who = || x509::subject(cert);
    let ids = [CertIdHash::Sha384, CertIdHash::Sha256, CertIdHash::Sha1]
        .map(|h| CertId::of(cert, issuer, h, provider));
    let mut found = None;
    for (index, der) in responses.iter().enumerate() {
        let resp = OcspResponse::parse(der)?;
        if let Some(single) = ids.iter().find_map(|id| resp.find(id)).cloned() {
            found = Some((index, resp, single));
            break;
        }
    }
    let (index, resp, single) =
        found.ok_or_else(|| bad(format!("no OCSP response holds a status for '{}'", who())))?;
    // Who signed: the issuer itself, or a delegated responder certificate in `certs`.
    let delegated;
    let (signer, responder): (&X509Certificate<'_>, _) =
        if is_responder(issuer, &resp.responder, provider) {
            (issuer, None)
        } else {
            let found = resp.certs.iter().find_map(|der| {
                x509::parse_cert(der, "OCSP responder certificate")
                    .ok()
                    .filter(|c| is_responder(c, &resp.responder, provider))
            });
            delegated = found.ok_or_else(|| {
                bad(format!(
                    "signed by a responder that is neither '{}' nor a certificate it included",
                    x509::subject(issuer)
                ))
            })?;
            x509::verify_issued_by(&delegated, issuer, provider, C).map_err(|e| {
                bad(format!(
                    "responder '{}' is not delegated by '{}': {e}",
                    x509::subject(&delegated),
                    x509::subject(issuer)
                ))
            })?;
            // id-kp-OCSPSigning (1.3.6.1.5.5.7.3.9), which x509-parser decodes as `ocsp_signing`.
            let ocsp_signing =
                matches!(delegated.extended_key_usage(), Ok(Some(eku)) if eku.value.ocsp_signing);
            if !ocsp_signing {
                return Err(bad(format!(
                    "responder '{}' lacks the OCSPSigning extended key usage",
                    x509::subject(&delegated)
                )));
            }
            let window = (x509::subject(&delegated), x509::Window::of(&delegated));
            (&delegated, Some(window))
        };
    x509::verify_signed(
        signer,
        &resp.signature_algorithm,
        &resp.tbs,
        &resp.signature,
        provider,
        C,
    )
    .map_err(|_| {
        bad(format!(
            "response signature by '{}' does not verify",
            x509::subject(signer)
        ))
    })?;
    if let Some(n) = nonce
        && resp.nonce.as_deref() != Some(n)
    {
        return Err(bad("response does not echo the request nonce"));
    }
    Ok(Attested {
        subject: who(),
        single,
        responder,
        response: index,
    })
}

/// Unix seconds `(thisUpdate, nextUpdate)` of the earliest-expiring single response: the window
/// in which the collateral store may serve the response.
pub fn validity_window(der: &[u8]) -> Option<(i64, i64)> {
    let resp = OcspResponse::parse(der).ok()?;
    let this = resp.responses.iter().map(|s| s.this_update).max()?;
    let next = resp
        .responses
        .iter()
        .map(|s| {
            s.next_update
                .unwrap_or(s.this_update + MAX_AGE_WITHOUT_NEXT_UPDATE_SECS)
        })
        .min()?;
    Some((this, next))
}

/// Build and sign a response (the simulator and tests play NVIDIA's responder with it).
#[cfg(any(feature = "sim", test))]
pub(crate) struct ResponseBuilder<'a> {
    pub responder: ResponderId,
    pub produced_at: i64,
    pub responses: &'a [SingleResponse],
    pub certs: &'a [Vec<u8>],
    pub nonce: Option<&'a [u8]>,
}

#[cfg(any(feature = "sim", test))]
impl ResponseBuilder<'_> {
    /// `sign(tbs) -> (signatureAlgorithm DER, signature)`.
    pub(crate) fn build(
        &self,
        sign: impl FnOnce(&[u8]) -> Result<(Vec<u8>, Vec<u8>)>,
    ) -> Result<Vec<u8>> {
        let responder = match &self.responder {
            ResponderId::ByName(n) => w::ctx(1, n),
            ResponderId::ByKey(h) => w::ctx(2, &w::octets(h)),
        };
        let singles: Vec<Vec<u8>> = self
            .responses
            .iter()
            .map(|s| {
                let status = match s.status {
                    CertStatus::Good => vec![0x80, 0x00],
                    CertStatus::Unknown => vec![0x82, 0x00],
                    CertStatus::Revoked { at, reason } => {
                        let mut v = w::generalized_time(at);
                        if let Some(r) = reason {
                            v.extend(w::ctx(0, &w::tlv(0x0A, &[r])));
                        }
                        w::tlv(0xA1, &v)
                    }
                };
                let mut parts = vec![
                    s.cert_id.to_der(),
                    status,
                    w::generalized_time(s.this_update),
                ];
                if let Some(n) = s.next_update {
                    parts.push(w::ctx(0, &w::generalized_time(n)));
                }
                w::seq(&parts)
            })
            .collect();
        let mut tbs = vec![
            responder,
            w::generalized_time(self.produced_at),
            w::seq(&singles),
        ];
        if let Some(n) = self.nonce {
            let ext = w::seq(&[w::oid(OID_OCSP_NONCE), w::octets(&w::octets(n))]);
            tbs.push(w::ctx(1, &w::seq(&[ext])));
        }
        let tbs = w::seq(&tbs);
        let (alg, sig) = sign(&tbs)?;
        Ok(envelope(&tbs, &alg, &sig, self.certs))
    }
}

/// A successful `OCSPResponse` around a signed `ResponseData`, in DER.
fn envelope(tbs: &[u8], alg: &[u8], sig: &[u8], certs: &[Vec<u8>]) -> Vec<u8> {
    let mut basic = vec![tbs.to_vec(), alg.to_vec(), w::bits(sig)];
    if !certs.is_empty() {
        basic.push(w::ctx(0, &w::seq(certs)));
    }
    let basic = w::seq(&basic);
    w::seq(&[
        w::tlv(0x0A, &[0]),
        w::ctx(0, &w::seq(&[w::oid(OID_OCSP_BASIC), w::octets(&basic)])),
    ])
}

/// The response in canonical form: re-encoded in DER from its parts, keeping only the included
/// certificates that match its ResponderID (no verdict can rest on the others). Verified OCSP
/// answers are cached under this form, so re-encoded lengths or extra certificates around one
/// signed answer do not make new entries. No signature is checked here.
pub(crate) fn canonical(der: &[u8], provider: &dyn CryptoProvider) -> Result<Vec<u8>> {
    let resp = OcspResponse::parse(der)?;
    let certs: Vec<Vec<u8>> = resp
        .certs
        .iter()
        .filter(|c| {
            x509::parse_cert(c, "OCSP responder certificate")
                .is_ok_and(|c| is_responder(&c, &resp.responder, provider))
        })
        .cloned()
        .collect();
    Ok(envelope(
        &resp.tbs,
        &resp.signature_algorithm,
        &resp.signature,
        &certs,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generalized_time_forms() {
        assert_eq!(generalized_time(0x18, b"19700101000000Z"), Some(0));
        assert_eq!(
            generalized_time(0x18, b"20260101000001.5Z"),
            Some(1_767_225_601)
        );
        assert_eq!(generalized_time(0x18, b"2026010100000Z"), None);
        assert_eq!(generalized_time(0x18, b"20261301000000Z"), None);
        assert_eq!(generalized_time(0x17, b"260101000000Z"), None);
    }

    #[test]
    fn request_shape() {
        let id = CertId {
            hash: CertIdHash::Sha384,
            issuer_name_hash: vec![1; 48],
            issuer_key_hash: vec![2; 48],
            serial: vec![0x00, 0x80],
        };
        let der = request(std::slice::from_ref(&id), None);
        // OCSPRequest { TBSRequest { requestList { Request { CertID } } } }
        let (_, req, []) = read_tlv(&der).unwrap() else {
            panic!()
        };
        let (_, tbs, []) = read_tlv(req).unwrap() else {
            panic!()
        };
        let (_, list, []) = read_tlv(tbs).unwrap() else {
            panic!()
        };
        let (_, one, []) = read_tlv(list).unwrap() else {
            panic!()
        };
        let (_, cid, []) = read_tlv(one).unwrap() else {
            panic!()
        };
        assert_eq!(CertId::parse(cid), Some(id.clone()));
        assert_eq!(id.serial_hex(), "80");
        assert!(request(&[id], Some(&[9; 32])).len() > der.len());
    }

    #[test]
    fn garbage_never_panics() {
        assert!(OcspResponse::parse(&[]).is_err());
        assert!(OcspResponse::parse(&[0x30, 0x03, 0x0A, 0x01, 0x03]).is_err());
        let e = OcspResponse::parse(&[0x30, 0x03, 0x0A, 0x01, 0x03]).unwrap_err();
        assert!(e.to_string().contains("tryLater"), "{e}");
        for n in 0..64u8 {
            let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37) ^ n).collect();
            let _ = OcspResponse::parse(&junk);
        }
    }
}
