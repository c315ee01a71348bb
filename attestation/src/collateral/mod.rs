//! Collateral store: vendor collateral (AMD VCEKs, cert chains and CRLs; Intel TCB info, QE
//! identity and CRLs; NVIDIA RIMs) kept on disk, content-addressed, each item with the validity
//! window read from its own content, so verifiers get collateral without the vendor being up.
//!
//! This is an I/O edge like [`crate::bundle`]: it reads and writes files, never the network and
//! never the clock (every call takes `now`). Online fetchers (AMD KDS, Intel PCS/PCCS, NVIDIA RIM
//! service) sit in front of it and put what they fetch; verification only ever sees bytes.
//!
//! Layout under the store root:
//! ```text
//! objects/<sha256 hex>          the bytes, written once, never modified
//! index.json                    key -> {sha256, not_before, not_after, stored_at, source}
//! ```
//! Keys mirror the vendor URL paths (e.g. `amd/vcek/v1/Milan/<hwid>?blSPL=3&teeSPL=0&snpSPL=8&ucodeSPL=115`)
//! so a KDS answer is cached by (chip id, TCB) — KDS rate-limits hard.

pub mod fetch;
pub mod needed;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::crypto::sha256;
use crate::error::{Error, Result};
use crate::snp::report::{Product, TcbVersion};

/// What a stored item is, and the vendor path it would be fetched from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CollateralKey {
    /// AMD KDS VCEK for a chip at a TCB.
    AmdVcek {
        product: Product,
        hw_id: Vec<u8>,
        tcb: TcbVersion,
    },
    /// AMD KDS `cert_chain` (ASK or ASVK + ARK).
    AmdCertChain { product: Product, vlek: bool },
    /// AMD KDS CRL for a product.
    AmdCrl { product: Product, vlek: bool },
    /// Intel PCS TDX TCB info for an FMSPC.
    IntelTdxTcbInfo { fmspc: [u8; 6] },
    /// Intel PCS TDX QE identity.
    IntelTdxQeIdentity,
    /// Intel PCS PCK CRL (`processor` or `platform`).
    IntelPckCrl { ca: String },
    /// Intel SGX Root CA CRL.
    IntelRootCaCrl,
    /// NVIDIA RIM by id.
    NvidiaRim { id: String },
    /// NVIDIA OCSP status of one device-chain certificate (asked by POST, cached by CertID).
    NvidiaOcsp {
        cert_id: crate::nvidia::ocsp::CertId,
    },
    /// Any other path (imported as is).
    Other(String),
}

impl CollateralKey {
    /// The VCEK key for a report: its product (CPUID, v3+), the hwID KDS indexes by (CHIP_ID;
    /// its first 8 bytes on Turin) and REPORTED_TCB. `None` for a v2 report, which does not
    /// name its product.
    pub fn vcek_for(report: &crate::snp::report::AttestationReport) -> Option<Self> {
        let product = report.cpuid_product()?;
        let hw_id = if product == Product::Turin {
            report.chip_id[..8].to_vec()
        } else {
            report.chip_id.to_vec()
        };
        Some(CollateralKey::AmdVcek {
            product,
            hw_id,
            tcb: TcbVersion::decode(report.reported_tcb, product),
        })
    }

    /// The canonical key string (the vendor path, without host).
    pub fn path(&self) -> String {
        match self {
            CollateralKey::AmdVcek {
                product,
                hw_id,
                tcb,
            } => {
                let mut p = format!(
                    "amd/vcek/v1/{}/{}?blSPL={}&teeSPL={}&snpSPL={}&ucodeSPL={}",
                    product.name(),
                    hex::encode(hw_id),
                    tcb.bootloader,
                    tcb.tee,
                    tcb.snp,
                    tcb.microcode
                );
                if let Some(fmc) = tcb.fmc {
                    p.push_str(&format!("&fmcSPL={fmc}"));
                }
                p
            }
            CollateralKey::AmdCertChain { product, vlek } => format!(
                "amd/{}/v1/{}/cert_chain",
                if *vlek { "vlek" } else { "vcek" },
                product.name()
            ),
            CollateralKey::AmdCrl { product, vlek } => format!(
                "amd/{}/v1/{}/crl",
                if *vlek { "vlek" } else { "vcek" },
                product.name()
            ),
            CollateralKey::IntelTdxTcbInfo { fmspc } => {
                format!(
                    "intel/tdx/certification/v4/tcb?fmspc={}",
                    hex::encode_upper(fmspc)
                )
            }
            CollateralKey::IntelTdxQeIdentity => "intel/tdx/certification/v4/qe/identity".into(),
            CollateralKey::IntelPckCrl { ca } => {
                format!("intel/sgx/certification/v4/pckcrl?ca={ca}")
            }
            CollateralKey::IntelRootCaCrl => "intel/sgx/certification/v4/rootcacrl".into(),
            CollateralKey::NvidiaRim { id } => format!("nvidia/rims/{id}"),
            CollateralKey::NvidiaOcsp { cert_id } => format!(
                "nvidia/ocsp/{}/{}",
                hex::encode(&cert_id.issuer_key_hash),
                cert_id.serial_hex()
            ),
            CollateralKey::Other(p) => p.clone(),
        }
    }
}

