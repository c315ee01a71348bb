//! Command implementations: read input, call the library, print.

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::nvidia::rim::{self, RimOptions};
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{Claims, KindClaims, SimTrust, Verifier, VerifierConfig};
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Pretty JSON on stdout.
pub fn print_json(v: &impl serde::Serialize) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// A usage or I/O problem (exit 2), as opposed to a verification refusal (exit 1).
pub type CliResult = Result<ExitCode, String>;

fn parse_at(at: Option<&str>) -> Result<OffsetDateTime, String> {
    match at {
        None => Ok(OffsetDateTime::now_utc()),
        Some(s) => OffsetDateTime::parse(s, &Rfc3339)
            .map_err(|e| format!("--at '{s}' is not an RFC 3339 time: {e}")),
    }
}

fn hex_arg<const N: usize>(s: Option<&str>, name: &str, exact: bool) -> Result<[u8; N], String> {
    let mut out = [0u8; N];
    let Some(s) = s else { return Ok(out) };
    let bytes =
        hex::decode(s.trim_start_matches("0x")).map_err(|e| format!("--{name} is not hex: {e}"))?;
    if bytes.len() > N || (exact && bytes.len() != N) {
        return Err(format!(
            "--{name} must be {}{N} bytes, got {}",
            if exact { "" } else { "at most " },
            bytes.len()
        ));
    }
    out[..bytes.len()].copy_from_slice(&bytes);
    Ok(out)
}

fn summary(c: &Claims) -> String {
    let sim = if c.sim { " [SIMULATED]" } else { "" };
    let debug = if c.debug { " [DEBUG]" } else { "" };
    match &c.detail {
        KindClaims::Snp(s) => format!(
            "SEV-SNP report v{} from {:?} signed by {}{sim}{debug}\n  measurement  {}\n  report_data  {}\n  chip_id      {}\n  reported_tcb bl={} tee={} snp={} ucode={}{}\n  policy       {}",
            s.version,
            s.product,
            s.signing_key.name(),
            s.measurement,
            s.report_data,
            s.chip_id,
            s.reported_tcb.bootloader,
            s.reported_tcb.tee,
            s.reported_tcb.snp,
            s.reported_tcb.microcode,
            s.reported_tcb
                .fmc
                .map(|f| format!(" fmc={f}"))
                .unwrap_or_default(),
            s.policy
        ),
        KindClaims::Tdx(t) => format!(
            "TDX quote v{} ({}) TCB {}{}{sim}{debug}\n  mr_td        {}\n  report_data  {}\n  td_attributes {}\n  rtmr0..3     {}",
            t.quote_version,
            t.body,
            t.tcb_status,
            if t.advisory_ids.is_empty() {
                String::new()
            } else {
                format!(" ({})", t.advisory_ids.join(", "))
            },
            t.mr_td,
            t.report_data,
            t.td_attributes,
            t.rtmr.join("\n               ")
        ),
        KindClaims::Sample(x) => format!(
            "CoCo sample evidence (unsigned){sim}{debug}\n  report_data  {}",
            x.report_data
        ),
        KindClaims::Nvidia(n) => format!(
            "NVIDIA GPU SPDM {} measurements, {} blocks{sim}\n  nonce        {}\n  vbios        {}\n  driver       {}\n  device       {}",
            n.spdm_version,
            n.measurement_count,
            n.nonce,
            n.vbios_version.as_deref().unwrap_or("-"),
            n.driver_version.as_deref().unwrap_or("-"),
            n.device_serial
        ),
    }
}

/// Options of `cgx verify`.
#[derive(Debug)]
pub struct VerifyOptions<'a> {
    pub nonce: Option<&'a str>,
    pub collateral: Option<&'a Path>,
    pub rims: &'a [std::path::PathBuf],
    pub rim_ignore_signer_expiry: bool,
}

