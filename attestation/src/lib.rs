//! cgx attestation: evidence formats and their verification.
//!
//! **Architecture invariant.** Verification is sans-IO and time-explicit:
//! `Verifier::verify(evidence, now) -> Claims | Error`. Nothing under [`snp`], [`tdx`],
//! [`nvidia`] or [`Verifier`] opens a file, a socket or reads the clock; collateral comes in with
//! the evidence. [`bundle`] is the one module that reads files (the on-disk evidence-bundle
//! layout), and it only turns a folder into bytes.
//!
//! A verifier decides cryptographic validity only. Whether a valid debug TD, an old TCB or a sim
//! root is acceptable is policy's question, answered from the [`Claims`].
//!
//! ```
//! use cgx_attestation::{SimTrust, Verifier, VerifierConfig, sim, snp};
//!
//! let now = time::OffsetDateTime::now_utc();
//! let product = snp::Product::Genoa;
//! let chain = sim::SimAmd::generate(
//!     product,
//!     snp::SigningKey::Vcek,
//!     sim::default_tcb(product),
//!     [1; 64],
//!     now.unix_timestamp(),
//! )?;
//! let bundle = chain.bundle(&sim::SnpReportOptions::default())?;
//! let dev = Verifier::new(VerifierConfig { sim: SimTrust::Pinned(vec![chain.root_pin()]) });
//! assert!(dev.verify(&bundle.evidence(), now)?.claims().sim);
//! // Production trust refuses the very same evidence.
//! let prod = Verifier::new(VerifierConfig::default());
//! assert_eq!(prod.verify(&bundle.evidence(), now).unwrap_err().code(), "untrusted_root");
//! # Ok::<(), cgx_attestation::Error>(())
//! ```

pub mod binding;
pub mod bundle;
mod cache;
pub mod claims;
pub mod collateral;
pub mod crypto;
mod der;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzz;
pub mod nvidia;
pub mod results;
pub mod sample;
#[cfg(feature = "sim")]
pub mod sim;
pub mod snp;
pub mod tdx;
pub mod trust;
mod x509;

pub use cache::CacheStats;
pub use claims::{Claims, EvidenceKind, KindClaims};
pub use error::{Error, Result};
pub use trust::SimTrust;

use crypto::CryptoProvider;

/// Evidence of any supported kind, as bytes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Evidence<'a> {
    Snp(snp::SnpEvidence<'a>),
    Tdx(tdx::TdxEvidence<'a>),
    Nvidia(nvidia::NvidiaEvidence<'a>),
    Sample(sample::SampleEvidence<'a>),
}

impl Evidence<'_> {
    pub fn kind(&self) -> EvidenceKind {
        match self {
            Evidence::Snp(_) => EvidenceKind::Snp,
            Evidence::Tdx(_) => EvidenceKind::Tdx,
            Evidence::Nvidia(_) => EvidenceKind::Nvidia,
            Evidence::Sample(s) if s.device => EvidenceKind::SampleDevice,
            Evidence::Sample(_) => EvidenceKind::Sample,
        }
    }
}

/// Claims that came out of a [`Verifier`]. Only this crate can construct one, so an API that
/// takes `VerifiedClaims` (key release, placement) cannot be handed claims someone typed in.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedClaims {
    claims: Claims,
}

impl VerifiedClaims {
    pub fn claims(&self) -> &Claims {
        &self.claims
    }

    pub fn into_claims(self) -> Claims {
        self.claims
    }
}

/// Verifier configuration.
#[derive(Debug, Clone, Default)]
pub struct VerifierConfig {
    /// Which simulator roots to trust (none by default).
    pub sim: SimTrust,
}

/// Verifies every evidence kind. Cheap to share (`&self` everywhere); holds chain caches.
#[derive(Debug)]
pub struct Verifier {
    snp: snp::SnpVerifier,
    tdx: tdx::TdxVerifier,
    nvidia: nvidia::NvidiaVerifier,
    /// Take CoCo's unsigned sample evidence (see [`Verifier::allowing_sample`]).
    sample: bool,
}

impl Verifier {
    /// A verifier over the default crypto provider.
    pub fn new(config: VerifierConfig) -> Self {
        Self::with_provider(config, &crypto::DEFAULT_PROVIDER)
    }

    pub fn with_provider(config: VerifierConfig, provider: &'static dyn CryptoProvider) -> Self {
        Verifier {
            snp: snp::SnpVerifier::new(provider, config.sim.clone()),
            tdx: tdx::TdxVerifier::default(),
            nvidia: nvidia::NvidiaVerifier::new(provider, config.sim),
            sample: false,
        }
    }

    /// Whether to take CoCo's unsigned `sample` evidence (development only; its claims say
    /// `sim` and `debug`). Refused by default: nothing vouches for it, so a verifier that takes
    /// it hands out claims anyone could have typed.
    pub fn allowing_sample(mut self, allow: bool) -> Self {
        self.sample = allow;
        self
    }

    /// How each of the verifier's caches stands: `snp_chains`, `nvidia_chains`, `nvidia_ocsp`,
    /// `tdx_known`, `tdx_collateral`. Each is bounded in bytes, not entries (see `cache.rs`).
    pub fn cache_stats(&self) -> [(&'static str, CacheStats); 5] {
        let [chains, ocsp] = self.nvidia.cache_stats();
        let [known, collateral] = self.tdx.cache_stats();
        [
            ("snp_chains", self.snp.cache_stats()),
            ("nvidia_chains", chains),
            ("nvidia_ocsp", ocsp),
            ("tdx_known", known),
            ("tdx_collateral", collateral),
        ]
    }

    /// Forget every known TDX platform, keeping the Intel collateral verified so far: the next
    /// quote is verified as from a platform seen for the first time by a running verifier
    /// (benchmarks and tests).
    #[cfg(feature = "test-support")]
    pub fn forget_tdx_platforms(&self) {
        self.tdx.forget_platforms();
    }

    /// Verify `evidence` at `now`.
    pub fn verify(
        &self,
        evidence: &Evidence<'_>,
        now: time::OffsetDateTime,
    ) -> Result<VerifiedClaims> {
        let now = now.unix_timestamp();
        let claims = match evidence {
            Evidence::Snp(ev) => self.snp.verify(ev, now)?,
            Evidence::Tdx(ev) => self.tdx.verify(ev, now)?,
            Evidence::Nvidia(ev) => self.nvidia.verify(ev, now)?,
            Evidence::Sample(_) if !self.sample => {
                return Err(Error::UntrustedRoot {
                    chain: error::ChainKind::Sample,
                    detail: "unsigned sample evidence is refused unless the verifier allows it"
                        .into(),
                });
            }
            Evidence::Sample(ev) => sample::claims(ev)?,
        };
        Ok(VerifiedClaims { claims })
    }
}
