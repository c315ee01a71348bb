//! Online collateral: AMD KDS, Intel PCS v4 (or a PCCS at another base URL) and the NVIDIA RIM
//! service, behind the on-disk [`CollateralStore`].
//!
//! `CollateralSource::get` answers from the store while an item is within its refresh interval;
//! otherwise it asks the vendor, validates the answer (a garbage body is never stored) and
//! stores it. When the vendor is down, slow, rate-limiting or answering garbage, a cached item
//! that is still inside its own validity window is served (stale but valid); only when there is
//! none does the caller get an error. Requests for one key are single-flight; AMD KDS, which
//! rate-limits hard (about one request per 10 s per IP), gets at most one request per
//! `amd_min_interval`, and a 429's `Retry-After` is honoured for every vendor.
//!
//! This is the I/O edge: it uses the network and a monotonic clock for pacing; validity is still
//! judged at the caller's `now`. The HTTP client is compiled only with the crate's `fetch`
//! feature (the KBS and the `cgx` command enable it); without it every source is
//! [`CollateralSource::offline`] and the verification core links no network code at all.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;

use super::{CollateralKey, CollateralStore, Entry, Freshness};
use crate::error::{Error, Result};

/// Vendor base URLs. A PCCS is an Intel base URL of its own.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Endpoints {
    /// AMD KDS, e.g. `https://kdsintf.amd.com`.
    pub amd_kds: String,
    /// Intel PCS v4 or a PCCS, e.g. `https://api.trustedservices.intel.com`.
    pub intel_pcs: String,
    /// Intel SGX Root CA CRL (full URL).
    pub intel_root_ca_crl: String,
    /// NVIDIA RIM service, e.g. `https://rim.attestation.nvidia.com`.
    pub nvidia_rim: String,
    /// NVIDIA OCSP responder for the device chain (the URL its certificates name).
    pub nvidia_ocsp: String,
}

impl Default for Endpoints {
    fn default() -> Self {
        Endpoints {
            amd_kds: "https://kdsintf.amd.com".into(),
            intel_pcs: "https://api.trustedservices.intel.com".into(),
            intel_root_ca_crl: "https://certificates.trustedservices.intel.com/IntelSGXRootCA.der"
                .into(),
            nvidia_rim: "https://rim.attestation.nvidia.com".into(),
            nvidia_ocsp: "http://ocsp.ndis.nvidia.com".into(),
        }
    }
}

/// Pacing and freshness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchPolicy {
    /// Per-request timeout.
    pub timeout: Duration,
    /// Minimum spacing of requests to AMD KDS.
    pub amd_min_interval: Duration,
    /// Longest a caller waits for its turn at a paced vendor before falling back to the cache.
    pub max_wait: Duration,
    /// Seconds after which a cached item is refreshed from the vendor (it stays usable while
    /// valid if the refresh fails).
    pub refresh_after_secs: i64,
    /// Largest answer accepted.
    pub max_body: u64,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            timeout: Duration::from_secs(20),
            amd_min_interval: Duration::from_secs(10),
            max_wait: Duration::from_secs(30),
            refresh_after_secs: 24 * 3600,
            max_body: 8 << 20,
        }
    }
}

/// Where an answer came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The store, within its refresh interval.
    Cache,
    /// The vendor, just now.
    Vendor,
    /// The store, because the vendor failed (the reason is kept for logs and metrics).
    StaleCache { vendor_error: String },
}

/// A stored item, as [`CollateralSource::cached`] finds it.
#[derive(Debug, Clone)]
pub struct Cached {
    pub bytes: Vec<u8>,
    /// Older than the refresh interval (still valid): fetch a fresh copy when convenient.
    pub refresh_due: bool,
}

/// A collateral item and its provenance.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub bytes: Vec<u8>,
    pub entry: Entry,
    pub origin: Origin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Vendor {
    Amd,
    Intel,
    Nvidia,
}

