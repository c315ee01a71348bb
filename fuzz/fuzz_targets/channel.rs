//! The host–guest channel as a hostile peer drives it: the frame decoder fed in pieces (a
//! frame that decodes encodes back to the same bytes), and a guest-side mux reading the bytes
//! as its link (frames for streams it never opened, an OPEN it must refuse, a broken framing).
#![no_main]

use cgx_channel::frame::{Decoder, HEADER};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let cut = (split as usize).min(rest.len());
    let mut d = Decoder::new();
    let mut consumed = 0usize;
    for part in [&rest[..cut], &rest[cut..]] {
        d.feed(part);
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    let mut again = Vec::new();
                    f.encode(&mut again).expect("a decoded frame encodes");
                    let len = again.len();
                    assert!(len >= HEADER);
                    assert_eq!(&again[..], &rest[consumed..consumed + len]);
                    consumed += len;
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    // The guest's side of a link that carries these bytes: it must end, and end every stream.
    let mux = cgx_channel::Mux::new(Box::new(std::io::sink()));
    let _ = mux.run(rest, None);
    assert_eq!(mux.streams(), 0);
});
