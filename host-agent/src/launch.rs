//! One launch description, two readers: the QEMU launcher boots exactly this VM
//! ([`Launch::qemu_args`]), and `cgx measure launch` computes the reference values of exactly
//! this VM ([`Launch::measure_args`]: the flags of `cgx measure snp|tdx`). A provider edits one
//! TOML table; the digest a report must carry and the VM that carries it cannot drift apart.
//!
//! ```toml
//! [launch]
//! tee = "snp"                      # snp | tdx | none (TCG tests: no TEE, nothing measured)
//! firmware = "/usr/share/ovmf/OVMF.amdsev.fd"   # OVMF (snp) or TDVF (tdx)
//! kernel = "/var/lib/cgx/image/vmlinuz"
//! initrd = "/var/lib/cgx/image/initrd.img"
//! append = "console=ttyS0"
//! vcpus = 4
//! vcpu_type = "EPYC-Genoa"         # snp: the QEMU CPU model the digest depends on
//! memory_mib = 16384
//! host_data = "<64 hex>"           # snp: HOST_DATA (e.g. an init-data digest)
//! id_block = "launch/id-block.b64" # snp: from `cgx measure snp --id-key … --out launch`
//! id_auth = "launch/id-auth.b64"
//! policy = "0x30000"               # snp guest policy
//! mrconfigid = "<96 hex>"          # tdx
//! vfio = ["0000:41:00.0"]          # GPUs passed through
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Which confidential-computing technology the VM launches under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tee {
    Snp,
    Tdx,
    /// No TEE (QEMU TCG in tests): nothing is measured.
    None,
}

/// A confidential VM's launch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    pub tee: Tee,
    /// OVMF (SNP) or TDVF (TDX); for `none`, optional firmware (`-bios`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<PathBuf>,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    #[serde(default)]
    pub append: String,
    pub vcpus: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu_type: Option<String>,
    pub memory_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_block: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_auth: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mrconfigid: Option<String>,
    #[serde(default)]
    pub vfio: Vec<String>,
}

/// Why a launch description is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    #[error("launch.{field}: {why}")]
    Field { field: &'static str, why: String },
}

fn bad<T>(field: &'static str, why: impl Into<String>) -> Result<T, LaunchError> {
    Err(LaunchError::Field {
        field,
        why: why.into(),
    })
}

fn hex_of(
    field: &'static str,
    v: &Option<String>,
    len: usize,
) -> Result<Option<Vec<u8>>, LaunchError> {
    match v {
        None => Ok(None),
        Some(h) => match hex::decode(h) {
            Ok(b) if b.len() == len => Ok(Some(b)),
            _ => bad(field, format!("{len} bytes of hex")),
        },
    }
}

/// How the guest reaches its host agent (the guest has no network address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Channel {
    /// A virtio-serial port named `cgx.0`, backed by a Unix socket on the host.
    VirtioSerial { socket: PathBuf },
}