pub fn verify(e: &crate::EvidenceArgs, o: &VerifyOptions<'_>) -> CliResult {
    let (dir, at, json_out, trust_sim) = (e.bundle.as_path(), e.at.as_deref(), e.json, e.trust_sim);
    let (rim_files, rim_ignore_expiry) = (o.rims, o.rim_ignore_signer_expiry);
    let nonce = match o.nonce {
        Some(n) => Some(hex_arg::<32>(Some(n), "nonce", true)?),
        None => None,
    };
    let now = parse_at(at)?;
    let verifier = Verifier::new(VerifierConfig {
        sim: if trust_sim {
            SimTrust::Any
        } else {
            SimTrust::Refuse
        },
    });
    let bundle = match o.collateral {
        Some(store) => {
            // Verification reads a prepared store and never goes online (`cgx collateral fetch`
            // is the online step).
            let store = cgx_attestation::collateral::CollateralStore::open(store)
                .map_err(|e| e.to_string())?;
            let src = cgx_attestation::collateral::fetch::CollateralSource::offline(store);
            Bundle::load_with(dir, &src, now.unix_timestamp())
        }
        None => Bundle::load(dir),
    };
    let kind = bundle.as_ref().ok().map(|b| b.kind().as_str());
    let result = bundle.and_then(|b| {
        let mut ev = b.evidence();
        if let Some(n) = &nonce {
            match &mut ev {
                cgx_attestation::Evidence::Nvidia(gpu) => gpu.expected_nonce = Some(n.as_slice()),
                _ => {
                    return Err(cgx_attestation::Error::InvalidField {
                        field: "--nonce",
                        detail:
                            "applies to NVIDIA evidence; CPU evidence binds nonces in report_data"
                                .into(),
                    });
                }
            }
        }
        verifier.verify(&ev, now)
    });
    match result {
        Ok(verified) => {
            let claims = verified.claims();
            let mut comparison = None;
            if !rim_files.is_empty() {
                let KindClaims::Nvidia(gpu) = &claims.detail else {
                    return Err("--rim applies to NVIDIA evidence only".into());
                };
                let opts = RimOptions {
                    ignore_signer_expiry: rim_ignore_expiry,
                };
                let mut rims = Vec::new();
                for f in rim_files {
                    let xml = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
                    match rim::verify(
                        &xml,
                        &cgx_attestation::crypto::DEFAULT_PROVIDER,
                        now.unix_timestamp(),
                        opts,
                    ) {
                        Ok(r) => rims.push(r),
                        Err(e) => return refused(json_out, Some("nvidia"), &e),
                    }
                }
                let refs: Vec<_> = rims.iter().collect();
                comparison =
                    Some(rim::compare(&gpu.measurements, &refs).map_err(|e| e.to_string())?);
            }
            if json_out {
                let mut out = json!({"valid": true, "kind": claims.kind, "claims": claims});
                if let Some(c) = &comparison {
                    out["rim_comparison"] = json!(c);
                }
                print_json(&out)?;
            } else {
                println!("VALID {}", summary(claims));
                if let Some(c) = &comparison {
                    println!(
                        "  RIMs: {} match, {} differ, {} without reference",
                        c.matched.len(),
                        c.mismatched.len(),
                        c.no_reference.len()
                    );
                    for m in &c.mismatched {
                        println!(
                            "    index {} measured {} expected {} ({})",
                            m.index,
                            m.measured.as_deref().unwrap_or("(absent)"),
                            m.expected.join(" | "),
                            m.rim
                        );
                    }
                }
            }
            let rims_ok = comparison.as_ref().is_none_or(|c| c.all_match());
            Ok(if rims_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Err(e) => refused(json_out, kind, &e),
    }
}

/// An error that carries a stable code (the verifier's, or the policy layer's).
trait Coded: std::fmt::Display {
    fn code(&self) -> &'static str;
}

impl Coded for cgx_attestation::Error {
    fn code(&self) -> &'static str {
        cgx_attestation::Error::code(self)
    }
}

impl Coded for cgx_policies::Error {
    fn code(&self) -> &'static str {
        cgx_policies::Error::code(self)
    }
}

fn refused(json_out: bool, kind: Option<&str>, e: &dyn Coded) -> CliResult {
    if json_out {
        let out = json!({
            "valid": false,
            "kind": kind,
            "error": {"code": e.code(), "message": e.to_string()},
        });
        print_json(&out)?;
    } else {
        println!(
            "REFUSED {}: {} ({})",
            kind.unwrap_or("evidence"),
            e,
            e.code()
        );
    }
    Ok(ExitCode::from(1))
}

