//! RTMR[0]: what TDVF extends before it starts anything, for a direct boot, in the order edk2's
//! TDVF (`OvmfPkg/IntelTdx`, `TdTcg2Dxe`) logs it — the layout `dstack-mr` and Tinfoil's
//! `tdx-measure` compute and check against TDs on Canonical's TDX stack:
//!
//! | # | event type | what is hashed |
//! |---|---|---|
//! | 1 | `EV_EFI_HANDOFF_TABLES2` | the TD HOB QEMU wrote, up to its end-of-list HOB ([`td_hob`]) |
//! | 2 | `EV_EFI_PLATFORM_FIRMWARE_BLOB2` | the configuration firmware volume (the image's) |
//! | 3–7 | `EV_EFI_VARIABLE_DRIVER_CONFIG` | `UEFI_VARIABLE_DATA` of SecureBoot, PK, KEK, db, dbx ([`variable_data`]); then dbt where the firmware has one |
//! | 8 | `EV_SEPARATOR` | four zero bytes |
//! | 9–11 | `EV_PLATFORM_CONFIG_FLAGS` | QEMU's fw_cfg `etc/table-loader`, `etc/acpi/rsdp`, `etc/acpi/tables` |
//! | 12– | `EV_EFI_VARIABLE_BOOT` | the data of `BootOrder`, then of each `Boot####` it lists (none without a `BootOrder`) |
//!
//! Layouts this does not model (a genuine TD of them does not match; `--replay` its log):
//! edk2 builds that measure the boot variables into PCR 5 (RTMR[1]) rather than PCR 1;
//! machines whose table-loader allocates more blobs (a vTPM's `etc/tpm/log`, vmgenid); older
//! qemu-tdx trees whose TD HOB also lists MMIO ranges; boots through a boot loader (shim adds
//! its `SbatLevel`).
//!
//! The image determines #2; #1 follows from the TDVF's sections and the guest's memory size
//! (QEMU `hw/i386/tdx.c`, `tdvf-hob.c`: the e820 RAM ranges, the TD HOB and temporary-memory
//! sections carved out as accepted memory, sorted by address). The rest is the platform's:
//! QEMU generates the ACPI tables for its machine (vCPUs, devices, QEMU version) and the
//! firmware build brings its variables. Those are inputs here ([`Platform`]): files dumped from a
//! VM of that configuration, hashed, never interpreted — except that [`acpi_vcpus`] reads the
//! MADT, so a caller can check the tables describe the vCPU count it launches with.

use super::event_log::replay_digests;
use super::tdvf::{SectionType, Tdvf};
use crate::ovmf::u32_at;
use crate::{Error, Result, guid, sha384};

/// `EFI_HOB_HANDOFF_TABLE_VERSION` (PI spec vol. 3, `EFI_HOB_HANDOFF_INFO_TABLE`).
const HANDOFF_TABLE_VERSION: u32 = 9;
/// `EFI_HOB_TYPE_HANDOFF`, `EFI_HOB_TYPE_RESOURCE_DESCRIPTOR`, `EFI_HOB_TYPE_END_OF_HOB_LIST`.
const HOB_HANDOFF: u16 = 0x0001;
const HOB_RESOURCE_DESCRIPTOR: u16 = 0x0003;
/// `EFI_HOB_HANDOFF_INFO_TABLE` (56 bytes), `EFI_HOB_RESOURCE_DESCRIPTOR` (48), the end HOB (8).
const HANDOFF_LEN: usize = 56;
const RESOURCE_LEN: usize = 48;
const END_LEN: u64 = 8;
/// `EFI_RESOURCE_SYSTEM_MEMORY` (accepted: QEMU's `TDX_RAM_ADDED`) and
/// `EFI_RESOURCE_MEMORY_UNACCEPTED`.
const RESOURCE_SYSTEM_MEMORY: u32 = 0;
const RESOURCE_MEMORY_UNACCEPTED: u32 = 7;
/// PRESENT | INITIALIZED | TESTED: QEMU's `EFI_RESOURCE_ATTRIBUTE_TDVF_PRIVATE` and
/// `…_TDVF_UNACCEPTED` alike.
const RESOURCE_ATTRIBUTES: u32 = 0x7;

/// The most guest memory taken (64 TiB): the map's arithmetic stays far from overflow.
pub const MAX_MEMORY: u64 = 1 << 46;
/// The most `Boot####` entries `BootOrder` may list.
pub const MAX_BOOT_OPTIONS: usize = 256;

