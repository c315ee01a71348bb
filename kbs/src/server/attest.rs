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
//!   appraised as sim evidence, which the default policy refuses unless reference values list
//!   its `svn` (`sample.svn`, as kbs-client's `set-sample-reference-value svn 1` sets it);
//!   additional evidence `{"sampledevice": {"svn", "report_data": base64}}` (kbs-client's
//!   `ENABLE_SAMPLE_DEVICE=1`) is part `gpu0`, of kind `sampledevice`, its report data binding
//!   [`cgx_protocol::kbs::binding::device_report_data`].
//!
//! The CPU report data must equal [`cgx_protocol::kbs::binding::cpu_report_data`] and each GPU's SPDM
//! nonce [`cgx_protocol::kbs::binding::nvidia_nonce`] for this session's nonce and TEE key.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_attestation::collateral::CollateralKey;
use cgx_attestation::collateral::needed::{self, NeedError, Role, SnpCarried};
use std::cell::RefCell;
use std::sync::Arc;

use cgx_attestation::collateral::fetch::{CollateralSource, tdx_collateral_json, tdx_keys};
use cgx_attestation::results::{CPU_PART, gpu_part};
use cgx_attestation::{Evidence, KindClaims, VerifiedClaims, nvidia, sample, snp, tdx};
use cgx_policies::{Appraisal, Appraiser, PolicyEngine};
use cgx_protocol::kbs_types::{Attestation, Tee};
use serde_json::Value;

use super::error::KbsError;

/// Appraiser (verifier, replaceable appraisal policy, result signer) and collateral source.
pub(crate) struct Attester {
    appraiser: Appraiser,
    source: Option<Arc<CollateralSource>>,
    allow_sample: bool,
}

/// One attestation's outcome, and the collateral its lookups did not find in the store (or
/// found due for a refresh): the caller fetches those through the bounded
/// [`super::fetch::FetchGate`] and tries again. Lookups never contact a vendor.
#[derive(Debug)]
pub(crate) struct Attempt {
    pub(crate) outcome: Result<Appraisal, KbsError>,
    pub(crate) missing: Vec<CollateralKey>,
    pub(crate) refresh: Vec<CollateralKey>,
}

/// The store lookups of one attestation.
struct Lookups<'a> {
    source: Option<&'a CollateralSource>,
    now: i64,
    missing: RefCell<Vec<CollateralKey>>,
    refresh: RefCell<Vec<CollateralKey>>,
}

impl Lookups<'_> {
    fn get(&self, key: CollateralKey) -> Option<Vec<u8>> {
        let source = self.source?;
        match source.cached(&key, self.now) {
            Ok(Some(c)) => {
                if c.refresh_due {
                    self.refresh.borrow_mut().push(key);
                }
                Some(c.bytes)
            }
            _ => {
                self.missing.borrow_mut().push(key);
                None
            }
        }
    }
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
    cgx_protocol::kbs::der::pem("CERTIFICATE", der)
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

