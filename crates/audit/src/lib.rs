//! **cgx-audit**: the auditor's cross-checks over a verified log's leaves (issue 33): what each decision must
//! rest on, judged from the leaves alone (and the archive, where given), with no server. Sans
//! I/O but for the archive's files. Each violation names its leaf, its action and why.
//!
//! - Every leaf is a `cgx.audit.v1` event of the log's service, `seq` growing.
//! - A lease is opened only on a node whose latest registration before it affirmed.
//! - An accepted metering record is signed by the lease's node under the key its registration
//!   attested, is of that lease, is the next of its chain (the previous record's hash, or the
//!   lease's genesis), and its hash is the one the leaf says.
//! - A window is paid (a `window` transfer) only on the accepted record of that window, whose
//!   hash the payment names, and, with proofs on, on a passing proof of each of the lease's
//!   GPUs covering it (its challenge of the latest window at or before it, or its first),
//!   judged before the payment.
//! - A slash for a proof names a failed proof judged before it.
//! - The ledger replayed from the transfer leaves refuses nothing and ends balanced.
//! - With an archive: every piece a registration names is there and hashes to its address.

pub mod schema;

use std::collections::HashMap;
use std::path::Path;

use cgx_ledger::{AccountId, Book, CauseKind, Phase, Transfer};
use cgx_protocol::metering::{MeteringRecord, genesis, token_hash};
use cgx_protocol::signed::{When, verify};
use serde_json::Value;

/// One violation: the leaf, its action, the reason.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    pub index: u64,
    pub action: String,
    pub reason: String,
}

/// What the checks covered.
#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    pub violations: Vec<Violation>,
    pub registrations: u64,
    pub leases: u64,
    pub records: u64,
    pub verdicts: u64,
    /// Windows paid (each one or more `window` transfers).
    pub payments: u64,
    pub transfers: u64,
    pub archived: u64,
    /// Registrations re-verified and re-appraised from the archive (by the caller).
    pub reappraised: u64,
}

/// How to judge.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    /// The service whose log this is (`cgx-broker`).
    pub service: &'a str,
    /// Whether windows are paid only under passing proofs (the broker's `[pow]` on).
    pub proofs: bool,
    /// The archive directory (pieces named by their SHA-256), if the auditor has it.
    pub archive: Option<&'a Path>,
}

/// Judged proofs by (lease, GPU): (window, passed, leaf index), in log order.
type Verdicts = HashMap<(String, u64), Vec<(u64, bool, u64)>>;

struct Node {
    key: Option<[u8; 32]>,
    affirming: bool,
    operator: String,
}

struct Lease {
    node: String,
    /// Its tenant, and its node's operator when it was opened.
    tenant: String,
    operator: String,
    gpus: Vec<u64>,
    /// Accepted records: seq → (hash, leaf index).
    records: HashMap<u64, (String, u64)>,
    last: Option<(u64, String)>,
}

