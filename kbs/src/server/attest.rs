//! `/attest`: CoCo evidence → our verifiers → appraisal → an EAR for the session.
//!
//! Evidence shapes (as CoCo's attesters send them):
//! - `snp`: `{"attestation_report": <sev AttestationReport as JSON, or the 1184 bytes in base64
//!   or hex>, "cert_chain": [{"cert_type": "VCEK"|"VLEK"|"ASK"|"ARK"|…, "data": [bytes…] or
//!   base64}]}`; the ASK/ARK (or ASVK/ARK) chain and a missing VCEK come from the collateral
//!   source;
//! - `tdx`: `{"quote": base64, "cc_eventlog": …}`; Intel collateral from the collateral source;
//! - additional evidence (a JSON string): `{"nvidia": {"device_evidence_list": [{"arch",
//!   "uuid", "evidence": hex or base64 SPDM report, "certificate": base64 PEM chain}]}}`
//!   (the inner object alone is accepted too);
//! - `sample` (only with `allow_sample`): `{"svn", "report_data": base64}`, unsigned; it is
//!   appraised as sim evidence, which the default policy refuses.
//!
//! The CPU report data must equal [`crate::binding::cpu_report_data`] and each GPU's SPDM
//! nonce [`crate::binding::nvidia_nonce`] for this session's nonce and TEE key.

use std::sync::{Arc, RwLock};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_attestation::appraisal::{Outcome, PolicyEngine, Tier};
use cgx_attestation::collateral::CollateralKey;
use cgx_attestation::collateral::fetch::CollateralSource;
use cgx_attestation::results::{ResultSigner, Submod, claims_digest_of};
use cgx_attestation::{Evidence, Verifier, nvidia, snp, tdx};
use kbs_types::{Attestation, Tee, TeePubKey};
use serde_json::Value;

use super::error::KbsError;

/// EAR submodule names, as Trustee names them (`cpu0`, then one per device).
pub const CPU_SUBMOD: &str = "cpu0";

/// A successful appraisal of one session's evidence.
#[derive(Debug)]
pub struct Attested {
    pub token: String,
    pub status: Tier,
    /// Violations across parts, described (for refusals that must say why).
    pub violations: Vec<String>,
}

/// Verifier, appraisal policy (replaceable at run time) and result signer.
pub struct Attester {
    verifier: Verifier,
    engine: RwLock<Arc<PolicyEngine>>,
    signer: ResultSigner,
    source: Option<CollateralSource>,
    online: bool,
    allow_sample: bool,
}

impl std::fmt::Debug for Attester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attester")
            .field("allow_sample", &self.allow_sample)
            .finish_non_exhaustive()
    }
}

fn failed(what: impl std::fmt::Display) -> KbsError {
    KbsError::AttestationFailed(what.to_string())
}

fn pem(der: &[u8]) -> String {
    crate::der::pem("CERTIFICATE", der)
}

/// Bytes given as a JSON array of numbers, base64 or hex.
fn bytes_of(v: &Value, what: &str) -> Result<Vec<u8>, KbsError> {
    match v {
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_u64().and_then(|n| u8::try_from(n).ok()))
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| failed(format!("{what}: not a byte array"))),
        Value::String(s) => hex::decode(s)
            .or_else(|_| STANDARD.decode(s))
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(s))
            .map_err(|_| failed(format!("{what}: neither hex nor base64"))),
        _ => Err(failed(format!("{what}: expected bytes"))),
    }
}

/// The raw SNP report from CoCo's `attestation_report` (sev's JSON form or bytes).
fn snp_report_bytes(v: &Value) -> Result<Vec<u8>, KbsError> {
    if v.is_object() {
        use sev::parser::Encoder;
        let r: sev::firmware::guest::AttestationReport = serde_json::from_value(v.clone())
            .map_err(|e| failed(format!("attestation_report: {e}")))?;
        let mut out = Vec::with_capacity(1184);
        r.encode(&mut out, ())
            .map_err(|e| failed(format!("attestation_report: {e}")))?;
        Ok(out)
    } else {
        bytes_of(v, "attestation_report")
    }
}

impl Attester {
    pub fn new(
        verifier: Verifier,
        engine: PolicyEngine,
        signer: ResultSigner,
        source: Option<CollateralSource>,
        online: bool,
        allow_sample: bool,
    ) -> Self {
        Attester {
            verifier,
            engine: RwLock::new(Arc::new(engine)),
            signer,
            source,
            online,
            allow_sample,
        }
    }