#[derive(Debug, Default)]
struct Pacing {
    next_allowed: Option<Instant>,
}

/// Collateral from the store, refreshed from the vendors.
#[derive(Debug)]
pub struct CollateralSource {
    store: Mutex<CollateralStore>,
    /// `None`: offline (and always so without the `fetch` feature).
    #[cfg(feature = "fetch")]
    agent: Option<ureq::Agent>,
    endpoints: Endpoints,
    policy: FetchPolicy,
    pacing: Mutex<HashMap<Vendor, Pacing>>,
    inflight: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Never contact a vendor: serve what the store holds while it is valid.
    offline: bool,
}

fn err(detail: impl Into<String>) -> Error {
    Error::Collateral {
        detail: detail.into(),
    }
}

/// What a vendor answered, before validation.
struct Answer {
    body: Vec<u8>,
    issuer_chain: Option<String>,
}

impl CollateralSource {
    /// A source that refreshes from the vendors at `endpoints`.
    #[cfg(feature = "fetch")]
    pub fn new(store: CollateralStore, endpoints: Endpoints, policy: FetchPolicy) -> Self {
        let agent = cgx_http::Client::vendor(policy.timeout).agent();
        CollateralSource {
            store: Mutex::new(store),
            agent: Some(agent),
            endpoints,
            policy,
            pacing: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            offline: false,
        }
    }

    /// A source that only reads `store` (air-gapped verification): no request ever leaves.
    pub fn offline(store: CollateralStore) -> Self {
        CollateralSource {
            store: Mutex::new(store),
            #[cfg(feature = "fetch")]
            agent: None,
            endpoints: Endpoints::default(),
            policy: FetchPolicy {
                refresh_after_secs: i64::MAX,
                ..FetchPolicy::default()
            },
            pacing: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            offline: true,
        }
    }

    /// The item for `key` at Unix time `now`.
    pub fn get(&self, key: &CollateralKey, now: i64) -> Result<Fetched> {
        let path = key.path();
        let got = self.get_single_flight(key, &path, now);
        // The key's gate goes when nobody else holds it: keys named once (chips that do not
        // exist) do not pile up.
        if let Ok(mut inflight) = self.inflight.lock()
            && inflight
                .get(&path)
                .is_some_and(|g| Arc::strong_count(g) == 1)
        {
            inflight.remove(&path);
        }
        got
    }

    fn get_single_flight(&self, key: &CollateralKey, path: &str, now: i64) -> Result<Fetched> {
        let path = path.to_string();
        let gate = {
            let mut inflight = self.inflight.lock().map_err(|_| err("lock poisoned"))?;
            inflight
                .entry(path.clone())
                .or_insert_with(|| Arc::new(Mutex::new(())))
                .clone()
        };
        // Single flight: one caller per key talks to the vendor; the others then find the cache.
        let _turn = gate.lock().map_err(|_| err("lock poisoned"))?;
        let cached = self
            .store
            .lock()
            .map_err(|_| err("lock poisoned"))?
            .get(&path, now)?;
        if let Some((bytes, Freshness::Valid, entry)) = &cached
            && now - entry.stored_at < self.policy.refresh_after_secs
        {
            return Ok(Fetched {
                bytes: bytes.clone(),
                entry: entry.clone(),
                origin: Origin::Cache,
            });
        }
        let fallback = |vendor_error: String| -> Result<Fetched> {
            match &cached {
                Some((bytes, Freshness::Valid, entry)) => Ok(Fetched {
                    bytes: bytes.clone(),
                    entry: entry.clone(),
                    origin: Origin::StaleCache { vendor_error },
                }),
                _ => Err(err(format!(
                    "{path}: {vendor_error}, and no valid cached copy"
                ))),
            }
        };
        if self.offline {
            return fallback("offline: not in the store".into());
        }
        let (vendor, url, post) = self.url(key);
        if let Err(wait) = self.take_turn(vendor) {
            return fallback(format!(
                "vendor rate limit: next request in {} s",
                wait.as_secs()
            ));
        }
        let answer = match self.request(vendor, &url, post) {
            Ok(a) => a,
            Err(e) => return fallback(e),
        };
        let bytes = match validate(key, answer) {
            Ok(b) => b,
            Err(e) => return fallback(format!("unusable answer from {url}: {e}")),
        };
        let entry = self
            .store
            .lock()
            .map_err(|_| err("lock poisoned"))?
            .put(&path, &bytes, &url, now)?;
        match entry.freshness(now) {
            Freshness::Valid => Ok(Fetched {
                bytes,
                entry,
                origin: Origin::Vendor,
            }),
            f => fallback(format!(
                "vendor answered with collateral that is {f:?} at this time"
            )),
        }
    }

