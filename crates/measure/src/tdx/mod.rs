//! Intel TDX launch measurements from a TD's image.
//!
//! - **MRTD** ([`mrtd`]): what the TDX module accumulates while QEMU adds the TDVF's sections —
//!   fully determined by the firmware image (and the VMM's [`PageOrder`]).
//! - **RTMRs**: what the firmware and the kernel's EFI stub extend at run time, event by event
//!   ([`event_log`]). Some events are the image's: the configuration firmware volume (RTMR[0]),
//!   the kernel's Authenticode digest as QEMU hands it over (RTMR[1]), the command line and the
//!   initrd (RTMR[2]); [`Launch::events`] computes those. Others are the platform's — QEMU's TD
//!   HOB and ACPI tables for the machine's memory and vCPUs, the boot variables, whatever the
//!   firmware build adds. [`platform`] computes the TD HOB and takes the rest as files dumped
//!   from a VM of that configuration; or they come from a genuine boot's event log, which
//!   [`check_events`] holds to the image.
//! - [`Launch::rtmr0`]: RTMR[0] for a direct boot, from the image, the memory size and the
//!   platform's files ([`platform`]).
//! - [`Launch::rtmr`] RTMR[1] and RTMR[2] as edk2's OVMF and Linux's EFI stub lay them out for a
//!   direct boot: RTMR[1] = kernel, `"Calling EFI Application from Boot Option"`, separator,
//!   `"Exit Boot Services Invocation"`, `"Exit Boot Services Returned with Success"`; RTMR[2] = the
//!   load options (where there are any) and the initrd (where there is one).

pub mod event_log;
pub mod kernel;
pub mod mrtd;
pub mod pe;
pub mod platform;
pub mod tdvf;

pub use mrtd::{PageOrder, mrtd};
pub use tdvf::Tdvf;

use crate::Result;
use event_log::{
    EV_EFI_BOOT_SERVICES_APPLICATION, EV_EFI_PLATFORM_FIRMWARE_BLOB2, EV_EVENT_TAG, EventLog,
    replay_digests,
};

/// The Linux EFI stub's tagged-event IDs (`drivers/firmware/efi/libstub/efistub.h`).
pub const TAG_INITRD: u32 = 0x8f3b_22ec;
pub const TAG_LOAD_OPTIONS: u32 = 0x8f3b_22ed;

/// A kernel booted directly (QEMU `-kernel`, `-initrd`, `-append`).
#[derive(Debug, Clone, Copy)]
pub struct DirectBoot<'a> {
    pub kernel: &'a [u8],
    pub initrd: Option<&'a [u8]>,
    pub cmdline: Option<&'a str>,
    /// Guest RAM in bytes (QEMU `-m`): where QEMU puts the initrd, which the kernel's header
    /// records, and the TD HOB's memory map.
    pub memory: u64,
    /// What the platform measures into RTMR[0]; with it, [`Launch::rtmr0`] is computed.
    pub platform: Option<&'a platform::Platform<'a>>,
}

/// What an event is, for [`Expected`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The configuration firmware volume (RTMR[0], `EV_EFI_PLATFORM_FIRMWARE_BLOB2`).
    Cfv,
    /// The kernel's Authenticode digest (RTMR[1], `EV_EFI_BOOT_SERVICES_APPLICATION`).
    Kernel,
    /// The kernel's load options, UTF-16 (RTMR[2], `EV_EVENT_TAG` load options).
    LoadOptions,
    /// The initrd (RTMR[2], `EV_EVENT_TAG` initrd).
    Initrd,
}

impl EventKind {
    /// Which RTMR it extends.
    pub fn rtmr(self) -> usize {
        match self {
            Self::Cfv => 0,
            Self::Kernel => 1,
            Self::LoadOptions | Self::Initrd => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Cfv => "configuration firmware volume",
            Self::Kernel => "kernel",
            Self::LoadOptions => "kernel command line",
            Self::Initrd => "initrd",
        }
    }