    /// Whether attestation may wait on the network (an online collateral source).
    pub fn may_block(&self) -> bool {
        self.online
    }

    pub fn signer(&self) -> &ResultSigner {
        &self.signer
    }

    /// Replace the appraisal policy (admin API, or a change another replica made).
    pub fn set_engine(&self, engine: PolicyEngine) {
        if let Ok(mut e) = self.engine.write() {
            *e = Arc::new(engine);
        }
    }

    fn engine(&self) -> Result<Arc<PolicyEngine>, KbsError> {
        self.engine
            .read()
            .map(|e| e.clone())
            .map_err(|_| KbsError::Internal("policy lock poisoned".into()))
    }

    fn collateral(&self, key: &CollateralKey, now: i64) -> Option<Vec<u8>> {
        self.source
            .as_ref()
            .and_then(|s| s.get(key, now).ok())
            .map(|f| f.bytes)
    }

    /// Verify and appraise `att` for a session with `nonce`, as of `now`; sign the EAR.
    pub fn attest(
        &self,
        tee: Tee,
        att: &Attestation,
        nonce: &str,
        now: time::OffsetDateTime,
    ) -> Result<Attested, KbsError> {
        if att.runtime_data.nonce != nonce {
            return Err(failed("runtime-data nonce is not this session's challenge"));
        }
        let key = &att.runtime_data.tee_pubkey;
        let additional = att.tee_evidence.additional_evidence.as_str();
        let expected = crate::binding::cpu_report_data(nonce, key, additional);
        let t = now.unix_timestamp();
        let mut parts: Vec<(String, Value)> = Vec::new();
        let cpu = match tee {
            Tee::Snp => self.snp_claims(&att.tee_evidence.primary_evidence, now)?,
            Tee::Tdx => self.tdx_claims(&att.tee_evidence.primary_evidence, t, now)?,
            Tee::Sample if self.allow_sample => sample_claims(&att.tee_evidence.primary_evidence)?,
            other => return Err(KbsError::UnsupportedTee(other.to_string())),
        };
        let report_data = cpu
            .get("report_data")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if report_data != hex::encode(expected) {
            return Err(failed(
                "report_data does not bind this session's nonce, TEE key and additional evidence",
            ));
        }
        if let Some(init) = &att.init_data {
            check_init_data(&init.body, &cpu)?;
        }
        parts.push((CPU_SUBMOD.into(), cpu));
        if !additional.trim().is_empty() {
            let gpu_nonce = crate::binding::nvidia_nonce(nonce, key);
            for (i, claims) in self
                .gpu_claims(additional, &gpu_nonce, t, now)?
                .into_iter()
                .enumerate()
            {
                parts.push((format!("gpu{i}"), claims));
            }
        }
        self.appraise(&parts, nonce, key, t)
    }

    fn appraise(
        &self,
        parts: &[(String, Value)],
        nonce: &str,
        key: &TeePubKey,
        issued_at: i64,
    ) -> Result<Attested, KbsError> {
        let engine = self.engine()?;
        let outcomes: Vec<Outcome> = parts
            .iter()
            .map(|(_, c)| engine.evaluate_json(c))
            .collect::<Result<_, _>>()
            .map_err(|e| KbsError::Internal(format!("appraisal policy: {e}")))?;
        let submods: Vec<Submod<'_>> = parts
            .iter()
            .zip(&outcomes)
            .map(|((name, json), outcome)| Submod {
                name,
                kind: json
                    .get("kind")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown"),
                sim: json.get("sim").and_then(Value::as_bool).unwrap_or(true),
                claims_sha256: claims_digest_of(json),
                outcome,
            })
            .collect();
        let node_key = crate::jcs::canonical(
            &serde_json::to_value(key).map_err(|e| KbsError::Internal(e.to_string()))?,
        );
        let ear = self
            .signer
            .build(
                &submods,
                engine.id(),
                Some(nonce.as_bytes()),
                Some(node_key.as_bytes()),
                issued_at,
            )
            .map_err(|e| KbsError::Internal(e.to_string()))?;
        let token = self
            .signer
            .sign(&ear)
            .map_err(|e| KbsError::Internal(e.to_string()))?;
        let status = outcomes
            .iter()
            .map(|o| o.status)
            .max()
            .unwrap_or(Tier::None);
        let violations = parts
            .iter()
            .zip(&outcomes)
            .flat_map(|((name, _), o)| {
                o.violations
                    .iter()
                    .map(move |v| format!("{name}: {}", v.describe()))
            })
            .collect();
        Ok(Attested {
            token,
            status,
            violations,
        })
    }

