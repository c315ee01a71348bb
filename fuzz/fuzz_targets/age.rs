//! An age file (header, stanzas, MAC, STREAM payload) opened with a fixed identity; the seeds
//! are encrypted to it, so mutations reach the payload. Also the identity and recipient parsers.
#![no_main]

use std::sync::OnceLock;

/// A throwaway X25519 identity for fuzzing only; `seeds` encrypts to its recipient.
const FUZZ_IDENTITY: &str = include_str!("age_identity.txt");

fn identity() -> Option<&'static cgx_age::Identity> {
    static I: OnceLock<Option<cgx_age::Identity>> = OnceLock::new();
    I.get_or_init(|| cgx_age::Identity::parse(FUZZ_IDENTITY.trim()).ok())
        .as_ref()
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some(id) = identity() {
        let mut out = Vec::new();
        let _ = cgx_age::decrypt(
            id,
            &mut &data[..],
            data.len() as u64,
            &mut out,
            1,
            &mut |_| {},
        );
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = cgx_age::Identity::parse(text);
        let _ = cgx_age::Recipient::parse(text);
    }
});
