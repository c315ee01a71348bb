#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cgx audit verify`: a log directory checked offline — ok, and its state file kept; then
//! the same log tampered with (an edited leaf, a forged checkpoint, a rolled-back one after a
//! later was seen): each a VIOLATION with its reason and exit status 1, the state file kept as
//! it was.

use std::path::Path;
use std::process::Command;

use cgx_tlog::Checkpoint;
use cgx_tlog::dir::publish;
use cgx_tlog::note::{KeyKind, NoteSigner, sign_checkpoint};
use cgx_tlog::tree::MemoryTree;

const ORIGIN: &str = "broker.test/log";

fn key() -> Vec<u8> {
    aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
        .unwrap()
        .as_ref()
        .to_vec()
}

fn signed(tree: &MemoryTree, log: &NoteSigner) -> Vec<u8> {
    let cp = Checkpoint::new(ORIGIN, tree.size(), tree.root().unwrap(), "").unwrap();
    sign_checkpoint(&cp, log).unwrap()
}

/// A leaf as the broker writes one (an event of no consequence: the cross-checks pass it).
fn leaf(i: u64) -> Vec<u8> {
    format!(
        "{{\"action\":\"test.event\",\"actor\":\"test\",\"at\":{i},\"detail\":{{}},\"kind\":\"cgx.audit.v1\",\"seq\":{},\"service\":\"cgx-broker\",\"subject\":\"s\"}}",
        i + 1
    )
    .into_bytes()
}

fn verify(dir: &Path, vkey: &str, state: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["audit", "verify", "--log"])
        .arg(dir)
        .args(["--log-key", vkey, "--state"])
        .arg(state)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn audit_verify_passes_a_log_and_names_each_violation() {
    let work = std::env::temp_dir().join(format!("cgx-audit-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let log = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &key()).unwrap();
    let vkey = log.vkey();
    let dir = work.join("log");
    let state = work.join("seen");
    let mut tree = MemoryTree::new();
    for i in 0..300u64 {
        tree.append(&leaf(i)).unwrap();
    }
    publish(&dir, &tree, 0, &signed(&tree, &log)).unwrap();
    let (code, out) = verify(&dir, &vkey, &state);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("ok: log broker.test/log — 300 leaves"),
        "{out}"
    );
    let first = std::fs::read(&state).unwrap();
    // One event's tlog-proof, exported and checked alone; a changed leaf is refused.
    let pf = work.join("leaf.tlog-proof");
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["audit", "proof", "--log"])
        .arg(&dir)
        .args(["--log-key", &vkey, "--seq", "43", "--out"])
        .arg(&pf)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check = |f: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args(["audit", "verify-proof"])
            .arg(f)
            .args(["--log-key", &vkey])
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, text) = check(&pf);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.starts_with("ok: leaf 42 is in broker.test/log's tree of 300 leaves"),
        "{text}"
    );
    let forged = String::from_utf8(std::fs::read(&pf).unwrap()).unwrap();
    let mut lines: Vec<String> = forged.lines().map(str::to_string).collect();
    lines[1] = format!(
        "extra {}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, leaf(41))
    );
    std::fs::write(work.join("forged.tlog-proof"), lines.join("\n") + "\n").unwrap();
    let (code, text) = check(&work.join("forged.tlog-proof"));
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("not included"), "{text}");
    // Grown: extends what was seen.
    for i in 300..700u64 {
        tree.append(&leaf(i)).unwrap();
    }
    publish(&dir, &tree, 300, &signed(&tree, &log)).unwrap();
    let (code, out) = verify(&dir, &vkey, &state);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("extends the checkpoint of 300 leaves"),
        "{out}"
    );
    let seen = std::fs::read(&state).unwrap();
    assert_ne!(seen, first);

    let copy = |name: &str| {
        let d = work.join(name);
        assert!(
            Command::new("cp")
                .arg("-r")
                .arg(&dir)
                .arg(&d)
                .status()
                .unwrap()
                .success()
        );
        d
    };
    // An edited leaf.
    let d = copy("edited");
    let p = d.join("tile/entries/001");
    let mut b = std::fs::read(&p).unwrap();
    b[3] ^= 1;
    std::fs::write(&p, b).unwrap();
    let (code, out) = verify(&d, &vkey, &state);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.starts_with("VIOLATION: leaf 256: not included"),
        "{out}"
    );
    // A checkpoint signed by a key that is not the log's.
    let d = copy("forged");
    let stranger = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &key()).unwrap();
    std::fs::write(d.join("checkpoint"), signed(&tree, &stranger)).unwrap();
    let (code, out) = verify(&d, &vkey, &state);
    assert_eq!(
        (code, out.starts_with("VIOLATION: signed note")),
        (1, true),
        "{out}"
    );
    // The first checkpoint put back after the second was seen.
    let d = copy("rolled");
    std::fs::write(d.join("checkpoint"), &first).unwrap();
    let (code, out) = verify(&d, &vkey, &state);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("rolled back: 300 leaves"), "{out}");
    // No violation moved the state on.
    assert_eq!(std::fs::read(&state).unwrap(), seen);
    // A key that is not a verifier key: a usage error (2), said so.
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["audit", "verify", "--log"])
        .arg(&dir)
        .args(["--log-key", "nonsense"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--log-key"));
    let _ = std::fs::remove_dir_all(&work);
}