    fn verified_json(
        &self,
        ev: &Evidence<'_>,
        now: time::OffsetDateTime,
    ) -> Result<Value, KbsError> {
        let claims = self
            .verifier
            .verify(ev, now)
            .map_err(|e| failed(format!("{} ({})", e, e.code())))?
            .into_claims();
        serde_json::to_value(&claims).map_err(|e| KbsError::Internal(e.to_string()))
    }

    fn snp_claims(&self, primary: &Value, now: time::OffsetDateTime) -> Result<Value, KbsError> {
        let t = now.unix_timestamp();
        let report = snp_report_bytes(
            primary
                .get("attestation_report")
                .ok_or_else(|| failed("snp evidence has no attestation_report"))?,
        )?;
        let parsed = snp::AttestationReport::parse(&report).map_err(|e| failed(e.to_string()))?;
        let mut signing: Option<(Vec<u8>, snp::SigningKey)> = None;
        let (mut ask, mut ark) = (None, None);
        if let Some(entries) = primary.get("cert_chain").and_then(Value::as_array) {
            for e in entries {
                let kind = e.get("cert_type").and_then(Value::as_str).unwrap_or("");
                let data = bytes_of(e.get("data").unwrap_or(&Value::Null), "cert_chain data")?;
                match kind.to_ascii_uppercase().as_str() {
                    "VCEK" => signing = Some((data, snp::SigningKey::Vcek)),
                    "VLEK" => signing = Some((data, snp::SigningKey::Vlek)),
                    "ASK" | "ASVK" => ask = Some(data),
                    "ARK" => ark = Some(data),
                    _ => {}
                }
            }
        }
        let product = parsed.cpuid_product();
        let (cert, kind) = match signing {
            Some(s) => s,
            None => {
                let key = CollateralKey::vcek_for(&parsed).ok_or_else(|| {
                    failed("no VCEK in cert_chain and the report names no product")
                })?;
                let vcek = self
                    .collateral(&key, t)
                    .ok_or_else(|| failed("no VCEK in cert_chain or in the collateral store"))?;
                (vcek, snp::SigningKey::Vcek)
            }
        };
        let chain = match (ask, ark) {
            (Some(ask), Some(ark)) => pem(&ask) + &pem(&ark),
            _ => {
                let product = product.ok_or_else(|| {
                    failed("no ASK/ARK in cert_chain and the report names no product")
                })?;
                let bytes = self
                    .collateral(
                        &CollateralKey::AmdCertChain {
                            product,
                            vlek: kind == snp::SigningKey::Vlek,
                        },
                        t,
                    )
                    .ok_or_else(|| failed("no ASK/ARK in cert_chain or in the collateral store"))?;
                String::from_utf8_lossy(&bytes).into_owned()
            }
        };
        let crls: Vec<Vec<u8>> = product
            .and_then(|product| {
                self.collateral(
                    &CollateralKey::AmdCrl {
                        product,
                        vlek: kind == snp::SigningKey::Vlek,
                    },
                    t,
                )
            })
            .into_iter()
            .collect();
        self.verified_json(
            &Evidence::Snp(snp::SnpEvidence {
                report: &report,
                signing_cert: &cert,
                signing_cert_kind: Some(kind),
                cert_chain: chain.as_bytes(),
                crls: &crls,
            }),
            now,
        )
    }

    fn tdx_claims(
        &self,
        primary: &Value,
        t: i64,
        now: time::OffsetDateTime,
    ) -> Result<Value, KbsError> {
        let quote = bytes_of(
            primary
                .get("quote")
                .ok_or_else(|| failed("tdx evidence has no quote"))?,
            "quote",
        )?;
        let (fmspc, ca) = tdx::collateral_ids(&quote).map_err(|e| failed(e.to_string()))?;
        let source = self
            .source
            .as_ref()
            .ok_or_else(|| failed("no collateral source configured for TDX"))?;
        let collateral = source
            .tdx_collateral(fmspc, ca, t)
            .map_err(|e| failed(format!("Intel collateral: {e}")))?;
        self.verified_json(
            &Evidence::Tdx(tdx::TdxEvidence {
                quote: &quote,
                collateral_json: &collateral,
            }),
            now,
        )
    }