/// The `report_data` bytes of CoCo sample evidence (`what`: which evidence, for the error).
fn sample_report_data(evidence: &Value, what: &str) -> Result<Vec<u8>, KbsError> {
    let rd = evidence
        .get("report_data")
        .ok_or_else(|| failed(format!("{what} has no report_data")))?;
    bytes_of(rd, "report_data")
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

/// Report data of verified CPU evidence (hex), as the verifier read it.
fn report_data(claims: &VerifiedClaims) -> &str {
    match &claims.claims().detail {
        KindClaims::Snp(s) => &s.report_data,
        KindClaims::Tdx(t) => &t.report_data,
        KindClaims::Sample(s) => &s.report_data,
        KindClaims::Nvidia(_) => "",
    }
}

impl Attester {
    pub(crate) fn new(
        appraiser: Appraiser,
        source: Option<Arc<CollateralSource>>,
        allow_sample: bool,
    ) -> Self {
        Attester {
            appraiser,
            source,
            allow_sample,
        }
    }

    pub(crate) fn signer(&self) -> &cgx_attestation::results::ResultSigner {
        self.appraiser.signer()
    }

    /// Replace the appraisal policy (admin API, or a change another replica made).
    pub(crate) fn set_engine(&self, engine: PolicyEngine) {
        self.appraiser.set_engine(engine);
    }

    /// Verify one part's evidence; a refusal keeps the verifier's code.
    fn verify(
        &self,
        part: &str,
        ev: &Evidence<'_>,
        now: time::OffsetDateTime,
    ) -> Result<VerifiedClaims, KbsError> {
        self.appraiser
            .verifier()
            .verify(ev, now)
            .map_err(|error| KbsError::Verification {
                part: part.to_string(),
                error,
            })
    }

    /// Verify and appraise `att` for a session with `nonce`, as of `now`; sign the EAR. The
    /// EAR's parts are [`CPU_PART`] and `gpu0`, `gpu1`, … as Trustee names them.
    pub(crate) fn attest(
        &self,
        tee: Tee,
        att: &Attestation,
        nonce: &str,
        now: time::OffsetDateTime,
    ) -> Attempt {
        let lk = Lookups {
            source: self.source.as_deref(),
            now: now.unix_timestamp(),
            missing: RefCell::new(Vec::new()),
            refresh: RefCell::new(Vec::new()),
        };
        let outcome = self.attest_with(tee, att, nonce, now, &lk);
        Attempt {
            outcome,
            missing: lk.missing.into_inner(),
            refresh: lk.refresh.into_inner(),
        }
    }

    fn attest_with(
        &self,
        tee: Tee,
        att: &Attestation,
        nonce: &str,
        now: time::OffsetDateTime,
        lk: &Lookups<'_>,
    ) -> Result<Appraisal, KbsError> {
        if att.runtime_data.nonce != nonce {
            return Err(failed("runtime-data nonce is not this session's challenge"));
        }
        let key = &att.runtime_data.tee_pubkey;
        let additional = att.tee_evidence.additional_evidence.as_str();
        let expected = cgx_protocol::kbs::binding::cpu_report_data(nonce, key, additional)
            .map_err(|e| failed(format!("runtime-data has no canonical form: {e}")))?;
        let t = now.unix_timestamp();
        let primary = &att.tee_evidence.primary_evidence;
        let cpu = match tee {
            Tee::Snp => self.snp_claims(primary, now, lk)?,
            Tee::Tdx => self.tdx_claims(primary, now, lk)?,
            Tee::Sample if self.allow_sample => self.sample_claims(primary, now)?,
            other => return Err(KbsError::UnsupportedTee(other.to_string())),
        };
        if report_data(&cpu) != hex::encode(expected) {
            return Err(failed(
                "report_data does not bind this session's nonce, TEE key and additional evidence",
            ));
        }
        if let Some(init) = &att.init_data {
            check_init_data(&init.body, &cpu)?;
        }
        let mut parts = vec![(CPU_PART.to_string(), cpu)];
        if tee == Tee::Sample && self.allow_sample && !additional.trim().is_empty() {
            parts.push((
                gpu_part(0),
                self.sample_device_claims(additional, nonce, key, now)?,
            ));
        } else if !additional.trim().is_empty() {
            let gpu_nonce = cgx_protocol::kbs::binding::nvidia_nonce(nonce, key);
            for (i, claims) in self
                .gpu_claims(additional, &gpu_nonce, now, lk)?
                .into_iter()
                .enumerate()
            {
                parts.push((gpu_part(i), claims));
            }
        }
        let node_key = cgx_protocol::jcs::canonical(
            &serde_json::to_value(key).map_err(|e| KbsError::Internal(e.to_string()))?,
        );
        self.appraiser
            .appraise_verified(parts, t, Some(nonce.as_bytes()), Some(node_key.as_bytes()))
            .map_err(|e| match e {
                cgx_policies::Error::Attestation(error) => KbsError::Verification {
                    part: "result".into(),
                    error,
                },
                other => KbsError::Internal(format!("appraisal: {other}")),
            })
    }

    /// CoCo's unsigned sample evidence (only with `allow_sample`): claims marked `sim`.
    fn sample_claims(
        &self,
        primary: &Value,
        now: time::OffsetDateTime,
    ) -> Result<VerifiedClaims, KbsError> {
        let rd = sample_report_data(primary, "sample evidence")?;
        self.verify(
            CPU_PART,
            &Evidence::Sample(sample::SampleEvidence {
                report_data: &rd,
                svn: primary.get("svn").unwrap_or(&Value::Null),
                device: false,
            }),
            now,
        )
    }

    /// CoCo's sample device evidence (`{"sampledevice": {"svn", "report_data"}}`), bound to
    /// the session as device evidence is.
    fn sample_device_claims(
        &self,
        additional: &str,
        nonce: &str,
        key: &cgx_protocol::kbs_types::TeePubKey,
        now: time::OffsetDateTime,
    ) -> Result<VerifiedClaims, KbsError> {
        let v: Value = serde_json::from_str(additional)
            .map_err(|e| failed(format!("additional-evidence is not JSON: {e}")))?;
        let device = v
            .get("sampledevice")
            .ok_or_else(|| failed("sample additional-evidence holds no sampledevice"))?;
        let rd = sample_report_data(device, "sampledevice evidence")?;
        if rd != cgx_protocol::kbs::binding::device_report_data(nonce, key) {
            return Err(failed(
                "sampledevice report_data does not bind this session's nonce and TEE key",
            ));
        }
        self.verify(
            &gpu_part(0),
            &Evidence::Sample(sample::SampleEvidence {
                report_data: &rd,
                svn: device.get("svn").unwrap_or(&Value::Null),
                device: true,
            }),
            now,
        )
    }

    fn snp_claims(
        &self,
        primary: &Value,
        now: time::OffsetDateTime,
        lk: &Lookups<'_>,
    ) -> Result<VerifiedClaims, KbsError> {
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
        // Not carried: the kind the report says signed it (a VLEK cannot be had from KDS,
        // and is refused at once rather than asked for as a VCEK).
        let kind = match &signing {
            Some((_, k)) => *k,
            None => parsed.signing_key().unwrap_or(snp::SigningKey::Vcek),
        };
        let carried_chain = match (ask, ark) {
            (Some(ask), Some(ark)) => Some(pem(&ask) + &pem(&ark)),
            _ => None,
        };
        let needs = needed::snp(
            &parsed,
            kind,
            SnpCarried {
                signing_cert: signing.is_some(),
                chain: carried_chain.as_deref().map(str::as_bytes),
            },
        )
        .map_err(|e| match e {
            NeedError::NoProduct("VCEK") => {
                failed("no VCEK in cert_chain and the report names no product")
            }
            NeedError::NoProduct(_) => {
                failed("no ASK/ARK in cert_chain and the report names no product")
            }
            other => failed(other.to_string()),
        })?;
        let stored = |role| needed::keys_of(&needs, role).next().cloned();
        let cert = match signing {
            Some((cert, _)) => cert,
            None => stored(Role::SigningCert)
                .and_then(|k| lk.get(k))
                .ok_or_else(|| failed("no VCEK in cert_chain or in the collateral store"))?,
        };
        let chain = match carried_chain {
            Some(c) => c,
            None => {
                let bytes = stored(Role::Chain)
                    .and_then(|k| lk.get(k))
                    .ok_or_else(|| failed("no ASK/ARK in cert_chain or in the collateral store"))?;
                String::from_utf8_lossy(&bytes).into_owned()
            }
        };
        let crl = stored(Role::Revocation).and_then(|k| lk.get(k));
        // Online, the CRL is required: attesting without it would let a revoked VCEK or ASK
        // through whenever the store lacks a current one (the caller fetches it and retries).
        // Offline, the operator's store decides: no CRL there, no revocation check.
        if crl.is_none() && self.source.as_ref().is_some_and(|s| s.is_online()) {
            return Err(failed(
                "the AMD CRL is not in the collateral store: revocation cannot be checked",
            ));
        }
        let crls: Vec<Vec<u8>> = crl.into_iter().collect();
        self.verify(
            CPU_PART,
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
        now: time::OffsetDateTime,
        lk: &Lookups<'_>,
    ) -> Result<VerifiedClaims, KbsError> {
        let quote = bytes_of(
            primary
                .get("quote")
                .ok_or_else(|| failed("tdx evidence has no quote"))?,
            "quote",
        )?;
        let (fmspc, ca) = tdx::collateral_ids(&quote).map_err(|e| failed(e.to_string()))?;
        if self.source.is_none() {
            return Err(failed("no collateral source configured for TDX"));
        }
        // Every item is looked up, so one round of fetching brings all that are missing.
        let [tcb, qe, pck_crl, root_crl] = tdx_keys(fmspc, ca).map(|k| lk.get(k));
        let (Some(tcb), Some(qe), Some(pck_crl), Some(root_crl)) = (tcb, qe, pck_crl, root_crl)
        else {
            return Err(failed(format!(
                "Intel collateral for FMSPC {} is not in the collateral store",
                hex::encode(fmspc)
            )));
        };
        let collateral = tdx_collateral_json(&tcb, &qe, &pck_crl, &root_crl)
            .map_err(|e| failed(format!("Intel collateral: {e}")))?;
        self.verify(
            CPU_PART,
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
        now: time::OffsetDateTime,
        lk: &Lookups<'_>,
    ) -> Result<Vec<VerifiedClaims>, KbsError> {
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
            // OCSP answers for every certificate, or none (revocation then reads "not
            // checked" in the claims, for policy to weigh); each lookup is made, so the missing
            // ones are all fetched at once.
            let ocsp: Vec<Vec<u8>> = match &self.source {
                Some(_) => needed::nvidia_ocsp(&chain)
                    .into_iter()
                    .map(|n| lk.get(n.key))
                    .collect::<Vec<_>>()
                    .into_iter()
                    .collect::<Option<Vec<_>>>()
                    .unwrap_or_default(),
                None => Vec::new(),
            };
            let claims = self.verify(
                &gpu_part(i),
                &Evidence::Nvidia(nvidia::NvidiaEvidence {
                    report: &report,
                    cert_chain: &chain,
                    expected_nonce: Some(gpu_nonce),
                    ocsp: &ocsp,
                }),
                now,
            )?;
            out.push(claims);
        }
        Ok(out)
    }
}

/// CoCo init-data: its digest (the algorithm its TOML names: sha256, sha384 or sha512; sha256
/// when unnamed) must be what the TEE measured at launch — SNP HOST_DATA (32 bytes), TDX
/// MRCONFIGID (48 bytes) — truncated or zero-padded to that field, as Trustee compares it.
pub(crate) fn check_init_data(body: &str, cpu: &VerifiedClaims) -> Result<(), KbsError> {
    let (field, size, measured) = match &cpu.claims().detail {
        KindClaims::Snp(s) => ("host_data", 32, s.host_data.as_str()),
        KindClaims::Tdx(t) => ("mr_config_id", 48, t.mr_config_id.as_str()),
        _ => {
            return Err(failed(format!(
                "init-data cannot be bound to {} evidence",
                cpu.claims().kind.as_str()
            )));
        }
    };
    let (algorithm, expected) =
        cgx_protocol::kbs::binding::init_data_digest(body, size).map_err(failed)?;
    if measured != hex::encode(&expected) {
        return Err(failed(format!(
            "init-data ({algorithm}) does not match the launch-time {field}"
        )));
    }
    Ok(())
}