    /// Whether a logged event is of this kind.
    fn matches(self, e: &event_log::Event) -> bool {
        let tag = || {
            e.data
                .get(..4)
                .map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
        };
        e.rtmr() == Some(self.rtmr())
            && match self {
                Self::Cfv => e.event_type == EV_EFI_PLATFORM_FIRMWARE_BLOB2,
                Self::Kernel => e.event_type == EV_EFI_BOOT_SERVICES_APPLICATION,
                Self::LoadOptions => {
                    e.event_type == EV_EVENT_TAG && tag() == Some(TAG_LOAD_OPTIONS)
                }
                Self::Initrd => e.event_type == EV_EVENT_TAG && tag() == Some(TAG_INITRD),
            }
    }
}

/// An event the image determines, and its digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    pub kind: EventKind,
    pub digest: [u8; 48],
}

/// What the image determines of a TD's measurements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub mrtd: [u8; 48],
    /// The image's events, RTMR by RTMR.
    pub events: Vec<Expected>,
    /// RTMR[1] and RTMR[2] for a direct boot, in edk2's layout.
    pub rtmr: Option<[[u8; 48]; 2]>,
    /// RTMR[0]'s events for a direct boot on a given platform ([`platform::rtmr0`] replays
    /// them).
    pub rtmr0: Option<Vec<platform::Rtmr0Event>>,
}

/// The load options OVMF gives a directly booted kernel (`OvmfPkg/Library/
/// X86QemuLoadImageLib`, `QemuLoadKernelImage`): the command line, `" initrd=initrd"` appended
/// where there is an initrd, UTF-16LE with its terminating NUL. Empty: none at all.
pub fn load_options(cmdline: Option<&str>, initrd: bool) -> Vec<u8> {
    let mut s = cmdline.unwrap_or_default().to_string();
    if initrd {
        s.push_str(" initrd=initrd");
    }
    if s.is_empty() {
        return Vec::new();
    }
    s.encode_utf16()
        .chain(std::iter::once(0))
        .flat_map(u16::to_le_bytes)
        .collect()
}

/// The digest of an `EV_EFI_ACTION` string or a separator.
fn fixed(data: &[u8]) -> [u8; 48] {
    crate::sha384(data)
}

/// Measure a TD launch from its image.
pub fn measure(tdvf: &Tdvf<'_>, order: PageOrder, boot: Option<&DirectBoot<'_>>) -> Result<Launch> {
    let mut events = Vec::new();
    let cfv = tdvf.cfv().map(crate::sha384);
    if let Some(digest) = cfv {
        events.push(Expected {
            kind: EventKind::Cfv,
            digest,
        });
    }
    let mut rtmr = None;
    let mut rtmr0 = None;
    if let Some(b) = boot {
        if let Some(p) = b.platform {
            rtmr0 = Some(platform::rtmr0_events(tdvf, b.memory, p, cfv)?);
        }
        let initrd_len = b.initrd.map_or(0, |i| i.len() as u64);
        let kernel = kernel::qemu_patched(b.kernel, initrd_len, b.memory)?;
        let kernel = pe::authenticode_sha384(&kernel)?;
        events.push(Expected {
            kind: EventKind::Kernel,
            digest: kernel,
        });
        let options = load_options(b.cmdline, b.initrd.is_some());
        let mut rtmr2 = Vec::new();
        if !options.is_empty() {
            rtmr2.push(Expected {
                kind: EventKind::LoadOptions,
                digest: crate::sha384(&options),
            });
        }
        if let Some(i) = b.initrd {
            rtmr2.push(Expected {
                kind: EventKind::Initrd,
                digest: crate::sha384(i),
            });
        }
        let rtmr1 = replay_digests(&[
            kernel,
            fixed(b"Calling EFI Application from Boot Option"),
            fixed(&[0; 4]),
            fixed(b"Exit Boot Services Invocation"),
            fixed(b"Exit Boot Services Returned with Success"),
        ]);
        rtmr = Some([rtmr1, replay_digests(rtmr2.iter().map(|e| &e.digest))]);
        events.extend(rtmr2);
    }
    Ok(Launch {
        mrtd: mrtd(tdvf, order),
        events,
        rtmr,
        rtmr0,
    })
}