    /// What the store holds for `key` at `now`, without contacting any vendor: the bytes while
    /// valid, and whether they are due for a refresh. A service answers from this on its request
    /// path and fetches misses elsewhere, bounded ([`Self::get`] may wait on a vendor).
    pub fn cached(&self, key: &CollateralKey, now: i64) -> Result<Option<Cached>> {
        let cached = self
            .store
            .lock()
            .map_err(|_| err("lock poisoned"))?
            .get(&key.path(), now)?;
        Ok(match cached {
            Some((bytes, Freshness::Valid, entry)) => Some(Cached {
                bytes,
                refresh_due: !self.offline
                    && now - entry.stored_at >= self.policy.refresh_after_secs,
            }),
            _ => None,
        })
    }

    /// Put an item in the store under `key` without the vendor path's validation (simulated
    /// collateral for tests and the dev network, into a running service; hence behind `sim`):
    /// the store's own rule applies — only content at least as fresh replaces an entry.
    #[cfg(feature = "sim")]
    pub fn put(&self, key: &CollateralKey, bytes: &[u8], source: &str, now: i64) -> Result<Entry> {
        self.store
            .lock()
            .map_err(|_| err("lock poisoned"))?
            .put(&key.path(), bytes, source, now)
    }

    /// Whether [`Self::get`] may contact vendors.
    pub fn is_online(&self) -> bool {
        !self.offline
    }

