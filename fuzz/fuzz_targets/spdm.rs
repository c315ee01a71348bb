//! NVIDIA SPDM GET_MEASUREMENTS request ‖ response.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cgx_attestation::fuzz::spdm(data));
