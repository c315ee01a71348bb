//! JWE and JWK: the KBS's response as the guest opens it (fixed EC P-256, P-384 and RSA keys),
//! and a requester's TEE public key (JWK) as the KBS reads it, thumbprints it and encrypts to it.
#![no_main]

use std::sync::OnceLock;

use cgx_protocol::kbs::jwe::{self, Curve, TeeKey};
use cgx_protocol::kbs_types::{Response, TeePubKey};

fn keys() -> &'static [TeeKey] {
    static K: OnceLock<Vec<TeeKey>> = OnceLock::new();
    K.get_or_init(|| {
        [
            TeeKey::generate_ec(Curve::P256),
            TeeKey::generate_ec(Curve::P384),
            TeeKey::generate_rsa(),
        ]
        .into_iter()
        .flatten()
        .collect()
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<Response>(data) {
        for k in keys() {
            let _ = k.decrypt(&r);
        }
    }
    if let Ok(pk) = serde_json::from_slice::<TeePubKey>(data) {
        let _ = jwe::thumbprint(&pk);
        let _ = jwe::encrypt(&pk, b"fuzz");
    }
});
