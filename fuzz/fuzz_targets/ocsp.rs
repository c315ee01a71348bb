//! An OCSP response, matched to a certificate and its issuer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::ocsp(data));
