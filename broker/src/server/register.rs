//! Registration on composite evidence: decode the node's message, take missing collateral
//! from the store (never fetched here), verify every piece and the binding between them and the
//! node identity (Ed25519 key + KBS TEE key) through the `Appraiser`, then check that what the
//! node *offers* is what its evidence *proves*: GPU count = GPU reports, the offered model is one
//! of the chip the GPU certificates name, the TEE kind is the report's.

use cgx_attestation::collateral::CollateralKey;
use cgx_attestation::collateral::fetch::{CollateralSource, tdx_collateral_json, tdx_keys};
use cgx_attestation::collateral::needed::{self, NeedError, Role, SnpCarried};
use cgx_attestation::{Evidence, EvidenceKind, KindClaims, nvidia, snp, tdx};
use cgx_policies::{Appraisal, Appraiser};
use cgx_protocol::broker::{CpuEvidence, Offer, Registration, unb64};

use super::error::BrokerError;
use super::index::{MAX_GPUS, TeeKind};

/// GPU models the broker knows: the chip their certificates name and their largest memory.
pub const GPU_MODELS: &[(&str, &str, u32)] = &[
    ("H100", "GH100", 96),
    ("H800", "GH100", 80),
    ("H200", "GH100", 141),
    ("H20", "GH100", 96),
    ("B200", "GB100", 192),
];

/// A registration's evidence, decoded into owned bytes.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub node_key: [u8; 32],
    pub tee_thumbprint: String,
    /// The nonce's bytes: what is checked, proven over and spent (never its text, which has
    /// several spellings).
    pub nonce: Vec<u8>,
    /// The node key's signature over [`cgx_protocol::broker::registration_message`] (`None`:
    /// not base64; refused by [`check_proof`], in its turn).
    proof: Option<Vec<u8>>,
    cpu: Cpu,
    gpus: Vec<Gpu>,
}

/// One GPU's (SPDM report, PEM chain, DER OCSP responses).
type Gpu = (Vec<u8>, Vec<u8>, Vec<Vec<u8>>);

#[derive(Debug)]
enum Cpu {
    Snp {
        report: Vec<u8>,
        cert: Vec<u8>,
        kind: snp::SigningKey,
        chain: Vec<u8>,
        crls: Vec<Vec<u8>>,
    },
    Tdx {
        quote: Vec<u8>,
        collateral: Vec<u8>,
    },
}

fn bytes(text: &str, what: &str) -> Result<Vec<u8>, BrokerError> {
    unb64(text).ok_or_else(|| BrokerError::BadRequest(format!("{what} is not base64")))
}

fn missing(what: &str) -> BrokerError {
    BrokerError::Evidence {
        code: "collateral_missing",
        detail: format!("{what}: not sent and not in the collateral store"),
    }
}