/// `EFI_GLOBAL_VARIABLE` (8be4df61-93ca-11d2-aa0d-00e098032b8c): SecureBoot, PK, KEK, boot
/// variables.
pub const EFI_GLOBAL_VARIABLE: [u8; 16] = guid(
    0x8be4_df61,
    0x93ca,
    0x11d2,
    [0xaa, 0x0d, 0x00, 0xe0, 0x98, 0x03, 0x2b, 0x8c],
);
/// `EFI_IMAGE_SECURITY_DATABASE_GUID` (d719b2cb-3d3a-4596-a3bc-dad00e67656f): db, dbx.
pub const EFI_IMAGE_SECURITY_DATABASE: [u8; 16] = guid(
    0xd719_b2cb,
    0x3d3a,
    0x4596,
    [0xa3, 0xbc, 0xda, 0xd0, 0x0e, 0x67, 0x65, 0x6f],
);

/// The secure boot variables TDVF measures, in its order, with their vendor GUIDs.
pub const SECURE_BOOT_VARIABLES: [(&str, [u8; 16]); 5] = [
    ("SecureBoot", EFI_GLOBAL_VARIABLE),
    ("PK", EFI_GLOBAL_VARIABLE),
    ("KEK", EFI_GLOBAL_VARIABLE),
    ("db", EFI_IMAGE_SECURITY_DATABASE),
    ("dbx", EFI_IMAGE_SECURITY_DATABASE),
];

/// What the platform puts in RTMR[0], as dumped from a VM of the configuration launched.
#[derive(Debug, Clone, Default)]
pub struct Platform<'a> {
    /// QEMU's fw_cfg `etc/table-loader`.
    pub table_loader: &'a [u8],
    /// QEMU's fw_cfg `etc/acpi/rsdp`.
    pub acpi_rsdp: &'a [u8],
    /// QEMU's fw_cfg `etc/acpi/tables`.
    pub acpi_tables: &'a [u8],
    /// The `BootOrder` variable's data (`UINT16` option numbers); `None` where the firmware
    /// has none (then no boot variable is measured).
    pub boot_order: Option<&'a [u8]>,
    /// `Boot####` variables' data by number; each `BootOrder` lists must be here (edk2 skips
    /// one the firmware lacks, but a dump that lacks one is likelier incomplete).
    pub boot_options: Vec<(u16, &'a [u8])>,
    /// The data of SecureBoot, PK, KEK, db and dbx ([`SECURE_BOOT_VARIABLES`] order); empty
    /// where the firmware has none (no keys enrolled: OVMF's TDX builds).
    pub secure_boot: [&'a [u8]; 5],
    /// dbt's data, where the firmware has one (edk2 measures it only then).
    pub dbt: Option<&'a [u8]>,
}

/// One RAM range of QEMU's TD memory map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamEntry {
    pub address: u64,
    pub length: u64,
    /// Added (and so accepted) before the TD runs: the TD HOB and temporary memory.
    pub accepted: bool,
}

/// QEMU's TD RAM map for `memory` bytes on q35: the e820 RAM ranges (below 4 GiB as
/// [`super::kernel::below_4g`] splits it, the rest from 4 GiB), each TD HOB and
/// temporary-memory section carved out as an accepted range (`tdx_accept_ram_range`: it must
/// lie within one unaccepted range), sorted by address.
pub fn ram_entries(tdvf: &Tdvf<'_>, memory: u64) -> Result<Vec<RamEntry>> {
    if memory == 0 || memory > MAX_MEMORY {
        return Err(Error::Parameter(format!(
            "guest memory {memory} bytes: must be 1 byte to 64 TiB"
        )));
    }
    let low = super::kernel::below_4g(memory);
    let mut map = vec![RamEntry {
        address: 0,
        length: low,
        accepted: false,
    }];
    if memory > low {
        map.push(RamEntry {
            address: 1 << 32,
            length: memory - low,
            accepted: false,
        });
    }
    for s in tdvf.sections() {
        if !matches!(s.kind, SectionType::TdHob | SectionType::TempMem) {
            continue;
        }
        let (start, len) = (s.memory_address, s.memory_data_size);
        let end = start
            .checked_add(len)
            .ok_or_else(|| Error::Firmware(format!("{:?} section at {start:#x} wraps", s.kind)))?;
        let at = map
            .iter()
            .position(|e| !e.accepted && e.address <= start && end <= e.address + e.length)
            .ok_or_else(|| {
                Error::Parameter(format!(
                    "the {:?} section [{start:#x}, {end:#x}) is not within the guest's RAM \
                     ({memory} bytes) or overlaps another: QEMU refuses this launch",
                    s.kind
                ))
            })?;
        let whole = map[at];
        map[at] = RamEntry {
            address: start,
            length: len,
            accepted: true,
        };
        if start > whole.address {
            map.push(RamEntry {
                address: whole.address,
                length: start - whole.address,
                accepted: false,
            });
        }
        let whole_end = whole.address + whole.length;
        if end < whole_end {
            map.push(RamEntry {
                address: end,
                length: whole_end - end,
                accepted: false,
            });
        }
    }
    map.sort_by_key(|e| e.address);
    Ok(map)
}

