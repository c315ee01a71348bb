//! The cgx guest image (`cgx image build`): a direct-boot kernel from Debian's packages and an
//! initrd holding the static guest agent as `/init`, its settings and the few kernel modules it
//! needs — nothing else. The same inputs give the same bytes (`cpio`'s rules), so the launch
//! digest `cgx measure snp|tdx` computes over the kernel, the initrd and the command line is the
//! digest of every VM booted from them, wherever it was built.
//!
//! What the initrd holds, all measured (SNP's kernel hashes, TDX's RTMRs):
//!
//! ```text
//! init                  the guest agent (static); as process 1 it runs guest-agent/src/init.rs
//! etc/cgx/agent.args    its arguments, one per line: the broker, the KBS, the broker's
//!                       lease-signing key, the CA — a host cannot point the VM elsewhere
//! etc/cgx/ca.pem        the CA the broker's and the KBS's certificates chain to (optional)
//! etc/cgx/modules       the modules init loads, dependencies first
//! lib/modules/*.ko      virtio_console (the host channel) and what it needs; configfs and
//!                       the TSM drivers when the kernel has them as modules
//! dev/console, proc, sys, run, tmp
//! ```

pub mod cpio;
pub mod modinfo;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use cpio::{Body, Entry};

/// Modules the agent cannot work without: the host channel (virtio-serial over virtio-pci).
pub const REQUIRED_MODULES: &[&str] = &["virtio_pci", "virtio_console"];
/// Modules taken when the kernel has them (configfs-tsm on SNP and TDX guests).
pub const OPTIONAL_MODULES: &[&str] = &["configfs", "tsm", "sev_guest", "tdx_guest"];
/// The kernel command line when none is given: the console on the first serial port (the
/// host agent's log), and a panic ends the VM instead of hanging it.
pub const DEFAULT_APPEND: &str = "console=ttyS0 panic=-1 quiet";

/// What an image is built from.
#[derive(Debug, Clone, Default)]
pub struct Spec {
    pub kernel: PathBuf,
    /// `lib/modules/<version>` of the kernel's package (`None`: a kernel with the drivers
    /// built in).
    pub modules: Option<PathBuf>,
    /// The guest agent, statically linked.
    pub agent: PathBuf,
    /// Its arguments (`run --broker … --channel cgx.0 …`).
    pub args: Vec<String>,
    pub ca: Option<PathBuf>,
    pub append: String,
}

/// Why an image cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    #[error("{path}: {detail}")]
    Read { path: String, detail: String },
    #[error("module {module}: {detail}")]
    Module { module: String, detail: String },
    #[error(
        "agent argument {0:?}: one line, not empty, no surrounding spaces, not starting with #"
    )]
    Arg(String),
    #[error("{0}")]
    Archive(#[from] cpio::CpioError),
}

fn read(p: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(p).map_err(|e| ImageError::Read {
        path: p.display().to_string(),
        detail: e.to_string(),
    })
}

/// A module's name as the kernel knows it (`sev-guest.ko` is `sev_guest`).
fn module_name(s: &str) -> String {
    s.trim_end_matches(".ko").replace('-', "_")
}

/// Every `.ko` under `dir`, by name (paths sorted, so the first of two is always the same),
/// and the names built into the kernel (`modules.builtin`).
fn index(dir: &Path) -> Result<(BTreeMap<String, PathBuf>, BTreeSet<String>), ImageError> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| ImageError::Read {
            path: d.display().to_string(),
            detail: e.to_string(),
        })?;
        for e in rd.flatten() {
            // The entry's own type: a symbolic link is neither followed nor taken.
            let Ok(kind) = e.file_type() else { continue };
            let p = e.path();
            if kind.is_dir() {
                stack.push(p);
            } else if kind.is_file() && p.extension().is_some_and(|x| x == "ko") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut by_name = BTreeMap::new();
    for f in files {
        if let Some(n) = f.file_name().and_then(|n| n.to_str()) {
            by_name.entry(module_name(n)).or_insert(f);
        }
    }
    let builtin = std::fs::read_to_string(dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next().map(module_name))
        .collect();
    Ok((by_name, builtin))
}

