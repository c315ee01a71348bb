//! Which collateral a piece of evidence needs from a store, beyond what it carries: one answer
//! for every reader (the KBS's attest flow, the broker's registration, bundle loading) and for
//! the writer that fills a store from bundles (`cgx collateral import`).
//!
//! What a missing item *means* stays each caller's policy — the broker requires the store's
//! current AMD CRL (a node chooses which CRL it sends), the KBS requires one when it fetches
//! online, a bundle checks revocation when the CRL can be had — so each [`Need`] says its
//! [`Role`] and the caller decides. Which item, under which key, is decided here only.
//!
//! **An AMD CRL is found by its chain's root.** Where the evidence carries its chain (ASK or
//! ASVK, then ARK), the CRL's key is the ARK's ([`crate::trust::amd_crl_key`]: AMD's own roots
//! under KDS's path for their product, a simulator's under its own pin), not the product the
//! report's CPUID names, which is the report's claim and read before any signature is checked.
//! Where the chain comes from the store, it is the store's chain for the report's product, and
//! the CRL the one KDS serves beside it.

use crate::collateral::CollateralKey;
use crate::snp::report::{AttestationReport, SigningKey};

/// What an item is for, so the caller can say what its absence means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The report's signing certificate (a VCEK), not carried by the evidence: without it
    /// nothing verifies.
    SigningCert,
    /// The vendor chain (ASK or ASVK, then ARK), not carried: without it nothing verifies.
    Chain,
    /// Revocation status: an AMD CRL, or one NVIDIA OCSP response. Whether its absence refuses
    /// the evidence is the caller's policy.
    Revocation,
    /// One of Intel's four TDX items (TCB info, QE identity, PCK CRL, root CA CRL): all four or
    /// no verification.
    IntelTdx,
}

/// One collateral item evidence needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub key: CollateralKey,
    pub role: Role,
}

/// Why no list of needs can be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NeedError {
    #[error(
        "the report is signed with a VLEK, which AMD KDS does not serve: the evidence must carry it"
    )]
    VlekNotServed,
    #[error("the evidence carries no {0} and the report does not name its product (a v2 report)")]
    NoProduct(&'static str),
    #[error("the AMD chain has no readable root, so no CRL can be found for it")]
    UnreadableChain,
}

/// What SEV-SNP evidence carries besides the report.
#[derive(Debug, Clone, Copy, Default)]
pub struct SnpCarried<'a> {
    /// The signing certificate (VCEK or VLEK) is in the evidence.
    pub signing_cert: bool,
    /// The chain (PEM: ASK or ASVK, then ARK), if the evidence carries one.
    pub chain: Option<&'a [u8]>,
}

/// The items SEV-SNP evidence with report `report`, signed by a `kind` key, needs: the
/// signing certificate and the chain where not carried, then the chain's CRL — in that order.
pub fn snp(
    report: &AttestationReport,
    kind: SigningKey,
    carried: SnpCarried<'_>,
) -> Result<Vec<Need>, NeedError> {
    let vlek = kind == SigningKey::Vlek;
    let mut needs = Vec::with_capacity(3);
    if !carried.signing_cert {
        if vlek {
            return Err(NeedError::VlekNotServed);
        }
        let key = CollateralKey::vcek_for(report).ok_or(NeedError::NoProduct("VCEK"))?;
        needs.push(Need {
            key,
            role: Role::SigningCert,
        });
    }
    let crl = match carried.chain {
        Some(chain) => crate::trust::amd_crl_key(chain, vlek).ok_or(NeedError::UnreadableChain)?,
        None => {
            let product = report
                .cpuid_product()
                .ok_or(NeedError::NoProduct("AMD chain"))?;
            needs.push(Need {
                key: CollateralKey::AmdCertChain { product, vlek },
                role: Role::Chain,
            });
            CollateralKey::AmdCrl { product, vlek }
        }
    };
    needs.push(Need {
        key: crl,
        role: Role::Revocation,
    });
    Ok(needs)
}

/// The Intel items a TDX quote needs, in the order [`super::fetch::tdx_collateral_json`]
/// takes them (TCB info, QE identity, PCK CRL, root CA CRL).
pub fn tdx(quote: &[u8]) -> crate::error::Result<[CollateralKey; 4]> {
    let (fmspc, ca) = crate::tdx::collateral_ids(quote)?;
    Ok(super::fetch::tdx_keys(fmspc, ca))
}

/// The OCSP responses an NVIDIA device chain (PEM) needs: one per certificate that has an
/// issuer in the chain, in chain order. An unreadable chain needs none (its verification
/// fails on its own).
pub fn nvidia_ocsp(chain_pem: &[u8]) -> Vec<Need> {
    crate::nvidia::ocsp::chain_cert_ids(chain_pem)
        .unwrap_or_default()
        .into_iter()
        .map(|cert_id| Need {
            key: CollateralKey::NvidiaOcsp { cert_id },
            role: Role::Revocation,
        })
        .collect()
}

/// The keys of `needs` with role `role`, in order.
pub fn keys_of(needs: &[Need], role: Role) -> impl Iterator<Item = &CollateralKey> {
    needs.iter().filter(move |n| n.role == role).map(|n| &n.key)
}