/// The TD HOB as QEMU writes it (`tdvf_hob_create`) and as TDVF measures it: the handoff
/// table (version 9, memory fields zero, `EfiEndOfHobList` the guest address just past the
/// end-of-list HOB), one resource descriptor per [`ram_entries`] range — without the
/// end-of-list HOB, which TDVF's measurement stops before.
pub fn td_hob(tdvf: &Tdvf<'_>, memory: u64) -> Result<Vec<u8>> {
    let section = tdvf
        .sections()
        .iter()
        .find(|s| s.kind == SectionType::TdHob)
        .ok_or_else(|| Error::Firmware("no TD HOB section".into()))?;
    let map = ram_entries(tdvf, memory)?;
    let len = HANDOFF_LEN + RESOURCE_LEN * map.len();
    if len as u64 + END_LEN > section.memory_data_size {
        return Err(Error::Parameter(format!(
            "the TD HOB ({} bytes) overruns its section ({} bytes): QEMU refuses this launch",
            len as u64 + END_LEN,
            section.memory_data_size
        )));
    }
    let mut hob = Vec::with_capacity(len);
    let header = |hob: &mut Vec<u8>, kind: u16, len: usize| {
        hob.extend_from_slice(&kind.to_le_bytes());
        hob.extend_from_slice(&(len as u16).to_le_bytes());
        hob.extend_from_slice(&[0; 4]);
    };
    header(&mut hob, HOB_HANDOFF, HANDOFF_LEN);
    hob.extend_from_slice(&HANDOFF_TABLE_VERSION.to_le_bytes());
    // BootMode, EfiMemoryTop/Bottom, EfiFreeMemoryTop/Bottom: zero.
    hob.extend_from_slice(&[0; 4 + 8 * 4]);
    let end_of_list = section.memory_address + len as u64 + END_LEN;
    hob.extend_from_slice(&end_of_list.to_le_bytes());
    for e in &map {
        header(&mut hob, HOB_RESOURCE_DESCRIPTOR, RESOURCE_LEN);
        hob.extend_from_slice(&[0; 16]); // Owner: the zero GUID.
        let kind = if e.accepted {
            RESOURCE_SYSTEM_MEMORY
        } else {
            RESOURCE_MEMORY_UNACCEPTED
        };
        hob.extend_from_slice(&kind.to_le_bytes());
        hob.extend_from_slice(&RESOURCE_ATTRIBUTES.to_le_bytes());
        hob.extend_from_slice(&e.address.to_le_bytes());
        hob.extend_from_slice(&e.length.to_le_bytes());
    }
    Ok(hob)
}

/// `UEFI_VARIABLE_DATA` (TCG PC Client PFP spec, §10.2.6): vendor GUID, the name's length in
/// UTF-16 code units, the data's length in bytes, the name (UTF-16LE, no terminator), the data.
pub fn variable_data(vendor: &[u8; 16], name: &str, data: &[u8]) -> Vec<u8> {
    let name: Vec<u16> = name.encode_utf16().collect();
    let mut out = Vec::with_capacity(32 + 2 * name.len() + data.len());
    out.extend_from_slice(vendor);
    out.extend_from_slice(&(name.len() as u64).to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend(name.iter().flat_map(|c| c.to_le_bytes()));
    out.extend_from_slice(data);
    out
}

/// One RTMR[0] event: what it is and its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rtmr0Event {
    pub name: String,
    pub digest: [u8; 48],
}