/// A short printable name (region, operator, GPU model, a resource path's part): 1–64 of
/// `[A-Za-z0-9._-]`, starting with a letter or digit (no `..`).
pub(crate) fn check_name(v: &str, what: &str) -> Result<(), BrokerError> {
    let ok = v.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && v.len() <= 64
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(BrokerError::BadRequest(format!(
            "{what} must be 1 to 64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )))
    }
}

/// Shape checks on the offer, before any evidence is looked at.
pub(crate) fn check_offer(o: &Offer) -> Result<(), BrokerError> {
    check_name(&o.gpu_model, "gpu_model")?;
    check_name(&o.region, "region")?;
    check_name(&o.operator, "operator")?;
    if o.gpu_count == 0 || o.gpu_count > MAX_GPUS {
        return Err(BrokerError::BadRequest(format!(
            "gpu_count must be 1 to {MAX_GPUS}"
        )));
    }
    if !o.price_per_gpu_hour_micros.in_range() {
        return Err(BrokerError::BadRequest(format!(
            "price_per_gpu_hour_micros must be at most {} (10^9 units)",
            cgx_protocol::money::Micros::MAX.get()
        )));
    }
    Ok(())
}

/// The registration's nonce, decoded (checked before anything else is read: [`decode`] takes
/// these bytes rather than decode the text again).
pub(crate) fn nonce(reg: &Registration) -> Result<Vec<u8>, BrokerError> {
    unb64(&reg.nonce)
        .ok_or_else(|| BrokerError::Nonce("not a nonce of this broker: ask for a new one".into()))
}

/// Decode `reg`, whose nonce is `nonce` ([`nonce`]); collateral the node did not send comes
/// from `source` (as of `now`).
pub(crate) fn decode(
    reg: &Registration,
    nonce: Vec<u8>,
    source: Option<&CollateralSource>,
    now: i64,
) -> Result<Decoded, BrokerError> {
    let key = bytes(&reg.node_key, "node_key")?;
    let node_key: [u8; 32] = key
        .try_into()
        .map_err(|_| BrokerError::BadRequest("node_key must be a 32-byte Ed25519 key".into()))?;
    let proof = unb64(&reg.proof);
    if reg.gpus.len() > MAX_GPUS as usize {
        return Err(BrokerError::BadRequest(format!(
            "at most {MAX_GPUS} GPU reports"
        )));
    }
    let tee_thumbprint = cgx_protocol::kbs::jwe::thumbprint(&reg.tee_pubkey);
    let lookup = |key: CollateralKey| -> Option<Vec<u8>> {
        source
            .and_then(|s| s.cached(&key, now).ok().flatten())
            .map(|c| c.bytes)
    };
    let cpu = match &reg.cpu {
        CpuEvidence::Snp {
            report,
            signing_cert,
            signing_key,
            cert_chain,
            crls,
        } => {
            let report = bytes(report, "cpu.report")?;
            let parsed =
                snp::AttestationReport::parse(&report).map_err(|e| BrokerError::Evidence {
                    code: e.code(),
                    detail: e.to_string(),
                })?;
            let kind = match signing_key.as_deref() {
                None | Some("vcek") => snp::SigningKey::Vcek,
                Some("vlek") => snp::SigningKey::Vlek,
                Some(other) => {
                    return Err(BrokerError::BadRequest(format!(
                        "cpu.signing_key must be vcek or vlek, not {other}"
                    )));
                }
            };
            let carried_cert = signing_cert
                .as_ref()
                .map(|c| bytes(c, "cpu.signing_cert"))
                .transpose()?;
            let carried_chain = cert_chain.as_ref().map(|c| c.clone().into_bytes());
            let needs = needed::snp(
                &parsed,
                kind,
                SnpCarried {
                    signing_cert: carried_cert.is_some(),
                    chain: carried_chain.as_deref(),
                },
            )
            .map_err(|e| match e {
                NeedError::NoProduct("VCEK") => missing("VCEK"),
                NeedError::NoProduct(_) => missing("AMD ASK/ARK chain"),
                other => BrokerError::Evidence {
                    code: "collateral_missing",
                    detail: other.to_string(),
                },
            })?;
            let stored = |role| needed::keys_of(&needs, role).next().cloned();
            let cert = match carried_cert {
                Some(c) => c,
                None => stored(Role::SigningCert)
                    .and_then(lookup)
                    .ok_or_else(|| missing("VCEK"))?,
            };
            let chain = match carried_chain {
                Some(c) => c,
                None => stored(Role::Chain)
                    .and_then(lookup)
                    .ok_or_else(|| missing("AMD ASK/ARK chain"))?,
            };
            // Revocation is the broker's to judge: a node chooses which CRLs it sends (one
            // from before a revocation hides it), so what it sends is not used, and the
            // store's current CRL for the chain's ARK is required.
            let _ = crls;
            let key = stored(Role::Revocation).ok_or_else(|| BrokerError::Evidence {
                code: "collateral_missing",
                detail: "no AMD CRL can be named for this evidence".into(),
            })?;
            let path = key.path();
            let crl = lookup(key).ok_or_else(|| BrokerError::Evidence {
                code: "collateral_missing",
                detail: format!(
                    "AMD CRL for the chain's ARK ({path}): the broker's collateral store has no current one (CRLs a node sends are not used)"
                ),
            })?;
            let crls = vec![crl];
            Cpu::Snp {
                report,
                cert,
                kind,
                chain,
                crls,
            }
        }
        CpuEvidence::Tdx { quote, collateral } => {
            let quote = bytes(quote, "cpu.quote")?;
            // As for SNP, revocation is the broker's to judge: Intel's collateral carries the
            // PCK and root CA CRLs, so the node's is not used and the store's current
            // collateral is required.
            let _ = collateral;
            let (fmspc, ca) = tdx::collateral_ids(&quote).map_err(|e| BrokerError::Evidence {
                code: e.code(),
                detail: e.to_string(),
            })?;
            let [a, b, c, d] = tdx_keys(fmspc, ca).map(lookup);
            let (Some(a), Some(b), Some(c), Some(d)) = (a, b, c, d) else {
                return Err(BrokerError::Evidence {
                    code: "collateral_missing",
                    detail: "Intel collateral (TCB info, QE identity, PCK and root CA CRLs): the broker's collateral store has no current copy (collateral a node sends is not used)".into(),
                });
            };
            let collateral =
                tdx_collateral_json(&a, &b, &c, &d).map_err(|e| BrokerError::Evidence {
                    code: e.code(),
                    detail: e.to_string(),
                })?;
            Cpu::Tdx { quote, collateral }
        }
    };
    let gpus = reg
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let chain = g.cert_chain.clone().into_bytes();
            // As for CRLs: a node chooses which OCSP responses it sends (one from before a
            // revocation, still inside its window, hides it), so its own are not used; the
            // store's current responses for every certificate of the chain are, and without
            // them the claims say `not_checked` and policy decides (`require_ocsp`).
            let _ = &g.ocsp;
            let ocsp = needed::nvidia_ocsp(&chain)
                .into_iter()
                .map(|n| lookup(n.key))
                .collect::<Option<Vec<_>>>()
                .unwrap_or_default();
            Ok((bytes(&g.report, &format!("gpus[{i}].report"))?, chain, ocsp))
        })
        .collect::<Result<Vec<_>, BrokerError>>()?;
    Ok(Decoded {
        node_key,
        tee_thumbprint,
        nonce,
        proof,
        cpu,
        gpus,
    })
}

