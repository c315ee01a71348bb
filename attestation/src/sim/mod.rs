//! The simulated TEE: evidence in the vendors' exact formats, signed by generated roots.
//!
//! An SNP report here is byte-for-byte the 1184-byte ATTESTATION_REPORT, signed by a generated
//! VCEK/VLEK certified by a generated ASK/ASVK and ARK with the same RSASSA-PSS and X.509
//! extension shapes AMD uses; NVIDIA evidence is a GET_MEASUREMENTS request ‖ MEASUREMENTS
//! response signed by a generated device chain with the TCG DICE FWID extension. Both go through
//! the same verification code as real evidence. Sim roots carry the subject prefix
//! [`crate::trust::SIM_ROOT_CN_PREFIX`], are trusted only through
//! [`SimTrust`](crate::SimTrust), and yield claims with `sim: true`.

mod presign;

use aws_lc_rs::encoding::{AsBigEndian, EcPrivateKeyBin};
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::rsa::{KeyPair as RsaKeyPair, KeySize};
use aws_lc_rs::signature::{self as sig, EcdsaKeyPair, KeyPair};

use crate::bundle::Bundle;
use crate::der::write as w;
use crate::error::{Error, Result};
use crate::snp::report::{SIGNED_LEN, offsets};
use crate::snp::{Product, SigningKey, TcbVersion};
use crate::trust::SIM_ROOT_CN_PREFIX;

fn keygen_err(what: &str) -> Error {
    Error::invalid("sim", format!("{what} key generation failed"))
}

fn sign_err(what: &str) -> Error {
    Error::invalid("sim", format!("{what} signing failed"))
}

fn name(cn: &str) -> Vec<u8> {
    w::seq(&[
        w::set(&[w::seq(&[w::oid("2.5.4.10"), w::utf8("cgx simulator")])]),
        w::set(&[w::seq(&[w::oid("2.5.4.3"), w::utf8(cn)])]),
    ])
}

fn name_with_serial(cn: &str, serial: &str) -> Vec<u8> {
    w::seq(&[
        w::set(&[w::seq(&[
            w::oid("2.5.4.5"),
            w::tlv(0x13, serial.as_bytes()),
        ])]),
        w::set(&[w::seq(&[w::oid("2.5.4.3"), w::utf8(cn)])]),
    ])
}

fn pss_sha384() -> Vec<u8> {
    let sha384 = w::seq(&[w::oid("2.16.840.1.101.3.4.2.2"), w::null()]);
    w::seq(&[
        w::oid("1.2.840.113549.1.1.10"),
        w::seq(&[
            w::ctx(0, &sha384),
            w::ctx(
                1,
                &w::seq(&[w::oid("1.2.840.113549.1.1.8"), sha384.clone()]),
            ),
            w::ctx(2, &w::small_uint(48)),
        ]),
    ])
}

fn ecdsa_sha384() -> Vec<u8> {
    w::seq(&[w::oid("1.2.840.10045.4.3.3")])
}

fn rsa_spki(pkcs1: &[u8]) -> Vec<u8> {
    w::seq(&[
        w::seq(&[w::oid("1.2.840.113549.1.1.1"), w::null()]),
        w::bits(pkcs1),
    ])
}

fn p384_spki(point: &[u8]) -> Vec<u8> {
    w::seq(&[
        w::seq(&[w::oid("1.2.840.10045.2.1"), w::oid("1.3.132.0.34")]),
        w::bits(point),
    ])
}

fn ext(oid: &str, critical: bool, value: Vec<u8>) -> Vec<u8> {
    let mut parts = vec![w::oid(oid)];
    if critical {
        parts.push(w::boolean(true));
    }
    parts.push(w::octets(&value));
    w::seq(&parts)
}

fn ca_ext() -> Vec<u8> {
    ext("2.5.29.19", true, w::seq(&[w::boolean(true)]))
}

/// A certificate's to-be-signed part.
struct Tbs<'a> {
    serial: u64,
    sig_alg: Vec<u8>,
    issuer: Vec<u8>,
    subject: Vec<u8>,
    spki: Vec<u8>,
    not_before: i64,
    not_after: i64,
    extensions: &'a [Vec<u8>],
}

impl Tbs<'_> {
    fn encode(&self) -> Vec<u8> {
        let mut parts = vec![
            w::ctx(0, &w::small_uint(2)),
            w::small_uint(self.serial),
            self.sig_alg.clone(),
            self.issuer.clone(),
            w::seq(&[
                w::generalized_time(self.not_before),
                w::generalized_time(self.not_after),
            ]),
            self.subject.clone(),
            self.spki.clone(),
        ];
        if !self.extensions.is_empty() {
            parts.push(w::ctx(3, &w::seq(self.extensions)));
        }
        w::seq(&parts)
    }
}

