//! `cgx audit fetch|verify`: the broker's transparency log copied to a directory and checked
//! there with nothing else of ours running — the checkpoint's signature under the log's key,
//! every leaf by its inclusion proof, and consistency with the last checkpoint this auditor
//! saw (kept in a state file). Prints by exception; exits 1 on any violation.

use std::path::Path;
use std::process::ExitCode;

use cgx_tlog::note::NoteKey;
use cgx_tlog::paths;
use cgx_tlog::verify::{Trust, verify_dir};

use crate::broker::Conn;
use crate::output::{CliResult, print_json};

/// Copy the broker's log (its newest checkpoint, every hash tile and entry bundle of that tree)
/// into `out`, checkpoint last: its size. Entry bundles need an auditor's key.
pub fn fetch_log(client: &cgx_broker::client::BrokerClient, out: &Path) -> Result<u64, String> {
    fetch_log_with(
        &|p: &str| client.log_file(p).map_err(|e| e.to_string()),
        out,
    )
}

/// Copy a log served under a prefix (`get` reads `checkpoint` and `tile/…` there) into `out`,
/// checkpoint last: its size.
pub fn fetch_log_with(
    get: &dyn Fn(&str) -> Result<Vec<u8>, String>,
    out: &Path,
) -> Result<u64, String> {
    let note = get("checkpoint")?;
    // The size only: the checkpoint is verified by `verify`, not here.
    let size: u64 = String::from_utf8_lossy(&note)
        .lines()
        .nth(1)
        .and_then(|l| l.parse().ok())
        .ok_or("the checkpoint has no size line")?;
    if size > cgx_tlog::MAX_SIZE {
        return Err(format!(
            "the checkpoint claims {size} leaves, more than the {} a log holds",
            cgx_tlog::MAX_SIZE
        ));
    }
    let put = |rel: &str, bytes: &[u8]| -> Result<(), String> {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))
    };
    for t in cgx_tlog::tiles_of(size) {
        let p = paths::tile_path(&t);
        put(&p, &get(&p).map_err(|e| format!("{p}: {e}"))?)?;
        if t.level() == 0 {
            let b = paths::tile_path(&paths::bundle_tile(t.level_index(), t.width()));
            put(&b, &get(&b).map_err(|e| format!("{b}: {e}"))?)?;
        }
    }
    put("checkpoint", &note)?;
    Ok(size)
}

