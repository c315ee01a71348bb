//! The initial VMSA page of each vCPU, as the VMM hands it to `SNP_LAUNCH_UPDATE`: the SEV-ES save
//! area (AMD64 Architecture Programmer's Manual Vol. 2, Table B-4, "VMSA Layout, State Save Area
//! for SEV-ES") filled with the x86 reset state as each VMM sets it. Only the fields below are
//! non-zero; offsets are Table B-4's.
//!
//! | offset | field | value |
//! |---|---|---|
//! | 0x000–0x09F | ES, CS, SS, DS, FS, GS, GDTR, LDTR, IDTR, TR (`{u16 selector, u16 attrib, u32 limit, u64 base}`) | real-mode segments |
//! | 0x0D0 | EFER | 0x1000 (SVME, as KVM sets it) |
//! | 0x148 | CR4 | 0x40 (MCE) |
//! | 0x158 | CR0 | 0x10 |
//! | 0x160 | DR7 | 0x400 |
//! | 0x168 | DR6 | 0xFFFF0FF0 |
//! | 0x170 | RFLAGS | 0x2 |
//! | 0x178 | RIP | reset address & 0xFFFF |
//! | 0x268 | G_PAT | 0x0007040600070406 (GCE: 0x00070106) |
//! | 0x310 | RDX | the vCPU signature (QEMU), 0x600 (EC2, GCE) |
//! | 0x3B0 | SEV_FEATURES | the guest features |
//! | 0x3E8 | XCR0 | 0x1 |
//! | 0x408 | MXCSR | 0x1F80 (QEMU), 0 (EC2, GCE) |
//! | 0x410 | X87_FCW | 0x37F (QEMU), 0 (EC2, GCE) |

/// The boot processor's reset address.
pub const BSP_EIP: u32 = 0xFFFF_FFF0;

/// Which VMM launches the guest: they differ in the reset state they write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vmm {
    Qemu,
    Ec2,
    Gce,
}

impl std::str::FromStr for Vmm {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "qemu" => Ok(Vmm::Qemu),
            "ec2" => Ok(Vmm::Ec2),
            "gce" => Ok(Vmm::Gce),
            _ => Err(crate::Error::Parameter(format!(
                "unknown VMM type {s} (qemu, ec2, gce)"
            ))),
        }
    }
}

fn put(page: &mut [u8; 4096], at: usize, bytes: &[u8]) {
    page[at..at + bytes.len()].copy_from_slice(bytes);
}

/// A VMCB segment (`{u16 selector, u16 attrib, u32 limit, u64 base}`) at `at`.
fn segment(page: &mut [u8; 4096], at: usize, selector: u16, attrib: u16, limit: u32, base: u64) {
    put(page, at, &selector.to_le_bytes());
    put(page, at + 2, &attrib.to_le_bytes());
    put(page, at + 4, &limit.to_le_bytes());
    put(page, at + 8, &base.to_le_bytes());
}

/// The VMSA page of a vCPU that starts at `eip`.
pub fn page(eip: u32, sev_features: u64, vcpu_signature: u32, vmm: Vmm) -> [u8; 4096] {
    let mut p = [0u8; 4096];
    let (cs_attrib, ss_attrib, tr_attrib, rdx, mxcsr, fcw, g_pat) = match vmm {
        Vmm::Qemu => (
            0x9b,
            0x93,
            0x8b,
            u64::from(vcpu_signature),
            0x1f80u32,
            0x37fu16,
            0x0007_0406_0007_0406u64,
        ),
        // EC2 marks the BSP's code segment not yet accessed.
        Vmm::Ec2 => (
            if eip == BSP_EIP { 0x9a } else { 0x9b },
            0x92,
            0x83,
            0x600,
            0,
            0,
            0x0007_0406_0007_0406,
        ),
        // GCE's hypervisor writes its own PAT.
        Vmm::Gce => (0x9b, 0x93, 0x8b, 0x600, 0, 0, 0x0007_0106),
    };
    segment(&mut p, 0x000, 0, 0x93, 0xffff, 0); // ES
    segment(
        &mut p,
        0x010,
        0xf000,
        cs_attrib,
        0xffff,
        u64::from(eip & 0xffff_0000),
    ); // CS
    segment(&mut p, 0x020, 0, ss_attrib, 0xffff, 0); // SS
    segment(&mut p, 0x030, 0, 0x93, 0xffff, 0); // DS
    segment(&mut p, 0x040, 0, 0x93, 0xffff, 0); // FS
    segment(&mut p, 0x050, 0, 0x93, 0xffff, 0); // GS
    segment(&mut p, 0x060, 0, 0, 0xffff, 0); // GDTR
    segment(&mut p, 0x070, 0, 0x82, 0xffff, 0); // LDTR
    segment(&mut p, 0x080, 0, 0, 0xffff, 0); // IDTR
    segment(&mut p, 0x090, 0, tr_attrib, 0xffff, 0); // TR
    put(&mut p, 0x0d0, &0x1000u64.to_le_bytes()); // EFER
    put(&mut p, 0x148, &0x40u64.to_le_bytes()); // CR4
    put(&mut p, 0x158, &0x10u64.to_le_bytes()); // CR0
    put(&mut p, 0x160, &0x400u64.to_le_bytes()); // DR7
    put(&mut p, 0x168, &0xffff_0ff0u64.to_le_bytes()); // DR6
    put(&mut p, 0x170, &0x2u64.to_le_bytes()); // RFLAGS
    put(&mut p, 0x178, &u64::from(eip & 0xffff).to_le_bytes()); // RIP
    put(&mut p, 0x268, &g_pat.to_le_bytes()); // G_PAT
    put(&mut p, 0x310, &rdx.to_le_bytes()); // RDX
    put(&mut p, 0x3b0, &sev_features.to_le_bytes()); // SEV_FEATURES
    put(&mut p, 0x3e8, &0x1u64.to_le_bytes()); // XCR0
    put(&mut p, 0x408, &mxcsr.to_le_bytes()); // MXCSR
    put(&mut p, 0x410, &fcw.to_le_bytes()); // X87_FCW
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_state_fields() {
        let p = page(BSP_EIP, 1, 0x00a0_0f11, Vmm::Qemu);
        assert_eq!(&p[0x010..0x012], &0xf000u16.to_le_bytes());
        assert_eq!(&p[0x018..0x020], &0xffff_0000u64.to_le_bytes());
        assert_eq!(&p[0x178..0x180], &0xfff0u64.to_le_bytes());
        assert_eq!(&p[0x310..0x318], &0x00a0_0f11u64.to_le_bytes());
        assert_eq!(&p[0x3b0..0x3b8], &1u64.to_le_bytes());
        let ec2 = page(BSP_EIP, 1, 0x00a0_0f11, Vmm::Ec2);
        assert_eq!(ec2[0x012], 0x9a);
        assert_eq!(&ec2[0x310..0x318], &0x600u64.to_le_bytes());
        assert_ne!(page(0xffff_f000, 1, 0, Vmm::Ec2)[0x012], 0x9a);
        assert!("Xen".parse::<Vmm>().is_err());
    }
}
