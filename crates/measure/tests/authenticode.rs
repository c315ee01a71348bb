#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The Authenticode digest (`cgx_measure::tdx::pe`, what the firmware measures for a kernel)
//! against LIEF's (`lief.PE.Binary.authentihash`, PyPI `lief` 0.16; CI installs it) on real EFI
//! images: Debian's systemd-boot and its Linux EFI stub (`systemd-boot-efi`), and the stub
//! signed with `sbsign` (`sbsigntool`), which appends a certificate table; and a real signed
//! Debian kernel (`CGX_TEST_KERNEL`, which `.ci/run` fetches), as shipped and as QEMU patches
//! its setup header for a direct boot — the digest the firmware measures into RTMR[1]. Skips
//! visibly where a peer is absent; fails instead under `.ci/run` (`CGX_REQUIRE_PEERS`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn skip(what: &str) {
    assert!(
        std::env::var_os("CGX_REQUIRE_PEERS").is_none(),
        "CGX_REQUIRE_PEERS is set, but {what}"
    );
    eprintln!("SKIPPED {what}");
}

fn lief(path: &Path) -> Option<String> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import lief, sys; lief.logging.disable(); \
             print(lief.PE.parse(sys.argv[1]).authentihash(lief.PE.ALGORITHMS.SHA_384).hex())",
        ])
        .arg(path)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The stub signed by `sbsign` with a throwaway key, or None where the tools are absent.
fn signed(stub: &Path, dir: &Path) -> Option<PathBuf> {
    let key = dir.join("k.pem");
    let cert = dir.join("c.pem");
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=cgx test",
            "-days",
            "1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .is_ok_and(|o| o.status.success());
    let out = dir.join("signed.efi");
    (ok && Command::new("sbsign")
        .arg("--key")
        .arg(&key)
        .arg("--cert")
        .arg(&cert)
        .arg("--output")
        .arg(&out)
        .arg(stub)
        .output()
        .is_ok_and(|o| o.status.success()))
    .then_some(out)
}

#[test]
fn authenticode_matches_lief_on_real_efi_images() {
    let dir = std::env::temp_dir().join(format!("cgx-authenticode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stub = PathBuf::from("/usr/lib/systemd/boot/efi/linuxx64.efi.stub");
    let mut images: Vec<PathBuf> = [
        stub.clone(),
        "/usr/lib/systemd/boot/efi/systemd-bootx64.efi".into(),
    ]
    .into_iter()
    .filter(|p| p.is_file())
    .collect();
    if images.is_empty() {
        skip("authenticode: no EFI images (apt-get install systemd-boot-efi)");
        return;
    }
    match signed(&stub, &dir) {
        Some(s) => images.push(s),
        None => skip("authenticode (signed image): no sbsign (apt-get install sbsigntool)"),
    }
    for img in &images {
        let Some(expected) = lief(img) else {
            skip("authenticode: no LIEF (pip install lief==0.16.7)");
            return;
        };
        let bytes = std::fs::read(img).unwrap();
        let ours = cgx_measure::tdx::pe::authenticode_sha384(&bytes).unwrap();
        assert_eq!(hex::encode(ours), expected, "{}", img.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The digest Debian's signature on `path` covers (its SpcIndirectDataContent), as LIEF reads
/// it from the PKCS#7: `(algorithm, hex)`.
fn signed_digest(path: &Path) -> Option<(String, String)> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import lief, sys; lief.logging.disable(); \
             c = lief.PE.parse(sys.argv[1]).signatures[0].content_info; \
             print(str(c.digest_algorithm).split('.')[-1], bytes(c.digest).hex())",
        ])
        .arg(path)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let (alg, hex) = text.split_once(' ')?;
    out.status
        .success()
        .then(|| (alg.to_string(), hex.to_string()))
}

/// A real bzImage (Debian's signed cloud kernel). Its Authenticode SHA-256 equals the digest
/// Debian's signing key signed: the ranges hashed are the ones a real signer (and UEFI) hash —
/// LIEF's own `authentihash` gets this image wrong (it misreads Linux's short optional header),
/// so the signature is the reference here. Then QEMU's header changes for a 16 MiB initrd in
/// 4 GiB and in 1 GiB of memory: only the setup header changes, inside the hashed headers, so
/// the firmware's digest moves with the memory size.
#[test]
fn a_real_kernel_as_qemu_hands_it_over() {
    let Some(kernel) = std::env::var_os("CGX_TEST_KERNEL").map(PathBuf::from) else {
        skip(
            "authenticode (real kernel): CGX_TEST_KERNEL is not set (.ci/run fetches Debian's cloud kernel)",
        );
        return;
    };
    let bytes = std::fs::read(&kernel).unwrap();
    let Some((alg, signed)) = signed_digest(&kernel) else {
        skip(
            "authenticode (real kernel): no LIEF to read its signature (pip install lief==0.16.7)",
        );
        return;
    };
    assert_eq!(alg, "SHA_256", "{}", kernel.display());
    let ours = cgx_measure::tdx::pe::authenticode_sha256(&bytes).unwrap();
    assert_eq!(hex::encode(ours), signed, "{}", kernel.display());
    let shipped = cgx_measure::tdx::pe::authenticode_sha384(&bytes).unwrap();
    let mut digests = std::collections::BTreeSet::new();
    for memory in [4u64 << 30, 1 << 30] {
        let patched = cgx_measure::tdx::kernel::qemu_patched(&bytes, 16 << 20, memory).unwrap();
        let changed: Vec<usize> = (0..bytes.len())
            .filter(|&i| bytes[i] != patched[i])
            .collect();
        assert!(
            changed.iter().all(|i| (0x210..0x230).contains(i)),
            "{changed:x?}"
        );
        digests.insert(cgx_measure::tdx::pe::authenticode_sha384(&patched).unwrap());
    }
    assert_eq!(digests.len(), 2);
    assert!(!digests.contains(&shipped));
}
