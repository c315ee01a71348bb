//! A RIM: XML parsing, exclusive canonicalization, XML-DSig verification.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::rim(data));