/// How a logged boot compares with one of the image's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Every event of that kind carries the image's digest.
    Same,
    /// An event of that kind carries another digest (the first such is given).
    Differs([u8; 48]),
    /// The log has no event of that kind.
    Absent,
}

/// Each of the image's events, looked for in a log: the same only where every logged event of
/// its kind (in its RTMR) carries the image's digest.
pub fn check_events(launch: &Launch, log: &EventLog) -> Vec<(Expected, Found)> {
    launch
        .events
        .iter()
        .map(|x| {
            let mut of_kind = log.events.iter().filter(|e| x.kind.matches(e)).peekable();
            let found = if of_kind.peek().is_none() {
                Found::Absent
            } else {
                match of_kind.find(|e| e.sha384 != Some(x.digest)) {
                    Some(e) => Found::Differs(e.sha384.unwrap_or([0; 48])),
                    None => Found::Same,
                }
            };
            (*x, found)
        })
        .collect()
}

/// The `EV_EFI_ACTION` strings edk2 measures around starting a boot option
/// (`MdePkg/Include/Guid/TcgEventHob.h`, `EFI_CALLING_EFI_APPLICATION` and the rest).
pub const EDK2_ACTIONS: [&str; 4] = [
    "Calling EFI Application from Boot Option",
    "Returning from EFI Application from Boot Option",
    "Exit Boot Services Invocation",
    "Exit Boot Services Returned with Success",
];

/// Events in RTMR[1] and RTMR[2] that a direct boot of the image does not explain: neither one
/// of its events, nor a separator (`EV_SEPARATOR` over four zero bytes), nor one of edk2's
/// boot-option actions ([`EDK2_ACTIONS`]) with that text's digest. A boot loader, a second EFI
/// application, another action, a measurement the kernel's stub does not make: each shows here.
pub fn unexplained<'a>(launch: &Launch, log: &'a EventLog) -> Vec<&'a event_log::Event> {
    let separator = fixed(&[0; 4]);
    let actions: Vec<[u8; 48]> = EDK2_ACTIONS.iter().map(|a| fixed(a.as_bytes())).collect();
    log.events
        .iter()
        .filter(|e| matches!(e.rtmr(), Some(1 | 2)))
        .filter(|e| {
            let d = e.sha384;
            let image = launch
                .events
                .iter()
                .any(|x| x.kind.matches(e) && d == Some(x.digest));
            let sep = e.event_type == event_log::EV_SEPARATOR && d == Some(separator);
            let action = e.event_type == event_log::EV_EFI_ACTION
                && d.is_some_and(|d| actions.contains(&d) && d == fixed(&e.data));
            !(image || sep || action)
        })
        .collect()
}