/// The modules to load for `wanted` (and `optional` where present), dependencies first.
pub fn resolve(
    dir: &Path,
    wanted: &[&str],
    optional: &[&str],
) -> Result<Vec<(String, PathBuf, Vec<u8>)>, ImageError> {
    let (by_name, builtin) = index(dir)?;
    let mut order: Vec<(String, PathBuf, Vec<u8>)> = Vec::new();
    let mut done = BTreeSet::new();
    fn visit(
        name: &str,
        by_name: &BTreeMap<String, PathBuf>,
        builtin: &BTreeSet<String>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        order: &mut Vec<(String, PathBuf, Vec<u8>)>,
    ) -> Result<(), ImageError> {
        let err = |detail: String| ImageError::Module {
            module: name.to_string(),
            detail,
        };
        if done.contains(name) || builtin.contains(name) {
            return Ok(());
        }
        if path.iter().any(|p| p == name) || path.len() > 64 {
            return Err(err(format!("a dependency cycle: {}", path.join(" → "))));
        }
        let file = by_name
            .get(name)
            .ok_or_else(|| err("neither a module file nor built in".into()))?;
        let bytes = read(file)?;
        let deps = modinfo::depends(&bytes).map_err(|e| err(e.to_string()))?;
        path.push(name.to_string());
        for d in deps {
            visit(&module_name(&d), by_name, builtin, path, done, order)?;
        }
        path.pop();
        done.insert(name.to_string());
        order.push((name.to_string(), file.clone(), bytes));
        Ok(())
    }
    // The wanted modules, then the optional ones the kernel ships.
    let names = wanted.iter().map(|w| module_name(w)).chain(
        optional
            .iter()
            .map(|o| module_name(o))
            .filter(|n| by_name.contains_key(n)),
    );
    for n in names {
        visit(
            &n,
            &by_name,
            &builtin,
            &mut Vec::new(),
            &mut done,
            &mut order,
        )?;
    }
    Ok(order)
}

/// A built image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub kernel: Vec<u8>,
    pub initrd: Vec<u8>,
    pub cmdline: String,
    pub modules: Vec<String>,
    pub agent_sha256: String,
}

fn sha256(b: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b))
}

/// Build the image of `spec`.
pub fn build(spec: &Spec) -> Result<Image, ImageError> {
    for a in &spec.args {
        if a.is_empty() || a.contains(['\n', '\r']) || a.trim() != a || a.starts_with('#') {
            return Err(ImageError::Arg(a.clone()));
        }
    }
    let kernel = read(&spec.kernel)?;
    let agent = read(&spec.agent)?;
    let modules = match &spec.modules {
        Some(dir) => resolve(dir, REQUIRED_MODULES, OPTIONAL_MODULES)?,
        None => Vec::new(),
    };
    let dir = |p: &str| Entry {
        path: p.into(),
        perm: 0o755,
        body: Body::Dir,
    };
    let file = |p: String, perm: u32, data: Vec<u8>| Entry {
        path: p,
        perm,
        body: Body::File(data),
    };
    let mut entries = vec![
        dir("dev"),
        Entry {
            path: "dev/console".into(),
            perm: 0o600,
            body: Body::CharDevice(5, 1),
        },
        dir("etc"),
        dir("etc/cgx"),
        dir("lib"),
        dir("lib/modules"),
        dir("proc"),
        dir("run"),
        dir("sys"),
        Entry {
            path: "tmp".into(),
            perm: 0o1777,
            body: Body::Dir,
        },
        file("init".into(), 0o755, agent.clone()),
        file(
            "etc/cgx/agent.args".into(),
            0o644,
            format!("{}\n", spec.args.join("\n")).into_bytes(),
        ),
    ];
    if let Some(ca) = &spec.ca {
        entries.push(file("etc/cgx/ca.pem".into(), 0o644, read(ca)?));
    }
    let mut list = String::new();
    for (name, _, bytes) in &modules {
        list += &format!("/lib/modules/{name}.ko\n");
        entries.push(file(format!("lib/modules/{name}.ko"), 0o644, bytes.clone()));
    }
    entries.push(file("etc/cgx/modules".into(), 0o644, list.into_bytes()));
    let initrd = cpio::write(&entries)?;
    Ok(Image {
        kernel,
        initrd,
        cmdline: if spec.append.is_empty() {
            DEFAULT_APPEND.to_string()
        } else {
            spec.append.clone()
        },
        modules: modules.into_iter().map(|(n, _, _)| n).collect(),
        agent_sha256: sha256(&agent),
    })
}

