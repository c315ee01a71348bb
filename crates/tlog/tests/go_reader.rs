#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Our log read by a reader no one here wrote: Go's `golang.org/x/mod/sumdb/tlog` and
//! `sumdb/note` (Debian's `golang-golang-x-mod-dev`, built by Debian's `golang-go` in GOPATH
//! mode; `.ci/run` installs both) verify the checkpoint's signature, the tree hash from our
//! tiles, every entry's inclusion and the consistency between checkpoints — across tile
//! boundaries up to the spec's 70 000-leaf shape — and refuse our logs tampered with. Skips
//! visibly where Go is absent; fails instead under `.ci/run` (`CGX_REQUIRE_PEERS`).

use std::path::{Path, PathBuf};
use std::process::Command;

use cgx_tlog::Checkpoint;
use cgx_tlog::dir::publish;
use cgx_tlog::note::{KeyKind, NoteSigner, sign_checkpoint};
use cgx_tlog::tree::MemoryTree;

const GOPATH: &str = "/usr/share/gocode";

fn skip(what: &str) {
    assert!(
        std::env::var_os("CGX_REQUIRE_PEERS").is_none(),
        "CGX_REQUIRE_PEERS is set, but {what}"
    );
    eprintln!("SKIPPED {what}");
}

/// The Go reader, built once into `dir`.
fn build(dir: &Path) -> Option<PathBuf> {
    if Command::new("go").arg("version").output().is_err() {
        skip("go is not installed (Debian: golang-go)");
        return None;
    }
    if !Path::new(GOPATH)
        .join("src/golang.org/x/mod/sumdb/tlog")
        .is_dir()
    {
        skip("Go's sumdb/tlog is not installed (Debian: golang-golang-x-mod-dev)");
        return None;
    }
    let bin = dir.join("tlogread");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/go/tlogread.go");
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(&src)
        .env("GO111MODULE", "off")
        .env("GOPATH", GOPATH)
        .env("GOCACHE", dir.join("gocache"))
        .env("GOFLAGS", "")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "go build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(bin)
}

/// Run the reader: Ok(stdout) or Err(stderr).
fn read(bin: &Path, dir: &Path, vkey: &str, old: Option<&Path>) -> Result<String, String> {
    let mut c = Command::new(bin);
    c.arg("-dir").arg(dir).arg("-vkey").arg(vkey);
    if let Some(old) = old {
        c.arg("-old").arg(old);
    }
    let out = c.output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

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

const ORIGIN: &str = "cgx.example/log";

fn leaf(i: u64) -> Vec<u8> {
    format!("{{\"kind\":\"cgx.audit.v1\",\"seq\":{i}}}").into_bytes()
}

fn copy(from: &Path, name: &str) -> PathBuf {
    let to = from.with_extension(name);
    let _ = std::fs::remove_dir_all(&to);
    assert!(
        Command::new("cp")
            .arg("-r")
            .arg(from)
            .arg(&to)
            .status()
            .unwrap()
            .success()
    );
    to
}

#[test]
fn go_sumdb_reads_and_verifies_our_log() {
    let work = std::env::temp_dir().join(format!("cgx-tlog-go-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let Some(bin) = build(&work) else { return };
    let log = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &key()).unwrap();
    let vkey = log.vkey();
    let dir = work.join("log");
    let mut tree = MemoryTree::new();
    let mut seen: Option<PathBuf> = None;
    // Sizes across tile boundaries, up to the spec's example of 70 000 leaves (273 full
    // level-0 tiles, one of width 112, a level-1 tile and a half, a level-2 tile).
    for (step, target) in [1u64, 255, 256, 257, 1000, 70_000].into_iter().enumerate() {
        let old = tree.size();
        while tree.size() < target {
            tree.append(&leaf(tree.size())).unwrap();
        }
        let note = signed(&tree, &log);
        publish(&dir, &tree, old, &note).unwrap();
        let out = read(&bin, &dir, &vkey, seen.as_deref()).unwrap();
        assert!(out.starts_with(&format!("ok: {target} leaves")), "{out}");
        let keep = work.join(format!("checkpoint-{step}"));
        std::fs::write(&keep, &note).unwrap();
        seen = Some(keep);
    }
    // The tampering below is on a log of 1000 leaves: each refusal is quicker to reach than
    // on the last.
    let mut small = MemoryTree::new();
    for i in 0..1000 {
        small.append(&leaf(i)).unwrap();
    }
    let big = dir;
    let dir = work.join("small");
    publish(&dir, &small, 0, &signed(&small, &log)).unwrap();
    let tree = small;
    let seen = work.join("checkpoint-4");
    let first = work.join("checkpoint-0");

    // An edited entry.
    let d = copy(&dir, "edited");
    let p = d.join("tile/entries/002");
    let mut b = std::fs::read(&p).unwrap();
    b[10] ^= 1;
    std::fs::write(&p, b).unwrap();
    let e = read(&bin, &d, &vkey, None).unwrap_err();
    assert!(e.contains("not included"), "{e}");
    // A hash tile changed.
    let d = copy(&dir, "tile");
    let p = d.join("tile/0/001");
    let mut t = std::fs::read(&p).unwrap();
    t[40] ^= 1;
    std::fs::write(&p, t).unwrap();
    assert!(read(&bin, &d, &vkey, None).is_err());
    // Another log's key; a checkpoint signed by a stranger under our name.
    let other = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &key()).unwrap();
    assert!(read(&bin, &dir, &other.vkey(), None).is_err());
    let d = copy(&dir, "forged");
    std::fs::write(d.join("checkpoint"), signed(&tree, &other)).unwrap();
    let e = read(&bin, &d, &vkey, None).unwrap_err();
    assert!(e.contains("checkpoint"), "{e}");
    // A rolled-back checkpoint (the first one, put back) after the last was seen.
    // (On the grown log, which still serves the first checkpoint's partial tiles.)
    let d = copy(&big, "rolled");
    std::fs::copy(&first, d.join("checkpoint")).unwrap();
    assert!(read(&bin, &d, &vkey, None).is_ok());
    let e = read(&bin, &d, &vkey, Some(&seen)).unwrap_err();
    assert!(e.contains("rolled back"), "{e}");
    // A fork: another history of the same size under the log's key.
    let fork = work.join("fork");
    let mut forked = MemoryTree::new();
    for i in 0..tree.size() {
        forked
            .append(&leaf(if i == 12 { 1_000_000 } else { i }))
            .unwrap();
    }
    publish(&fork, &forked, 0, &signed(&forked, &log)).unwrap();
    assert!(read(&bin, &fork, &vkey, None).is_ok());
    let e = read(&bin, &fork, &vkey, Some(&work.join("checkpoint-4"))).unwrap_err();
    assert!(e.contains("not consistent"), "{e}");
    let _ = std::fs::remove_dir_all(&work);
    for ext in ["edited", "tile", "forged"] {
        let _ = std::fs::remove_dir_all(dir.with_extension(ext));
    }
    let _ = std::fs::remove_dir_all(big.with_extension("rolled"));
}
