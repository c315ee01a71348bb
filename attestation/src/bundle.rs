//! Evidence bundles on disk: the one place this crate reads files.
//!
//! A bundle is a folder (layout in `../shared/vectors/README.md`):
//!
//! | kind | files |
//! |---|---|
//! | snp | `report.bin`; `vcek.der`/`vlek.der` (or `.pem`); `ask_ark.pem`/`asvk_ark.pem`; optional `*.crl` |
//! | tdx | `quote.bin`; `collateral.json` |
//! | nvidia | `attestation_report.hex` or `.bin`; `cert_chain.pem`; optional `*.ocsp` (DER OCSP responses for the chain) |
//!
//! `expected.json`, when present, names the kind; otherwise the files do.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::{Evidence, EvidenceKind, nvidia, snp, tdx};

/// The bytes of one bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bundle {
    Snp {
        report: Vec<u8>,
        signing_cert: Vec<u8>,
        signing_key: snp::SigningKey,
        cert_chain: Vec<u8>,
        crls: Vec<Vec<u8>>,
    },
    Tdx {
        quote: Vec<u8>,
        collateral: Vec<u8>,
    },
    Nvidia {
        report: Vec<u8>,
        cert_chain: Vec<u8>,
        /// DER OCSP responses covering the chain; empty when revocation was not fetched.
        ocsp: Vec<Vec<u8>>,
    },
}

/// The files in `dir` with extension `ext`, sorted.
fn files_with_extension(dir: &Path, ext: &str) -> Result<Vec<PathBuf>> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::Bundle {
            path: dir.display().to_string(),
            detail: e.to_string(),
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    entries.sort();
    Ok(entries)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Bundle {
        path: path.display().to_string(),
        detail: e.to_string(),
    })
}