enum Signer<'a> {
    Rsa(&'a RsaKeyPair),
    Ec(&'a EcdsaKeyPair),
}

fn sign_tbs(tbs: &Tbs<'_>, signer: Signer<'_>) -> Result<Vec<u8>> {
    let body = tbs.encode();
    let rng = SystemRandom::new();
    let signature = match signer {
        Signer::Rsa(k) => {
            let mut s = vec![0u8; k.public_modulus_len()];
            k.sign(&sig::RSA_PSS_SHA384, &rng, &body, &mut s)
                .map_err(|_| sign_err("certificate"))?;
            s
        }
        Signer::Ec(k) => k
            .sign(&rng, &body)
            .map_err(|_| sign_err("certificate"))?
            .as_ref()
            .to_vec(),
    };
    Ok(w::seq(&[body, tbs.sig_alg.clone(), w::bits(&signature)]))
}

/// Validity of generated certificates: from a day before `now` for ten years.
fn window(now: i64) -> (i64, i64) {
    (now - 86_400, now + 10 * 365 * 86_400)
}

/// A generated AMD-shaped key hierarchy.
#[derive(Debug)]
pub struct SimAmd {
    pub product: Product,
    pub signing_key: SigningKey,
    ark: RsaKeyPair,
    ask: RsaKeyPair,
    leaf: EcdsaKeyPair,
    pub ark_der: Vec<u8>,
    pub ask_der: Vec<u8>,
    pub leaf_der: Vec<u8>,
    /// TCB and chip the leaf is certified for.
    pub tcb: TcbVersion,
    pub chip_id: [u8; 64],
    /// Nonces precomputed for the leaf's report signatures ([`SimAmd::presign`]).
    presigned: presign::Presigned,
}

/// What to put in a simulated SNP report.
#[derive(Debug, Clone)]
pub struct SnpReportOptions {
    pub version: u32,
    pub report_data: [u8; 64],
    pub measurement: [u8; 48],
    pub policy: u64,
    pub vmpl: u32,
    pub host_data: [u8; 32],
    /// The digests of the keys that signed the launch's ID block (zero: none); a non-zero
    /// author key digest sets KEY_INFO's AUTHOR_KEY_EN.
    pub id_key_digest: [u8; 48],
    pub author_key_digest: [u8; 48],
}

impl Default for SnpReportOptions {
    fn default() -> Self {
        SnpReportOptions {
            version: 5,
            report_data: [0; 64],
            measurement: [0; 48],
            // SMT allowed (bit 16) and the reserved-must-be-one bit 17, like real guests.
            policy: 0x30000,
            vmpl: 0,
            host_data: [0; 32],
            id_key_digest: [0; 48],
            author_key_digest: [0; 48],
        }
    }
}

impl SimAmd {
    /// Generate ARK, ASK (or ASVK) and VCEK (or VLEK) valid around `now`.
    pub fn generate(
        product: Product,
        signing_key: SigningKey,
        tcb: TcbVersion,
        chip_id: [u8; 64],
        now: i64,
    ) -> Result<Self> {
        let ark = RsaKeyPair::generate(KeySize::Rsa2048).map_err(|_| keygen_err("ARK"))?;
        let ask = RsaKeyPair::generate(KeySize::Rsa2048).map_err(|_| keygen_err("ASK"))?;
        let leaf = EcdsaKeyPair::generate(&sig::ECDSA_P384_SHA384_FIXED_SIGNING)
            .map_err(|_| keygen_err("VCEK"))?;
        let presigned = presigned_for(&leaf)?;
        let mut sim = SimAmd {
            presigned,
            product,
            signing_key,
            ark,
            ask,
            leaf,
            ark_der: Vec::new(),
            ask_der: Vec::new(),
            leaf_der: Vec::new(),
            tcb,
            chip_id,
        };
        let (nb, na) = window(now);
        let ark_name = name(&format!("{SIM_ROOT_CN_PREFIX}ARK-{}", product.name()));
        sim.ark_der = sign_tbs(
            &Tbs {
                serial: 1,
                sig_alg: pss_sha384(),
                issuer: ark_name.clone(),
                subject: ark_name.clone(),
                spki: rsa_spki(sim.ark.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &[ca_ext()],
            },
            Signer::Rsa(&sim.ark),
        )?;
        sim.ask_der = sim.issue_ask(&sim.ask, 2, nb, na)?;
        sim.leaf_der = sim.issue_leaf(tcb, chip_id, nb, na)?;
        Ok(sim)
    }

    fn ask_name(&self) -> Vec<u8> {
        let prefix = match self.signing_key {
            SigningKey::Vcek => "SEV",
            SigningKey::Vlek => "SEV-VLEK",
        };
        name(&format!(
            "{SIM_ROOT_CN_PREFIX}{prefix}-{}",
            self.product.name()
        ))
    }

    /// Issue an ASK certificate for `key`, signed by the ARK.
    fn issue_ask(&self, key: &RsaKeyPair, serial: u64, nb: i64, na: i64) -> Result<Vec<u8>> {
        sign_tbs(
            &Tbs {
                serial,
                sig_alg: pss_sha384(),
                issuer: name(&format!("{SIM_ROOT_CN_PREFIX}ARK-{}", self.product.name())),
                subject: self.ask_name(),
                spki: rsa_spki(key.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &[ca_ext()],
            },
            Signer::Rsa(&self.ark),
        )
    }

    /// Issue a VCEK/VLEK certificate for the leaf key with the given TCB, chip and window.
    pub fn issue_leaf(
        &self,
        tcb: TcbVersion,
        chip_id: [u8; 64],
        nb: i64,
        na: i64,
    ) -> Result<Vec<u8>> {
        let mut exts = vec![
            ext(
                "1.3.6.1.4.1.3704.1.2",
                false,
                w::tlv(0x16, format!("{}-B0", self.product.name()).as_bytes()),
            ),
            ext(
                "1.3.6.1.4.1.3704.1.3.1",
                false,
                w::small_uint(tcb.bootloader.into()),
            ),
            ext(
                "1.3.6.1.4.1.3704.1.3.2",
                false,
                w::small_uint(tcb.tee.into()),
            ),
            ext(
                "1.3.6.1.4.1.3704.1.3.3",
                false,
                w::small_uint(tcb.snp.into()),
            ),
            ext(
                "1.3.6.1.4.1.3704.1.3.8",
                false,
                w::small_uint(tcb.microcode.into()),
            ),
        ];
        if self.product == Product::Turin {
            exts.push(ext(
                "1.3.6.1.4.1.3704.1.3.9",
                false,
                w::small_uint(tcb.fmc.unwrap_or(0).into()),
            ));
        }
        if self.signing_key == SigningKey::Vcek {
            let hw: &[u8] = if self.product == Product::Turin {
                &chip_id[..8]
            } else {
                &chip_id
            };
            exts.push(ext("1.3.6.1.4.1.3704.1.4", false, w::octets(hw)));
        }
        sign_tbs(
            &Tbs {
                serial: 3,
                sig_alg: pss_sha384(),
                issuer: self.ask_name(),
                subject: name(&format!("{SIM_ROOT_CN_PREFIX}{}", self.signing_key.name())),
                spki: p384_spki(self.leaf.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &exts,
            },
            Signer::Rsa(&self.ask),
        )
    }

    /// SHA-256 of the sim ARK's SubjectPublicKeyInfo, for [`SimTrust::Pinned`](crate::SimTrust).
    pub fn root_pin(&self) -> [u8; 32] {
        crate::crypto::sha256(&rsa_spki(self.ark.public_key().as_ref()))
    }

    /// `cert_chain` as KDS serves it: ASK then ARK, PEM.
    pub fn cert_chain_pem(&self) -> String {
        crate::x509::to_pem("CERTIFICATE", &self.ask_der)
            + &crate::x509::to_pem("CERTIFICATE", &self.ark_der)
    }

    /// An unsigned report in the exact layout, for this chain's product, TCB and chip.
    pub fn report_body(&self, o: &SnpReportOptions) -> Vec<u8> {
        let mut r = vec![0u8; crate::snp::report::REPORT_LEN];
        let put = |r: &mut Vec<u8>, off: usize, b: &[u8]| r[off..off + b.len()].copy_from_slice(b);
        put(&mut r, offsets::VERSION, &o.version.to_le_bytes());
        put(&mut r, offsets::GUEST_SVN, &1u32.to_le_bytes());
        put(&mut r, offsets::POLICY, &o.policy.to_le_bytes());
        put(&mut r, offsets::VMPL, &o.vmpl.to_le_bytes());
        put(&mut r, offsets::SIGNATURE_ALGO, &1u32.to_le_bytes());
        let tcb = self.tcb.encode(self.product).to_le_bytes();
        put(&mut r, offsets::CURRENT_TCB, &tcb);
        put(&mut r, offsets::PLATFORM_INFO, &1u64.to_le_bytes());
        let key_info: u32 = match self.signing_key {
            SigningKey::Vcek => 0,
            SigningKey::Vlek => 1 << 2,
        } | u32::from(o.author_key_digest != [0; 48]);
        put(&mut r, offsets::KEY_INFO, &key_info.to_le_bytes());
        put(&mut r, offsets::REPORT_DATA, &o.report_data);
        put(&mut r, offsets::MEASUREMENT, &o.measurement);
        put(&mut r, offsets::HOST_DATA, &o.host_data);
        put(&mut r, offsets::ID_KEY_DIGEST, &o.id_key_digest);
        put(&mut r, offsets::AUTHOR_KEY_DIGEST, &o.author_key_digest);
        put(&mut r, offsets::REPORT_ID, &[0x5a; 32]);
        put(&mut r, offsets::REPORT_ID_MA, &[0xff; 32]);
        put(&mut r, offsets::REPORTED_TCB, &tcb);
        if o.version >= 3 {
            let (fam, model) = match self.product {
                Product::Milan => (0x19, 0x01),
                Product::Genoa => (0x19, 0x11),
                Product::Turin => (0x1A, 0x02),
            };
            put(&mut r, offsets::CPUID_FAM_ID, &[fam, model, 1]);
        }
        if self.signing_key == SigningKey::Vcek {
            put(&mut r, offsets::CHIP_ID, &self.chip_id);
        }
        put(&mut r, offsets::COMMITTED_TCB, &tcb);
        put(&mut r, offsets::CURRENT_BUILD, &[21, 55, 1]);
        put(&mut r, offsets::CURRENT_BUILD + 4, &[21, 55, 1]);
        put(&mut r, offsets::LAUNCH_TCB, &tcb);
        r
    }

    /// Precompute `count` report-signature nonces on `threads` threads; later reports are signed
    /// with them, one each, until they run out. Signing is then a multiplication and an
    /// addition mod n: the benchmark's simulated AMD-SPs, which stand for other machines'
    /// hardware, stay off the cores of the KBS it measures (see `presign.rs`).
    pub fn presign(&self, count: usize, threads: usize) -> Result<()> {
        self.presigned
            .fill(count, threads)
            .map_err(|e| Error::invalid("sim", format!("presigning: {e}")))
    }

    /// Precomputed nonces not used yet.
    pub fn presigned_ready(&self) -> usize {
        self.presigned.ready()
    }

    /// Sign bytes 0x000..0x2A0 of `report` in place with the VCEK/VLEK (with a precomputed
    /// nonce while there are any).
    pub fn sign_report(&self, report: &mut [u8]) -> Result<()> {
        if report.len() != crate::snp::report::REPORT_LEN {
            return Err(Error::invalid("sim", "report must be 1184 bytes"));
        }
        let rs: [u8; 96] = match self.presigned.sign(&report[..SIGNED_LEN]) {
            Some(rs) => rs,
            None => self
                .leaf
                .sign(&SystemRandom::new(), &report[..SIGNED_LEN])
                .map_err(|_| sign_err("report"))?
                .as_ref()
                .try_into()
                .map_err(|_| sign_err("report"))?,
        };
        // The report stores r and s little-endian, each in a 72-byte field.
        for i in 0..48 {
            report[offsets::SIGNATURE_R + i] = rs[47 - i];
            report[offsets::SIGNATURE_S + i] = rs[95 - i];
        }
        Ok(())
    }

    /// A signed report as a bundle.
    pub fn bundle(&self, o: &SnpReportOptions) -> Result<Bundle> {
        let mut report = self.report_body(o);
        self.sign_report(&mut report)?;
        Ok(Bundle::Snp {
            report,
            signing_cert: self.leaf_der.clone(),
            signing_key: self.signing_key,
            cert_chain: self.cert_chain_pem().into_bytes(),
            crls: Vec::new(),
        })
    }

    /// Composite evidence of one simulated node ([`crate::binding`]): a bundle per GPU whose
    /// SPDM nonce derives from `nonce`, `node_key` and its index, and an SNP report whose
    /// report data binds nonce, node key and every GPU's evidence in order.
    pub fn composite(
        &self,
        gpus: &[SimGpu],
        nonce: &[u8],
        node_key: &[u8],
    ) -> Result<SimComposite> {
        self.composite_with(gpus, nonce, node_key, &SnpReportOptions::default())
    }

    /// [`SimAmd::composite`] with the report's other fields (measurement, policy, …) from
    /// `options`; its report data is always the binding's.
    pub fn composite_with(
        &self,
        gpus: &[SimGpu],
        nonce: &[u8],
        node_key: &[u8],
        options: &SnpReportOptions,
    ) -> Result<SimComposite> {
        let gpus = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let index = u32::try_from(i).map_err(|_| Error::invalid("gpus", "too many"))?;
                g.bundle(crate::binding::gpu_nonce(nonce, node_key, index), 8)
            })
            .collect::<Result<Vec<_>>>()?;
        let parts: Vec<(&[u8], &[u8])> = gpus.iter().filter_map(nvidia_parts).collect();
        let report_data = crate::binding::report_data(
            nonce,
            node_key,
            &crate::binding::gpu_evidence_digest(&parts),
        );
        let cpu = self.bundle(&SnpReportOptions {
            report_data,
            ..options.clone()
        })?;
        Ok(SimComposite { cpu, gpus })
    }

    /// A CRL signed by the ARK revoking `serials`, valid from `this_update` to `next_update`.
    pub fn crl(&self, serials: &[u64], this_update: i64, next_update: i64) -> Result<Vec<u8>> {
        let revoked: Vec<Vec<u8>> = serials
            .iter()
            .map(|s| w::seq(&[w::small_uint(*s), w::generalized_time(this_update)]))
            .collect();
        let mut parts = vec![
            w::small_uint(1),
            pss_sha384(),
            name(&format!("{SIM_ROOT_CN_PREFIX}ARK-{}", self.product.name())),
            w::generalized_time(this_update),
            w::generalized_time(next_update),
        ];
        if !revoked.is_empty() {
            parts.push(w::seq(&revoked));
        }
        let body = w::seq(&parts);
        let mut s = vec![0u8; self.ark.public_modulus_len()];
        self.ark
            .sign(&sig::RSA_PSS_SHA384, &SystemRandom::new(), &body, &mut s)
            .map_err(|_| sign_err("CRL"))?;
        Ok(w::seq(&[body, pss_sha384(), w::bits(&s)]))
    }

    /// Serial numbers: ARK 1, ASK 2, leaf 3.
    pub const ASK_SERIAL: u64 = 2;
    pub const LEAF_SERIAL: u64 = 3;

    /// An ASK certificate signed by this ARK for a fresh key (a wrong link for tamper tests).
    pub fn foreign_ask_der(&self, now: i64) -> Result<Vec<u8>> {
        let other = RsaKeyPair::generate(KeySize::Rsa2048).map_err(|_| keygen_err("ASK"))?;
        let (nb, na) = window(now);
        self.issue_ask(&other, 9, nb, na)
    }
}

/// A simulated node's composite evidence ([`SimAmd::composite`]).
#[derive(Debug, Clone)]
pub struct SimComposite {
    pub cpu: Bundle,
    pub gpus: Vec<Bundle>,
}

fn nvidia_parts(b: &Bundle) -> Option<(&[u8], &[u8])> {
    match b {
        Bundle::Nvidia {
            report, cert_chain, ..
        } => Some((report.as_slice(), cert_chain.as_slice())),
        _ => None,
    }
}

impl SimComposite {
    /// This evidence as a node's registration carries it (`cgx_protocol::broker`): the SNP
    /// report with its VCEK and chain, and each GPU's SPDM transcript, chain and OCSP answers;
    /// `None` when the CPU part is not SEV-SNP.
    pub fn broker_evidence(
        &self,
    ) -> Option<(
        cgx_protocol::broker::CpuEvidence,
        Vec<cgx_protocol::broker::GpuEvidence>,
    )> {
        let Bundle::Snp {
            report,
            signing_cert,
            cert_chain,
            ..
        } = &self.cpu
        else {
            return None;
        };
        let gpus = self
            .gpus
            .iter()
            .filter_map(|g| match g {
                Bundle::Nvidia {
                    report,
                    cert_chain,
                    ocsp,
                } => Some(cgx_protocol::broker::GpuEvidence::new(
                    report, cert_chain, ocsp,
                )),
                _ => None,
            })
            .collect();
        Some((
            cgx_protocol::broker::CpuEvidence::snp_with_vcek(report, signing_cert, cert_chain),
            gpus,
        ))
    }

    /// The evidence with the GPUs in `order` (indices into [`SimComposite::gpus`]; a test
    /// reorders or drops them to break the binding), for `nonce` and `node_key`.
    pub fn evidence<'a>(
        &'a self,
        order: &[usize],
        nonce: &'a [u8],
        node_key: &'a [u8],
    ) -> crate::binding::CompositeEvidence<'a> {
        crate::binding::CompositeEvidence {
            cpu: self.cpu.evidence(),
            gpus: order
                .iter()
                .filter_map(|&i| self.gpus.get(i).and_then(nvidia_parts))
                .map(|(report, cert_chain)| crate::nvidia::NvidiaEvidence {
                    report,
                    cert_chain,
                    expected_nonce: None,
                    ocsp: &[],
                })
                .collect(),
            nonce,
            node_pubkey: node_key,
        }
    }
}

