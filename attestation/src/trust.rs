//! Trust anchors: the vendor roots pinned in the binary, and the simulator roots a caller may
//! choose to trust.
//!
//! Roots are pinned by the SHA-256 of their SubjectPublicKeyInfo: a chain in a bundle must end at
//! a self-signed certificate whose key hashes to one of these, whatever else the bundle claims.
//! The Intel SGX Root CA is pinned inside dcap-qvl (`QuoteVerifier::new_prod`).

use crate::snp::report::Product;

/// AMD ARK SubjectPublicKeyInfo SHA-256 per product (ARK-Milan, ARK-Genoa, ARK-Turin as AMD KDS
/// serves them in `cert_chain`; the VLEK chain's ASVK hangs off the same ARK).
pub(crate) const AMD_ARKS: [(Product, [u8; 32]); 3] = [
    (
        Product::Milan,
        hex32("9f056bee44377e29308cb5ffa895bdfb62d18881fa6bed8d6f075b0204089cb9"),
    ),
    (
        Product::Genoa,
        hex32("429a69c9422aa258ee4d8db5fcda9c6470ef15f8cd5a9cebd6cbc7d90b863831"),
    ),
    (
        Product::Turin,
        hex32("4f125410563a2ab9a50356f9243f6fe0b6f73de98603f53f90339c70e9d7ad08"),
    ),
];

/// NVIDIA Device Identity CA (both published encodings share this key).
pub(crate) const NVIDIA_DEVICE_ROOTS: [[u8; 32]; 1] = [hex32(
    "a90c4eb5acfd3e3d03a25db6a26b84f720ad0503196c627c21ddd48dd85b06a4",
)];

/// NVIDIA CoRIM signing Root CA (signs the RIM service's reference-value chains).
pub(crate) const NVIDIA_RIM_ROOTS: [[u8; 32]; 1] = [hex32(
    "dec1dc316477aa851eebdf51327ae9f864bc8d89254657ed1e7eb9168af1e1a3",
)];

/// SHA-256 of the whole Intel SGX Root CA certificate (DER). dcap-qvl pins the root's key; we
/// additionally require the copy a quote carries to be this exact certificate, so no byte of a
/// quote's certification data goes unchecked.
pub(crate) const INTEL_SGX_ROOT_CA_SHA256: [u8; 32] =
    hex32("44a0196b2b99f889b8e149e95b807a350e7424964399e885a7cbb8ccfab674d3");

/// Subject common-name prefix of every root the simulator makes. Only a root carrying it can be
/// trusted as a sim root, so a sim trust setting never widens trust in vendor-looking chains.
pub const SIM_ROOT_CN_PREFIX: &str = "cgx-sim ";

/// Which simulated roots to trust. Production trusts none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SimTrust {
    /// Refuse every sim root (the default).
    #[default]
    Refuse,
    /// Trust sim roots with these SPKI SHA-256 pins.
    Pinned(Vec<[u8; 32]>),
    /// Trust any self-signed sim root (development: `cgx verify --trust-sim`).
    Any,
}

impl SimTrust {
    pub(crate) fn trusts(&self, spki_sha256: &[u8; 32]) -> bool {
        match self {
            SimTrust::Refuse => false,
            SimTrust::Pinned(pins) => pins.contains(spki_sha256),
            SimTrust::Any => true,
        }
    }
}

// Only evaluated at compile time (in `const` items): a bad literal fails the build.
#[allow(clippy::panic)]
const fn hex_val(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => panic!("pinned fingerprints are lowercase hex"),
    }
}

/// Compile-time hex decoding of pins (a bad literal fails the build, never a run).
const fn hex32(s: &str) -> [u8; 32] {
    let b = s.as_bytes();
    assert!(b.len() == 64, "pin must be 64 hex digits");
    let mut out = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = hex_val(b[2 * i]) << 4 | hex_val(b[2 * i + 1]);
        i += 1;
    }
    out
}

/// Where the CRL of an AMD certificate chain (PEM: ASK or ASVK and ARK, in either order, as the
/// verifier accepts them) lives in a collateral store: AMD's own chains under KDS's path for
/// the product (`CollateralKey::AmdCrl`); a simulator chain, each of which has an ARK of its
/// own, under `sim/amd/<ARK SPKI SHA-256>/crl`. The root is found as the verifier finds it,
/// not by position: AMD's pinned ARK wherever it stands, else the chain's one self-issued
/// certificate (a chain labelled ARK-first must not name a CRL that is never there and so skip
/// revocation where a missing CRL is tolerated). `None`: no root can be told. Reads public
/// bytes only; verifying the chain and the CRL is the verifier's. The product is the ARK's
/// (each AMD product has its own).
pub fn amd_crl_key(chain_pem: &[u8], vlek: bool) -> Option<crate::collateral::CollateralKey> {
    use crate::collateral::CollateralKey;
    // A KBS names the CRL of the chain each attestation carries: parsing it every time cost
    // the flow a PEM decode and two X.509 parses. The answer is a function of public bytes,
    // so it is remembered by them (bounded; a flood of chains churns only probation).
    // One memory per signing-key kind: a chain asked about under the other kind never
    // replaces the entry an honest node's answer sits in.
    type Memo = crate::cache::ChainCache<CollateralKey>;
    static SEEN: std::sync::OnceLock<[Memo; 2]> = std::sync::OnceLock::new();
    let memos = SEEN.get_or_init(|| {
        [
            Memo::with_budget(CRL_KEY_MEMO_BUDGET / 2),
            Memo::with_budget(CRL_KEY_MEMO_BUDGET / 2),
        ]
    });
    let seen = &memos[usize::from(vlek)];
    if let Some(k) = seen.get(chain_pem, &[]) {
        return Some((*k).clone());
    }
    seen.note_miss();
    let key = amd_crl_key_parsed(chain_pem, vlek)?;
    let bytes = match &key {
        CollateralKey::Other(path) => path.len(),
        _ => 0,
    };
    seen.insert(chain_pem, &[], std::sync::Arc::new(key.clone()), bytes);
    Some(key)
}

/// Bytes [`amd_crl_key`] may keep: a chain's PEM is about 3 KiB, so a few hundred chains.
const CRL_KEY_MEMO_BUDGET: usize = 1 << 20;

fn amd_crl_key_parsed(chain_pem: &[u8], vlek: bool) -> Option<crate::collateral::CollateralKey> {
    use crate::collateral::CollateralKey;
    let ders = crate::x509::pem_certs(chain_pem, "AMD chain").ok()?;
    let certs: Vec<_> = ders
        .iter()
        .filter_map(|d| x509_parser::parse_x509_certificate(d).ok().map(|(_, c)| c))
        .collect();
    if certs.len() != ders.len() {
        return None;
    }
    for c in &certs {
        let pin = crate::x509::spki_sha256(c);
        if let Some((product, _)) = AMD_ARKS.iter().find(|(_, p)| *p == pin) {
            return Some(CollateralKey::AmdCrl {
                product: *product,
                vlek,
            });
        }
    }
    let mut roots = certs.iter().filter(|c| c.subject() == c.issuer());
    let root = roots.next()?;
    if roots.next().is_some() {
        return None;
    }
    Some(CollateralKey::Other(format!(
        "sim/amd/{}/crl",
        hex::encode(crate::x509::spki_sha256(root))
    )))
}
