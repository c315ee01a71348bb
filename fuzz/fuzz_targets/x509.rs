//! Certificates (DER or PEM) and a CRL checked against them.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::x509(data));