impl Launch {
    /// Check what QEMU and the measurement would otherwise each refuse differently.
    pub fn check(&self) -> Result<(), LaunchError> {
        if self.vcpus == 0 || self.vcpus > 4096 {
            return bad("vcpus", "1 to 4096");
        }
        if self.memory_mib < 256 {
            return bad("memory_mib", "at least 256");
        }
        if self.append.contains('\0') || self.append.len() > 2048 {
            return bad("append", "at most 2048 bytes, no NUL");
        }
        for a in &self.vfio {
            let ok = a.len() == 12
                && a.bytes().enumerate().all(|(i, b)| match i {
                    4 | 7 => b == b':',
                    10 => b == b'.',
                    _ => b.is_ascii_hexdigit(),
                });
            if !ok {
                return bad("vfio", format!("'{a}' is not a PCI address (0000:41:00.0)"));
            }
        }
        // QEMU splits option values at commas: a comma in a value would add options the
        // measurement does not know of.
        for (field, p) in [
            ("firmware", self.firmware.as_ref()),
            ("kernel", Some(&self.kernel)),
            ("initrd", Some(&self.initrd)),
            ("id_block", self.id_block.as_ref()),
            ("id_auth", self.id_auth.as_ref()),
        ] {
            if let Some(p) = p
                && (p.to_string_lossy().contains(',') || p.as_os_str().is_empty())
            {
                return bad(field, "a path without commas");
            }
        }
        if let Some(t) = &self.vcpu_type
            && (t.is_empty()
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
        {
            return bad(
                "vcpu_type",
                "a QEMU CPU model name (letters, digits, '-', '_', '.')",
            );
        }
        match self.tee {
            Tee::Snp => {
                if self.firmware.is_none() {
                    return bad("firmware", "an SNP launch needs OVMF");
                }
                if self.vcpu_type.is_none() {
                    return bad(
                        "vcpu_type",
                        "an SNP launch's digest depends on the vCPU type (e.g. EPYC-Genoa)",
                    );
                }
                hex_of("host_data", &self.host_data, 32)?;
                if self.id_block.is_some() != self.id_auth.is_some() {
                    return bad("id_block", "id_block and id_auth go together");
                }
                if self.mrconfigid.is_some() {
                    return bad("mrconfigid", "a TDX field in an SNP launch");
                }
            }
            Tee::Tdx => {
                if self.firmware.is_none() {
                    return bad("firmware", "a TDX launch needs TDVF");
                }
                hex_of("mrconfigid", &self.mrconfigid, 48)?;
                if self.host_data.is_some() || self.id_block.is_some() || self.policy.is_some() {
                    return bad("host_data", "SNP fields in a TDX launch");
                }
            }
            Tee::None => {}
        }
        if let Some(p) = &self.policy {
            let digits = p.strip_prefix("0x").unwrap_or(p);
            if u64::from_str_radix(digits, 16).is_err() {
                return bad("policy", "a hex number");
            }
        }
        Ok(())
    }

    /// QEMU's arguments for this launch, the guest's channel to its host agent, and `tcg`
    /// (no KVM: tests).
    pub fn qemu_args(&self, channel: &Channel, tcg: bool) -> Result<Vec<String>, LaunchError> {
        self.check()?;
        let Channel::VirtioSerial { socket } = channel;
        if socket.to_string_lossy().contains(',') {
            return bad("socket", "a path without commas");
        }
        let b64 = |b: &[u8]| {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(b)
        };
        let path = |p: &PathBuf| p.display().to_string();
        let mut a: Vec<String> = Vec::new();
        let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
        push(&["-nodefaults", "-nographic", "-no-reboot"]);
        push(&["-serial", "stdio"]);
        let mem = format!("{}M", self.memory_mib);
        match self.tee {
            Tee::Snp => {
                let mut obj =
                    "sev-snp-guest,id=sev0,cbitpos=51,reduced-phys-bits=1,kernel-hashes=on"
                        .to_string();
                if let Some(p) = &self.policy {
                    obj += &format!(",policy={p}");
                }
                if let Some(h) = hex_of("host_data", &self.host_data, 32)? {
                    obj += &format!(",host-data={}", b64(&h));
                }
                if let (Some(b), Some(au)) = (&self.id_block, &self.id_auth) {
                    // QEMU takes the values; `cgx measure snp --out` writes them as files.
                    let read = |field: &'static str, p: &PathBuf| {
                        std::fs::read_to_string(p)
                            .map_err(|e| LaunchError::Field {
                                field,
                                why: format!("{}: {e}", p.display()),
                            })
                            .and_then(|t| {
                                let t = t.trim().to_string();
                                if t.len() > 4096 || t.contains(',') {
                                    bad(field, "not an ID block file of cgx measure snp")
                                } else {
                                    Ok(t)
                                }
                            })
                    };
                    obj += &format!(
                        ",id-block={},id-auth={}",
                        read("id_block", b)?,
                        read("id_auth", au)?
                    );
                }
                push(&[
                    "-machine",
                    "q35,confidential-guest-support=sev0,memory-backend=ram0",
                    "-object",
                    &format!("memory-backend-memfd,id=ram0,size={mem},share=true"),
                    "-object",
                    &obj,
                    "-enable-kvm",
                ]);
            }
            Tee::Tdx => {
                let mut obj = "tdx-guest,id=tdx0".to_string();
                if let Some(m) = hex_of("mrconfigid", &self.mrconfigid, 48)? {
                    obj += &format!(",mrconfigid={}", b64(&m));
                }
                push(&[
                    "-machine",
                    "q35,confidential-guest-support=tdx0,kernel-irqchip=split",
                    "-object",
                    &obj,
                    "-enable-kvm",
                ]);
            }
            Tee::None => {
                push(&["-machine", "q35"]);
                if tcg {
                    push(&["-accel", "tcg"]);
                } else {
                    push(&["-enable-kvm"]);
                }
            }
        }
        if let Some(fw) = &self.firmware {
            push(&["-bios", &path(fw)]);
        }
        if let Some(cpu) = &self.vcpu_type {
            push(&["-cpu", cpu]);
        }
        push(&["-smp", &self.vcpus.to_string(), "-m", &mem]);
        push(&[
            "-kernel",
            &path(&self.kernel),
            "-initrd",
            &path(&self.initrd),
        ]);
        if !self.append.is_empty() {
            push(&["-append", &self.append]);
        }
        for (i, dev) in self.vfio.iter().enumerate() {
            push(&["-device", &format!("vfio-pci,host={dev},id=gpu{i}")]);
        }
        match channel {
            Channel::VirtioSerial { socket } => push(&[
                "-device",
                "virtio-serial-pci,id=cgxserial",
                "-chardev",
                &format!(
                    "socket,id=cgx0,path={},server=on,wait=off",
                    socket.display()
                ),
                "-device",
                "virtserialport,chardev=cgx0,name=cgx.0",
            ]),
        }
        Ok(a)
    }

