//! A TDX quote: decoding, canonical-encoding check, PCK chain and FMSPC.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::tdx_quote(data));