/// A registration as archived (`cgx_protocol::archive`): the node's registration and the
/// collateral its appraisal used, decoded as [`decode`] would have, for an auditor's
/// re-appraisal (no collateral store: the archived bytes are what was used).
pub(crate) fn decode_archived(
    reg: &Registration,
    c: &cgx_protocol::archive::Collateral,
) -> Result<Decoded, BrokerError> {
    use cgx_protocol::archive::CpuCollateral;
    let key = bytes(&reg.node_key, "node_key")?;
    let node_key: [u8; 32] = key
        .try_into()
        .map_err(|_| BrokerError::BadRequest("node_key must be a 32-byte Ed25519 key".into()))?;
    let cpu = match (&reg.cpu, &c.cpu) {
        (
            CpuEvidence::Snp { report, .. },
            CpuCollateral::Snp {
                signing_key,
                signing_cert,
                chain,
                crls,
            },
        ) => Cpu::Snp {
            report: bytes(report, "cpu.report")?,
            cert: bytes(signing_cert, "collateral.signing_cert")?,
            kind: match signing_key.as_str() {
                "vlek" => snp::SigningKey::Vlek,
                _ => snp::SigningKey::Vcek,
            },
            chain: bytes(chain, "collateral.chain")?,
            crls: crls
                .iter()
                .map(|c| bytes(c, "collateral.crls"))
                .collect::<Result<_, _>>()?,
        },
        (CpuEvidence::Tdx { quote, .. }, CpuCollateral::Tdx { collateral }) => Cpu::Tdx {
            quote: bytes(quote, "cpu.quote")?,
            collateral: bytes(collateral, "collateral.collateral")?,
        },
        _ => {
            return Err(BrokerError::BadRequest(
                "the archived collateral is not of the evidence's kind".into(),
            ));
        }
    };
    if c.gpus.len() != reg.gpus.len() {
        return Err(BrokerError::BadRequest(
            "the archived collateral does not cover the registration's GPUs".into(),
        ));
    }
    let gpus = reg
        .gpus
        .iter()
        .zip(&c.gpus)
        .enumerate()
        .map(|(i, (g, gc))| {
            Ok((
                bytes(&g.report, &format!("gpus[{i}].report"))?,
                g.cert_chain.clone().into_bytes(),
                gc.ocsp
                    .iter()
                    .map(|o| bytes(o, "collateral.ocsp"))
                    .collect::<Result<Vec<_>, BrokerError>>()?,
            ))
        })
        .collect::<Result<Vec<_>, BrokerError>>()?;
    Ok(Decoded {
        node_key,
        tee_thumbprint: cgx_protocol::kbs::jwe::thumbprint(&reg.tee_pubkey),
        nonce: nonce(reg)?,
        proof: unb64(&reg.proof),
        cpu,
        gpus,
    })
}

