//! Whole SNP, TDX or NVIDIA evidence, through Verifier::verify (sim roots trusted).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::evidence(data));