    fn gpu_claims(
        &self,
        additional: &str,
        gpu_nonce: &[u8; 32],
        t: i64,
        now: time::OffsetDateTime,
    ) -> Result<Vec<Value>, KbsError> {
        let v: Value = serde_json::from_str(additional)
            .map_err(|e| failed(format!("additional-evidence is not JSON: {e}")))?;
        let nv = v.get("nvidia").unwrap_or(&v);
        let list = nv
            .get("device_evidence_list")
            .and_then(Value::as_array)
            .ok_or_else(|| failed("additional-evidence holds no nvidia device_evidence_list"))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, d) in list.iter().enumerate() {
            let report = bytes_of(d.get("evidence").unwrap_or(&Value::Null), "GPU evidence")?;
            let chain = d
                .get("certificate")
                .and_then(Value::as_str)
                .and_then(|s| STANDARD.decode(s).ok())
                .ok_or_else(|| failed(format!("GPU {i}: certificate is not base64")))?;
            let ocsp: Vec<Vec<u8>> = match &self.source {
                Some(_) => nvidia::ocsp::chain_cert_ids(&chain)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|cert_id| self.collateral(&CollateralKey::NvidiaOcsp { cert_id }, t))
                    .collect::<Option<Vec<_>>>()
                    .unwrap_or_default(),
                None => Vec::new(),
            };
            let claims = self
                .verified_json(
                    &Evidence::Nvidia(nvidia::NvidiaEvidence {
                        report: &report,
                        cert_chain: &chain,
                        expected_nonce: Some(gpu_nonce),
                        ocsp: &ocsp,
                    }),
                    now,
                )
                .map_err(|e| failed(format!("GPU {i}: {e}")))?;
            out.push(claims);
        }
        Ok(out)
    }
}

/// CoCo init-data: its digest (the algorithm its TOML names: sha256, sha384 or sha512; sha256
/// when unnamed) must be what the TEE measured at launch — SNP HOST_DATA (32 bytes), TDX
/// MRCONFIGID (48 bytes) — truncated or zero-padded to that field, as Trustee compares it.
pub fn check_init_data(body: &str, cpu: &Value) -> Result<(), KbsError> {
    let algorithm = body
        .lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "algorithm")
        .map(|(_, v)| v.trim().trim_matches(['"', '\'']).to_ascii_lowercase())
        .unwrap_or_else(|| "sha256".into());
    let alg = match algorithm.as_str() {
        "sha256" => &aws_lc_rs::digest::SHA256,
        "sha384" => &aws_lc_rs::digest::SHA384,
        "sha512" => &aws_lc_rs::digest::SHA512,
        other => return Err(failed(format!("init-data digest algorithm {other}"))),
    };
    let digest = aws_lc_rs::digest::digest(alg, body.as_bytes());
    let (field, size) = match cpu.get("kind").and_then(Value::as_str) {
        Some("snp") => ("host_data", 32),
        Some("tdx") => ("mr_config_id", 48),
        other => {
            return Err(failed(format!(
                "init-data cannot be bound to {} evidence",
                other.unwrap_or("this")
            )));
        }
    };
    let mut expected = digest.as_ref().to_vec();
    expected.resize(size, 0);
    let measured = cpu.get(field).and_then(Value::as_str).unwrap_or_default();
    if measured != hex::encode(&expected) {
        return Err(failed(format!(
            "init-data ({algorithm}) does not match the launch-time {field}"
        )));
    }
    Ok(())
}

/// CoCo's unsigned sample evidence as claims: marked `sim` (nothing vouches for it).
fn sample_claims(primary: &Value) -> Result<Value, KbsError> {
    let rd = bytes_of(
        primary
            .get("report_data")
            .ok_or_else(|| failed("sample evidence has no report_data"))?,
        "report_data",
    )?;
    let mut padded = rd.clone();
    padded.resize(64, 0);
    Ok(serde_json::json!({
        "schema": cgx_attestation::claims::CLAIMS_SCHEMA,
        "kind": "sample",
        "sim": true,
        "debug": true,
        "svn": primary.get("svn").cloned().unwrap_or(Value::Null),
        "report_data": hex::encode(padded),
    }))
}