/// The collateral the appraisal of `d` uses, byte for byte: archived beside the registration so
/// an auditor re-verifies the evidence without asking anyone (issue 33).
pub(crate) fn collateral_used(d: &Decoded) -> cgx_protocol::archive::Collateral {
    use cgx_protocol::archive::{Collateral, CpuCollateral, GpuCollateral};
    use cgx_protocol::broker::b64;
    let cpu = match &d.cpu {
        Cpu::Snp {
            cert,
            kind,
            chain,
            crls,
            ..
        } => CpuCollateral::Snp {
            signing_key: kind.name().to_ascii_lowercase(),
            signing_cert: b64(cert),
            chain: b64(chain),
            crls: crls.iter().map(|c| b64(c)).collect(),
        },
        Cpu::Tdx { collateral, .. } => CpuCollateral::Tdx {
            collateral: b64(collateral),
        },
    };
    Collateral {
        cpu,
        gpus: d
            .gpus
            .iter()
            .map(|(_, _, ocsp)| GpuCollateral {
                ocsp: ocsp.iter().map(|o| b64(o)).collect(),
            })
            .collect(),
    }
}

/// The registration proof: the node key signed the nonce, the operator and the TEE key's
/// thumbprint (possession of the key the evidence binds).
pub(crate) fn check_proof(reg: &Registration, d: &Decoded) -> Result<(), BrokerError> {
    let msg = cgx_protocol::broker::registration_message(
        &d.nonce,
        &reg.offer.operator,
        &d.tee_thumbprint,
    );
    aws_lc_rs::signature::UnparsedPublicKey::new(&aws_lc_rs::signature::ED25519, d.node_key)
        .verify(&msg, d.proof.as_deref().ok_or_else(proof_refused)?)
        .map_err(|_| proof_refused())
}

fn proof_refused() -> BrokerError {
    BrokerError::Evidence {
        code: "node_key_proof",
        detail: "the registration is not signed by the node key it names".into(),
    }
}

/// Verify, bind and appraise (CPU-heavy: the caller runs it off the async threads).
pub(crate) fn appraise(
    appraiser: &Appraiser,
    d: &Decoded,
    now: time::OffsetDateTime,
) -> Result<Appraisal, BrokerError> {
    let identity = cgx_protocol::broker::node_identity(&d.node_key, &d.tee_thumbprint);
    let cpu = match &d.cpu {
        Cpu::Snp {
            report,
            cert,
            kind,
            chain,
            crls,
        } => Evidence::Snp(snp::SnpEvidence {
            report,
            signing_cert: cert,
            signing_cert_kind: Some(*kind),
            cert_chain: chain,
            crls,
        }),
        Cpu::Tdx { quote, collateral } => Evidence::Tdx(tdx::TdxEvidence {
            quote,
            collateral_json: collateral,
        }),
    };
    let ev = cgx_attestation::binding::CompositeEvidence {
        cpu,
        gpus: d
            .gpus
            .iter()
            .map(|(report, chain, ocsp)| nvidia::NvidiaEvidence {
                report,
                cert_chain: chain,
                expected_nonce: None,
                ocsp,
            })
            .collect(),
        nonce: &d.nonce,
        node_pubkey: &identity,
    };
    appraiser
        .appraise_composite(&ev, now, now.unix_timestamp())
        .map_err(|e| match e {
            cgx_policies::Error::Attestation(error) => BrokerError::Evidence {
                code: error.code(),
                detail: error.to_string(),
            },
            other => BrokerError::Internal(format!("appraisal: {other}")),
        })
}