/// One index entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub sha256: String,
    /// Validity window read from the content (Unix seconds); `None` when the content has none.
    pub not_before: Option<i64>,
    pub not_after: Option<i64>,
    pub stored_at: i64,
    /// Where it came from (a URL, `import:<file>`, `bundle:<dir>`).
    pub source: String,
}

/// How usable a stored item is at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Inside its validity window (or it has none).
    Valid,
    /// Before its window opens.
    NotYetValid,
    /// Past its window: kept for audit, never served as valid.
    Expired,
}

impl Entry {
    pub fn freshness(&self, now: i64) -> Freshness {
        match (self.not_before, self.not_after) {
            (Some(nb), _) if now < nb => Freshness::NotYetValid,
            (_, Some(na)) if now > na => Freshness::Expired,
            _ => Freshness::Valid,
        }
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Collateral {
        detail: format!("{}: {e}", path.display()),
    }
}

/// Read the validity window from the content itself: X.509 certificates (the intersection over
/// a PEM chain), CRLs and OCSP responses (thisUpdate/nextUpdate), Intel TCB info / QE identity
/// JSON (issueDate/nextUpdate, also inside a dcap-qvl collateral JSON).
pub fn validity_window(bytes: &[u8]) -> (Option<i64>, Option<i64>) {
    use x509_parser::prelude::FromDer;
    if let Some((this, next)) = crate::nvidia::ocsp::validity_window(bytes) {
        return (Some(this), Some(next));
    }
    let mut nb: Option<i64> = None;
    let mut na: Option<i64> = None;
    let mut narrow = |b: i64, a: i64| {
        nb = Some(nb.map_or(b, |x| x.max(b)));
        na = Some(na.map_or(a, |x| x.min(a)));
    };
    let ders: Vec<Vec<u8>> = if bytes.first() == Some(&0x30) {
        vec![bytes.to_vec()]
    } else {
        x509_parser::pem::Pem::iter_from_buffer(bytes)
            .filter_map(|p| p.ok().map(|p| p.contents))
            .collect()
    };
    for der in &ders {
        if let Ok((_, c)) = x509_parser::certificate::X509Certificate::from_der(der) {
            narrow(
                c.validity().not_before.timestamp(),
                c.validity().not_after.timestamp(),
            );
        } else if let Ok((_, crl)) =
            x509_parser::revocation_list::CertificateRevocationList::from_der(der)
        {
            let this = crl.last_update().timestamp();
            narrow(this, crl.next_update().map_or(i64::MAX, |n| n.timestamp()));
        }
    }
    if ders.is_empty()
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes)
    {
        let mut docs = vec![v.clone()];
        // dcap-qvl's QuoteCollateralV3 carries the PCS documents as strings; a stored PCS answer
        // ({"body", "issuer_chain"}) carries its body as a string (base64 for a CRL).
        for k in ["tcb_info", "qe_identity", "body"] {
            if let Some(s) = v.get(k).and_then(|s| s.as_str()) {
                if let Ok(d) = serde_json::from_str(s) {
                    docs.push(d);
                } else if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(s) {
                    let (b, a) = validity_window(&der);
                    if let (Some(b), Some(a)) = (b, a) {
                        narrow(b, a);
                    }
                }
            }
        }
        if let Some(chain) = v.get("issuer_chain").and_then(|s| s.as_str()) {
            let (b, a) = validity_window(chain.as_bytes());
            if let (Some(b), Some(a)) = (b, a) {
                narrow(b, a);
            }
        }
        for d in docs {
            let body = d
                .get("tcbInfo")
                .or_else(|| d.get("enclaveIdentity"))
                .unwrap_or(&d);
            let t = |k: &str| {
                body.get(k)
                    .and_then(|s| s.as_str())
                    .and_then(|s| {
                        time::OffsetDateTime::parse(
                            s,
                            &time::format_description::well_known::Rfc3339,
                        )
                        .ok()
                    })
                    .map(|t| t.unix_timestamp())
            };
            if let (Some(b), Some(a)) = (t("issueDate"), t("nextUpdate")) {
                narrow(b, a);
            }
        }
    }
    (nb, na)
}