/// A generated NVIDIA-shaped device chain: root → identity CA → GPU attestation leaf.
#[derive(Debug)]
pub struct SimGpu {
    root: EcdsaKeyPair,
    ca: EcdsaKeyPair,
    leaf: EcdsaKeyPair,
    root_der: Vec<u8>,
    ca_der: Vec<u8>,
    created: i64,
    pub chain_pem: String,
    pub fwid: [u8; 48],
    pub serial: String,
    /// The `good` response, made once: a GPU's OCSP response is fetched once and reused for
    /// days, so verifiers see the same bytes (and cache their check) as they do for real GPUs.
    good: std::sync::OnceLock<Vec<u8>>,
}

/// What the simulated OCSP responder says, and who signs it.
#[derive(Debug, Clone, Copy)]
pub struct SimOcsp {
    pub status: crate::nvidia::ocsp::CertStatus,
    pub this_update: i64,
    pub next_update: Option<i64>,
    pub signer: SimOcspSigner,
}

/// Who signs a simulated OCSP response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimOcspSigner {
    /// The issuer of the certificate asked about (the sim root).
    Issuer,
    /// A responder certificate the root issued, with id-kp-OCSPSigning (`eku: true`) or
    /// without it; included in the response and named by key hash.
    Delegated { eku: bool },
}

