//! Keys derived from the key-encryption key (HKDF-SHA-256, salt `cgx-kbs`, one `info` per use),
//! so replicas agree on them without storing another secret.

use aws_lc_rs::hmac;

/// The HMAC-SHA-256 key for `info` (session ids, policy rows, version marks).
pub(crate) fn mac_key(kek: &[u8; 32], info: &[u8]) -> hmac::Key {
    struct Len;
    impl aws_lc_rs::hkdf::KeyType for Len {
        fn len(&self) -> usize {
            32
        }
    }
    let mut k = [0u8; 32];
    let prk = aws_lc_rs::hkdf::Salt::new(aws_lc_rs::hkdf::HKDF_SHA256, b"cgx-kbs").extract(kek);
    if let Ok(okm) = prk.expand(&[info], Len) {
        let _ = okm.fill(&mut k);
    }
    hmac::Key::new(hmac::HMAC_SHA256, &k)
}
