//! `cgx up`: the whole path on embedded defaults, no hardware needed — simulated SNP and GPU
//! evidence verified as real evidence is, then a job's weights key released from a loopback KBS
//! (the development network's) into the simulated VM only with its lease.

use std::process::ExitCode;

use cgx_age::Identity;
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_kbs::client::KbsClient;
use time::OffsetDateTime;

use crate::output::{CliResult, summary};
use crate::sim::aws_lc_rs_fill;

fn now() -> i64 {
    OffsetDateTime::now_utc().unix_timestamp()
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
    up_release(&node)?;
    println!("ok: key released only into the attested VM, only with its lease");
    Ok(ExitCode::SUCCESS)
}

/// `cgx up`, KBS part: a job's weights key released into the simulated VM only with a lease
/// for its key, and the weights decrypted with it.
fn up_release(node: &cgx_kbs::sim::SimNode) -> Result<(), String> {
    let setup = cgx_devnet::setup(&[node], None).map_err(|e| e.to_string())?;
    let result = (|| {
        let local = cgx_devnet::Server::start(&setup.config).map_err(|e| e.to_string())?;
        let id = Identity::generate().map_err(|e| e.to_string())?;
        let path = "acme/weights/llama";
        local
            .put_resource(&setup.admin, path, id.to_secret_string().as_bytes(), true)
            .map_err(|e| e.to_string())?;
        let weights: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut file = Vec::new();
        cgx_age::encrypt(
            &id.recipient().map_err(|e| e.to_string())?,
            &mut &weights[..],
            weights.len() as u64,
            &mut file,
            0,
            &mut |_| {},
        )
        .map_err(|e| e.to_string())?;
        println!(
            "[kbs] {} up; weights identity stored at {path} (job resource: lease required); 4 MiB of weights age-encrypted to it",
            local.base
        );
        let mut c = KbsClient::with_new_key(&local.base, None).map_err(|e| e.to_string())?;
        c.attest(node).map_err(|e| e.to_string())?;
        println!(
            "[kbs] attested: SNP report + {} GPU report(s) bound to the KBS nonce and TEE key; EAR issued",
            node.gpus.len()
        );
        match c.resource(path, None) {
            Err(e) => println!("[kbs] without a lease: refused as it must be: {e}"),
            Ok(_) => return Err("released without a lease".into()),
        }
        let tee = c.tee_key().public().map_err(|e| e.to_string())?;
        let lease = setup
            .broker
            .lease(
                "lease-1",
                &[path],
                &cgx_protocol::kbs::jwe::thumbprint(&tee),
                now() + 600,
            )
            .map_err(|e| e.to_string())?;
        let secret = c.resource(path, Some(&lease)).map_err(|e| e.to_string())?;
        let identity =
            Identity::parse(&String::from_utf8_lossy(&secret)).map_err(|e| e.to_string())?;
        let mut plain = Vec::new();
        cgx_age::decrypt(
            &identity,
            &mut &file[..],
            file.len() as u64,
            &mut plain,
            0,
            &mut |_| {},
        )
        .map_err(|e| e.to_string())?;
        if plain != weights {
            return Err("decrypted weights differ".into());
        }
        println!(
            "[kbs] with the broker's lease for this node's key: identity released as a JWE to the TEE key; weights decrypted and equal"
        );
        local.stop();
        Ok(())
    })();
    setup.cleanup();
    result
}