/// NVIDIA opaque-data fields the simulator writes, as the real H100 in
/// `vectors/nvidia/h100-trustee-coco` signed them: VBIOS 96.00.74.00.1A, driver 580.95.05,
/// protected PCIe off (0x55), opaque-data version 1 and FEATURE_FLAG 0 (SPT): `cc_mode` `on`.
const SIM_VBIOS: [u8; 8] = [0x00, 0x74, 0x00, 0x96, 0x1A, 0, 0, 0];
const SIM_DRIVER: &[u8] = b"580.95.05\0";
const SIM_PROTECTED_PCIE_STATUS: [u8; 1] = [0x55];
const SIM_OPAQUE_DATA_VERSION: [u8; 2] = [0x01, 0x00];
const SIM_FEATURE_FLAG: [u8; 2] = [0x00, 0x00];
/// The `driver_version` claim of simulated GPUs (reference values for sim nodes name it).
pub const SIM_GPU_DRIVER_VERSION: &str = "580.95.05";
/// The `vbios_version` claim of simulated GPUs.
pub const SIM_GPU_VBIOS_VERSION: &str = "96.00.74.00.1A";

impl SimGpu {
    pub fn generate(now: i64) -> Result<Self> {
        let gen_asn1 = || {
            EcdsaKeyPair::generate(&sig::ECDSA_P384_SHA384_ASN1_SIGNING)
                .map_err(|_| keygen_err("GPU CA"))
        };
        let root = gen_asn1()?;
        let ca = gen_asn1()?;
        let leaf = EcdsaKeyPair::generate(&sig::ECDSA_P384_SHA384_FIXED_SIGNING)
            .map_err(|_| keygen_err("GPU leaf"))?;
        let mut fwid = [0u8; 48];
        aws_lc_rs::rand::fill(&mut fwid).map_err(|_| keygen_err("FWID"))?;
        let mut serial_bytes = [0u8; 20];
        aws_lc_rs::rand::fill(&mut serial_bytes).map_err(|_| keygen_err("serial"))?;
        let serial = hex::encode_upper(serial_bytes);
        let (nb, na) = window(now);
        let root_name = name(&format!("{SIM_ROOT_CN_PREFIX}NVIDIA Device Identity CA"));
        let ca_name = name(&format!("{SIM_ROOT_CN_PREFIX}GH100 Identity"));
        let root_der = sign_tbs(
            &Tbs {
                serial: 1,
                sig_alg: ecdsa_sha384(),
                issuer: root_name.clone(),
                subject: root_name.clone(),
                spki: p384_spki(root.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &[ca_ext()],
            },
            Signer::Ec(&root),
        )?;
        let ca_der = sign_tbs(
            &Tbs {
                serial: 2,
                sig_alg: ecdsa_sha384(),
                issuer: root_name,
                subject: ca_name.clone(),
                spki: p384_spki(ca.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &[ca_ext()],
            },
            Signer::Ec(&root),
        )?;
        // NVIDIA's TcbInfo value: SEQUENCE { INTEGER, SEQUENCE { sha384 OID, OCTET STRING fwid } }.
        let tcb_info = w::seq(&[
            w::small_uint(1),
            w::seq(&[w::oid("2.16.840.1.101.3.4.2.2"), w::octets(&fwid)]),
        ]);
        let leaf_der = sign_tbs(
            &Tbs {
                serial: 3,
                sig_alg: ecdsa_sha384(),
                issuer: ca_name,
                subject: name_with_serial(
                    &format!("{SIM_ROOT_CN_PREFIX}GH100 GSP FMC LF"),
                    &serial,
                ),
                spki: p384_spki(leaf.public_key().as_ref()),
                not_before: nb,
                not_after: na,
                extensions: &[ext("2.23.133.5.4.1", false, tcb_info)],
            },
            Signer::Ec(&ca),
        )?;
        let chain_pem = crate::x509::to_pem("CERTIFICATE", &leaf_der)
            + &crate::x509::to_pem("CERTIFICATE", &ca_der)
            + &crate::x509::to_pem("CERTIFICATE", &root_der);
        Ok(SimGpu {
            root,
            ca,
            leaf,
            root_der,
            ca_der,
            created: now,
            chain_pem,
            fwid,
            serial,
            good: std::sync::OnceLock::new(),
        })
    }

    /// SHA-256 of the sim root's SubjectPublicKeyInfo.
    pub fn root_pin(&self) -> [u8; 32] {
        crate::crypto::sha256(&p384_spki(self.root.public_key().as_ref()))
    }

    /// `request ‖ response` with 64 SHA-384 measurement blocks, signed by the leaf.
    pub fn evidence(&self, nonce: [u8; 32], measurements: &[[u8; 48]]) -> Result<Vec<u8>> {
        let _ = &self.ca;
        let mut out = vec![0x11, 0xE0, 0x01, 0xFF];
        out.extend_from_slice(&nonce);
        out.push(0); // SlotIDParam
        let mut record = Vec::new();
        for (i, m) in measurements.iter().enumerate() {
            let index =
                u8::try_from(i + 1).map_err(|_| Error::invalid("sim", "too many blocks"))?;
            record.extend_from_slice(&[index, 0x01]);
            record.extend_from_slice(&(3u16 + 48).to_le_bytes());
            record.push(0x00); // DMTFSpecMeasurementValueType: immutable ROM / digest
            record.extend_from_slice(&48u16.to_le_bytes());
            record.extend_from_slice(m);
        }
        let count = u8::try_from(measurements.len())
            .map_err(|_| Error::invalid("sim", "too many blocks"))?;
        out.extend_from_slice(&[0x11, 0x60, 0x00, 0x00, count]);
        let rlen = u32::try_from(record.len()).map_err(|_| Error::invalid("sim", "record"))?;
        out.extend_from_slice(&rlen.to_le_bytes()[..3]);
        out.extend_from_slice(&record);
        let mut responder_nonce = [0u8; 32];
        aws_lc_rs::rand::fill(&mut responder_nonce).map_err(|_| keygen_err("nonce"))?;
        out.extend_from_slice(&responder_nonce);
        let mut opaque = Vec::new();
        for (t, v) in [
            (6u16, &SIM_VBIOS[..]),
            (3, SIM_DRIVER),
            (20, &self.fwid[..]),
            (21, &SIM_PROTECTED_PCIE_STATUS[..]),
            (34, &SIM_OPAQUE_DATA_VERSION[..]),
            (36, &SIM_FEATURE_FLAG[..]),
        ] {
            opaque.extend_from_slice(&t.to_le_bytes());
            opaque.extend_from_slice(&(v.len() as u16).to_le_bytes());
            opaque.extend_from_slice(v);
        }
        out.extend_from_slice(&(opaque.len() as u16).to_le_bytes());
        out.extend_from_slice(&opaque);
        let s = self
            .leaf
            .sign(&SystemRandom::new(), &out)
            .map_err(|_| sign_err("SPDM"))?;
        out.extend_from_slice(s.as_ref());
        Ok(out)
    }

    /// The OCSP responder's answer about the identity CA (the one certificate between leaf and
    /// root), signed by the root as NVIDIA's responder signs for its CAs.
    pub fn ocsp_response(&self, o: &SimOcsp) -> Result<Vec<u8>> {
        use crate::nvidia::ocsp::{
            CertId, CertIdHash, ResponderId, ResponseBuilder, SingleResponse,
        };
        let cert_id = CertId::new(&self.ca_der, &self.root_der, CertIdHash::Sha384)?;
        let root = crate::x509::parse_cert(&self.root_der, "sim root")?;
        let single = SingleResponse {
            cert_id,
            status: o.status,
            this_update: o.this_update,
            next_update: o.next_update,
        };
        let delegate;
        let (signer, responder, certs) = match o.signer {
            SimOcspSigner::Issuer => (
                &self.root,
                ResponderId::ByName(root.subject().as_raw().to_vec()),
                Vec::new(),
            ),
            SimOcspSigner::Delegated { eku } => {
                delegate = EcdsaKeyPair::generate(&sig::ECDSA_P384_SHA384_ASN1_SIGNING)
                    .map_err(|_| keygen_err("OCSP responder"))?;
                let (nb, na) = window(o.this_update);
                let extensions = if eku {
                    vec![ext(
                        "2.5.29.37",
                        false,
                        w::seq(&[w::oid("1.3.6.1.5.5.7.3.9")]),
                    )]
                } else {
                    Vec::new()
                };
                let der = sign_tbs(
                    &Tbs {
                        serial: 4,
                        sig_alg: ecdsa_sha384(),
                        issuer: root.subject().as_raw().to_vec(),
                        subject: name(&format!("{SIM_ROOT_CN_PREFIX}NVIDIA OCSP Responder")),
                        spki: p384_spki(delegate.public_key().as_ref()),
                        not_before: nb,
                        not_after: na,
                        extensions: &extensions,
                    },
                    Signer::Ec(&self.root),
                )?;
                let key_hash = crate::crypto::CryptoProvider::digest(
                    &crate::crypto::DEFAULT_PROVIDER,
                    crate::crypto::DigestAlg::Sha1,
                    &[delegate.public_key().as_ref()],
                );
                (&delegate, ResponderId::ByKey(key_hash), vec![der])
            }
        };
        ResponseBuilder {
            responder,
            produced_at: o.this_update,
            responses: std::slice::from_ref(&single),
            certs: &certs,
            nonce: None,
        }
        .build(|tbs| {
            let s = signer
                .sign(&SystemRandom::new(), tbs)
                .map_err(|_| sign_err("OCSP response"))?;
            Ok((ecdsa_sha384(), s.as_ref().to_vec()))
        })
    }

    /// A `good` response valid from a day before generation for 30 days (the same bytes on
    /// every call, as a device's cached response is).
    pub fn good_ocsp(&self) -> Result<Vec<u8>> {
        if let Some(r) = self.good.get() {
            return Ok(r.clone());
        }
        let r = self.ocsp_response(&SimOcsp {
            status: crate::nvidia::ocsp::CertStatus::Good,
            this_update: self.created - 86_400,
            next_update: Some(self.created + 30 * 86_400),
            signer: SimOcspSigner::Issuer,
        })?;
        Ok(self.good.get_or_init(|| r).clone())
    }

    /// Evidence as a bundle, with `count` deterministic measurements.
    pub fn bundle(&self, nonce: [u8; 32], count: usize) -> Result<Bundle> {
        let measurements: Vec<[u8; 48]> = (0..count)
            .map(|i| {
                let d = crate::crypto::sha256(format!("cgx-sim measurement {i}").as_bytes());
                let mut m = [0u8; 48];
                m[..32].copy_from_slice(&d);
                m
            })
            .collect();
        Ok(Bundle::Nvidia {
            report: self.evidence(nonce, &measurements)?,
            cert_chain: self.chain_pem.clone().into_bytes(),
            ocsp: vec![self.good_ocsp()?],
        })
    }
}

/// Default TCB of simulated platforms.
pub fn default_tcb(product: Product) -> TcbVersion {
    TcbVersion {
        fmc: (product == Product::Turin).then_some(1),
        bootloader: 9,
        tee: 0,
        snp: 23,
        microcode: 72,
    }
}

/// Random bytes from the system generator (chip ids and nonces of simulated platforms).
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    aws_lc_rs::rand::fill(buf).map_err(|_| keygen_err("random"))
}

/// The presigning store for a VCEK (`SimAmd::presign`): it signs with the key's scalar.
fn presigned_for(leaf: &EcdsaKeyPair) -> Result<presign::Presigned> {
    let d: EcPrivateKeyBin<'static> = leaf
        .private_key()
        .as_be_bytes()
        .map_err(|_| keygen_err("VCEK"))?;
    Ok(presign::Presigned::new(
        d.as_ref()
            .try_into()
            .map_err(|_| keygen_err("VCEK scalar"))?,
    ))
}

/// A simulated machine's keys and certificates as bytes: the simulated hardware outlives the
/// process that made it (a host's launcher makes the machine and publishes its collateral, the
/// guest agent it boots loads it), as a real chip's keys outlive every VM.
mod saved {
    use super::*;
    use aws_lc_rs::encoding::AsDer;
    use serde::{Deserialize, Serialize};