/// RTMR[0]'s events for a direct boot of `tdvf` with `memory` bytes on `platform`, in the
/// module's table order; [`rtmr0`] replays them. `cfv`: the digest of `tdvf`'s CFV, which
/// [`super::measure`] has already taken for the image's events.
pub fn rtmr0_events(
    tdvf: &Tdvf<'_>,
    memory: u64,
    platform: &Platform<'_>,
    cfv: Option<[u8; 48]>,
) -> Result<Vec<Rtmr0Event>> {
    let ev = |name: &str, bytes: &[u8]| Rtmr0Event {
        name: name.to_string(),
        digest: sha384(bytes),
    };
    let mut out = vec![ev("TD HOB", &td_hob(tdvf, memory)?)];
    if let Some(digest) = cfv {
        out.push(Rtmr0Event {
            name: "configuration firmware volume".into(),
            digest,
        });
    }
    for ((name, vendor), data) in SECURE_BOOT_VARIABLES.iter().zip(platform.secure_boot) {
        out.push(ev(name, &variable_data(vendor, name, data)));
    }
    if let Some(dbt) = platform.dbt {
        out.push(ev(
            "dbt",
            &variable_data(&EFI_IMAGE_SECURITY_DATABASE, "dbt", dbt),
        ));
    }
    out.push(ev("separator", &[0; 4]));
    out.push(ev("etc/table-loader", platform.table_loader));
    out.push(ev("etc/acpi/rsdp", platform.acpi_rsdp));
    out.push(ev("etc/acpi/tables", platform.acpi_tables));
    let Some(order) = platform.boot_order else {
        return Ok(out);
    };
    out.push(ev("BootOrder", order));
    for n in boot_order(order)? {
        let data = platform
            .boot_options
            .iter()
            .find(|(m, _)| *m == n)
            .map(|(_, d)| *d)
            .ok_or_else(|| {
                Error::Parameter(format!(
                    "BootOrder lists Boot{n:04X}, which the platform's variables do not include"
                ))
            })?;
        out.push(ev(&format!("Boot{n:04X}"), data));
    }
    Ok(out)
}

/// RTMR[0] from its events.
pub fn rtmr0(events: &[Rtmr0Event]) -> [u8; 48] {
    replay_digests(events.iter().map(|e| &e.digest))
}