pub fn sim_snp(
    out: &Path,
    report_data: Option<&str>,
    measurement: Option<&str>,
    product: Product,
    vlek: bool,
    version: u32,
) -> CliResult {
    if ![2, 3, 5].contains(&version) {
        return Err(format!("--version {version}: use 2, 3 or 5"));
    }
    let opts = SnpReportOptions {
        version,
        report_data: hex_arg::<64>(report_data, "report-data", false)?,
        measurement: hex_arg::<48>(measurement, "measurement", true)?,
        ..Default::default()
    };
    let mut chip = [0u8; 64];
    aws_lc_rs_fill(&mut chip)?;
    let key = if vlek {
        SigningKey::Vlek
    } else {
        SigningKey::Vcek
    };
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let sim = SimAmd::generate(product, key, default_tcb(product), chip, now)
        .map_err(|e| e.to_string())?;
    sim.bundle(&opts)
        .and_then(|b| b.write(out))
        .map_err(|e| e.to_string())?;
    println!(
        "wrote simulated {} SNP evidence ({}) to {}\nverify it with: cgx verify {} --trust-sim",
        product.name(),
        key.name(),
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn aws_lc_rs_fill(buf: &mut [u8]) -> Result<(), String> {
    cgx_attestation::sim::fill_random(buf).map_err(|e| e.to_string())
}

pub fn sim_nvidia(out: &Path, nonce: Option<&str>) -> CliResult {
    let nonce = match nonce {
        Some(_) => hex_arg::<32>(nonce, "nonce", true)?,
        None => {
            let mut n = [0u8; 32];
            aws_lc_rs_fill(&mut n)?;
            n
        }
    };
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let gpu = SimGpu::generate(now).map_err(|e| e.to_string())?;
    gpu.bundle(nonce, 64)
        .and_then(|b| b.write(out))
        .map_err(|e| e.to_string())?;
    println!(
        "wrote simulated NVIDIA GPU evidence to {}\nverify it with: cgx verify {} --trust-sim",
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn rim_verify(
    files: &[std::path::PathBuf],
    at: Option<&str>,
    ignore: bool,
    json_out: bool,
) -> CliResult {
    if files.is_empty() {
        return Err("name at least one RIM file".into());
    }
    let now = parse_at(at)?.unix_timestamp();
    let opts = RimOptions {
        ignore_signer_expiry: ignore,
    };
    let mut all_ok = true;
    let mut results = Vec::new();
    for f in files {
        let xml = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let r = rim::verify(&xml, &cgx_attestation::crypto::DEFAULT_PROVIDER, now, opts);
        match &r {
            Ok(v) => {
                if !json_out {
                    println!(
                        "VALID   {} {} {} ({} golden measurements){}",
                        f.display(),
                        v.product,
                        v.version,
                        v.golden.len(),
                        if v.signer_expired {
                            " [signer expired, accepted]"
                        } else {
                            ""
                        }
                    );
                }
                results.push(json!({"file": f.display().to_string(), "valid": true, "rim": v}));
            }
            Err(e) => {
                all_ok = false;
                if !json_out {
                    println!("REFUSED {}: {e} ({})", f.display(), e.code());
                }
                results.push(json!({"file": f.display().to_string(), "valid": false,
                    "error": {"code": e.code(), "message": e.to_string()}}));
            }
        }
    }
    if json_out {
        print_json(&results)?;
    }
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `cgx up`: the whole attestation path on embedded defaults, no hardware needed.
pub fn up() -> CliResult {
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    println!(
        "cgx up: simulated confidential VM with one GPU (evidence is simulated; claims say so)"
    );
    let mut chip = [0u8; 64];
    aws_lc_rs_fill(&mut chip)?;
    let snp = SimAmd::generate(
        Product::Genoa,
        SigningKey::Vcek,
        default_tcb(Product::Genoa),
        chip,
        t,
    )
    .map_err(|e| e.to_string())?;
    let gpu = SimGpu::generate(t).map_err(|e| e.to_string())?;
    let mut nonce = [0u8; 32];
    aws_lc_rs_fill(&mut nonce)?;
    let gpu_bundle = gpu.bundle(nonce, 64).map_err(|e| e.to_string())?;
    let mut report_data = [0u8; 64];
    report_data[..32].copy_from_slice(&nonce);
    let snp_bundle = snp
        .bundle(&SnpReportOptions {
            report_data,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
    let production = Verifier::new(VerifierConfig::default());
    let dev = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![snp.root_pin(), gpu.root_pin()]),
    });
    for (name, b) in [("CPU", &snp_bundle), ("GPU", &gpu_bundle)] {
        match production.verify(&b.evidence(), now) {
            Err(e) => println!(
                "[production trust] {name}: refused as it must be: {} ({})",
                e,
                e.code()
            ),
            Ok(_) => return Err(format!("{name}: sim evidence passed production trust")),
        }
        match dev.verify(&b.evidence(), now) {
            Ok(c) => println!("[sim roots pinned] {name}: VALID {}", summary(c.claims())),
            Err(e) => {
                println!("[sim roots pinned] {name}: REFUSED {e}");
                return Ok(ExitCode::from(1));
            }
        }
    }
    println!("ok: both verified through the same code path real evidence takes");
    let node = cgx_kbs::sim::SimNode {
        amd: snp,
        gpus: vec![gpu],
        measurement: [0x2A; 48],
    };
    crate::kbs::up_release(&node)?;
    println!("ok: key released only into the attested VM, only with its lease");
    Ok(ExitCode::SUCCESS)
}

/// Options of `cgx appraise`.
#[derive(Debug)]
pub struct AppraiseOptions<'a> {
    pub policy: Option<&'a Path>,
    pub reference_values: Option<&'a Path>,
    pub signing_key: Option<&'a Path>,
    pub nonce: Option<&'a str>,
}

fn read_text(p: &Path) -> Result<String, String> {
    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
}

pub fn appraise(e: &crate::EvidenceArgs, o: &AppraiseOptions<'_>) -> CliResult {
    use cgx_attestation::results::{ResultSigner, Tier};
    use cgx_policies::{Appraiser, PolicyEngine};
    let dir = e.bundle.as_path();
    let now = parse_at(e.at.as_deref())?;
    let nonce = match o.nonce {
        Some(n) => Some(hex::decode(n).map_err(|e| format!("--nonce is not hex: {e}"))?),
        None => None,
    };
    let rego = match o.policy {
        Some(p) => read_text(p)?,
        None => cgx_policies::APPRAISAL_POLICY.to_string(),
    };
    let refs = match o.reference_values {
        Some(p) => read_text(p)?,
        None => cgx_policies::DEFAULT_REFERENCE_VALUES.to_string(),
    };
    let engine = PolicyEngine::new("cgx.appraisal", &rego, &refs).map_err(|e| e.to_string())?;
    let signer = match o.signing_key {
        Some(p) => {
            let der = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            ResultSigner::from_pkcs8(&der).map_err(|e| e.to_string())?
        }
        None => ResultSigner::generate().map_err(|e| e.to_string())?,
    };
    let policy_id = engine.id().to_string();
    let appraiser = Appraiser::new(
        Verifier::new(VerifierConfig {
            sim: if e.trust_sim {
                SimTrust::Any
            } else {
                SimTrust::Refuse
            },
        }),
        engine,
        signer,
    );
    let bundle = match Bundle::load(dir) {
        Ok(b) => b,
        Err(err) => return refused(e.json, None, &err),
    };
    let kind = Some(bundle.kind().as_str());
    let issued_at = OffsetDateTime::now_utc().unix_timestamp();
    let appraisal =
        match appraiser.appraise(&bundle.evidence(), now, issued_at, nonce.as_deref(), None) {
            Ok(a) => a,
            Err(err) => return refused(e.json, kind, &err),
        };
    let Some(a) = appraisal.first() else {
        return Err("the appraisal has no part".into());
    };
    // Decode what was signed, through the same verification a relying party does.
    let ear =
        cgx_attestation::results::verify(appraisal.token(), &appraiser.signer().jwk(), issued_at)
            .map_err(|e| e.to_string())?;
    let ear_json = serde_json::to_value(&ear).map_err(|e| e.to_string())?;
    if e.json {
        let out = json!({
            "status": a.outcome.status.as_str(),
            "trust_vector": a.outcome.trust_vector,
            "violations": a.outcome.violations,
            "ear": ear_json,
            "token": appraisal.token(),
            "jwks": appraiser.signer().jwks(),
        });
        print_json(&out)?;
    } else {
        println!(
            "{} {}",
            a.outcome.status.as_str().to_uppercase(),
            summary(&a.claims)
        );
        let tv: Vec<String> = a
            .outcome
            .trust_vector
            .iter()
            .filter(|(_, c)| **c != 0)
            .map(|(k, c)| format!("{k}={c}"))
            .collect();
        println!("  trust vector {}", tv.join(" "));
        for v in &a.outcome.violations {
            println!("  {}", v.describe());
        }
        println!("  policy       {policy_id}");
        println!(
            "  result       EAR, ES256, kid {}, expires in {} s",
            appraiser.signer().kid(),
            appraiser.signer().ttl_secs
        );
    }
    Ok(ExitCode::from(match a.outcome.status {
        Tier::Affirming => 0,
        Tier::Warning | Tier::None => 3,
        Tier::Contraindicated => 4,
    }))
}

pub fn policy_test(dir: &Path) -> CliResult {
    let results = cgx_policies::run_tests(dir).map_err(|e| e.to_string())?;
    let mut failed = 0;
    for r in &results {
        if r.passed {
            println!("PASS {}", r.name);
        } else {
            failed += 1;
            println!("FAIL {}: {}", r.name, r.detail.as_deref().unwrap_or(""));
        }
    }
    println!("{} passed, {} failed", results.len() - failed, failed);
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn store_dir(a: &crate::SourceArgs) -> Result<std::path::PathBuf, String> {
    if let Some(s) = &a.store {
        return Ok(s.clone());
    }
    if let Some(s) = std::env::var_os("CGX_COLLATERAL") {
        return Ok(s.into());
    }
    let home = std::env::var_os("HOME").ok_or("no --store, $CGX_COLLATERAL or $HOME")?;
    Ok(std::path::PathBuf::from(home).join(".cache/cgx/collateral"))
}

fn collateral_source(
    a: &crate::SourceArgs,
) -> Result<cgx_attestation::collateral::fetch::CollateralSource, String> {
    use cgx_attestation::collateral::CollateralStore;
    use cgx_attestation::collateral::fetch::{CollateralSource, Endpoints, FetchPolicy};
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    Ok(CollateralSource::new(
        store,
        Endpoints {
            amd_kds: a.kds.clone(),
            intel_pcs: a.pcs.clone(),
            intel_root_ca_crl: a.intel_root_ca_crl.clone(),
            nvidia_rim: a.rim_service.clone(),
            nvidia_ocsp: a.nvidia_ocsp.clone(),
        },
        FetchPolicy::default(),
    ))
}

pub fn collateral_fetch(
    a: &crate::SourceArgs,
    bundles: &[std::path::PathBuf],
    rim_ids: &[String],
) -> CliResult {
    use cgx_attestation::collateral::CollateralKey;
    if bundles.is_empty() && rim_ids.is_empty() {
        return Err("name bundles or --rim-id".into());
    }
    let src = collateral_source(a)?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut failed = 0;
    for b in bundles {
        match Bundle::load_with(b, &src, now) {
            Ok(Bundle::Nvidia { ocsp, .. }) if ocsp.is_empty() => {
                failed += 1;
                println!(
                    "FAIL {}: OCSP responses for the device chain could not be had",
                    b.display()
                );
            }
            Ok(bundle) => println!(
                "ok   {} ({} collateral in the store)",
                b.display(),
                bundle.kind().as_str()
            ),
            Err(e) => {
                failed += 1;
                println!("FAIL {}: {e}", b.display());
            }
        }
    }
    for id in rim_ids {
        match src.get(&CollateralKey::NvidiaRim { id: id.clone() }, now) {
            Ok(f) => println!("ok   RIM {id} ({:?})", f.origin),
            Err(e) => {
                failed += 1;
                println!("FAIL RIM {id}: {e}");
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn collateral_import(a: &crate::SourceArgs, paths: &[std::path::PathBuf]) -> CliResult {
    use cgx_attestation::collateral::{CollateralKey, CollateralStore};
    let mut store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut n = 0;
    for p in paths {
        let src = format!("import:{}", p.display());
        if p.join("index.json").is_file() {
            n += store.import(p, now).map_err(|e| e.to_string())?;
        } else if p.extension().is_some_and(|x| x == "swidtag" || x == "xml") {
            let xml = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            cgx_attestation::nvidia::c14n::parse(&xml)
                .map_err(|e| format!("{}: {e}", p.display()))?;
            let id = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            store
                .put(&CollateralKey::NvidiaRim { id }.path(), &xml, &src, now)
                .map_err(|e| e.to_string())?;
            n += 1;
        } else {
            let bundle = Bundle::load(p).map_err(|e| e.to_string())?;
            match bundle {
                Bundle::Snp {
                    report,
                    signing_cert,
                    signing_key,
                    cert_chain,
                    crls,
                } => {
                    let r = cgx_attestation::snp::AttestationReport::parse(&report)
                        .map_err(|e| e.to_string())?;
                    let vcek_key = CollateralKey::vcek_for(&r)
                        .ok_or("v2 report: its product is not in the report")?;
                    let CollateralKey::AmdVcek { product, .. } = vcek_key else {
                        return Err("not a VCEK key".into());
                    };
                    let vlek = signing_key == cgx_attestation::snp::SigningKey::Vlek;
                    if !vlek {
                        let der = if signing_cert.first() == Some(&0x30) {
                            signing_cert
                        } else {
                            return Err("import the VCEK as DER".into());
                        };
                        store
                            .put(&vcek_key.path(), &der, &src, now)
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                    store
                        .put(
                            &CollateralKey::AmdCertChain { product, vlek }.path(),
                            &cert_chain,
                            &src,
                            now,
                        )
                        .map_err(|e| e.to_string())?;
                    n += 1;
                    for crl in crls {
                        store
                            .put(
                                &CollateralKey::AmdCrl { product, vlek }.path(),
                                &crl,
                                &src,
                                now,
                            )
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                }
                _ => {
                    return Err(format!(
                        "{}: only SNP bundles, exported stores and RIM files import",
                        p.display()
                    ));
                }
            }
        }
    }
    println!("imported {n} items into {}", store_dir(a)?.display());
    Ok(ExitCode::SUCCESS)
}

pub fn collateral_export(a: &crate::SourceArgs, dir: &Path) -> CliResult {
    use cgx_attestation::collateral::CollateralStore;
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let n = store
        .export(dir, OffsetDateTime::now_utc().unix_timestamp())
        .map_err(|e| e.to_string())?;
    println!("exported {n} items to {}", dir.display());
    Ok(ExitCode::SUCCESS)
}

pub fn collateral_ls(a: &crate::SourceArgs, json_out: bool) -> CliResult {
    use cgx_attestation::collateral::CollateralStore;
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let rows: Vec<serde_json::Value> = store
        .list()
        .map(|(k, e)| {
            json!({"key": k, "freshness": format!("{:?}", e.freshness(now)).to_lowercase(),
            "not_after": e.not_after.map(crate_rfc3339), "source": e.source, "sha256": e.sha256})
        })
        .collect();
    if json_out {
        print_json(&rows)?;
    } else {
        for r in &rows {
            println!(
                "{:<12} {:<22} {}",
                r["freshness"].as_str().unwrap_or(""),
                r["not_after"].as_str().unwrap_or("-"),
                r["key"].as_str().unwrap_or("")
            );
        }
        println!("{} items", rows.len());
    }
    Ok(ExitCode::SUCCESS)
}

fn crate_rfc3339(ts: i64) -> String {
    OffsetDateTime::from_unix_timestamp(ts)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| ts.to_string())
}

/// `cgx bench ARGS…`: run `cgx-bench ARGS…` — the program beside this one, else on `PATH` — as
/// git and cargo run their external subcommands, so the benchmarks' peer crates (`sev`,
/// `dcap-qvl` on ring, ring) stay out of the user's binary while the command, its flags and its
/// JSON stay as they were.
pub fn bench(args: &[String]) -> CliResult {
    let name = format!("cgx-bench{}", std::env::consts::EXE_SUFFIX);
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(&name)))
        .filter(|p| p.is_file());
    let program = beside.unwrap_or_else(|| name.clone().into());
    let mut cmd = std::process::Command::new(&program);
    cmd.args(args);
    let missing = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "cgx bench runs the {name} program, which is neither beside cgx nor on PATH: \
                 build it with `cargo build --release -p cgx-bench`"
            )
        } else {
            format!("{}: {e}", program.display())
        }
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Only returns on failure: on success this process becomes cgx-bench.
        Err(missing(cmd.exec()))
    }
    #[cfg(not(unix))]
    {
        let status = cmd.status().map_err(missing)?;
        Ok(ExitCode::from(
            status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .unwrap_or(1),
        ))
    }
}