/// Kernels made to order, for tests here and in other crates (`test-support`).
#[cfg(any(test, feature = "test-support"))]
pub mod testing {
    /// A minimal PE32+ image: headers in the first 0x200 bytes, two sections (listed out of
    /// file order), `trailer` bytes after them and a certificate table of `cert` bytes.
    pub fn pe(trailer: usize, cert: usize) -> Vec<u8> {
        let mut b = vec![0u8; 0x600 + trailer + cert];
        b[..2].copy_from_slice(b"MZ");
        b[0x3c..0x40].copy_from_slice(&0x80u32.to_le_bytes());
        b[0x80..0x84].copy_from_slice(b"PE\0\0");
        let coff = 0x84;
        b[coff..coff + 2].copy_from_slice(&0x8664u16.to_le_bytes());
        b[coff + 2..coff + 4].copy_from_slice(&2u16.to_le_bytes());
        b[coff + 16..coff + 18].copy_from_slice(&240u16.to_le_bytes());
        let opt = coff + 20;
        b[opt..opt + 2].copy_from_slice(&0x20bu16.to_le_bytes());
        b[opt + 60..opt + 64].copy_from_slice(&0x200u32.to_le_bytes());
        b[opt + 64..opt + 68].copy_from_slice(&0xdead_beefu32.to_le_bytes()); // CheckSum
        b[opt + 108..opt + 112].copy_from_slice(&16u32.to_le_bytes());
        let cert_dir = opt + 112 + 32;
        let cert_at = (0x600 + trailer) as u32;
        b[cert_dir..cert_dir + 4].copy_from_slice(&cert_at.to_le_bytes());
        b[cert_dir + 4..cert_dir + 8].copy_from_slice(&(cert as u32).to_le_bytes());
        let table = opt + 240;
        for (i, (size, offset)) in [(0x200u32, 0x400u32), (0x200, 0x200)].iter().enumerate() {
            let at = table + 40 * i;
            b[at + 16..at + 20].copy_from_slice(&size.to_le_bytes());
            b[at + 20..at + 24].copy_from_slice(&offset.to_le_bytes());
        }
        for (i, x) in b.iter_mut().enumerate().skip(0x200) {
            *x = (i % 251) as u8;
        }
        b
    }