impl Image {
    /// Write `vmlinuz`, `initrd.img`, `cmdline` and `image.json` (what went in, by digest)
    /// into `dir`.
    pub fn write(&self, dir: &Path) -> Result<PathBuf, ImageError> {
        let w = |name: &str, b: &[u8]| {
            std::fs::write(dir.join(name), b).map_err(|e| ImageError::Read {
                path: dir.join(name).display().to_string(),
                detail: e.to_string(),
            })
        };
        std::fs::create_dir_all(dir).map_err(|e| ImageError::Read {
            path: dir.display().to_string(),
            detail: e.to_string(),
        })?;
        w("vmlinuz", &self.kernel)?;
        w("initrd.img", &self.initrd)?;
        w("cmdline", self.cmdline.as_bytes())?;
        let manifest = serde_json::json!({
            "kernel_sha256": sha256(&self.kernel),
            "initrd_sha256": sha256(&self.initrd),
            "agent_sha256": self.agent_sha256,
            "cmdline": self.cmdline,
            "modules": self.modules,
        });
        let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
        w("image.json", text.as_bytes())?;
        Ok(dir.join("image.json"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cgx-image-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A module tree as Debian's kernel package lays it out.
    fn modules(d: &Path) {
        let put = |p: &str, depends: &str| {
            let f = d.join(p);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(
                f,
                modinfo::tests::elf(format!("depends={depends}\0").as_bytes()),
            )
            .unwrap();
        };
        put(
            "kernel/drivers/char/virtio_console.ko",
            "virtio,virtio_ring",
        );
        put("kernel/drivers/virtio/virtio_ring.ko", "virtio");
        put("kernel/drivers/virtio/virtio.ko", "");
        put(
            "kernel/drivers/virtio/virtio_pci.ko",
            "virtio,virtio_ring,virtio_pci_modern_dev",
        );
        put("kernel/drivers/virtio/virtio_pci_modern_dev.ko", "");
        put("kernel/fs/configfs/configfs.ko", "");
        put("kernel/drivers/virt/coco/sev-guest/sev-guest.ko", "tsm");
        std::fs::write(
            d.join("modules.builtin"),
            "kernel/drivers/virt/coco/tsm.ko\n",
        )
        .unwrap();
    }

    #[test]
    fn the_same_inputs_give_the_same_image_with_dependencies_first() {
        let d = tmp("same");
        modules(&d.join("mods"));
        std::fs::write(d.join("vmlinuz"), b"kernel").unwrap();
        std::fs::write(d.join("agent"), b"\x7fELF agent").unwrap();
        let spec = Spec {
            kernel: d.join("vmlinuz"),
            modules: Some(d.join("mods")),
            agent: d.join("agent"),
            args: vec!["run".into(), "--broker".into(), "https://b.example".into()],
            ca: None,
            append: String::new(),
        };
        let a = build(&spec).unwrap();
        assert_eq!(
            a.modules,
            [
                "virtio",
                "virtio_ring",
                "virtio_pci_modern_dev",
                "virtio_pci",
                "virtio_console",
                "configfs",
                "sev_guest"
            ]
        );
        assert_eq!(a.cmdline, DEFAULT_APPEND);
        // Built again (another process, another day: nothing of either is in the bytes).
        assert_eq!(a, build(&spec).unwrap());
        a.write(&d.join("out1")).unwrap();
        build(&spec).unwrap().write(&d.join("out2")).unwrap();
        for f in ["vmlinuz", "initrd.img", "cmdline", "image.json"] {
            assert_eq!(
                std::fs::read(d.join("out1").join(f)).unwrap(),
                std::fs::read(d.join("out2").join(f)).unwrap(),
                "{f}"
            );
        }
        // Another setting is another image (and another launch digest).
        let mut other = spec.clone();
        other.args[2] = "https://elsewhere.example".into();
        assert_ne!(build(&other).unwrap().initrd, a.initrd);
        // Refusals, each with its reason.
        for bad in ["", " run", "a\nb", "# x"] {
            let mut s = spec.clone();
            s.args.push(bad.into());
            assert!(matches!(build(&s), Err(ImageError::Arg(_))), "{bad:?}");
        }
        std::fs::remove_file(d.join("mods/kernel/drivers/virtio/virtio.ko")).unwrap();
        let e = build(&spec).unwrap_err().to_string();
        assert_eq!(e, "module virtio: neither a module file nor built in");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