    /// The flags of `cgx measure snp` or `cgx measure tdx` that measure this launch (`None`
    /// for a launch without a TEE).
    pub fn measure_args(&self) -> Result<Option<Vec<String>>, LaunchError> {
        self.check()?;
        let path = |p: &PathBuf| p.display().to_string();
        let Some(fw) = &self.firmware else {
            return Ok(None);
        };
        let mut a = Vec::new();
        match self.tee {
            Tee::None => return Ok(None),
            Tee::Snp => {
                a.extend(["snp".into(), "--ovmf".into(), path(fw)]);
                a.extend(["--vcpus".into(), self.vcpus.to_string()]);
                if let Some(t) = &self.vcpu_type {
                    a.extend(["--vcpu-type".into(), t.clone()]);
                }
            }
            Tee::Tdx => {
                a.extend(["tdx".into(), "--tdvf".into(), path(fw)]);
                a.extend(["--memory".into(), format!("{}M", self.memory_mib)]);
            }
        }
        a.extend(["--kernel".into(), path(&self.kernel)]);
        a.extend(["--initrd".into(), path(&self.initrd)]);
        a.extend(["--append".into(), self.append.clone()]);
        // HOST_DATA and the ID block are not in the launch digest: QEMU takes them from this
        // description, and the KBS compares HOST_DATA with the init-data it was given.
        Ok(Some(a))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const SNP: &str = r#"
            tee = "snp"
            firmware = "/fw/OVMF.fd"
            kernel = "/img/vmlinuz"
            initrd = "/img/initrd.img"
            append = "console=ttyS0"
            vcpus = 4
            vcpu_type = "EPYC-Genoa"
            memory_mib = 8192
            host_data = "0101010101010101010101010101010101010101010101010101010101010101"
            vfio = ["0000:41:00.0"]
            "#;

    fn snp() -> Launch {
        toml::from_str(SNP).unwrap()
    }

    #[test]
    fn the_vm_booted_is_the_vm_measured() {
        let l = snp();
        let q = l
            .qemu_args(
                &Channel::VirtioSerial {
                    socket: "/run/cgx/vm.sock".into(),
                },
                false,
            )
            .unwrap()
            .join(" ");
        for part in [
            "sev-snp-guest,id=sev0,cbitpos=51,reduced-phys-bits=1,kernel-hashes=on,host-data=AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=",
            "-bios /fw/OVMF.fd",
            "-cpu EPYC-Genoa",
            "-smp 4 -m 8192M",
            "-kernel /img/vmlinuz -initrd /img/initrd.img -append console=ttyS0",
            "vfio-pci,host=0000:41:00.0",
            "virtserialport,chardev=cgx0,name=cgx.0",
        ] {
            assert!(q.contains(part), "{part} not in {q}");
        }
        let m = l.measure_args().unwrap().unwrap().join(" ");
        assert_eq!(
            m,
            "snp --ovmf /fw/OVMF.fd --vcpus 4 --vcpu-type EPYC-Genoa --kernel /img/vmlinuz \
             --initrd /img/initrd.img --append console=ttyS0"
        );
    }

    #[test]
    fn bad_descriptions_are_refused_by_field() {
        for (edit, field) in [
            (r#"vcpus = 0"#, "vcpus"),
            (r#"host_data = "01""#, "host_data"),
            (r#"vfio = ["41:00.0"]"#, "vfio"),
            (r#"mrconfigid = "00""#, "mrconfigid"),
            (r#"policy = "zz""#, "policy"),
            (r#"memory_mib = 1"#, "memory_mib"),
            (r#"id_block = "a.b64""#, "id_block"),
            (r#"vcpu_type = "EPYC,+invtsc""#, "vcpu_type"),
            (r#"kernel = "/img/vmlinuz,x=1""#, "kernel"),
        ] {
            let key = edit.split_once(" = ").unwrap().0;
            let mut text: String = SNP
                .lines()
                .filter(|l| !l.trim_start().starts_with(&format!("{key} =")))
                .map(|l| format!("{l}\n"))
                .collect();
            text.push_str(edit);
            let l: Launch = toml::from_str(&text).unwrap();
            let e = l.check().unwrap_err().to_string();
            assert!(e.starts_with(&format!("launch.{field}")), "{edit}: {e}");
        }
        let e = toml::from_str::<Launch>("tee = \"sgx\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sgx"), "{e}");
    }
}