/// Check `leaves` (in log order, from index 0).
pub fn check(leaves: &[Vec<u8>], rules: Rules<'_>) -> Report {
    let mut r = Report::default();
    let mut nodes: HashMap<String, Node> = HashMap::new();
    let mut leases: HashMap<String, Lease> = HashMap::new();
    // (lease, gpu) → [(window, passed, leaf index)], in log order.
    let mut verdicts: Verdicts = HashMap::new();
    // challenge id → what was judged, and whether it was slashed for.
    let mut challenges: HashMap<String, Challenge> = HashMap::new();
    // (lease, seq) of records refused as a second, different record of one window.
    let mut equivocations: std::collections::HashSet<(String, u64)> = Default::default();
    // (lease, window) paid to a provider.
    let mut provider_paid: std::collections::HashSet<(String, u64)> = Default::default();
    let mut book = Book::new();
    let mut chain: Vec<Transfer> = Vec::new();
    let mut paid: std::collections::HashSet<(String, u64)> = std::collections::HashSet::new();
    let mut last_seq = i64::MIN;
    let mut last_index = 0;
    for (i, bytes) in leaves.iter().enumerate() {
        let index = i as u64;
        last_index = index;
        let mut bad = |action: &str, reason: String| {
            r.violations.push(Violation {
                index,
                action: action.to_string(),
                reason,
            })
        };
        let Ok(leaf) = serde_json::from_slice::<Value>(bytes) else {
            bad("?", "not JSON".into());
            continue;
        };
        let action = leaf["action"].as_str().unwrap_or("?").to_string();
        if leaf["kind"] != "cgx.audit.v1" {
            bad(&action, format!("kind {}: not cgx.audit.v1", leaf["kind"]));
            continue;
        }
        if leaf["service"] != rules.service {
            bad(
                &action,
                format!("service {}: not {}", leaf["service"], rules.service),
            );
        }
        let seq = leaf["seq"].as_i64().unwrap_or(i64::MIN);
        if seq <= last_seq {
            bad(&action, format!("seq {seq} does not follow {last_seq}"));
        }
        last_seq = seq;
        let subject = leaf["subject"].as_str().unwrap_or("").to_string();
        let d = &leaf["detail"];
        match action.as_str() {
            "node.register" => {
                r.registrations += 1;
                let key = d["node_key"]
                    .as_str()
                    .and_then(cgx_protocol::broker::unb64)
                    .and_then(|k| <[u8; 32]>::try_from(k).ok());
                if key.is_none() {
                    bad(&action, "no node key".into());
                }
                nodes.insert(
                    subject.clone(),
                    Node {
                        key,
                        affirming: d["status"] == "affirming",
                        operator: d["operator"].as_str().unwrap_or("").to_string(),
                    },
                );
                for field in ["registration_sha256", "collateral_sha256", "ear_sha256"] {
                    if let Some(why) = archived(rules.archive, d[field].as_str(), &mut r.archived) {
                        bad(&action, format!("{field}: {why}"));
                    }
                }
            }
            "node.register.refused" => {
                for field in ["registration_sha256", "collateral_sha256"] {
                    if let Some(why) = archived(rules.archive, d[field].as_str(), &mut r.archived) {
                        bad(&action, format!("{field}: {why}"));
                    }
                }
            }
            "lease.open" => {
                r.leases += 1;
                let node = d["node"].as_str().unwrap_or("").to_string();
                match nodes.get(&node) {
                    Some(n) if n.affirming => {}
                    Some(_) => bad(
                        &action,
                        format!(
                            "lease {subject} opened on node {node}, whose registration does not affirm"
                        ),
                    ),
                    None => bad(
                        &action,
                        format!("lease {subject} opened on node {node}, never registered"),
                    ),
                }
                let gpus = d["gpus"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                if leases.contains_key(&subject) {
                    bad(&action, format!("lease {subject} opened twice"));
                    continue;
                }
                let operator = nodes
                    .get(&node)
                    .map(|n| n.operator.clone())
                    .unwrap_or_default();
                leases.insert(
                    subject.clone(),
                    Lease {
                        node,
                        tenant: d["tenant"].as_str().unwrap_or("").to_string(),
                        operator,
                        gpus,
                        records: HashMap::new(),
                        last: None,
                    },
                );
            }
            "metering.refuse" => {
                // An equivocation is proven by the leaves alone: the refused record, signed by
                // the lease's node under its attested key, of a window whose accepted record
                // is another.
                let seq: Option<u64> = d["seq"].as_str().and_then(|s| s.parse().ok());
                let claimed = d["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("differs from it under the same key"));
                if let (Some(seq), true) = (seq, claimed) {
                    let proven = leases.get(&subject).is_some_and(|l| {
                        let key = nodes.get(&l.node).and_then(|n| n.key);
                        let token = d["record"].as_str();
                        match (key, token, l.records.get(&seq)) {
                            (Some(key), Some(token), Some((held, _))) => {
                                verify::<MeteringRecord>(token, &[key], When::Any)
                                    .is_ok_and(|h| h.body.lease == subject && h.body.seq == seq)
                                    && token_hash(token) != *held
                            }
                            _ => false,
                        }
                    });
                    if proven {
                        equivocations.insert((subject.clone(), seq));
                    } else {
                        bad(
                            &action,
                            format!(
                                "record {seq} of lease {subject} refused as an equivocation the leaves do not prove"
                            ),
                        );
                    }
                }
            }
            "metering.accept" => {
                r.records += 1;
                if let Err(why) = accept(&mut leases, &nodes, &subject, &leaf, index) {
                    bad(&action, why);
                }
            }
            "pow.verdict" => {
                r.verdicts += 1;
                let lease = d["lease"].as_str().unwrap_or("").to_string();
                if let Some(l) = leases.get(&lease)
                    && d["node"].as_str().is_some_and(|n| n != l.node)
                {
                    bad(
                        &action,
                        format!(
                            "a verdict on node {} for lease {lease}, which is node {}'s",
                            d["node"], l.node
                        ),
                    );
                }
                let gpu = d["gpu"].as_u64().unwrap_or(u64::MAX);
                let window = d["window"].as_str().and_then(|w| w.parse().ok());
                let Some(window) = window else {
                    bad(&action, "no window".into());
                    continue;
                };
                let passed = d["state"] == "passed";
                verdicts
                    .entry((lease, gpu))
                    .or_default()
                    .push((window, passed, index));
                challenges.insert(
                    subject.clone(),
                    Challenge {
                        failed: d["state"] == "failed",
                        lease: d["lease"].as_str().unwrap_or("").to_string(),
                        slashed: false,
                    },
                );
            }
            "ledger.transfer" => {
                let Some(list) = d["transfers"].as_array() else {
                    bad(&action, "no transfers".into());
                    continue;
                };
                for t in list {
                    r.transfers += 1;
                    match transfer(t, leaf["at"].as_i64().unwrap_or(0)) {
                        Ok(t) => {
                            if let (CauseKind::Window, Some(l), Some(w)) =
                                (t.cause, &t.lease, t.window)
                            {
                                paid.insert((l.clone(), w));
                            }
                            let mut seen = Seen {
                                challenges: &mut challenges,
                                equivocations: &equivocations,
                                provider_paid: &mut provider_paid,
                            };
                            if let Some(why) =
                                backed(&t, &leases, &verdicts, &mut seen, rules.proofs)
                            {
                                bad(&action, format!("transfer {}: {why}", t.id));
                            }
                            chain.push(t);
                        }
                        Err(why) => bad(&action, format!("a transfer: {why}")),
                    }
                }
                if d["continues"] != true {
                    if let Some(last) = chain.last_mut() {
                        last.linked = false;
                    }
                    for (t, res) in chain.iter().zip(book.apply(&chain)) {
                        if let Err(e) = res {
                            bad(
                                &action,
                                format!("replayed, transfer {} is refused: {e}", t.id),
                            );
                        }
                    }
                    chain.clear();
                }
            }
            _ => {}
        }
    }
    r.payments = paid.len() as u64;
    if !chain.is_empty() {
        r.violations.push(Violation {
            index: last_index,
            action: "ledger.transfer".into(),
            reason: "the log ends inside a chain of transfers".into(),
        });
    }
    if let Err(e) = book.check() {
        r.violations.push(Violation {
            index: last_index,
            action: "ledger".into(),
            reason: format!("the ledger replayed from the leaves does not balance: {e}"),
        });
    }
    r
}

/// The KBS's releases against the broker's log (both verified): each release under a lease
/// is of a lease the broker opened, for the tenant and node the release names, on a node whose
/// registration (the latest before the lease) affirmed and attested the very TEE key the
/// resource went to, while the lease was live (from its opening to its end or its term); a
/// release without a lease went to a TEE key some affirming registration attested before it.
pub fn check_releases(kbs: &[Vec<u8>], broker: &[Vec<u8>]) -> Vec<Violation> {
    struct Open {
        at: i64,
        node: String,
        tenant: String,
        ends_at: i64,
        ended_at: Option<i64>,
        tee: Option<String>,
        affirming: bool,
    }
    // TEE key → its registrations: (when, affirming), in log order.
    let mut attested: HashMap<String, Vec<(i64, bool)>> = HashMap::new();
    // Node → (TEE key, affirming) of its latest registration.
    let mut nodes: HashMap<String, (String, bool)> = HashMap::new();
    let mut leases: HashMap<String, Open> = HashMap::new();
    for l in broker {
        let Ok(j) = serde_json::from_slice::<Value>(l) else {
            continue;
        };
        let d = &j["detail"];
        let at = j["at"].as_i64().unwrap_or(0);
        let subject = j["subject"].as_str().unwrap_or("").to_string();
        match j["action"].as_str() {
            Some("node.register") => {
                let tee = d["tee_thumbprint"].as_str().unwrap_or("").to_string();
                let affirming = d["status"] == "affirming";
                attested
                    .entry(tee.clone())
                    .or_default()
                    .push((at, affirming));
                nodes.insert(subject, (tee, affirming));
            }
            Some("lease.open") => {
                let node = d["node"].as_str().unwrap_or("").to_string();
                let (tee, affirming) = nodes
                    .get(&node)
                    .map(|(t, a)| (Some(t.clone()), *a))
                    .unwrap_or((None, false));
                leases.insert(
                    subject,
                    Open {
                        at,
                        node,
                        tenant: d["tenant"].as_str().unwrap_or("").to_string(),
                        ends_at: d["ends_at"].as_i64().unwrap_or(i64::MAX),
                        ended_at: None,
                        tee,
                        affirming,
                    },
                );
            }
            Some("lease.end") => {
                if let Some(o) = leases.get_mut(&subject) {
                    o.ended_at = Some(at);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (i, l) in kbs.iter().enumerate() {
        let Ok(j) = serde_json::from_slice::<Value>(l) else {
            continue;
        };
        if j["action"] != "release" {
            continue;
        }
        let d = &j["detail"];
        let at = j["at"].as_i64().unwrap_or(0);
        let path = j["subject"].as_str().unwrap_or("");
        let tee = d["tee_key"].as_str().unwrap_or("");
        // The resource's repository is its tenant's.
        let repo = path.split('/').next().unwrap_or("");
        let why = match d["lease"].as_str() {
            Some(lease) if d["tenant"].as_str() != Some(repo) => Some(format!(
                "released {path} under lease {lease} for tenant {}, not the resource's tenant {repo}",
                d["tenant"]
            )),
            Some(lease) => match leases.get(lease) {
                None => Some(format!(
                    "released {path} under lease {lease}, which the broker never opened"
                )),
                Some(o) if !o.affirming => Some(format!(
                    "released {path} under lease {lease}, on node {} whose registration did not affirm",
                    o.node
                )),
                Some(o) if o.tee.as_deref() != Some(tee) => Some(format!(
                    "released {path} to TEE key {tee}, not the key node {} attested",
                    o.node
                )),
                Some(o) if d["tenant"].as_str().is_some_and(|t| t != o.tenant) => Some(format!(
                    "released {path} for tenant {}, but lease {lease} is tenant {}'s",
                    d["tenant"], o.tenant
                )),
                Some(o) if at < o.at || at > o.ended_at.unwrap_or(o.ends_at).min(o.ends_at) => {
                    Some(format!(
                        "released {path} at {at}, outside lease {lease}'s life"
                    ))
                }
                Some(_) => None,
            },
            None => {
                // The latest registration of that TEE key before the release must affirm.
                let latest = attested
                    .get(tee)
                    .and_then(|v| v.iter().rev().find(|(t, _)| *t <= at));
                match latest {
                    Some((_, true)) => None,
                    _ => Some(format!(
                        "released {path} to TEE key {tee}, whose latest registration before it did not affirm"
                    )),
                }
            }
        };
        if let Some(reason) = why {
            out.push(Violation {
                index: i as u64,
                action: "release".into(),
                reason,
            });
        }
    }
    out
}

/// The checkpoints of another log (`origin`, the KBS's) that this log recorded (`log.anchor`
/// leaves) against that log's leaves, verified: each anchored tree must be a prefix of it, with
/// the root anchored. A log rewritten after another party recorded its checkpoint is caught
/// here, witnesses or not.
pub fn check_anchors(log: &[Vec<u8>], origin: &str, anchored: &[Vec<u8>]) -> Vec<Violation> {
    let mut tree = cgx_tlog::tree::MemoryTree::new();
    for l in anchored {
        if tree.append(l).is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    for (i, l) in log.iter().enumerate() {
        let Ok(j) = serde_json::from_slice::<Value>(l) else {
            continue;
        };
        if j["action"] != "log.anchor" || j["subject"] != origin {
            continue;
        }
        let d = &j["detail"];
        let size: Option<u64> = d["size"].as_str().and_then(|s| s.parse().ok());
        let root = d["root"]
            .as_str()
            .and_then(|r| cgx_tlog::Hash::parse_hash(r).ok());
        let why = match (size, root) {
            (Some(n), _) if n > tree.size() => Some(format!(
                "{origin}'s checkpoint of {n} leaves was anchored, but its log holds {}: rolled back",
                tree.size()
            )),
            (Some(0), _) => None,
            (Some(n), Some(r)) => match tree.root_at(n) {
                Ok(h) if h == r => None,
                _ => Some(format!(
                    "{origin}'s tree of {n} leaves is not the one anchored: its log was rewritten"
                )),
            },
            _ => Some("an anchor without a size or root".into()),
        };
        if let Some(reason) = why {
            out.push(Violation {
                index: i as u64,
                action: "log.anchor".into(),
                reason,
            });
        }
    }
    out
}

/// An accepted record checked against its lease, node and chain, then noted.
fn accept(
    leases: &mut HashMap<String, Lease>,
    nodes: &HashMap<String, Node>,
    lease_id: &str,
    leaf: &Value,
    index: u64,
) -> Result<(), String> {
    let d = &leaf["detail"];
    let lease = leases
        .get_mut(lease_id)
        .ok_or_else(|| format!("a record of lease {lease_id}, never opened"))?;
    if leaf["actor"] != format!("node:{}", lease.node) {
        return Err(format!(
            "accepted from {}, but lease {lease_id} is node {}'s",
            leaf["actor"], lease.node
        ));
    }
    let key = nodes
        .get(&lease.node)
        .and_then(|n| n.key)
        .ok_or_else(|| format!("node {} has no attested key", lease.node))?;
    let token = d["record"].as_str().ok_or("no record")?;
    let h = verify::<MeteringRecord>(token, &[key], When::Any)
        .map_err(|e| format!("the record is not node {}'s: {e}", lease.node))?;
    let rec = h.body;
    let seq: u64 = d["seq"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .ok_or("no seq")?;
    if rec.lease != lease_id || rec.seq != seq || rec.sub != lease.node {
        return Err(format!(
            "the record says lease {} seq {} node {}, the leaf lease {lease_id} seq {seq}",
            rec.lease, rec.seq, rec.sub
        ));
    }
    let hash = token_hash(token);
    if d["hash"] != hash.as_str() {
        return Err("the leaf's hash is not the record's".into());
    }
    let prev = match &lease.last {
        None if seq == 0 => genesis(lease_id),
        Some((s, h)) if *s + 1 == seq => h.clone(),
        _ => {
            return Err(format!(
                "record {seq} does not follow {:?}",
                lease.last.as_ref().map(|l| l.0)
            ));
        }
    };
    if rec.prev != prev {
        return Err(format!(
            "record {seq} does not link to the record before it"
        ));
    }
    lease.records.insert(seq, (hash.clone(), index));
    lease.last = Some((seq, hash));
    Ok(())
}

/// A transfer as its leaf carries it.
fn transfer(t: &Value, at: i64) -> Result<Transfer, String> {
    let s = |k: &str| t[k].as_str().ok_or_else(|| format!("no {k}"));
    let num = |k: &str| -> Result<u64, String> {
        s(k)?
            .parse()
            .map_err(|_| format!("{k} is not a decimal string"))
    };
    Ok(Transfer {
        id: s("id")?.to_string(),
        debit: s("debit")?
            .parse::<AccountId>()
            .map_err(|e| e.to_string())?,
        credit: s("credit")?
            .parse::<AccountId>()
            .map_err(|e| e.to_string())?,
        amount: num("amount")?,
        phase: Phase::parse(s("phase")?).ok_or("no such phase")?,
        pending: t["pending"].as_str().map(str::to_string),
        expires_at: t["expires_at"].as_i64().unwrap_or(0),
        // Chains are replayed whole: the caller unlinks the chain's last.
        linked: true,
        cause: CauseKind::parse(s("cause")?).ok_or("no such cause")?,
        reference: s("reference")?.to_string(),
        lease: t["lease"].as_str().map(str::to_string),
        window: match t.get("window") {
            Some(_) => Some(num("window")?),
            None => None,
        },
        at,
    })
}

/// A judged proof-of-work challenge.
struct Challenge {
    failed: bool,
    lease: String,
    slashed: bool,
}

/// What `backed` reads and marks as it goes.
struct Seen<'a> {
    challenges: &'a mut HashMap<String, Challenge>,
    equivocations: &'a std::collections::HashSet<(String, u64)>,
    provider_paid: &'a mut std::collections::HashSet<(String, u64)>,
}

/// Whether `a` is one of the accounts a window of `lease` moves money between: its tenant's,
/// its escrow, its operator's provider account, the fee.
fn window_account(a: &AccountId, lease_id: &str, lease: &Lease) -> bool {
    let s = a.to_string();
    s == format!("tenant/{}", lease.tenant)
        || s == format!("escrow/{lease_id}")
        || s == format!("provider/{}", lease.operator)
        || s == AccountId::fee().to_string()
}

/// Why a transfer is not backed by what it rests on (`None`: it is, or needs nothing).
fn backed(
    t: &Transfer,
    leases: &HashMap<String, Lease>,
    verdicts: &Verdicts,
    seen: &mut Seen<'_>,
    proofs: bool,
) -> Option<String> {
    match t.cause {
        CauseKind::Window => {
            let (Some(lease_id), Some(w)) = (&t.lease, t.window) else {
                return Some("a window paid with no lease or window".into());
            };
            let Some(lease) = leases.get(lease_id) else {
                return Some(format!("lease {lease_id} was never opened"));
            };
            let Some((hash, _)) = lease.records.get(&w) else {
                return Some(format!(
                    "window {w} of lease {lease_id} paid with no accepted record"
                ));
            };
            if *hash != t.reference {
                return Some(format!(
                    "window {w} paid on record {}, not the accepted {hash}",
                    t.reference
                ));
            }
            // Between the lease's own accounts only, and to its provider once.
            for a in [&t.debit, &t.credit] {
                if !window_account(a, lease_id, lease) {
                    return Some(format!(
                        "window {w} of lease {lease_id} moves money through {a}, not an account of that lease"
                    ));
                }
            }
            if t.credit.to_string() == format!("provider/{}", lease.operator)
                && !seen.provider_paid.insert((lease_id.clone(), w))
            {
                return Some(format!(
                    "window {w} of lease {lease_id} paid to its provider twice"
                ));
            }
            if proofs {
                for g in &lease.gpus {
                    let of_gpu = verdicts.get(&(lease_id.clone(), *g));
                    let covering = of_gpu.and_then(|v| {
                        v.iter()
                            .filter(|(cw, _, _)| *cw <= w)
                            .max_by_key(|(cw, _, _)| *cw)
                            .or_else(|| v.iter().min_by_key(|(cw, _, _)| *cw))
                    });
                    match covering {
                        // Judged before this payment: only leaves before it are known.
                        Some((_, true, _)) => {}
                        Some((cw, false, _)) => {
                            return Some(format!(
                                "window {w} paid, but GPU {g}'s covering proof (window {cw}) did not pass"
                            ));
                        }
                        _ => {
                            return Some(format!(
                                "window {w} paid with no judged proof of GPU {g}"
                            ));
                        }
                    }
                }
            }
            None
        }
        CauseKind::Slash => {
            // A slash takes the cheating lease's operator's stake, through the slashed
            // account, to the lease's tenant.
            let to_lease = |lease_id: &str| -> Option<String> {
                let Some(lease) = leases.get(lease_id) else {
                    return Some(format!("a slash for lease {lease_id}, never opened"));
                };
                let allowed = [
                    format!("stake/{}", lease.operator),
                    AccountId::slashed().to_string(),
                    format!("tenant/{}", lease.tenant),
                ];
                for a in [&t.debit, &t.credit] {
                    if !allowed.contains(&a.to_string()) {
                        return Some(format!(
                            "a slash through {a}, not lease {lease_id}'s operator's stake or its tenant"
                        ));
                    }
                }
                None
            };
            let forfeit = t.debit.to_string().starts_with("stake/");
            if let Some(c) = t.reference.strip_prefix("pow/") {
                return match seen.challenges.get_mut(c) {
                    // The stake is forfeited once per failed proof.
                    Some(ch) if ch.failed && !(forfeit && ch.slashed) => {
                        ch.slashed |= forfeit;
                        let lease = ch.lease.clone();
                        to_lease(&lease)
                    }
                    Some(ch) if ch.failed => Some(format!("proof {c} slashed for twice")),
                    Some(_) => Some(format!("a slash for proof {c}, which did not fail")),
                    None => Some(format!("a slash for proof {c}, never judged")),
                };
            }
            if let Some(rest) = t.reference.strip_prefix("equivocation/") {
                let (lease, seq) = rest.rsplit_once('/')?;
                let seq: u64 = seq.parse().ok()?;
                if !seen.equivocations.contains(&(lease.to_string(), seq)) {
                    return Some(format!(
                        "a slash for two records of window {seq} of lease {lease}, but no second record was refused as such"
                    ));
                }
                return to_lease(lease);
            }
            Some(format!(
                "a slash for {}, which names no proven cheat",
                t.reference
            ))
        }
        _ => None,
    }
}

/// Why an archived piece does not hold (`None`: it does, or there is no archive to look in).
fn archived(dir: Option<&Path>, sha: Option<&str>, count: &mut u64) -> Option<String> {
    let dir = dir?;
    let Some(sha) = sha else {
        return Some("not named".into());
    };
    if !cgx_protocol::archive::is_address(sha) {
        return Some(format!("{sha:?} is not an address"));
    }
    let p = dir.join(sha);
    match std::fs::read(&p) {
        Ok(b) if cgx_protocol::archive::address(&b) == sha => {
            *count += 1;
            None
        }
        Ok(_) => Some(format!("{} does not hash to its name", p.display())),
        Err(e) => Some(format!("{}: {e}", p.display())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cgx_protocol::metering::MeteringRecord;
    use serde_json::json;

    const NODE: &str = "n1";
    const LEASE: &str = "l1";

    struct Log {
        leaves: Vec<Vec<u8>>,
        seq: i64,
    }

    impl Log {
        fn push(&mut self, action: &str, actor: &str, subject: &str, detail: Value) {
            self.seq += 1;
            self.leaves.push(
                serde_json::to_vec(&json!({
                    "kind": "cgx.audit.v1", "service": "cgx-broker", "seq": self.seq, "at": 100,
                    "actor": actor, "action": action, "subject": subject, "detail": detail,
                }))
                .unwrap(),
            );
        }
    }

    fn signer() -> cgx_protocol::signed::Signer {
        let der = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        cgx_protocol::signed::Signer::from_pkcs8(der.as_ref()).unwrap()
    }

    fn record(key: &cgx_protocol::signed::Signer, seq: u64, prev: String) -> String {
        let r = MeteringRecord {
            sub: NODE.into(),
            lease: LEASE.into(),
            seq,
            window_start: 100 + 60 * seq as i64,
            window_secs: 60,
            gpus: Vec::new(),
            pow: None,
            workload: cgx_protocol::records::WorkloadState::Running,
            prev,
        };
        key.sign(&r, 100, 400).unwrap()
    }

    fn transfer(
        id: &str,
        debit: &str,
        credit: &str,
        amount: u64,
        cause: &str,
        reference: &str,
    ) -> Value {
        json!({"id": id, "debit": debit, "credit": credit, "amount": amount.to_string(),
               "phase": "single", "cause": cause, "reference": reference})
    }

    /// A node registered, a lease on it, two records, GPU 0's proof passed, window 0 paid.
    fn honest(key: &cgx_protocol::signed::Signer) -> (Log, Vec<String>) {
        let mut log = Log {
            leaves: Vec::new(),
            seq: 0,
        };
        log.push(
            "node.register",
            "operator:op1",
            NODE,
            json!({
            "node_key": cgx_protocol::broker::b64(&key.public_key()), "status": "affirming",
            "operator": "op1"}),
        );
        log.push(
            "ledger.transfer",
            "broker",
            "d1",
            json!({"transfers": [
            transfer("d1", "world", "tenant/acme", 1000, "deposit", "wire")]}),
        );
        log.push(
            "lease.open",
            "broker",
            LEASE,
            json!({"node": NODE, "gpus": [0], "tenant": "acme"}),
        );
        let t0 = record(key, 0, genesis(LEASE));
        let h0 = token_hash(&t0);
        let t1 = record(key, 1, h0.clone());
        let h1 = token_hash(&t1);
        for (seq, t, h, prev) in [(0, &t0, &h0, genesis(LEASE)), (1, &t1, &h1, h0.clone())] {
            log.push(
                "metering.accept",
                &format!("node:{NODE}"),
                LEASE,
                json!({
                "seq": seq.to_string(), "hash": h, "prev": prev, "record": t}),
            );
        }
        log.push(
            "pow.verdict",
            "broker",
            "c1",
            json!({
            "lease": LEASE, "gpu": 0, "window": "0", "state": "passed"}),
        );
        (log, vec![h0, h1])
    }

    fn pay(log: &mut Log, window: u64, reference: &str) {
        let mut t = transfer(
            &format!("window/{LEASE}/{window}"),
            "tenant/acme",
            "provider/op1",
            10,
            "window",
            reference,
        );
        t["lease"] = json!(LEASE);
        t["window"] = json!(window.to_string());
        log.push("ledger.transfer", "broker", "w", json!({"transfers": [t]}));
    }

    fn reasons(log: &Log, proofs: bool) -> Vec<String> {
        check(
            &log.leaves,
            Rules {
                service: "cgx-broker",
                proofs,
                archive: None,
            },
        )
        .violations
        .into_iter()
        .map(|v| format!("{} {}: {}", v.index, v.action, v.reason))
        .collect()
    }

    #[test]
    fn an_honest_log_passes_and_each_unbacked_decision_is_named() {
        let key = signer();
        let (mut log, hashes) = honest(&key);
        pay(&mut log, 0, &hashes[0]);
        assert_eq!(reasons(&log, true), Vec::<String>::new());
        let r = check(
            &log.leaves,
            Rules {
                service: "cgx-broker",
                proofs: true,
                archive: None,
            },
        );
        assert_eq!(
            (r.registrations, r.leases, r.records, r.verdicts, r.payments),
            (1, 1, 2, 1, 1)
        );

        // A window paid on a record that is not the accepted one.
        let (mut l, _) = honest(&key);
        pay(&mut l, 0, &hashes[1]);
        assert!(
            reasons(&l, true)[0].contains("not the accepted"),
            "{:?}",
            reasons(&l, true)
        );
        // A window with no accepted record.
        let (mut l, _) = honest(&key);
        pay(&mut l, 5, &hashes[0]);
        assert!(reasons(&l, true)[0].contains("no accepted record"));
        // The covering proof failed.
        let (mut l, h) = honest(&key);
        l.push(
            "pow.verdict",
            "broker",
            "c2",
            json!({"lease": LEASE, "gpu": 0, "window": "1", "state": "failed"}),
        );
        pay(&mut l, 1, &h[1]);
        assert!(
            reasons(&l, true)[0].contains("did not pass"),
            "{:?}",
            reasons(&l, true)
        );
        // No proof judged at all: a violation with proofs on, none with them off.
        let mut l = Log {
            leaves: honest(&key).0.leaves[..5].to_vec(),
            seq: 5,
        };
        pay(&mut l, 0, &hashes[0]);
        assert!(reasons(&l, true)[0].contains("no judged proof"));
        assert_eq!(reasons(&l, false), Vec::<String>::new());
        // More paid than the tenant holds: the replay refuses it.
        let (mut l, h) = honest(&key);
        let mut t = transfer(
            "window/l1/0",
            "tenant/acme",
            "provider/op1",
            5000,
            "window",
            &h[0],
        );
        t["lease"] = json!(LEASE);
        t["window"] = json!("0");
        l.push("ledger.transfer", "broker", "w", json!({"transfers": [t]}));
        assert!(
            reasons(&l, true).iter().any(|r| r.contains("replayed")),
            "{:?}",
            reasons(&l, true)
        );
        // A window paid to another provider, or paid twice.
        let (mut l, h) = honest(&key);
        let mut t = transfer(
            "window/l1/0",
            "tenant/acme",
            "provider/evil",
            10,
            "window",
            &h[0],
        );
        t["lease"] = json!(LEASE);
        t["window"] = json!("0");
        l.push("ledger.transfer", "broker", "w", json!({"transfers": [t]}));
        assert!(
            reasons(&l, true)[0].contains("not an account of that lease"),
            "{:?}",
            reasons(&l, true)
        );
        let (mut l, h) = honest(&key);
        pay(&mut l, 0, &h[0]);
        let mut t = transfer(
            "window/l1/0-again",
            "tenant/acme",
            "provider/op1",
            10,
            "window",
            &h[0],
        );
        t["lease"] = json!(LEASE);
        t["window"] = json!("0");
        l.push("ledger.transfer", "broker", "w2", json!({"transfers": [t]}));
        assert!(
            reasons(&l, true)[0].contains("twice"),
            "{:?}",
            reasons(&l, true)
        );
        // A slash for no proven cheat, or from another operator's stake.
        let (mut l, _) = honest(&key);
        l.push(
            "ledger.transfer",
            "broker",
            "s",
            json!({"transfers": [
            transfer("slash/y", "stake/op1", "tenant/acme", 1, "slash", "whatever")]}),
        );
        assert!(reasons(&l, true)[0].contains("names no proven cheat"));
        let (mut l, _) = honest(&key);
        l.push(
            "pow.verdict",
            "broker",
            "c9",
            json!({"lease": LEASE, "gpu": 0, "window": "0", "state": "failed"}),
        );
        l.push(
            "ledger.transfer",
            "broker",
            "s",
            json!({"transfers": [
            transfer("slash/z", "stake/other", "tenant/acme", 1, "slash", "pow/c9")]}),
        );
        assert!(
            reasons(&l, true)
                .iter()
                .any(|r| r.contains("not lease l1's operator's stake")),
            "{:?}",
            reasons(&l, true)
        );
        // A slash for a proof never judged.
        let (mut l, _) = honest(&key);
        l.push(
            "ledger.transfer",
            "broker",
            "s",
            json!({"transfers": [
            transfer("slash/x", "world", "tenant/acme", 1, "slash", "pow/nope")]}),
        );
        assert!(reasons(&l, true)[0].contains("never judged"));
    }

    /// Releases are held to the broker's leases; anchored checkpoints to the anchored log.
    #[test]
    fn releases_need_a_live_lease_on_the_attested_key_and_anchors_a_prefix() {
        let ev = |seq: i64, at: i64, action: &str, subject: &str, detail: Value| {
            serde_json::to_vec(
                &json!({"kind": "cgx.audit.v1", "service": "s", "seq": seq, "at": at,
                "actor": "a", "action": action, "subject": subject, "detail": detail}),
            )
            .unwrap()
        };
        let broker = vec![
            ev(
                1,
                10,
                "node.register",
                NODE,
                json!({"status": "affirming", "tee_thumbprint": "tk"}),
            ),
            ev(
                2,
                20,
                "lease.open",
                LEASE,
                json!({"node": NODE, "tenant": "acme", "ends_at": 100}),
            ),
            ev(3, 50, "lease.end", LEASE, json!({})),
        ];
        let release = |at: i64, tee: &str, lease: Option<&str>| {
            ev(
                1,
                at,
                "release",
                "acme/w/k",
                json!({"tee_key": tee, "lease": lease, "tenant": "acme"}),
            )
        };
        assert!(check_releases(&[release(30, "tk", Some(LEASE))], &broker).is_empty());
        assert!(check_releases(&[release(30, "tk", None)], &broker).is_empty());
        for (r, why) in [
            (release(30, "other", Some(LEASE)), "not the key"),
            (release(60, "tk", Some(LEASE)), "outside lease"),
            (release(15, "tk", Some(LEASE)), "outside lease"),
            (release(30, "tk", Some("l9")), "never opened"),
            (
                ev(
                    1,
                    30,
                    "release",
                    "other/w/k",
                    json!({"tee_key": "tk", "lease": LEASE, "tenant": "acme"}),
                ),
                "not the resource's tenant",
            ),
            (
                ev(
                    1,
                    30,
                    "release",
                    "acme/w/k",
                    json!({"tee_key": "tk", "lease": LEASE}),
                ),
                "not the resource's tenant",
            ),
            (release(5, "tk", None), "did not affirm"),
        ] {
            let v = check_releases(&[r], &broker);
            assert!(
                v.first().is_some_and(|v| v.reason.contains(why)),
                "{why}: {v:?}"
            );
        }
        // Anchors: a prefix of the anchored log holds; a rewritten or shorter log does not.
        let kbs: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i]).collect();
        let mut t = cgx_tlog::tree::MemoryTree::new();
        for l in &kbs[..6] {
            t.append(l).unwrap();
        }
        let anchor = ev(
            4,
            60,
            "log.anchor",
            "kbs/log",
            json!({"size": "6", "root": t.root().unwrap().to_string()}),
        );
        let log = vec![anchor];
        assert!(check_anchors(&log, "kbs/log", &kbs).is_empty());
        let mut rewritten = kbs.clone();
        rewritten[2] = vec![99];
        assert!(
            check_anchors(&log, "kbs/log", &rewritten)[0]
                .reason
                .contains("rewritten")
        );
        assert!(
            check_anchors(&log, "kbs/log", &kbs[..4])[0]
                .reason
                .contains("rolled back")
        );
        assert!(check_anchors(&log, "other/log", &kbs[..4]).is_empty());
    }

    #[test]
    fn records_leases_and_sequence_are_checked() {
        let key = signer();
        // A record signed by another key.
        let (mut l, h) = honest(&key);
        let forged = record(&signer(), 2, h[1].clone());
        l.push(
            "metering.accept",
            &format!("node:{NODE}"),
            LEASE,
            json!({
            "seq": "2", "hash": token_hash(&forged), "prev": h[1], "record": forged}),
        );
        assert!(
            reasons(&l, true)[0].contains("not node n1's"),
            "{:?}",
            reasons(&l, true)
        );
        // A record that skips one.
        let (mut l, h) = honest(&key);
        let t = record(&key, 3, h[1].clone());
        l.push(
            "metering.accept",
            &format!("node:{NODE}"),
            LEASE,
            json!({
            "seq": "3", "hash": token_hash(&t), "prev": h[1], "record": t}),
        );
        assert!(reasons(&l, true)[0].contains("does not follow"));
        // A lease on a node never registered, and a seq that goes back.
        let (mut l, _) = honest(&key);
        l.push(
            "lease.open",
            "broker",
            "l2",
            json!({"node": "n9", "gpus": [0]}),
        );
        l.seq -= 3;
        l.push("lease.end", "broker", "l2", json!({}));
        let r = reasons(&l, true);
        assert!(r[0].contains("never registered"), "{r:?}");
        assert!(r[1].contains("does not follow"), "{r:?}");
        // Not an audit leaf at all.
        l.leaves.push(b"{\"kind\":\"other\"}".to_vec());
        assert!(
            reasons(&l, true)
                .last()
                .unwrap()
                .contains("not cgx.audit.v1")
        );
    }
}