/// The option numbers `BootOrder` lists (`UINT16`s, little-endian).
pub fn boot_order(data: &[u8]) -> Result<Vec<u16>> {
    if !data.len().is_multiple_of(2) || data.len() / 2 > MAX_BOOT_OPTIONS {
        return Err(Error::Parameter(format!(
            "BootOrder: {} bytes is not a list of at most {MAX_BOOT_OPTIONS} UINT16 option numbers",
            data.len()
        )));
    }
    Ok(data
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// The vCPUs the MADT in QEMU's `etc/acpi/tables` blob describes: enabled Processor Local APIC
/// (type 0) and Processor Local x2APIC (type 9) entries (ACPI 6.5, §5.2.12). The blob is the
/// tables back to back (FACS first, 64-byte aligned by QEMU), zero-padded at the end.
pub fn acpi_vcpus(tables: &[u8]) -> Result<u32> {
    let mut at = 0;
    while at < tables.len() {
        if tables[at..].iter().all(|&b| b == 0) {
            break;
        }
        let len = u32_at(tables, at + 4)
            .ok_or_else(|| acpi_error(at, "a truncated table header"))? as usize;
        // Every table has the 36-byte ACPI header (the FACS, 64 bytes, its own).
        let end = at
            .checked_add(len)
            .filter(|&e| len >= 36 && e <= tables.len())
            .ok_or_else(|| acpi_error(at, "a table whose length is short or leaves the blob"))?;
        if &tables[at..at + 4] == b"APIC" {
            return madt_cpus(tables, at, end);
        }
        at = end;
    }
    Err(Error::Parameter(
        "etc/acpi/tables: no MADT (APIC) table".into(),
    ))
}

/// The enabled processors the MADT at `tables[at..end]` lists.
fn madt_cpus(tables: &[u8], at: usize, end: usize) -> Result<u32> {
    if end - at < 44 {
        return Err(acpi_error(at, "a MADT shorter than its fixed fields"));
    }
    // Header (36), local APIC address (4), flags (4), then the entries.
    let mut p = at + 44;
    let mut cpus = 0u32;
    while p < end {
        let (kind, len) = match tables.get(p..p + 2) {
            Some(h) if h[1] >= 2 && p + usize::from(h[1]) <= end => (h[0], h[1]),
            _ => return Err(acpi_error(p, "a malformed MADT entry")),
        };
        let flags = match kind {
            0 if len >= 8 => u32_at(tables, p + 4),
            9 if len >= 16 => u32_at(tables, p + 8),
            _ => None,
        };
        if flags.is_some_and(|f| f & 1 != 0) {
            cpus += 1;
        }
        p += usize::from(len);
    }
    Ok(cpus)
}

fn acpi_error(at: usize, why: &str) -> Error {
    Error::Parameter(format!("etc/acpi/tables: {why} at offset {at:#x}"))
}

/// ACPI table blobs made to order, for tests here and in other crates (`test-support`).
#[cfg(any(test, feature = "test-support"))]
pub mod testing {
    /// A table: signature, length, then `body` (a real header's other 28 bytes are zero).
    pub fn table(sig: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut t = sig.to_vec();
        t.extend_from_slice(&((36 + body.len()) as u32).to_le_bytes());
        t.extend_from_slice(&[0; 28]);
        t.extend_from_slice(body);
        t
    }

    /// QEMU's blob in miniature: a FACS, a DSDT, a MADT with `cpus` enabled local APICs and
    /// one disabled, zero padding.
    pub fn acpi_tables(cpus: u8) -> Vec<u8> {
        let mut facs = b"FACS".to_vec();
        facs.extend_from_slice(&64u32.to_le_bytes());
        facs.resize(64, 0);
        let mut madt = vec![0; 8];
        for id in 0..=cpus {
            let enabled = u32::from(id < cpus);
            madt.extend_from_slice(&[0, 8, id, id]);
            madt.extend_from_slice(&enabled.to_le_bytes());
        }
        let mut blob = facs;
        blob.extend(table(b"DSDT", &[0x10; 20]));
        blob.extend(table(b"APIC", &madt));
        blob.resize(blob.len() + 512, 0);
        blob
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::tdvf::testing::small;
    use super::*;

    fn entry(address: u64, length: u64, accepted: bool) -> RamEntry {
        RamEntry {
            address,
            length,
            accepted,
        }
    }

    /// `small()` has its TD HOB at 0x809000 (1 page) and temporary memory at 0x80a000 (2).
    #[test]
    fn the_ram_map_is_qemus_for_small_and_large_guests() {
        let img = small();
        let t = Tdvf::parse(&img).unwrap();
        assert_eq!(
            ram_entries(&t, 2 << 30).unwrap(),
            [
                entry(0, 0x80_9000, false),
                entry(0x80_9000, 0x1000, true),
                entry(0x80_a000, 0x2000, true),
                entry(0x80_c000, (2 << 30) - 0x80_c000, false),
            ]
        );
        // 4 GiB on q35: 2 GiB below 4 GiB, 2 GiB from 4 GiB.
        let m = ram_entries(&t, 4 << 30).unwrap();
        assert_eq!(m[3], entry(0x80_c000, 0x8000_0000 - 0x80_c000, false));
        assert_eq!(m[4], entry(1 << 32, 2 << 30, false));
        assert_eq!(m.len(), 5);
        // Too little memory for the sections: QEMU refuses, so does this.
        assert!(ram_entries(&t, 0x80_a000).is_err());
        assert!(ram_entries(&t, 0).is_err());
        assert!(ram_entries(&t, MAX_MEMORY + 1).is_err());
    }

    #[test]
    fn the_td_hob_is_laid_out_as_qemu_writes_it() {
        let img = small();
        let t = Tdvf::parse(&img).unwrap();
        let hob = td_hob(&t, 2 << 30).unwrap();
        assert_eq!(hob.len(), 56 + 4 * 48);
        assert_eq!(&hob[..8], &[1, 0, 56, 0, 0, 0, 0, 0]);
        assert_eq!(&hob[8..12], &9u32.to_le_bytes());
        // EfiEndOfHobList: just past the end HOB, which the measured bytes leave out.
        let end = u64::from_le_bytes(hob[48..56].try_into().unwrap());
        assert_eq!(end, 0x80_9000 + hob.len() as u64 + 8);
        // The second descriptor: the TD HOB page, accepted system memory.
        let d = &hob[56 + 48..56 + 96];
        assert_eq!(&d[..4], &[3, 0, 48, 0]);
        assert_eq!(&d[24..28], &0u32.to_le_bytes());
        assert_eq!(&d[28..32], &7u32.to_le_bytes());
        assert_eq!(&d[32..40], &0x80_9000u64.to_le_bytes());
        assert_eq!(&d[40..48], &0x1000u64.to_le_bytes());
        // The first: unaccepted memory (7) below it.
        assert_eq!(&hob[56 + 24..56 + 28], &7u32.to_le_bytes());
    }

    #[test]
    fn variable_data_is_the_tcg_structure() {
        let d = variable_data(&EFI_GLOBAL_VARIABLE, "PK", &[0xaa]);
        assert_eq!(&d[..16], &EFI_GLOBAL_VARIABLE);
        assert_eq!(&d[16..24], &2u64.to_le_bytes());
        assert_eq!(&d[24..32], &1u64.to_le_bytes());
        assert_eq!(&d[32..], &[b'P', 0, b'K', 0, 0xaa]);
    }

    #[test]
    fn rtmr0_lists_the_events_in_tdvf_order_and_needs_every_listed_boot_option() {
        let img = small();
        let t = Tdvf::parse(&img).unwrap();
        let tables = testing::acpi_tables(2);
        let mut p = Platform {
            table_loader: b"loader",
            acpi_rsdp: b"rsdp",
            acpi_tables: &tables,
            boot_order: Some(&[1, 0, 0, 0]),
            boot_options: vec![(0, b"zero".as_slice()), (1, b"one".as_slice())],
            secure_boot: [&[]; 5],
            dbt: None,
        };
        let events = rtmr0_events(&t, 2 << 30, &p, t.cfv().map(sha384)).unwrap();
        let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "TD HOB",
                "configuration firmware volume",
                "SecureBoot",
                "PK",
                "KEK",
                "db",
                "dbx",
                "separator",
                "etc/table-loader",
                "etc/acpi/rsdp",
                "etc/acpi/tables",
                "BootOrder",
                "Boot0001",
                "Boot0000",
            ]
        );
        assert_eq!(events[12].digest, sha384(b"one"));
        // The memory size reaches RTMR[0] through the TD HOB.
        let other = rtmr0_events(&t, 4 << 30, &p, t.cfv().map(sha384)).unwrap();
        assert_ne!(rtmr0(&events), rtmr0(&other));
        assert_eq!(events[1..], other[1..]);
        // A dbt goes after dbx; without a BootOrder no boot variable is measured.
        p.dbt = Some(b"dbt");
        let with_dbt = rtmr0_events(&t, 2 << 30, &p, t.cfv().map(sha384)).unwrap();
        assert_eq!(with_dbt[7].name, "dbt");
        assert_eq!(with_dbt.len(), events.len() + 1);
        p.dbt = None;
        p.boot_order = None;
        let no_order = rtmr0_events(&t, 2 << 30, &p, t.cfv().map(sha384)).unwrap();
        assert_eq!(no_order.last().unwrap().name, "etc/acpi/tables");
        p.boot_order = Some(&[1, 0, 0, 0]);
        p.boot_options.pop();
        let e = rtmr0_events(&t, 2 << 30, &p, t.cfv().map(sha384))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Boot0001"), "{e}");
        p.boot_order = Some(&[1, 0, 0]);
        assert!(rtmr0_events(&t, 2 << 30, &p, t.cfv().map(sha384)).is_err());
    }

    #[test]
    fn the_madt_gives_the_vcpu_count() {
        assert_eq!(acpi_vcpus(&testing::acpi_tables(4)).unwrap(), 4);
        assert_eq!(acpi_vcpus(&testing::acpi_tables(1)).unwrap(), 1);
        // No MADT, a length past the end, a zero-length entry: refused, not guessed.
        let dsdt = testing::table(b"DSDT", &[1; 4]);
        assert!(acpi_vcpus(&dsdt).is_err());
        let mut long = testing::acpi_tables(2);
        long[64 + 4] = 0xff;
        assert!(acpi_vcpus(&long).is_err());
        let mut zero = testing::table(b"APIC", &[0; 8]);
        zero.extend_from_slice(&[0, 0, 0, 0]);
        let n = zero.len() as u32;
        zero[4..8].copy_from_slice(&n.to_le_bytes());
        assert!(acpi_vcpus(&zero).is_err());
        assert!(acpi_vcpus(&[]).is_err());
        // Tables shorter than their header, a MADT shorter than its fixed fields.
        let mut short = testing::table(b"DSDT", &[]);
        short[4..8].copy_from_slice(&8u32.to_le_bytes());
        assert!(acpi_vcpus(&short).is_err());
        assert!(acpi_vcpus(&testing::table(b"APIC", &[0; 4])).is_err());
    }
}