    /// Wait for this vendor's pacing slot (AMD) or refuse while a 429 is in force.
    fn take_turn(&self, vendor: Vendor) -> std::result::Result<(), Duration> {
        let wait = {
            let Ok(mut pacing) = self.pacing.lock() else {
                return Err(Duration::ZERO);
            };
            let p = pacing.entry(vendor).or_default();
            let now = Instant::now();
            let wait = p
                .next_allowed
                .map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
            if wait > self.policy.max_wait {
                return Err(wait);
            }
            if vendor == Vendor::Amd {
                p.next_allowed = Some(now + wait + self.policy.amd_min_interval);
            }
            wait
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        Ok(())
    }

    #[cfg(feature = "fetch")]
    fn back_off(&self, vendor: Vendor, secs: u64) {
        if let Ok(mut pacing) = self.pacing.lock() {
            let until = Instant::now() + Duration::from_secs(secs);
            let p = pacing.entry(vendor).or_default();
            p.next_allowed = Some(p.next_allowed.map_or(until, |t| t.max(until)));
        }
    }

    #[cfg(not(feature = "fetch"))]
    fn request(
        &self,
        _vendor: Vendor,
        url: &str,
        _post: Option<(&'static str, Vec<u8>)>,
    ) -> std::result::Result<Answer, String> {
        Err(format!(
            "{url}: built without the fetch feature (offline only)"
        ))
    }

    #[cfg(feature = "fetch")]
    fn request(
        &self,
        vendor: Vendor,
        url: &str,
        post: Option<(&'static str, Vec<u8>)>,
    ) -> std::result::Result<Answer, String> {
        let Some(agent) = &self.agent else {
            return Err(format!("{url}: offline source"));
        };
        let sent = match post {
            None => agent.get(url).call(),
            Some((content_type, body)) => agent
                .post(url)
                .header("content-type", content_type)
                .send(&body[..]),
        };
        let mut resp = sent.map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status().as_u16();
        if status == 429 || status == 503 {
            let retry = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(if vendor == Vendor::Amd { 10 } else { 5 });
            self.back_off(vendor, retry.min(3600));
            return Err(format!("{url}: HTTP {status}, retry after {retry} s"));
        }
        if status != 200 {
            return Err(format!("{url}: HTTP {status}"));
        }
        let issuer_chain = [
            "tcb-info-issuer-chain",
            "sgx-enclave-identity-issuer-chain",
            "sgx-pck-crl-issuer-chain",
        ]
        .iter()
        .find_map(|h| resp.headers().get(*h))
        .and_then(|v| v.to_str().ok())
        .map(percent_decode);
        let body = resp
            .body_mut()
            .with_config()
            .limit(self.policy.max_body)
            .read_to_vec()
            .map_err(|e| format!("{url}: reading body: {e}"))?;
        Ok(Answer { body, issuer_chain })
    }

    /// Vendor, URL and — for OCSP — the POST body of the request for `key`.
    fn url(&self, key: &CollateralKey) -> (Vendor, String, Option<(&'static str, Vec<u8>)>) {
        let e = &self.endpoints;
        let path = key.path();
        let (vendor, url) = match key {
            CollateralKey::AmdVcek { .. }
            | CollateralKey::AmdCertChain { .. }
            | CollateralKey::AmdCrl { .. } => (
                Vendor::Amd,
                format!(
                    "{}/{}",
                    e.amd_kds.trim_end_matches('/'),
                    path.trim_start_matches("amd/")
                ),
            ),
            CollateralKey::IntelRootCaCrl => (Vendor::Intel, e.intel_root_ca_crl.clone()),
            CollateralKey::IntelTdxTcbInfo { .. }
            | CollateralKey::IntelTdxQeIdentity
            | CollateralKey::IntelPckCrl { .. } => (
                Vendor::Intel,
                format!(
                    "{}/{}",
                    e.intel_pcs.trim_end_matches('/'),
                    path.trim_start_matches("intel/")
                ),
            ),
            CollateralKey::NvidiaRim { id } => (
                Vendor::Nvidia,
                format!("{}/v1/rim/{id}", e.nvidia_rim.trim_end_matches('/')),
            ),
            CollateralKey::NvidiaOcsp { cert_id } => {
                let body = crate::nvidia::ocsp::request(std::slice::from_ref(cert_id), None);
                return (
                    Vendor::Nvidia,
                    e.nvidia_ocsp.clone(),
                    Some(("application/ocsp-request", body)),
                );
            }
            CollateralKey::Other(_) => (Vendor::Intel, path.clone()),
        };
        (vendor, url, None)
    }

    /// Intel collateral for a TDX quote's FMSPC and PCK CA, assembled into the dcap-qvl
    /// `QuoteCollateralV3` JSON that [`crate::tdx`] verifies with.
    pub fn tdx_collateral(&self, fmspc: [u8; 6], ca: &str, now: i64) -> Result<Vec<u8>> {
        let [tcb, qe, pck_crl, root_crl] =
            tdx_keys(fmspc, ca).map(|k| self.get(&k, now).map(|f| f.bytes));
        tdx_collateral_json(&tcb?, &qe?, &pck_crl?, &root_crl?)
    }
}

/// The Intel collateral items a TDX quote with this FMSPC and PCK CA needs, in the order
/// [`tdx_collateral_json`] takes them: TCB info, QE identity, PCK CRL, root CA CRL.
pub fn tdx_keys(fmspc: [u8; 6], ca: &str) -> [CollateralKey; 4] {
    [
        CollateralKey::IntelTdxTcbInfo { fmspc },
        CollateralKey::IntelTdxQeIdentity,
        CollateralKey::IntelPckCrl { ca: ca.to_string() },
        CollateralKey::IntelRootCaCrl,
    ]
}

/// Stored Intel collateral items ([`tdx_keys`] order) assembled into the dcap-qvl
/// `QuoteCollateralV3` JSON that [`crate::tdx`] verifies with.
pub fn tdx_collateral_json(
    tcb: &[u8],
    qe: &[u8],
    pck_crl: &[u8],
    root_crl: &[u8],
) -> Result<Vec<u8>> {
    let tcb: PcsDoc = serde_json::from_slice(tcb).map_err(|e| err(format!("TCB info: {e}")))?;
    let qe: PcsDoc = serde_json::from_slice(qe).map_err(|e| err(format!("QE identity: {e}")))?;
    let pck: PcsDoc = serde_json::from_slice(pck_crl).map_err(|e| err(format!("PCK CRL: {e}")))?;
    let (tcb_info, tcb_sig) = split_signed(&tcb.body, "tcbInfo")?;
    let (qe_identity, qe_sig) = split_signed(&qe.body, "enclaveIdentity")?;
    let pck_der = base64::engine::general_purpose::STANDARD
        .decode(&pck.body)
        .map_err(|e| err(format!("PCK CRL: {e}")))?;
    let json = serde_json::json!({
        "pck_crl_issuer_chain": pck.issuer_chain,
        "root_ca_crl": hex::encode(root_crl),
        "pck_crl": hex::encode(pck_der),
        "tcb_info_issuer_chain": tcb.issuer_chain,
        "tcb_info": tcb_info,
        "tcb_info_signature": tcb_sig,
        "qe_identity_issuer_chain": qe.issuer_chain,
        "qe_identity": qe_identity,
        "qe_identity_signature": qe_sig,
    });
    serde_json::to_vec(&json).map_err(|e| err(e.to_string()))
}

/// An Intel PCS answer as stored: the body and the issuer chain from its response header.
#[derive(serde::Serialize, serde::Deserialize)]
struct PcsDoc {
    /// The body (JSON text), or base64 of a binary body (CRLs).
    body: String,
    issuer_chain: String,
}

/// `{"<field>": {...}, "signature": "<hex>"}` → (the exact signed text of `<field>`, signature).
fn split_signed(body: &str, field: &str) -> Result<(String, String)> {
    #[derive(serde::Deserialize)]
    struct Signed<'a> {
        #[serde(borrow, rename = "tcbInfo")]
        tcb_info: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, rename = "enclaveIdentity")]
        enclave_identity: Option<&'a serde_json::value::RawValue>,
        signature: String,
    }
    let s: Signed<'_> = serde_json::from_str(body).map_err(|e| err(format!("{field}: {e}")))?;
    let raw = match field {
        "tcbInfo" => s.tcb_info,
        _ => s.enclave_identity,
    }
    .ok_or_else(|| err(format!("no {field} in the answer")))?;
    // The signature covers the exact text of the object; keep it byte for byte.
    Ok((raw.get().to_string(), s.signature))
}

#[cfg(feature = "fetch")]
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(hex, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Refuse answers that are not what was asked for, before they reach the store.
fn validate(key: &CollateralKey, a: Answer) -> std::result::Result<Vec<u8>, String> {
    use x509_parser::prelude::FromDer;
    match key {
        CollateralKey::AmdVcek { hw_id, .. } => {
            let (_, cert) = x509_parser::certificate::X509Certificate::from_der(&a.body)
                .map_err(|e| format!("not a certificate: {e}"))?;
            let found = cert
                .extensions()
                .iter()
                .find(|e| e.oid.to_id_string() == "1.3.6.1.4.1.3704.1.4")
                .map(|e| match crate::der::read_tlv(e.value) {
                    Some((0x04, v, [])) => v.to_vec(),
                    _ => e.value.to_vec(),
                });
            if found.as_deref() != Some(hw_id.as_slice()) {
                return Err("VCEK for another chip".into());
            }
            Ok(a.body)
        }
        CollateralKey::AmdCertChain { .. } => {
            let certs = crate::x509::pem_certs(&a.body, "cert_chain").map_err(|e| e.to_string())?;
            if certs.len() != 2 {
                return Err(format!(
                    "{} certificates, expected ASK and ARK",
                    certs.len()
                ));
            }
            Ok(a.body)
        }
        CollateralKey::AmdCrl { .. } | CollateralKey::IntelRootCaCrl => {
            x509_parser::revocation_list::CertificateRevocationList::from_der(&a.body)
                .map_err(|e| format!("not a CRL: {e}"))?;
            Ok(a.body)
        }
        CollateralKey::IntelTdxTcbInfo { fmspc } => {
            let body = String::from_utf8(a.body).map_err(|_| "not UTF-8".to_string())?;
            let (tcb, _) = split_signed(&body, "tcbInfo").map_err(|e| e.to_string())?;
            let v: serde_json::Value = serde_json::from_str(&tcb).map_err(|e| e.to_string())?;
            let got = v.get("fmspc").and_then(|f| f.as_str()).unwrap_or("");
            if !got.eq_ignore_ascii_case(&hex::encode(fmspc)) {
                return Err(format!("TCB info for FMSPC {got}"));
            }
            pcs_doc(body, a.issuer_chain)
        }
        CollateralKey::IntelTdxQeIdentity => {
            let body = String::from_utf8(a.body).map_err(|_| "not UTF-8".to_string())?;
            split_signed(&body, "enclaveIdentity").map_err(|e| e.to_string())?;
            pcs_doc(body, a.issuer_chain)
        }
        CollateralKey::IntelPckCrl { .. } => {
            // PCS serves the PCK CRL as DER (encoding=der) or hex text.
            let der = if a.body.first() == Some(&0x30) {
                a.body
            } else {
                hex::decode(String::from_utf8_lossy(&a.body).trim())
                    .map_err(|_| "not a CRL".to_string())?
            };
            x509_parser::revocation_list::CertificateRevocationList::from_der(&der)
                .map_err(|e| format!("not a CRL: {e}"))?;
            pcs_doc(
                base64::engine::general_purpose::STANDARD.encode(der),
                a.issuer_chain,
            )
        }
        CollateralKey::NvidiaRim { id } => {
            let v: serde_json::Value =
                serde_json::from_slice(&a.body).map_err(|e| format!("not JSON: {e}"))?;
            let b64 = v
                .get("rim")
                .and_then(|r| r.as_str())
                .ok_or("no rim field")?;
            let xml = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| format!("rim is not base64: {e}"))?;
            let root = crate::nvidia::c14n::parse(&xml).map_err(|e| e.to_string())?;
            if root.local != "SoftwareIdentity" {
                return Err("rim is not a SWID tag".into());
            }
            let _ = id;
            Ok(xml)
        }
        CollateralKey::NvidiaOcsp { cert_id } => {
            let r = crate::nvidia::ocsp::OcspResponse::parse(&a.body).map_err(|e| e.to_string())?;
            if r.find(cert_id).is_none() {
                return Err(format!(
                    "OCSP response holds no status for serial {}",
                    cert_id.serial_hex()
                ));
            }
            Ok(a.body)
        }
        CollateralKey::Other(_) => Ok(a.body),
    }
}

fn pcs_doc(body: String, issuer_chain: Option<String>) -> std::result::Result<Vec<u8>, String> {
    let issuer_chain = issuer_chain.ok_or("no issuer chain header")?;
    serde_json::to_vec(&PcsDoc { body, issuer_chain }).map_err(|e| e.to_string())
}
