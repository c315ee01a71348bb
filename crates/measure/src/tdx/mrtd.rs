//! MRTD: the SHA-384 the TDX module accumulates while the VMM builds the TD (Intel TDX Module
//! ABI spec, `TDH.MEM.PAGE.ADD` and `TDH.MR.EXTEND`; TDX Module base architecture spec §12.1
//! "TD Measurement").
//!
//! The module hashes one 128-byte buffer per operation into one running SHA-384, finalised at
//! `TDH.MR.FINALIZE`:
//! - `TDH.MEM.PAGE.ADD`: `"MEM.PAGE.ADD"` zero-padded to 16 bytes, the page's GPA (u64 LE),
//!   zeros to 128 bytes;
//! - `TDH.MR.EXTEND` (one 256-byte chunk): `"MR.EXTEND"` zero-padded to 16 bytes, the chunk's GPA
//!   (u64 LE), zeros to 128 bytes; then the chunk's 256 bytes.
//!
//! The VMM adds each section's pages in the TDVF's order and, for sections marked
//! [`MR_EXTEND`](super::tdvf::ATTRIBUTE_MR_EXTEND), extends with each page's sixteen chunks.
//! Linux's KVM (`KVM_TDX_INIT_MEM_REGION`, 6.16 and the QEMU ≥ 9 stacks built on it) extends
//! each page right after adding it; the QEMU 8 / early-kernel stacks added a whole section's
//! pages first and then extended them ([`PageOrder`]).

use super::tdvf::{Section, Tdvf};
use crate::ovmf::PAGE;

/// `TDH.MR.EXTEND`'s granularity.
const CHUNK: usize = 256;

/// The order in which the VMM adds and extends a section's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageOrder {
    /// Each page added, then extended (upstream KVM, QEMU ≥ 9).
    #[default]
    PerPage,
    /// All of a section's pages added, then all extended (QEMU 8 with the TDX preview kernels).
    PerSection,
}

impl std::str::FromStr for PageOrder {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "per-page" => Ok(Self::PerPage),
            "per-section" => Ok(Self::PerSection),
            _ => Err(crate::Error::Parameter(format!(
                "page order '{s}' (per-page or per-section)"
            ))),
        }
    }
}

fn op(tag: &[u8], gpa: u64) -> [u8; 128] {
    let mut b = [0u8; 128];
    b[..tag.len()].copy_from_slice(tag);
    b[16..24].copy_from_slice(&gpa.to_le_bytes());
    b
}

/// The TD's MRTD.
pub fn mrtd(tdvf: &Tdvf<'_>, order: PageOrder) -> [u8; 48] {
    let mut h = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA384);
    let zero = [0u8; PAGE];
    for s in tdvf.sections() {
        // Content is the image's for firmware volumes, zeros for fresh memory (which parsing
        // refuses to extend, so `zero` is never hashed for it in practice).
        let content = tdvf.content(s);
        let page_of = |p: u64| -> &[u8] {
            let at = (p as usize) * PAGE;
            content.and_then(|c| c.get(at..at + PAGE)).unwrap_or(&zero)
        };
        let add = |h: &mut aws_lc_rs::digest::Context, p: u64| {
            h.update(&op(b"MEM.PAGE.ADD", page_gpa(s, p)));
        };
        let extend = |h: &mut aws_lc_rs::digest::Context, p: u64| {
            if s.extended() {
                for (i, chunk) in page_of(p).chunks_exact(CHUNK).enumerate() {
                    h.update(&op(b"MR.EXTEND", page_gpa(s, p) + (i * CHUNK) as u64));
                    h.update(chunk);
                }
            }
        };
        match order {
            PageOrder::PerPage => {
                for p in 0..s.pages() {
                    add(&mut h, p);
                    extend(&mut h, p);
                }
            }
            PageOrder::PerSection => {
                (0..s.pages()).for_each(|p| add(&mut h, p));
                (0..s.pages()).for_each(|p| extend(&mut h, p));
            }
        }
    }
    let mut out = [0u8; 48];
    out.copy_from_slice(h.finish().as_ref());
    out
}

fn page_gpa(s: &Section, p: u64) -> u64 {
    s.memory_address + p * PAGE as u64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tdx::tdvf::testing::small;

    /// Expected values computed independently of this crate, with Python's hashlib over
    /// [`small`]'s layout (page n of the image filled with byte n):
    /// ```python
    /// import hashlib
    /// def op(tag, gpa): return tag.ljust(16, b"\0") + gpa.to_bytes(8, "little") + bytes(104)
    /// secs = [(0x2000, 0xffffb000, 6, True), (0x0000, 0xffff7000, 2, True),
    ///         (None, 0x809000, 1, False), (None, 0x80a000, 2, False)]
    /// def mrtd(per_page):
    ///     h = hashlib.sha384()
    ///     for off, gpa, n, ext in secs:
    ///         adds = [op(b"MEM.PAGE.ADD", gpa + p * 4096) for p in range(n)]
    ///         exts = [b"".join(op(b"MR.EXTEND", gpa + p * 4096 + c * 256)
    ///                 + bytes([(off // 4096) + p]) * 256 for c in range(16))
    ///                 if ext else b"" for p in range(n)]
    ///         parts = [a + e for a, e in zip(adds, exts)] if per_page else adds + exts
    ///         for x in parts: h.update(x)
    ///     return h.hexdigest()
    /// ```
    #[test]
    fn mrtd_matches_an_independent_computation() {
        let img = small();
        let t = Tdvf::parse(&img).unwrap();
        assert_eq!(
            hex::encode(mrtd(&t, PageOrder::PerPage)),
            "2c06e32d145be6f5e9c6a124806b04cb12d894419c279eef8cebaaf3a4b02b696ab6bbb8264591af53089d3e92df7643"
        );
        assert_eq!(
            hex::encode(mrtd(&t, PageOrder::PerSection)),
            "82722f2a0eae6b747361306aef9953311a65e6b36ccf26402c94006815e5dd61c7e6a048413048bf1a805659c0ea239a"
        );
    }
}