    /// A bzImage setup header: protocol 2.15, LOADED_HIGH, `xloadflags` as given.
    pub fn bzimage(xloadflags: u16) -> Vec<u8> {
        let mut k = vec![0u8; 0x2000];
        k[0x202..0x206].copy_from_slice(b"HdrS");
        k[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        k[0x211] = 0x01;
        k[0x22c..0x230].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
        k[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        k
    }

    /// A bzImage (boot protocol 2.15, above-4G initrds) that is also a PE32+ image, as a
    /// kernel with an EFI stub is.
    pub fn kernel() -> Vec<u8> {
        let mut k = bzimage(1 << 1);
        let pe = pe(0, 0);
        k[..0x200].copy_from_slice(&pe[..0x200]);
        k
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::event_log::testing::log;
    use super::event_log::{EV_EFI_ACTION as ACTION, EV_SEPARATOR};
    use super::*;

    /// Event digests from a real OVMF TD boot (Trustee's `deps/verifier/test_data/
    /// CCEL_data_ovmf_out.json`): what this module computes for the fixed events equals them.
    #[test]
    fn fixed_events_match_a_real_ovmf_td_log() {
        let hex = |d: [u8; 48]| hex::encode(d);
        assert!(
            hex(fixed(b"Calling EFI Application from Boot Option")).starts_with("77a0dab2312b4e1e")
        );
        assert!(hex(fixed(&[0; 4])).starts_with("394341b7182cd227"));
        assert!(hex(fixed(b"Exit Boot Services Invocation")).starts_with("214b0bef13797560"));
        assert!(
            hex(fixed(b"Exit Boot Services Returned with Success")).starts_with("0a2e01c85deae718")
        );
    }

    #[test]
    fn load_options_are_utf16_with_the_initrd_named() {
        assert_eq!(load_options(None, false), Vec::<u8>::new());
        assert_eq!(load_options(Some("a"), false), b"a\0\0\0".to_vec());
        let o = load_options(Some("console=hvc0"), true);
        let s: Vec<u16> = o
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(
            String::from_utf16(&s).unwrap(),
            "console=hvc0 initrd=initrd\0"
        );
        assert_eq!(load_options(None, true).len(), 2 * 15);
    }

    #[test]
    fn a_log_is_checked_event_by_event() {
        let img = tdvf::testing::small();
        let t = Tdvf::parse(&img).unwrap();
        let k = testing::kernel();
        let boot = DirectBoot {
            kernel: &k,
            initrd: Some(b"initrd bytes"),
            cmdline: Some("console=hvc0"),
            memory: 2 << 30,
            platform: None,
        };
        let launch = measure(&t, PageOrder::PerPage, Some(&boot)).unwrap();
        assert_eq!(launch.events.len(), 4);
        let d = |kind| {
            launch
                .events
                .iter()
                .find(|e| e.kind == kind)
                .unwrap()
                .digest
        };
        let tagged = |tag: u32| [tag.to_le_bytes().as_slice(), &[0; 4]].concat();
        let (lo, ird) = (tagged(TAG_LOAD_OPTIONS), tagged(TAG_INITRD));
        let good = log(
            &[
                (1, EV_EFI_PLATFORM_FIRMWARE_BLOB2, d(EventKind::Cfv), b"Fv"),
                (1, EV_SEPARATOR, fixed(&[0; 4]), &[0; 4]),
                (
                    2,
                    EV_EFI_BOOT_SERVICES_APPLICATION,
                    d(EventKind::Kernel),
                    b"k",
                ),
                (
                    2,
                    ACTION,
                    fixed(b"Calling EFI Application from Boot Option"),
                    b"Calling EFI Application from Boot Option",
                ),
                (2, EV_SEPARATOR, fixed(&[0; 4]), &[0; 4]),
                (3, EV_EVENT_TAG, d(EventKind::LoadOptions), &lo),
                (3, EV_EVENT_TAG, d(EventKind::Initrd), &ird),
                (
                    2,
                    ACTION,
                    fixed(b"Exit Boot Services Invocation"),
                    b"Exit Boot Services Invocation",
                ),
                (
                    2,
                    ACTION,
                    fixed(b"Exit Boot Services Returned with Success"),
                    b"Exit Boot Services Returned with Success",
                ),
            ],
            64,
        );
        let l = EventLog::parse(&good).unwrap();
        assert!(
            check_events(&launch, &l)
                .iter()
                .all(|(_, f)| *f == Found::Same)
        );
        assert!(unexplained(&launch, &l).is_empty());
        // A second EFI application in RTMR[1]: the kernel no longer checks out, and it is
        // named among the unexplained.
        let mut extra = l.clone();
        extra.events.insert(
            3,
            event_log::Event {
                mr_index: 2,
                event_type: EV_EFI_BOOT_SERVICES_APPLICATION,
                sha384: Some([3; 48]),
                data: vec![],
            },
        );
        assert_eq!(check_events(&launch, &extra)[1].1, Found::Differs([3; 48]));
        assert_eq!(unexplained(&launch, &extra).len(), 1);
        // An action whose digest is not its text's is unexplained too, and so is any action
        // but edk2's, even with its own text's digest (a boot loader's measurement relabelled).
        extra.events[3].event_type = ACTION;
        extra.events[3].data = b"Calling EFI Application from Boot Option".to_vec();
        assert_eq!(unexplained(&launch, &extra).len(), 1);
        extra.events[3].data = b"grub_cmd: linux /vmlinuz".to_vec();
        extra.events[3].sha384 = Some(fixed(b"grub_cmd: linux /vmlinuz"));
        assert_eq!(unexplained(&launch, &extra).len(), 1);
        let r = l.replay();
        assert_eq!(launch.rtmr.unwrap(), [r[1], r[2]]);
        // Another initrd: that event differs, the rest still match, RTMR[2] differs.
        let other = log(&[(3, EV_EVENT_TAG, [9; 48], &ird)], 0);
        let checks = check_events(&launch, &EventLog::parse(&other).unwrap());
        assert_eq!(checks[3].1, Found::Differs([9; 48]));
        assert_eq!(checks[0].1, Found::Absent);
        // A different memory size moves the initrd, so the kernel's digest changes.
        let small_mem = DirectBoot {
            memory: 1 << 30,
            ..boot
        };
        let l2 = measure(&t, PageOrder::PerPage, Some(&small_mem)).unwrap();
        assert_ne!(l2.events[1].digest, launch.events[1].digest);
        assert_eq!(l2.mrtd, launch.mrtd);
    }
}