/// `cgx audit fetch --out DIR [--archive DIR]`.
pub fn fetch(conn: &Conn, out: &Path, archive: Option<&Path>) -> CliResult {
    let client = conn.client()?;
    let size = fetch_log(&client, out)?;
    println!("fetched {size} leaves into {}", out.display());
    if let Some(dir) = archive {
        let n = fetch_archive(&client, out, dir)?;
        println!("fetched {n} archived pieces into {}", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `cgx audit fetch-kbs --kbs URL --admin-key FILE --out DIR`: the KBS's own log (entry
/// bundles with an unscoped administrator's token).
pub fn fetch_kbs(kbs: &str, admin_key: &Path, ca: Option<&Path>, out: &Path) -> CliResult {
    let token = crate::kbs::admin_token(admin_key, 300)?;
    let ca_pem = ca
        .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
        .transpose()?;
    let agent = cgx_kbs::client::agent(ca_pem.as_deref()).map_err(|e| e.to_string())?;
    let size = fetch_kbs_log(&agent, kbs, &token, out)?;
    println!(
        "fetched the KBS's log, {size} leaves, into {}",
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Copy the KBS at `base`'s log into `out` (entry bundles with the administrator's `token`):
/// its size.
pub fn fetch_kbs_log(
    agent: &ureq::Agent,
    base: &str,
    token: &str,
    out: &Path,
) -> Result<u64, String> {
    let base = base.trim_end_matches('/');
    let get = |p: &str| -> Result<Vec<u8>, String> {
        let url = format!("{base}/kbs/v0/log/{p}");
        let mut r = agent
            .get(&url)
            .header("authorization", &format!("Bearer {token}"))
            .call()
            .map_err(|e| format!("{url}: {e}"))?;
        if r.status().as_u16() != 200 {
            return Err(format!("{url}: {}", r.status()));
        }
        // The largest entry bundle: 256 leaves of at most 65 535 bytes, each length-prefixed.
        r.body_mut()
            .with_config()
            .limit(256 * (2 + 65_535))
            .read_to_vec()
            .map_err(|e| format!("{url}: {e}"))
    };
    fetch_log_with(&get, out)
}

/// Copy every archived piece the leaves of the log in `log` name into `dir` (each file named
/// by its SHA-256, checked before it is written): how many.
pub fn fetch_archive(
    client: &cgx_broker::client::BrokerClient,
    log: &Path,
    dir: &Path,
) -> Result<u64, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut n = 0;
    for leaf in cgx_tlog::verify::read_leaves(log).map_err(|e| e.to_string())? {
        let Ok(j) = serde_json::from_slice::<serde_json::Value>(&leaf) else {
            continue;
        };
        let Some(detail) = j["detail"].as_object() else {
            continue;
        };
        for (k, v) in detail {
            let Some(sha) = v.as_str().filter(|_| k.ends_with("_sha256")) else {
                continue;
            };
            if !matches!(
                k.as_str(),
                "registration_sha256" | "collateral_sha256" | "ear_sha256"
            ) || !cgx_protocol::archive::is_address(sha)
                || dir.join(sha).exists()
            {
                continue;
            }
            let bytes = client
                .log_file(&format!("archive/{sha}"))
                .map_err(|e| format!("archive {sha}: {e}"))?;
            if cgx_protocol::archive::address(&bytes) != sha {
                return Err(format!("the broker's archived {sha} does not hash to it"));
            }
            std::fs::write(dir.join(sha), &bytes).map_err(|e| format!("{sha}: {e}"))?;
            n += 1;
        }
    }
    Ok(n)
}

/// What `cgx audit verify` is asked to check.
#[derive(Debug, Clone, Default)]
pub struct VerifyArgs {
    pub log_key: String,
    pub witnesses: Vec<String>,
    pub quorum: usize,
    pub state: Option<std::path::PathBuf>,
    pub archive: Option<std::path::PathBuf>,
    /// Windows are paid on their records alone (the broker runs without proofs).
    pub no_proofs: bool,
    /// Re-verify every archived registration against the trust roots and re-appraise it under
    /// this policy and these reference values (files; the built-in ones where absent) at its
    /// recorded time: its tier must be the one its leaf says.
    pub reappraise: bool,
    pub policy: Option<std::path::PathBuf>,
    pub refs: Option<std::path::PathBuf>,
    /// Simulator root pins trusted in re-appraisal (development networks only).
    pub sim_roots: Vec<String>,
    /// The KBS's own log (a directory `fetch` laid out) and its key: verified too, every
    /// release held to the broker's leases, every anchored KBS checkpoint to the KBS's log.
    pub kbs_log: Option<std::path::PathBuf>,
    pub kbs_log_key: Option<String>,
    /// How many of the witnesses must have cosigned the KBS's checkpoint.
    pub kbs_quorum: usize,
    /// Report violations of leaves in `[from, to)` only (every leaf is still read: what a
    /// leaf rests on may come before the range).
    pub from: Option<u64>,
    pub to: Option<u64>,
    /// Record the verdict with this broker, signed in with this auditor's key.
    pub report: Option<(String, std::path::PathBuf)>,
    pub json: bool,
}

/// `cgx audit verify --log DIR --log-key VKEY [--witness VKEY… --quorum N] [--state FILE]
/// [--archive DIR] [--from N --to N] [--json]`: the log's own checks, then the cross-checks
/// (`audit_check`). Prints by exception; exit 1 on any violation.
pub fn verify(log: &Path, a: &VerifyArgs) -> CliResult {
    let trust = trust_of(a)?;
    let state = a.state.as_deref();
    let seen = match state {
        Some(p) if p.exists() => {
            Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?)
        }
        _ => None,
    };
    // A progress bar on stderr, for a terminal and a log long enough to wait for.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut last = 0;
    let mut progress = |done: u64, all: u64| {
        if !tty || all < 200_000 || (done - last < all / 100 && done < all) {
            return;
        }
        last = done;
        let filled = usize::try_from(done * 40 / all.max(1)).unwrap_or(40);
        eprint!(
            "\r[{}{}] {:>3}% {done}/{all} leaves",
            "#".repeat(filled),
            " ".repeat(40 - filled.min(40)),
            done * 100 / all.max(1)
        );
        if done >= all {
            eprintln!();
        }
    };
    let v = match cgx_tlog::verify::verify_dir_with(log, &trust, seen.as_deref(), &mut progress) {
        Ok(v) => v,
        Err(e) => {
            if a.json {
                print_json(&serde_json::json!({"valid": false, "error": e.to_string()}))?;
            } else {
                println!("VIOLATION: {e}");
            }
            return Ok(ExitCode::from(1));
        }
    };
    let mut report = cgx_audit::check(
        &v.leaves,
        cgx_audit::Rules {
            service: "cgx-broker",
            proofs: !a.no_proofs,
            archive: a.archive.as_deref(),
        },
    );
    if a.reappraise {
        let archive = a
            .archive
            .as_deref()
            .ok_or("--reappraise needs --archive (the evidence it re-verifies)")?;
        let read = |p: &Option<std::path::PathBuf>| -> Result<Option<String>, String> {
            p.as_ref()
                .map(|p| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display())))
                .transpose()
        };
        let r = cgx_broker::server::reappraise::Reappraiser::new(
            read(&a.policy)?.as_deref(),
            read(&a.refs)?.as_deref(),
            &a.sim_roots,
        )?;
        let (n, violations) = reappraise_all(&v.leaves, archive, &r);
        report.reappraised = n;
        report.violations.extend(violations);
    }
    let mut kbs_checked = None;
    if let Some(dir) = &a.kbs_log {
        let key = a
            .kbs_log_key
            .as_deref()
            .ok_or("--kbs-log needs --kbs-log-key")?;
        let kbs_trust = Trust {
            log: NoteKey::parse(key).map_err(|e| format!("--kbs-log-key: {e}"))?,
            witnesses: trust.witnesses.clone(),
            quorum: a.kbs_quorum,
        };
        match verify_dir(dir, &kbs_trust, None) {
            Ok(k) => {
                let origin = k.opened.checkpoint.origin().to_string();
                let mut r = cgx_audit::check(
                    &k.leaves,
                    cgx_audit::Rules {
                        service: "cgx-kbs",
                        proofs: !a.no_proofs,
                        archive: None,
                    },
                );
                // Named as the KBS's (their index is in the KBS's log).
                let kbs = |mut x: cgx_audit::Violation| {
                    x.action = format!("kbs {}", x.action);
                    x
                };
                report.violations.extend(r.violations.drain(..).map(kbs));
                report.violations.extend(
                    cgx_audit::check_releases(&k.leaves, &v.leaves)
                        .into_iter()
                        .map(kbs),
                );
                report
                    .violations
                    .extend(cgx_audit::check_anchors(&v.leaves, &origin, &k.leaves));
                kbs_checked = Some((origin, k.size));
            }
            Err(e) => report.violations.push(cgx_audit::Violation {
                index: 0,
                action: "kbs log".into(),
                reason: e.to_string(),
            }),
        }
    }
    // A range narrows the broker's leaves reported; a violation of the whole log (the ledger,
    // the KBS's log) is always reported.
    let ranged = a.from.is_some() || a.to.is_some();
    report.violations.retain(|x| {
        x.action == "ledger"
            || x.action.starts_with("kbs")
            || (a.from.is_none_or(|f| x.index >= f) && a.to.is_none_or(|t| x.index < t))
    });
    let seen_size = seen.as_deref().and_then(|s| {
        String::from_utf8_lossy(s)
            .lines()
            .nth(1)
            .and_then(|l| l.parse::<u64>().ok())
    });
    let valid = report.violations.is_empty();
    if let Some(p) = state
        && valid
        && !ranged
    {
        // The checkpoint verified (the bytes read and checked, not the file again): what the
        // next run must extend. Kept only when everything held.
        cgx_service::durable::write_atomic(p, &v.note)
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if a.json {
        print_json(&serde_json::json!({
            "valid": valid,
            "origin": v.opened.checkpoint.origin(),
            "size": v.size,
            "root": v.root.to_string(),
            "cosigned_by": v.opened.cosigned.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "extends": seen_size,
            "checked": &report,
        }))?;
    } else {
        for x in &report.violations {
            println!(
                "VIOLATION leaf {} ({}): {}",
                x.index,
                printable(&x.action),
                printable(&x.reason)
            );
        }
        println!(
            "{}: log {} — {} leaves, root {}; every leaf included{}{}; {} registrations, {} leases, {} records, {} proofs judged, {} windows paid, {} transfers replayed{}; {} violations",
            if valid { "ok" } else { "FAILED" },
            v.opened.checkpoint.origin(),
            v.size,
            v.root,
            match seen_size {
                Some(n) => format!("; extends the checkpoint of {n} leaves seen before"),
                None => String::new(),
            },
            if v.opened.cosigned.is_empty() {
                String::new()
            } else {
                format!(
                    "; cosigned by {}",
                    v.opened
                        .cosigned
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
            report.registrations,
            report.leases,
            report.records,
            report.verdicts,
            report.payments,
            report.transfers,
            if a.archive.is_some() {
                format!(
                    ", {} archived pieces rehashed, {} registrations re-verified and re-appraised",
                    report.archived, report.reappraised
                )
            } else {
                String::new()
            },
            report.violations.len()
        );
        if let Some((origin, size)) = &kbs_checked {
            println!(
                "and the KBS's log {origin}: {size} leaves, every release held to the broker's leases, every anchored checkpoint a prefix of it"
            );
        }
    }
    if let Some((broker, key)) = &a.report {
        let mut checks = Vec::new();
        if a.archive.is_some() {
            checks.push("archive".to_string());
        }
        if a.reappraise {
            checks.push("reappraise".into());
        }
        if a.kbs_log.is_some() {
            checks.push("kbs-log".into());
        }
        if !a.no_proofs {
            checks.push("proofs".into());
        }
        let verdict = cgx_protocol::broker::LogVerdict {
            origin: v.opened.checkpoint.origin().to_string(),
            size: v.size.to_string(),
            root: v.root.to_string(),
            violations: report.violations.len() as u64,
            checks,
        };
        let conn = crate::broker::Conn {
            broker: broker.clone(),
            key: Some(key.clone()),
            ca: None,
            json: false,
        };
        conn.client()?
            .log_verdict(&verdict)
            .map_err(|e| format!("recording the verdict with {broker}: {e}"))?;
        if !a.json {
            println!("verdict recorded with {broker} (an audit.verdict leaf)");
        }
    }
    Ok(if valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `cgx witness vkey --config FILE`: the witness's verifier key.
pub fn witness_vkey(config: &Path) -> CliResult {
    let cfg: cgx_service::witness::WitnessConfig =
        cgx_service::config::load_service(config, |_: &mut cgx_service::witness::WitnessConfig| {})
            .map_err(|e: cgx_service::ServiceError| e.to_string())?;
    let w = cgx_service::witness::Witness::open(&cfg).map_err(|e| e.to_string())?;
    println!("{}", w.vkey());
    Ok(ExitCode::SUCCESS)
}

/// `cgx audit proof --log DIR --log-key VKEY (--index N | --seq N) [--out FILE]`: one leaf's
/// C2SP tlog-proof (the leaf, its inclusion proof, the checkpoint with its cosignatures) from
/// a log directory verified first.
pub fn proof(
    log: &Path,
    a: &VerifyArgs,
    index: Option<u64>,
    seq: Option<i64>,
    out: Option<&Path>,
) -> CliResult {
    let trust = trust_of(a)?;
    let v = verify_dir(log, &trust, None).map_err(|e| format!("the log does not verify: {e}"))?;
    let index = match (index, seq) {
        (Some(i), None) => i,
        (None, Some(s)) => v
            .leaves
            .iter()
            .position(|l| {
                serde_json::from_slice::<serde_json::Value>(l)
                    .is_ok_and(|j| j["seq"].as_i64() == Some(s))
            })
            .map(|i| i as u64)
            .ok_or_else(|| format!("no leaf of seq {s} in the log"))?,
        _ => return Err("name the event by --index or --seq (one of them)".into()),
    };
    let leaf = v
        .leaves
        .get(usize::try_from(index).map_err(|e| e.to_string())?)
        .ok_or_else(|| format!("no leaf {index}: the log holds {}", v.size))?
        .clone();
    let mut tree = cgx_tlog::tree::MemoryTree::new();
    for l in &v.leaves {
        tree.append(l).map_err(|e| e.to_string())?;
    }
    let p = cgx_tlog::proof::TlogProof {
        extra: Some(leaf),
        index,
        hashes: tree
            .prove_inclusion(v.size, index)
            .map_err(|e| e.to_string())?,
        checkpoint: v.note.clone(),
    };
    match out {
        Some(f) => std::fs::write(f, p.to_bytes()).map_err(|e| format!("{}: {e}", f.display()))?,
        None => {
            use std::io::Write as _;
            std::io::stdout()
                .write_all(&p.to_bytes())
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `cgx audit verify-proof FILE --log-key VKEY [--witness VKEY… --quorum N] [--json]`: a
/// tlog-proof checked alone; the leaf printed. Exit 1 when it does not hold.
pub fn verify_proof(file: &Path, a: &VerifyArgs) -> CliResult {
    let trust = trust_of(a)?;
    let bytes = read_capped(file, cgx_tlog::proof::MAX_PROOF_FILE)?;
    let checked = cgx_tlog::proof::TlogProof::parse(&bytes).and_then(|p| {
        p.verify(&trust.log, &trust.witnesses, trust.quorum)
            .map(|o| (p, o))
    });
    match checked {
        Ok((p, o)) => {
            let leaf: serde_json::Value =
                serde_json::from_slice(p.extra.as_deref().unwrap_or_default())
                    .unwrap_or(serde_json::Value::Null);
            if a.json {
                print_json(&serde_json::json!({
                    "valid": true,
                    "index": p.index,
                    "size": o.checkpoint.size(),
                    "origin": o.checkpoint.origin(),
                    "cosigned_by": o.cosigned.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                    "leaf": leaf,
                }))?;
            } else {
                println!(
                    "ok: leaf {} is in {}'s tree of {} leaves{}: {}",
                    p.index,
                    o.checkpoint.origin(),
                    o.checkpoint.size(),
                    if o.cosigned.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", cosigned by {}",
                            o.cosigned
                                .iter()
                                .map(|(n, _)| n.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    },
                    leaf
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if a.json {
                print_json(&serde_json::json!({"valid": false, "error": e.to_string()}))?;
            } else {
                println!("VIOLATION: {e}");
            }
            Ok(ExitCode::from(1))
        }
    }
}

fn trust_of(a: &VerifyArgs) -> Result<Trust, String> {
    let witnesses = a
        .witnesses
        .iter()
        .map(|w| NoteKey::parse(w).map_err(|e| format!("--witness: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    if a.quorum > witnesses.len() {
        return Err(format!(
            "--quorum {}: only {} witnesses named",
            a.quorum,
            witnesses.len()
        ));
    }
    Ok(Trust {
        log: NoteKey::parse(&a.log_key).map_err(|e| format!("--log-key: {e}"))?,
        witnesses,
        quorum: a.quorum,
    })
}

/// A regular file's bytes, at most `max` of them.
fn read_capped(p: &Path, max: usize) -> Result<Vec<u8>, String> {
    use std::io::Read as _;
    let f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let meta = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a regular file", p.display()));
    }
    let mut b = Vec::new();
    f.take(max as u64 + 1)
        .read_to_end(&mut b)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    if b.len() > max {
        return Err(format!("{}: more than {max} bytes", p.display()));
    }
    Ok(b)
}

/// Every archived registration of `leaves` re-verified and re-appraised at its leaf's time: how
/// many, and each whose tier differs from its leaf's (or whose evidence no longer verifies).
pub fn reappraise_all(
    leaves: &[Vec<u8>],
    archive: &Path,
    r: &cgx_broker::server::reappraise::Reappraiser,
) -> (u64, Vec<cgx_audit::Violation>) {
    let mut n = 0;
    let mut out = Vec::new();
    for (i, l) in leaves.iter().enumerate() {
        let Ok(j) = serde_json::from_slice::<serde_json::Value>(l) else {
            continue;
        };
        if j["action"] != "node.register" {
            continue;
        }
        let d = &j["detail"];
        let piece = |f: &str| -> Result<Vec<u8>, String> {
            let sha = d[f]
                .as_str()
                .filter(|s| cgx_protocol::archive::is_address(s));
            let sha = sha.ok_or_else(|| format!("{f} names no piece"))?;
            let b = read_capped(&archive.join(sha), 16 << 20)?;
            if cgx_protocol::archive::address(&b) != sha {
                return Err(format!("{f}: the piece does not hash to its name"));
            }
            Ok(b)
        };
        let judged = piece("registration_sha256").and_then(|reg| {
            let col = piece("collateral_sha256")?;
            r.reappraise(&reg, &col, j["at"].as_i64().unwrap_or(0))
        });
        let why = match judged {
            // The leaf must name whom the archived evidence is of, whatever its tier.
            Ok(r)
                if j["subject"] != r.node_id.as_str()
                    || d["node_key"] != r.node_key.as_str()
                    || d["tee_thumbprint"] != r.tee_thumbprint.as_str()
                    || d["operator"] != r.operator.as_str() =>
            {
                Some(format!(
                    "the archived evidence is node {}'s (operator {}, TEE key {}), not what the leaf names",
                    r.node_id, r.operator, r.tee_thumbprint
                ))
            }
            Ok(r) if d["status"] == r.tier.to_string() => None,
            Ok(r) => Some(format!(
                "re-appraised as {} ({}), the broker recorded {}",
                r.tier,
                r.violations.join("; "),
                d["status"]
            )),
            Err(e) => Some(format!("its evidence does not re-verify: {e}")),
        };
        n += 1;
        if let Some(reason) = why {
            out.push(cgx_audit::Violation {
                index: i as u64,
                action: "node.register".into(),
                reason,
            });
        }
    }
    (n, out)
}

/// `s` with control characters escaped: a leaf's text printed to a terminal cannot move the
/// cursor or hide a line.
fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}