fn first_existing(dir: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

fn missing(dir: &Path, what: &str) -> Error {
    Error::Bundle {
        path: dir.display().to_string(),
        detail: format!("no {what}"),
    }
}

impl Bundle {
    /// Load the bundle in `dir`, taking collateral it lacks (VCEK and AMD cert chain for SNP,
    /// Intel collateral for TDX) from `source` as of Unix time `now`.
    pub fn load_with(
        dir: &Path,
        source: &crate::collateral::fetch::CollateralSource,
        now: i64,
    ) -> Result<Self> {
        let kind = if dir.is_dir() {
            Self::detect_kind(dir)?
        } else {
            return Self::load(dir);
        };
        match kind {
            EvidenceKind::Snp
                if first_existing(
                    dir,
                    &["vcek.der", "vcek.pem", "vcek.crt", "vlek.der", "vlek.pem"],
                )
                .is_none() =>
            {
                use crate::collateral::needed::{self, NeedError, Role, SnpCarried};
                let report = read(&dir.join("report.bin"))?;
                let parsed = snp::AttestationReport::parse(&report)?;
                let chain_file = first_existing(dir, &["ask_ark.pem", "cert_chain.pem"])
                    .map(|p| read(&p))
                    .transpose()?;
                let carried = SnpCarried {
                    signing_cert: false,
                    chain: chain_file.as_deref(),
                };
                let needs = needed::snp(&parsed, parsed.signing_key()?, carried).map_err(|e| {
                    missing(
                        dir,
                        match e {
                            NeedError::VlekNotServed => {
                                "vlek.der (VLEKs are not served by AMD KDS)"
                            }
                            NeedError::NoProduct(_) => {
                                "vcek.der (a v2 report does not name its product)"
                            }
                            _ => "a readable ask_ark.pem",
                        },
                    )
                })?;
                let fetch = |role| -> Result<Option<Vec<u8>>> {
                    needed::keys_of(&needs, role)
                        .next()
                        .map(|k| source.get(k, now).map(|f| f.bytes))
                        .transpose()
                };
                let vcek = fetch(Role::SigningCert)?.ok_or_else(|| missing(dir, "vcek.der"))?;
                let chain = match chain_file {
                    Some(c) => c,
                    None => fetch(Role::Chain)?.ok_or_else(|| missing(dir, "ask_ark.pem"))?,
                };
                // Revocation is checked whenever the CRL can be had; its absence is not an error
                // (AMD CRLs are checked "when supplied").
                let crls = fetch(Role::Revocation)
                    .ok()
                    .flatten()
                    .map(|c| vec![c])
                    .unwrap_or_default();
                Ok(Bundle::Snp {
                    report,
                    signing_cert: vcek,
                    signing_key: snp::SigningKey::Vcek,
                    cert_chain: chain,
                    crls,
                })
            }
            EvidenceKind::Nvidia if files_with_extension(dir, "ocsp")?.is_empty() => {
                let Bundle::Nvidia {
                    report,
                    cert_chain,
                    ocsp: _,
                } = Self::load(dir)?
                else {
                    return Err(missing(dir, "NVIDIA evidence"));
                };
                // Like AMD CRLs: revocation is checked whenever the responses can be had; when
                // they cannot, the claims say `not_checked` and policy decides.
                let ocsp = crate::collateral::needed::nvidia_ocsp(&cert_chain)
                    .iter()
                    .map(|n| source.get(&n.key, now).map(|f| f.bytes))
                    .collect::<Result<Vec<_>>>()
                    .unwrap_or_default();
                Ok(Bundle::Nvidia {
                    report,
                    cert_chain,
                    ocsp,
                })
            }
            EvidenceKind::Tdx if !dir.join("collateral.json").is_file() => {
                let quote = read(&dir.join("quote.bin"))?;
                let (fmspc, ca) = crate::tdx::collateral_ids(&quote)?;
                let collateral = source.tdx_collateral(fmspc, ca, now)?;
                Ok(Bundle::Tdx { quote, collateral })
            }
            _ => Self::load(dir),
        }
    }

    /// Load the bundle in `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Bundle {
                path: dir.display().to_string(),
                detail: "not a folder".into(),
            });
        }
        match Self::detect_kind(dir)? {
            EvidenceKind::Snp => {
                let report = read(&dir.join("report.bin"))?;
                let (cert, signing_key) = if let Some(p) =
                    first_existing(dir, &["vcek.der", "vcek.pem", "vcek.crt"])
                {
                    (p, snp::SigningKey::Vcek)
                } else if let Some(p) = first_existing(dir, &["vlek.der", "vlek.pem", "vlek.crt"]) {
                    (p, snp::SigningKey::Vlek)
                } else {
                    return Err(missing(dir, "vcek.der or vlek.der"));
                };
                let chain = first_existing(dir, &["ask_ark.pem", "asvk_ark.pem", "cert_chain.pem"])
                    .ok_or_else(|| missing(dir, "ask_ark.pem or asvk_ark.pem"))?;
                let crls = files_with_extension(dir, "crl")?
                    .iter()
                    .map(|p| read(p))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Bundle::Snp {
                    report,
                    signing_cert: read(&cert)?,
                    signing_key,
                    cert_chain: read(&chain)?,
                    crls,
                })
            }
            EvidenceKind::Tdx => Ok(Bundle::Tdx {
                quote: read(&dir.join("quote.bin"))?,
                collateral: read(&dir.join("collateral.json"))?,
            }),
            EvidenceKind::Sample | EvidenceKind::SampleDevice => Err(Error::Bundle {
                path: dir.display().to_string(),
                detail: "sample evidence has no bundle form".into(),
            }),
            EvidenceKind::Nvidia => {
                let report = if let Some(p) = first_existing(dir, &["attestation_report.bin"]) {
                    read(&p)?
                } else {
                    let p = dir.join("attestation_report.hex");
                    let text = read(&p)?;
                    let clean: Vec<u8> = text
                        .into_iter()
                        .filter(|b| !b.is_ascii_whitespace())
                        .collect();
                    hex::decode(&clean)
                        .map_err(|e| Error::malformed("attestation_report.hex", e.to_string()))?
                };
                Ok(Bundle::Nvidia {
                    report,
                    cert_chain: read(&dir.join("cert_chain.pem"))?,
                    ocsp: files_with_extension(dir, "ocsp")?
                        .iter()
                        .map(|p| read(p))
                        .collect::<Result<Vec<_>>>()?,
                })
            }
        }
    }

    fn detect_kind(dir: &Path) -> Result<EvidenceKind> {
        if let Ok(text) = std::fs::read(dir.join("expected.json"))
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text)
        {
            match v.get("kind").and_then(|k| k.as_str()) {
                Some("snp") => return Ok(EvidenceKind::Snp),
                Some("tdx") => return Ok(EvidenceKind::Tdx),
                Some("nvidia") => return Ok(EvidenceKind::Nvidia),
                _ => {}
            }
        }
        if dir.join("report.bin").is_file() {
            Ok(EvidenceKind::Snp)
        } else if dir.join("quote.bin").is_file() {
            Ok(EvidenceKind::Tdx)
        } else if first_existing(dir, &["attestation_report.hex", "attestation_report.bin"])
            .is_some()
        {
            Ok(EvidenceKind::Nvidia)
        } else {
            Err(missing(
                dir,
                "report.bin, quote.bin or attestation_report.*",
            ))
        }
    }

    pub fn kind(&self) -> EvidenceKind {
        match self {
            Bundle::Snp { .. } => EvidenceKind::Snp,
            Bundle::Tdx { .. } => EvidenceKind::Tdx,
            Bundle::Nvidia { .. } => EvidenceKind::Nvidia,
        }
    }

    /// Borrow the bundle as evidence.
    pub fn evidence(&self) -> Evidence<'_> {
        match self {
            Bundle::Snp {
                report,
                signing_cert,
                signing_key,
                cert_chain,
                crls,
            } => Evidence::Snp(snp::SnpEvidence {
                report,
                signing_cert,
                signing_cert_kind: Some(*signing_key),
                cert_chain,
                crls,
            }),
            Bundle::Tdx { quote, collateral } => Evidence::Tdx(tdx::TdxEvidence {
                quote,
                collateral_json: collateral,
            }),
            Bundle::Nvidia {
                report,
                cert_chain,
                ocsp,
            } => Evidence::Nvidia(nvidia::NvidiaEvidence {
                report,
                cert_chain,
                expected_nonce: None,
                ocsp,
            }),
        }
    }

    /// Write the bundle into `dir` (used by `cgx sim`).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let io = |p: &Path, e: std::io::Error| Error::Bundle {
            path: p.display().to_string(),
            detail: e.to_string(),
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let files: Vec<(String, &[u8])> = match self {
            Bundle::Snp {
                report,
                signing_cert,
                signing_key,
                cert_chain,
                crls: _,
            } => {
                let (leaf, chain) = match signing_key {
                    snp::SigningKey::Vcek => ("vcek.der", "ask_ark.pem"),
                    snp::SigningKey::Vlek => ("vlek.der", "asvk_ark.pem"),
                };
                vec![
                    ("report.bin".into(), report.as_slice()),
                    (leaf.into(), signing_cert.as_slice()),
                    (chain.into(), cert_chain.as_slice()),
                ]
            }
            Bundle::Tdx { quote, collateral } => vec![
                ("quote.bin".into(), quote.as_slice()),
                ("collateral.json".into(), collateral.as_slice()),
            ],
            Bundle::Nvidia {
                report,
                cert_chain,
                ocsp,
            } => {
                let mut v: Vec<(String, &[u8])> = vec![
                    ("attestation_report.bin".into(), report.as_slice()),
                    ("cert_chain.pem".into(), cert_chain.as_slice()),
                ];
                for (i, r) in ocsp.iter().enumerate() {
                    v.push((format!("device-{i}.ocsp"), r.as_slice()));
                }
                v
            }
        };
        for (name, bytes) in files {
            let p = dir.join(name);
            std::fs::write(&p, bytes).map_err(|e| io(&p, e))?;
        }
        Ok(())
    }
}

/// The shared real-hardware vectors folder: `$CGX_VECTORS` when set, else `shared/vectors` in
/// `start` or one of its ancestors' parents (`<checkout>/../shared/vectors`). `None` when absent.
/// A development aid (tests and `cgx bench`): feature `test-support`.
#[cfg(feature = "test-support")]
pub fn shared_vectors(start: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CGX_VECTORS") {
        let p = PathBuf::from(p);
        return p.is_dir().then_some(p);
    }
    start
        .ancestors()
        .map(|a| a.join("shared/vectors"))
        .find(|p| p.is_dir())
}