    fn b(x: &[u8]) -> String {
        hex::encode(x)
    }

    fn unb(what: &str, x: &str) -> Result<Vec<u8>> {
        hex::decode(x).map_err(|_| Error::invalid("sim machine", format!("{what} is not hex")))
    }

    fn rsa_pk8(k: &RsaKeyPair, what: &str) -> Result<String> {
        let der: aws_lc_rs::encoding::Pkcs8V1Der<'static> =
            k.as_der().map_err(|_| keygen_err(what))?;
        Ok(b(der.as_ref()))
    }

    fn ec_pk8(k: &EcdsaKeyPair, what: &str) -> Result<String> {
        Ok(b(k.to_pkcs8v1().map_err(|_| keygen_err(what))?.as_ref()))
    }

    fn rsa(what: &str, x: &str) -> Result<RsaKeyPair> {
        RsaKeyPair::from_pkcs8(&unb(what, x)?)
            .map_err(|_| Error::invalid("sim machine", format!("{what} is not an RSA key")))
    }

    fn ec(alg: &'static sig::EcdsaSigningAlgorithm, what: &str, x: &str) -> Result<EcdsaKeyPair> {
        EcdsaKeyPair::from_pkcs8(alg, &unb(what, x)?)
            .map_err(|_| Error::invalid("sim machine", format!("{what} is not a P-384 key")))
    }

