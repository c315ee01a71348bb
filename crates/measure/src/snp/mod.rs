//! The SEV-SNP launch digest of a guest booted from an OVMF image, as the AMD-SP computes it
//! while the VMM adds the guest's initial pages (`SNP_LAUNCH_UPDATE`) and as the report's
//! `MEASUREMENT` field carries it.
//!
//! The order (QEMU's `sev-snp-guest`, and the EC2 and GCE variants):
//! 1. every page of the firmware image, as normal pages at `4 GiB − len`;
//! 2. the SEV metadata sections in the firmware's order ([`crate::ovmf`]): pre-validated memory as
//!    zero pages (unmeasured on GCE), the secrets page, the CPUID page (on EC2 after all other
//!    sections), and the kernel-hashes page — QEMU's SEV hashes table ([`hashes`]) where a kernel
//!    is booted directly, zero pages otherwise; the SVSM calling area as zero pages;
//! 3. one VMSA page per vCPU ([`vmsa`]): the boot processor's at the reset vector, the others at
//!    the firmware's SEV-ES reset block.

pub mod cpu;
pub mod digest;
pub mod hashes;
pub mod id_block;
pub mod vmsa;

use crate::ovmf::{Ovmf, SectionKind};
use crate::{Error, Result};
pub use cpu::{cpu_signature, cpu_type};
pub use digest::LaunchDigest;
pub use hashes::SevHashes;
pub use vmsa::Vmm;

/// The most vCPUs measured (QEMU's limit for a VM is far below; each costs one page hash).
pub const MAX_VCPUS: u32 = 4096;

/// What a launch is made of, besides the firmware.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchParams {
    pub vcpus: u32,
    /// CPUID Fn0000_0001_EAX of the guest's vCPU type ([`cpu_type`], [`cpu_signature`]); QEMU
    /// puts it in each VMSA's RDX.
    pub vcpu_signature: u32,
    pub vmm: Vmm,
    /// The VMSA's `SEV_FEATURES` (the SNP guest policy's features; 0x1, SNPActive, by default).
    pub guest_features: u64,
    /// QEMU's kernel hashes, for measured direct kernel boot (`kernel-hashes=on`).
    pub kernel_hashes: Option<SevHashes>,
    /// A digest of the firmware's pages computed beforehand (`--snp-ovmf-hash`): the chain
    /// starts from it instead of hashing the image's pages.
    pub firmware_digest: Option<[u8; 48]>,
}

/// The launch digest of `ovmf` booted with `params`.
pub fn launch_digest(ovmf: &Ovmf<'_>, params: &LaunchParams) -> Result<[u8; 48]> {
    if params.vcpus == 0 || params.vcpus > MAX_VCPUS {
        return Err(Error::Parameter(format!(
            "vcpus {} is not within 1..={MAX_VCPUS}",
            params.vcpus
        )));
    }
    let mut ld = match params.firmware_digest {
        Some(seed) => LaunchDigest::from_seed(seed),
        None => {
            let mut ld = LaunchDigest::new();
            ld.normal_pages(ovmf.gpa(), ovmf.data())?;
            ld
        }
    };
    metadata_pages(&mut ld, ovmf, params)?;
    let ap_eip = ovmf.sev_es_reset_eip()?;
    if ap_eip == 0 && params.vcpus > 1 {
        return Err(Error::Firmware(
            "the SEV-ES reset block's AP reset address is 0: the APs cannot start".into(),
        ));
    }
    let bsp = vmsa::page(
        vmsa::BSP_EIP,
        params.guest_features,
        params.vcpu_signature,
        params.vmm,
    );
    let ap = vmsa::page(
        ap_eip,
        params.guest_features,
        params.vcpu_signature,
        params.vmm,
    );
    for i in 0..params.vcpus {
        ld.vmsa_page(if i == 0 { &bsp } else { &ap });
    }
    Ok(ld.digest())
}

/// The digest of the firmware's pages alone (what `firmware_digest` takes).
pub fn firmware_digest(ovmf: &Ovmf<'_>) -> Result<[u8; 48]> {
    let mut ld = LaunchDigest::new();
    ld.normal_pages(ovmf.gpa(), ovmf.data())?;
    Ok(ld.digest())
}

fn metadata_pages(ld: &mut LaunchDigest, ovmf: &Ovmf<'_>, params: &LaunchParams) -> Result<()> {
    let mut has_hashes_section = false;
    for s in ovmf.sections() {
        let (gpa, size) = (u64::from(s.gpa), u64::from(s.size));
        match s.kind {
            SectionKind::SnpSecMem if params.vmm == Vmm::Gce => ld.unmeasured_pages(gpa, size)?,
            SectionKind::SnpSecMem | SectionKind::SvsmCaa => ld.zero_pages(gpa, size)?,
            SectionKind::SnpSecrets => ld.secrets_page(gpa),
            // EC2 adds the CPUID page after every other section.
            SectionKind::Cpuid if params.vmm == Vmm::Ec2 => {}
            SectionKind::Cpuid => ld.cpuid_page(gpa),
            SectionKind::SnpKernelHashes => {
                has_hashes_section = true;
                match &params.kernel_hashes {
                    Some(h) => {
                        if size != 4096 {
                            return Err(Error::Firmware(format!(
                                "the kernel-hashes section is {size} bytes, not one page"
                            )));
                        }
                        let table = ovmf.sev_hashes_table_gpa()?;
                        ld.normal_page(gpa, &h.page(table as usize & 0xfff)?);
                    }
                    None => ld.zero_pages(gpa, size)?,
                }
            }
        }
    }
    if params.vmm == Vmm::Ec2 {
        for s in ovmf.sections() {
            if s.kind == SectionKind::Cpuid {
                ld.cpuid_page(u64::from(s.gpa));
            }
        }
    }
    if params.kernel_hashes.is_some() && !has_hashes_section {
        return Err(Error::Unsupported(
            "a kernel was given, but this firmware's SEV metadata has no kernel-hashes section \
             (use an OVMF built for measured direct boot, e.g. AmdSev)"
                .into(),
        ));
    }
    Ok(())
}
