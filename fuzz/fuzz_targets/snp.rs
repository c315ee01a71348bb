//! An SNP attestation report, and the certificate table the guest agent reads from the
//! firmware's auxblob (split on the separator).
#![no_main]

#[allow(dead_code)]
#[path = "../../guest-agent/src/evidence.rs"]
mod evidence;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let f = cgx_attestation::fuzz::fields(data, 2);
    cgx_attestation::fuzz::snp_report(f[0]);
    let _ = evidence::snp_cert_table(f[1]);
});
