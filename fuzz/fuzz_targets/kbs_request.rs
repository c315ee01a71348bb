//! Every KBS request body and bearer credential; the first byte picks which.
#![no_main]

use cgx_kbs::server::fuzz;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => fuzz::auth_body(body),
        1 => fuzz::attest_body(body),
        2 => fuzz::admin_body(body),
        _ => fuzz::credential(body),
    }
});