    /// [`SimAmd`] as saved.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SavedAmd {
        product: Product,
        signing_key: SigningKey,
        tcb: TcbVersion,
        chip_id: String,
        ark: String,
        ask: String,
        leaf: String,
        ark_der: String,
        ask_der: String,
        leaf_der: String,
    }

    /// [`SimGpu`] as saved.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SavedGpu {
        root: String,
        ca: String,
        leaf: String,
        root_der: String,
        ca_der: String,
        created: i64,
        chain_pem: String,
        fwid: String,
        serial: String,
    }

    impl SimAmd {
        /// This AMD-SP's keys and certificates, to [`SimAmd::load`] elsewhere.
        pub fn save(&self) -> Result<SavedAmd> {
            Ok(SavedAmd {
                product: self.product,
                signing_key: self.signing_key,
                tcb: self.tcb,
                chip_id: b(&self.chip_id),
                ark: rsa_pk8(&self.ark, "ARK")?,
                ask: rsa_pk8(&self.ask, "ASK")?,
                leaf: ec_pk8(&self.leaf, "VCEK")?,
                ark_der: b(&self.ark_der),
                ask_der: b(&self.ask_der),
                leaf_der: b(&self.leaf_der),
            })
        }

        /// The AMD-SP [`SimAmd::save`] saved.
        pub fn load(s: &SavedAmd) -> Result<SimAmd> {
            let leaf = ec(&sig::ECDSA_P384_SHA384_FIXED_SIGNING, "VCEK", &s.leaf)?;
            let presigned = presigned_for(&leaf)?;
            Ok(SimAmd {
                product: s.product,
                signing_key: s.signing_key,
                ark: rsa("ARK", &s.ark)?,
                ask: rsa("ASK", &s.ask)?,
                leaf,
                ark_der: unb("ARK certificate", &s.ark_der)?,
                ask_der: unb("ASK certificate", &s.ask_der)?,
                leaf_der: unb("VCEK certificate", &s.leaf_der)?,
                tcb: s.tcb,
                chip_id: unb("chip id", &s.chip_id)?
                    .try_into()
                    .map_err(|_| Error::invalid("sim machine", "chip id is not 64 bytes"))?,
                presigned,
            })
        }
    }

    impl SimGpu {
        /// This GPU's keys and certificates, to [`SimGpu::load`] elsewhere.
        pub fn save(&self) -> Result<SavedGpu> {
            Ok(SavedGpu {
                root: ec_pk8(&self.root, "GPU root")?,
                ca: ec_pk8(&self.ca, "GPU CA")?,
                leaf: ec_pk8(&self.leaf, "GPU leaf")?,
                root_der: b(&self.root_der),
                ca_der: b(&self.ca_der),
                created: self.created,
                chain_pem: self.chain_pem.clone(),
                fwid: b(&self.fwid),
                serial: self.serial.clone(),
            })
        }

        /// The GPU [`SimGpu::save`] saved.
        pub fn load(s: &SavedGpu) -> Result<SimGpu> {
            let asn1 = &sig::ECDSA_P384_SHA384_ASN1_SIGNING;
            Ok(SimGpu {
                root: ec(asn1, "GPU root", &s.root)?,
                ca: ec(asn1, "GPU CA", &s.ca)?,
                leaf: ec(&sig::ECDSA_P384_SHA384_FIXED_SIGNING, "GPU leaf", &s.leaf)?,
                root_der: unb("GPU root certificate", &s.root_der)?,
                ca_der: unb("GPU CA certificate", &s.ca_der)?,
                created: s.created,
                chain_pem: s.chain_pem.clone(),
                fwid: unb("FWID", &s.fwid)?
                    .try_into()
                    .map_err(|_| Error::invalid("sim machine", "FWID is not 48 bytes"))?,
                serial: s.serial.clone(),
                good: std::sync::OnceLock::new(),
            })
        }
    }
}

pub use saved::{SavedAmd, SavedGpu};