/// What the evidence proves about the hardware.
#[derive(Debug, Clone)]
pub(crate) struct Proven {
    pub tee: TeeKind,
    pub chip: String,
    pub sim: bool,
}

/// The offer must claim only what the appraisal's verified claims prove.
/// One GPU is one device: the same device serial twice in one registration is one GPU offered
/// as several. The serial is the device leaf certificate's, whose key the GPU derives from its
/// own secret. (The FWID is not refused twice: it is a digest of the firmware, DICE TcbInfo,
/// which every GPU on the same firmware shares.)
pub(crate) fn one_report_per_gpu(serials: &[&str]) -> Result<(), BrokerError> {
    let mut seen = std::collections::HashSet::with_capacity(serials.len());
    for (i, s) in serials.iter().enumerate() {
        if s.is_empty() || !seen.insert(*s) {
            return Err(BrokerError::Inventory(format!(
                "GPU {i}'s device serial '{s}' is empty or appears twice in this registration: one GPU offered as several"
            )));
        }
    }
    Ok(())
}

pub(crate) fn check_inventory(offer: &Offer, a: &Appraisal) -> Result<Proven, BrokerError> {
    let parts = a.parts();
    let Some(cpu) = parts.first() else {
        return Err(BrokerError::Internal("an appraisal without parts".into()));
    };
    let tee = match cpu.claims.kind {
        EvidenceKind::Snp => TeeKind::Snp,
        EvidenceKind::Tdx => TeeKind::Tdx,
        other => {
            return Err(BrokerError::Inventory(format!(
                "the CPU evidence is {}, not an SNP report or TDX quote",
                other.as_str()
            )));
        }
    };
    let gpus = &parts[1..];
    if gpus.len() != offer.gpu_count as usize {
        return Err(BrokerError::Inventory(format!(
            "the offer claims {} GPUs, the evidence carries {} GPU reports",
            offer.gpu_count,
            gpus.len()
        )));
    }
    let Some((_, chip, max_mem)) = GPU_MODELS.iter().find(|(m, _, _)| *m == offer.gpu_model) else {
        return Err(BrokerError::Inventory(format!(
            "GPU model {} is not one the broker knows ({})",
            offer.gpu_model,
            GPU_MODELS
                .iter()
                .map(|m| m.0)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    let mut serials = Vec::with_capacity(gpus.len());
    for (i, g) in gpus.iter().enumerate() {
        let KindClaims::Nvidia(n) = &g.claims.detail else {
            return Err(BrokerError::Inventory(format!(
                "GPU {i}'s evidence is not an NVIDIA report"
            )));
        };
        serials.push(n.device_serial.as_str());
        if n.chip.as_deref() != Some(*chip) {
            return Err(BrokerError::Inventory(format!(
                "the offer claims {} ({chip}), GPU {i}'s certificate names {}",
                offer.gpu_model,
                n.chip.as_deref().unwrap_or("no chip")
            )));
        }
    }
    one_report_per_gpu(&serials)?;
    if offer.gpu_memory_gib == 0 || offer.gpu_memory_gib > *max_mem {
        return Err(BrokerError::Inventory(format!(
            "{} GiB per GPU: a {} has 1 to {max_mem} GiB",
            offer.gpu_memory_gib, offer.gpu_model
        )));
    }
    Ok(Proven {
        tee,
        chip: chip.to_string(),
        sim: parts.iter().any(|p| p.claims.sim),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_twice_in_one_registration_is_refused() {
        assert!(one_report_per_gpu(&["a", "b", "c"]).is_ok());
        for bad in [&["a", "b", "a"][..], &["a", ""][..]] {
            let e = one_report_per_gpu(bad).unwrap_err().to_string();
            assert!(e.contains("one GPU offered as several"), "{e}");
        }
    }
}