/// The on-disk store.
#[derive(Debug)]
pub struct CollateralStore {
    root: PathBuf,
    index: BTreeMap<String, Entry>,
}

impl CollateralStore {
    /// Open (or create) the store at `root`.
    pub fn open(root: &Path) -> Result<Self> {
        std::fs::create_dir_all(root.join("objects")).map_err(|e| io(root, e))?;
        let index_path = root.join("index.json");
        let index = match std::fs::read(&index_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| io(&index_path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(io(&index_path, e)),
        };
        Ok(CollateralStore {
            root: root.to_path_buf(),
            index,
        })
    }

    fn object_path(&self, sha: &str) -> PathBuf {
        self.root.join("objects").join(sha)
    }

    /// Store `bytes` under `key`. Replaces an older entry for the key only when the new content
    /// is at least as fresh (a later `not_after`), so a replayed old answer cannot evict a newer.
    pub fn put(&mut self, key: &str, bytes: &[u8], source: &str, now: i64) -> Result<Entry> {
        if key.is_empty() || key.contains("..") {
            return Err(Error::Collateral {
                detail: format!("invalid key '{key}'"),
            });
        }
        let sha = hex::encode(sha256(bytes));
        let (not_before, not_after) = validity_window(bytes);
        let entry = Entry {
            sha256: sha.clone(),
            not_before,
            not_after,
            stored_at: now,
            source: source.to_string(),
        };
        if let Some(old) = self.index.get(key)
            && old.not_after.unwrap_or(i64::MAX) > entry.not_after.unwrap_or(i64::MAX)
        {
            return Ok(old.clone());
        }
        let path = self.object_path(&sha);
        if !path.exists() {
            // Write to a temporary name and rename: a crash never leaves a torn object.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        }
        self.index.insert(key.to_string(), entry.clone());
        self.save()?;
        Ok(entry)
    }

    fn save(&self) -> Result<()> {
        let path = self.root.join("index.json");
        let tmp = path.with_extension("tmp");
        let body = serde_json::to_vec_pretty(&self.index).map_err(|e| io(&path, e))?;
        std::fs::write(&tmp, body).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))
    }

    /// The bytes for `key` and how fresh they are at `now`. Content is checked against its
    /// address, so a corrupted object is an error, not collateral.
    pub fn get(&self, key: &str, now: i64) -> Result<Option<(Vec<u8>, Freshness, Entry)>> {
        let Some(entry) = self.index.get(key) else {
            return Ok(None);
        };
        let path = self.object_path(&entry.sha256);
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        if hex::encode(sha256(&bytes)) != entry.sha256 {
            return Err(Error::Collateral {
                detail: format!("{}: content does not match its address", path.display()),
            });
        }
        Ok(Some((bytes, entry.freshness(now), entry.clone())))
    }

    /// Every key with its entry.
    pub fn list(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.index.iter()
    }

    /// Copy every item into another store at `dir` (an air-gapped cache to carry across).
    pub fn export(&self, dir: &Path, now: i64) -> Result<usize> {
        let mut other = CollateralStore::open(dir)?;
        let mut n = 0;
        for (key, entry) in &self.index {
            let path = self.object_path(&entry.sha256);
            let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
            other.put(key, &bytes, &entry.source, now)?;
            n += 1;
        }
        Ok(n)
    }

    /// Import an exported store at `dir`.
    pub fn import(&mut self, dir: &Path, now: i64) -> Result<usize> {
        let other = CollateralStore::open(dir)?;
        let mut n = 0;
        for (key, entry) in &other.index {
            if let Some((bytes, _, _)) = other.get(key, now)? {
                self.put(key, &bytes, &entry.source, now)?;
                n += 1;
            }
        }
        Ok(n)
    }
}
