#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The Authenticode digest (`cgx_measure::tdx::pe`, what the firmware measures for a kernel)
//! against LIEF's (`lief.PE.Binary.authentihash`, PyPI `lief` 0.16; CI installs it) on real EFI
//! images: Debian's systemd-boot and its Linux EFI stub (`systemd-boot-efi`), and the stub
//! signed with `sbsign` (`sbsigntool`), which appends a certificate table. Skips visibly where a
//! peer is absent; fails instead under `.ci/run` (`CGX_REQUIRE_PEERS`).

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
