//! The in-memory index placement decides on: every registered node's verified record, its
//! freshness, its free GPUs, and per GPU model an ordered set by (price, reputation, id). Pure
//! data and functions of `now` — no I/O, no clock — so the rules are tested directly and the
//! benchmark measures them alone. The database is the truth: a replica rebuilds this index from
//! it at start and keeps it in step (`store/`, `monitor.rs`: `sync`).
//!
//! A node is **placeable** while its appraisal is affirming, its result is younger than the
//! re-attestation interval (and its EAR unexpired), and its last signed heartbeat is at most
//! `missed_heartbeats` intervals old. A job **fits** a placeable node with the job's GPU model,
//! enough free GPUs with enough memory, an allowed TEE kind and region, a price at most the
//! job's, and no refusal from the job's placement policy. Among fitting nodes the cheapest wins,
//! then the higher reputation (node + operator), then the region earlier in the job's
//! preference list, then the smaller node id: deterministic.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use cgx_policies::placement::PlacementPolicy;

pub use cgx_protocol::records::{Micros, NodeRecord, TeeKind, Tier};

/// Freshness rules.
#[derive(Debug, Clone, Copy)]
pub struct Freshness {
    pub reattest_secs: i64,
    pub heartbeat_secs: i64,
    pub missed_heartbeats: i64,
    /// How long a failed or missed proof-of-work keeps a node unplaceable.
    pub pow_penalty_secs: i64,
}

/// Why a node is not placeable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unplaceable {
    #[error("appraisal is {status}, not affirming: {detail}")]
    NotAffirming { status: Tier, detail: String },
    #[error("attestation lapsed at {at} (re-attestation due every {every} s)")]
    AttestationLapsed { at: i64, every: i64 },
    #[error("missed heartbeats: last at {last}, {missed} intervals of {every} s allowed")]
    HeartbeatsMissed { last: i64, every: i64, missed: i64 },
    /// A later registration of another node carries one of its GPUs: a GPU is passed through
    /// to one VM at a time, so this one no longer has it (until it registers again).
    #[error("GPU {serial} is now offered by node {node}; register again")]
    GpuMoved { serial: String, node: String },
    /// Its proof-of-work failed or was not answered in time: it is not shown to be computing.
    #[error("proof of work failed at {at} ({reason}); unplaceable until {until}")]
    ProofFailed { at: i64, until: i64, reason: String },
}

/// Why a job does not fit a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Misfit {
    #[error("not placeable: {0}")]
    Unplaceable(Unplaceable),
    #[error("GPU model {has}, the job needs {wants}")]
    GpuModel { has: String, wants: String },
    #[error("{has} GiB per GPU, the job needs {wants}")]
    GpuMemory { has: u32, wants: u32 },
    #[error("TEE {has}, the job allows {allowed}")]
    Tee { has: &'static str, allowed: String },
    #[error("region {has}, the job allows {allowed}")]
    Region { has: String, allowed: String },
    #[error("price {price} per GPU-hour over the job's {max} (millionths)")]
    OverPrice { price: Micros, max: Micros },
    #[error("{free} GPUs free, the job needs {wants}")]
    Full { free: u32, wants: u32 },
    /// A VM serves one tenant at a time (the other tenant is not named: it is not the
    /// asker's business).
    #[error("the node serves another tenant's lease")]
    OtherTenant,
    #[error("placement policy: {}", .0.join("; "))]
    Policy(Vec<String>),
    #[error("placement policy failed: {0}")]
    PolicyError(String),
}

impl Misfit {
    /// A stable short name (counts in a pending job's reason, test assertions).
    pub fn code(&self) -> &'static str {
        match self {
            Misfit::Unplaceable(Unplaceable::NotAffirming { .. }) => "not_affirming",
            Misfit::Unplaceable(Unplaceable::AttestationLapsed { .. }) => "attestation_lapsed",
            Misfit::Unplaceable(Unplaceable::HeartbeatsMissed { .. }) => "heartbeats_missed",
            Misfit::Unplaceable(Unplaceable::GpuMoved { .. }) => "gpu_moved",
            Misfit::Unplaceable(Unplaceable::ProofFailed { .. }) => "proof_failed",
            Misfit::GpuModel { .. } => "gpu_model",
            Misfit::GpuMemory { .. } => "gpu_memory",
            Misfit::Tee { .. } => "tee",
            Misfit::Region { .. } => "region",
            Misfit::OverPrice { .. } => "over_price",
            Misfit::Full { .. } => "full",
            Misfit::OtherTenant => "other_tenant",
            Misfit::Policy(_) => "placement_policy",
            Misfit::PolicyError(_) => "placement_policy_error",
        }
    }
}

/// A job's requirements as placement reads them (parsed and checked at submission).
#[derive(Debug, Clone)]
pub struct Requirements {
    /// The job's tenant: a node serving another tenant's lease does not fit.
    pub tenant: String,
    pub gpu_model: String,
    pub gpu_count: u32,
    pub min_gpu_memory_gib: u32,
    /// Empty: any.
    pub tee: Vec<TeeKind>,
    /// Empty: any; otherwise in order of preference.
    pub regions: Vec<String>,
    pub max_price: Micros,
    pub policy: Option<Arc<PlacementPolicy>>,
    /// The job has a placement policy (also where `policy` was not compiled: a status read).
    pub has_policy: bool,
    /// The spec as submitted (the policy's `input.job`).
    pub spec: Arc<serde_json::Value>,
}

/// A placement decision: the node and the GPUs reserved on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub node_id: String,
    pub gpus: Vec<u32>,
}

#[derive(Debug)]
struct Entry {
    record: Arc<NodeRecord>,
    /// The signed record this entry was built from (a changed row is re-verified).
    record_token: String,
    node_reputation: i64,
    last_heartbeat: i64,
    heartbeat_seq: i64,
    /// Asked to re-attest before its interval ends (cleared by re-attestation).
    reattest_asked: bool,
    /// One of its GPUs (serial) in a later registration of another node (that node).
    displaced: Option<(String, String)>,
    /// When its last proof-of-work failed or was missed, and why.
    pow_failed: Option<(i64, String)>,
    /// Bit i set: GPU i is allocated (committed, or reserved by a placement in flight).
    used: u64,
    /// The tenant whose leases hold the VM, until when (`i64::MAX` while one is open; else
    /// when the last token of its last lease has expired). A VM serves one tenant at a time.
    tenant: Option<(String, i64)>,
    /// Bit i set: GPU i is reserved by a placement of this replica not yet committed (a sync
    /// from the database must not hand it out meanwhile).
    inflight: u64,
    /// The ordering key it sits under in its partition.
    key: RankKey,
    /// Its partition (`None`: no free GPU, so in none).
    part: Option<Part>,
}

type RankKey = (Micros, Reverse<i64>, String);

/// A partition of placeable capacity: (GPU model, TEE, region, free-GPU bucket). A job walks
/// only the partitions that can hold it — its model, its TEEs, its regions, buckets with room
/// enough — each in rank order, and merges them: a decision costs the partitions it may use,
/// not the fleet.
///
/// A node a tenant holds (an open lease, or one that ended less than a lease TTL ago) sits in
/// that tenant's partition (the last member): a VM serves one tenant at a time, so another
/// tenant's job never walks past it. A hold that lapses returns the node to the free
/// partitions at the next [`Index::release_lapsed_holds`] (the monitor's pass).
type Part = (String, TeeKind, String, u32, Option<String>);

/// Free-GPU buckets: exact up to 8, then 16, 32, 64 (a bucket holds free counts down to the
/// previous bucket + 1).
fn bucket(free: u32) -> u32 {
    match free {
        0..=8 => free,
        9..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

const BUCKETS: [u32; 11] = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64];

/// Every bucket of one (GPU model, TEE, region, holder): the partitions are kept shelf by
/// shelf, so a decision looks up one shelf per TEE and region (and holder), not one
/// partition per bucket — eleven times fewer hashes of the key's strings.
type Shelf = (String, TeeKind, String, Option<String>);

/// The shelf of a partition, and its bucket's slot on it.
fn shelf_of(p: &Part) -> (Shelf, usize) {
    let slot = BUCKETS.iter().position(|b| *b == p.3).unwrap_or(0);
    ((p.0.clone(), p.1, p.2.clone(), p.4.clone()), slot)
}

/// The index. Not thread-safe by itself: the service keeps it behind a lock.
#[derive(Debug)]
pub struct Index {
    /// GPUs (serials) whose proof of work failed: when, and why. A node offering one is not
    /// placeable until the penalty ends, whatever its id (a new registration is a new id).
    gpu_penalties: HashMap<String, (i64, String)>,
    freshness: Freshness,
    nodes: HashMap<String, Entry>,
    /// Every node's id, in order: the console's pages walk it by keyset.
    by_id: BTreeSet<String>,
    operators: HashMap<String, i64>,
    parts: HashMap<Shelf, [BTreeSet<RankKey>; BUCKETS.len()]>,
    /// Every region a node has offered (the partitions a job without regions walks).
    regions: BTreeSet<String>,
    /// GPU device serial → the node whose evidence carried it.
    gpu_owner: HashMap<String, String>,
    /// Node id → the newest `attested_at` of a record of it this replica has accepted: an
    /// older, validly signed record put back in the database is refused (it would undo a
    /// re-attestation that found the node worse).
    newest: HashMap<String, i64>,
    /// Counts this replica's own writes of node records ([`Index::wrote`]); a sync that read
    /// its rows before such a write skips the node ([`Index::wrote_since`]).
    generation: u64,
    /// Node id → the generation of this replica's last write of its record.
    written: HashMap<String, u64>,
    /// Tenant → how many partition entries its holds put in its own partitions (a job looks
    /// there only when its tenant has some).
    held: HashMap<String, usize>,
}

/// A node that passed every filter but the placement policy, in rank order, with what the
/// policy reads of it: the policy runs on it outside the index's lock.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub choice: Choice,
    /// The record the input was built from: the choice stands only while the node's record
    /// is still this one (checked again under the lock).
    pub record: Arc<NodeRecord>,
    /// The policy's input (`None` when the job has no policy).
    pub input: Option<serde_json::Value>,
}

/// The device serials of a record's GPUs (from the verified claims).
pub(crate) fn serials(record: &NodeRecord) -> Vec<String> {
    record.claims["gpus"]
        .as_array()
        .map(|g| {
            g.iter()
                .filter_map(|c| c["device_serial"].as_str())
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Placement-policy evaluations one decision makes at most: a tenant's policy that refuses the
/// best nodes one after another costs a bounded amount per pass (the job waits, and says why).
pub const MAX_POLICY_EVALS: usize = 32;

/// Nodes [`Index::why_none`] examines at most.
pub const WHY_NONE_SAMPLE: usize = 4096;

/// Most GPUs one node may offer (the allocation bitmap's width).
pub const MAX_GPUS: u32 = 64;

fn mask_count(m: u64) -> u32 {
    m.count_ones()
}

impl Index {
    pub fn new(freshness: Freshness) -> Self {
        Index {
            freshness,
            nodes: HashMap::new(),
            by_id: BTreeSet::new(),
            operators: HashMap::new(),
            parts: HashMap::new(),
            regions: BTreeSet::new(),
            gpu_owner: HashMap::new(),
            newest: HashMap::new(),
            generation: 0,
            written: HashMap::new(),
            held: HashMap::new(),
            gpu_penalties: HashMap::new(),
        }
    }

    /// Holds that lapsed by `now` (the tenant's last token expired) end: those nodes return to
    /// the free partitions. The monitor calls it each pass.
    pub fn release_lapsed_holds(&mut self, now: i64) {
        let lapsed: Vec<String> = self
            .nodes
            .values()
            .filter(|e| e.tenant.as_ref().is_some_and(|(_, until)| now > *until))
            .map(|e| e.record.id.clone())
            .collect();
        for id in lapsed {
            if let Some(e) = self.nodes.get_mut(&id) {
                e.tenant = None;
            }
            self.repartition(&id);
        }
    }

    /// Whether a record of `id` attested at `attested_at` may replace what this replica has
    /// seen: never one older than the newest accepted.
    pub fn accepts_record(&self, id: &str, attested_at: i64) -> bool {
        self.newest.get(id).is_none_or(|n| attested_at >= *n)
    }

    /// The count of this replica's own record writes so far: a sync takes it before it reads
    /// rows.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// This replica wrote `id`'s record itself (a registration or re-attestation it served).
    pub fn wrote(&mut self, id: &str) {
        self.generation += 1;
        self.written.insert(id.to_string(), self.generation);
    }

    /// Whether this replica wrote `id`'s record after generation `since`. A row read before
    /// then may be the record that write replaced: with an `attested_at` in the same second,
    /// [`Index::accepts_record`] cannot tell it is older, so the sync leaves the node to its
    /// next pass, which reads the row again.
    pub fn wrote_since(&self, id: &str, since: u64) -> bool {
        self.written.get(id).is_some_and(|g| *g > since)
    }

    /// Another node, placeable at `now`, whose evidence carries one of `record`'s GPUs: a GPU
    /// is passed through to one VM at a time, so the same device offered twice is refused.
    pub fn gpu_claimed_elsewhere(&self, record: &NodeRecord, now: i64) -> Option<(String, String)> {
        serials(record).into_iter().find_map(|serial| {
            let owner = self.gpu_owner.get(&serial)?;
            let live = owner != &record.id && self.placeable(owner, now).is_some_and(|p| p.is_ok());
            live.then(|| (serial, owner.clone()))
        })
    }

    pub fn freshness(&self) -> Freshness {
        self.freshness
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn reputation_of(&self, e: &Entry) -> i64 {
        e.node_reputation
            .saturating_add(self.operators.get(&e.record.operator).copied().unwrap_or(0))
    }

    fn rank_key(&self, record: &NodeRecord, node_reputation: i64) -> RankKey {
        let rep = node_reputation
            .saturating_add(self.operators.get(&record.operator).copied().unwrap_or(0));
        (record.price, Reverse(rep), record.id.clone())
    }

    /// The signed record token an entry was built from (`None`: not indexed).
    pub fn record_token(&self, id: &str) -> Option<&str> {
        self.nodes.get(id).map(|e| e.record_token.as_str())
    }

    /// Insert or replace a node (registration, re-attestation, a row another replica wrote).
    /// `used`: its allocated GPUs (bit i: GPU i).
    pub fn upsert(
        &mut self,
        record: NodeRecord,
        record_token: String,
        node_reputation: i64,
        last_heartbeat: i64,
        heartbeat_seq: i64,
        used: u64,
    ) {
        self.remove(&record.id);
        let newest = self
            .newest
            .entry(record.id.clone())
            .or_insert(record.attested_at);
        *newest = (*newest).max(record.attested_at);
        let key = self.rank_key(&record, node_reputation);
        let used = used & full_mask(record.gpu_count);
        let mut displaced = Vec::new();
        for serial in serials(&record) {
            if let Some(prev) = self.gpu_owner.insert(serial.clone(), record.id.clone())
                && prev != record.id
            {
                displaced.push((prev, serial));
            }
        }
        for (prev, serial) in displaced {
            if let Some(e) = self.nodes.get_mut(&prev) {
                e.displaced = Some((serial, record.id.clone()));
            }
        }
        self.regions.insert(record.region.clone());
        let id = record.id.clone();
        self.by_id.insert(id.clone());
        self.nodes.insert(
            id.clone(),
            Entry {
                record: Arc::new(record),
                record_token,
                node_reputation,
                last_heartbeat,
                heartbeat_seq,
                reattest_asked: false,
                pow_failed: None,
                displaced: None,
                used,
                tenant: None,
                inflight: 0,
                key,
                part: None,
            },
        );
        self.repartition(&id);
    }

    /// A re-attestation of an indexed node: the new record, everything else kept (reputation,
    /// allocations and reservations in flight, heartbeat sequence); it counts as a heartbeat
    /// at `now`. False if the node is not indexed.
    pub fn refresh(&mut self, record: NodeRecord, record_token: String, now: i64) -> bool {
        let id = record.id.clone();
        let Some(e) = self.nodes.get(&id) else {
            return false;
        };
        let (rep, last, seq, used, inflight, tenant) = (
            e.node_reputation,
            e.last_heartbeat.max(now),
            e.heartbeat_seq,
            e.used,
            e.inflight,
            e.tenant.clone(),
        );
        self.upsert(record, record_token, rep, last, seq, used);
        if let Some(e) = self.nodes.get_mut(&id) {
            e.inflight = inflight & full_mask(e.record.gpu_count);
            e.tenant = tenant;
        }
        self.repartition(&id);
        true
    }

    /// Put node `id` under the partition its free GPUs call for (and its current rank key).
    fn repartition(&mut self, id: &str) {
        let Some(e) = self.nodes.get(id) else { return };
        let free = e.record.gpu_count - mask_count(e.used);
        let held_by = e.tenant.as_ref().map(|(t, _)| t.clone());
        let want = (free > 0).then(|| {
            (
                e.record.gpu_model.clone(),
                e.record.tee,
                e.record.region.clone(),
                bucket(free),
                held_by,
            )
        });
        let (old, key) = (e.part.clone(), e.key.clone());
        if let Some(p) = &old {
            self.unshelve(p, &key);
        }
        if let Some(p) = &want {
            self.shelve(p, key);
        }
        if let Some(e) = self.nodes.get_mut(id) {
            e.part = want;
        }
    }

    /// Put `key` in partition `p`, counting its holder's entries.
    fn shelve(&mut self, p: &Part, key: RankKey) {
        let (shelf, slot) = shelf_of(p);
        self.parts
            .entry(shelf)
            .or_insert_with(|| std::array::from_fn(|_| BTreeSet::new()))[slot]
            .insert(key);
        if let Some(t) = &p.4 {
            *self.held.entry(t.clone()).or_default() += 1;
        }
    }

    /// Take `key` out of partition `p` (its shelf goes once every bucket on it is empty), and
    /// its holder's count down.
    fn unshelve(&mut self, p: &Part, key: &RankKey) {
        let (shelf, slot) = shelf_of(p);
        let Some(sets) = self.parts.get_mut(&shelf) else {
            return;
        };
        if !sets[slot].remove(key) {
            return;
        }
        if sets.iter().all(BTreeSet::is_empty) {
            self.parts.remove(&shelf);
        }
        if let Some(t) = &p.4
            && let Some(n) = self.held.get_mut(t)
        {
            *n -= 1;
            if *n == 0 {
                self.held.remove(t);
            }
        }
    }

    pub fn remove(&mut self, id: &str) -> bool {
        let Some(e) = self.nodes.remove(id) else {
            return false;
        };
        self.by_id.remove(id);
        for serial in serials(&e.record) {
            if self.gpu_owner.get(&serial).is_some_and(|o| o == id) {
                self.gpu_owner.remove(&serial);
            }
        }
        if let Some(p) = &e.part {
            self.unshelve(p, &e.key);
        }
        true
    }

    /// Set an operator's reputation (every one of its nodes is re-ranked).
    pub fn set_operator_reputation(&mut self, operator: &str, reputation: i64) {
        if self.operators.get(operator) == Some(&reputation) {
            return;
        }
        self.operators.insert(operator.to_string(), reputation);
        let ids: Vec<String> = self
            .nodes
            .values()
            .filter(|e| e.record.operator == operator)
            .map(|e| e.record.id.clone())
            .collect();
        for id in ids {
            self.rerank(&id);
        }
    }

    /// Set a node's own reputation.
    pub fn set_node_reputation(&mut self, id: &str, reputation: i64) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.node_reputation = reputation;
        }
        self.rerank(id);
    }

    fn rerank(&mut self, id: &str) {
        let Some(e) = self.nodes.get(id) else { return };
        let new = self.rank_key(&e.record, e.node_reputation);
        if let Some(p) = e.part.clone() {
            let key = e.key.clone();
            self.unshelve(&p, &key);
        }
        if let Some(e) = self.nodes.get_mut(id) {
            e.key = new;
            e.part = None;
        }
        self.repartition(id);
    }

    pub fn record(&self, id: &str) -> Option<Arc<NodeRecord>> {
        self.nodes.get(id).map(|e| e.record.clone())
    }

    /// Ask node `id` to re-attest (or clear the ask).
    pub fn ask_reattest(&mut self, id: &str, asked: bool) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.reattest_asked = asked;
        }
    }

    /// GPU `serial`'s last failed proof (a later one replaces an earlier).
    pub fn set_gpu_penalty(&mut self, serial: &str, at: i64, reason: &str) {
        let e = self
            .gpu_penalties
            .entry(serial.to_string())
            .or_insert((at, reason.to_string()));
        if at >= e.0 {
            *e = (at, reason.to_string());
        }
    }

    /// Node `id`'s last failed proof (`at` 0: none).
    pub fn set_pow_failure(&mut self, id: &str, at: i64, reason: &str) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.pow_failed = (at > 0).then(|| (at, reason.to_string()));
        }
    }

    /// Has node `id` been asked to re-attest?
    pub fn reattest_asked(&self, id: &str) -> bool {
        self.nodes.get(id).is_some_and(|e| e.reattest_asked)
    }

    /// A signed heartbeat arrived: `seq` must exceed the last one seen (a replayed heartbeat
    /// changes nothing). Returns whether it was taken.
    pub fn heartbeat(&mut self, id: &str, seq: i64, at: i64) -> bool {
        match self.nodes.get_mut(id) {
            Some(e) if seq > e.heartbeat_seq => {
                e.heartbeat_seq = seq;
                e.last_heartbeat = e.last_heartbeat.max(at);
                true
            }
            _ => false,
        }
    }

    /// The last heartbeat and its sequence number.
    pub fn last_heartbeat(&self, id: &str) -> Option<(i64, i64)> {
        self.nodes
            .get(id)
            .map(|e| (e.last_heartbeat, e.heartbeat_seq))
    }

    /// Heartbeat state another replica wrote (never moves backwards).
    pub fn observe_heartbeat(&mut self, id: &str, last: i64, seq: i64) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.last_heartbeat = e.last_heartbeat.max(last);
            e.heartbeat_seq = e.heartbeat_seq.max(seq);
        }
    }

    /// Whether node `id` is placeable at `now`, and why not.
    pub fn placeable(&self, id: &str, now: i64) -> Option<Result<(), Unplaceable>> {
        self.nodes.get(id).map(|e| self.entry_placeable(e, now))
    }

    /// Until when the node's attestation counts (min of the re-attestation deadline and the
    /// EAR's expiry).
    pub fn fresh_until(&self, record: &NodeRecord) -> i64 {
        record
            .attested_at
            .saturating_add(self.freshness.reattest_secs)
            .min(record.ear_expires_at)
    }

    fn entry_placeable(&self, e: &Entry, now: i64) -> Result<(), Unplaceable> {
        let r = &e.record;
        if let Some((serial, node)) = &e.displaced {
            return Err(Unplaceable::GpuMoved {
                serial: serial.clone(),
                node: node.clone(),
            });
        }
        if r.status != Tier::Affirming {
            return Err(Unplaceable::NotAffirming {
                status: r.status,
                detail: if r.violations.is_empty() {
                    "no violation reported".into()
                } else {
                    r.violations.join("; ")
                },
            });
        }
        if let Some((at, reason)) = &e.pow_failed {
            let until = at.saturating_add(self.freshness.pow_penalty_secs);
            if now < until {
                return Err(Unplaceable::ProofFailed {
                    at: *at,
                    until,
                    reason: reason.clone(),
                });
            }
        }
        if !self.gpu_penalties.is_empty() {
            for serial in serials(r) {
                if let Some((at, reason)) = self.gpu_penalties.get(&serial) {
                    let until = at.saturating_add(self.freshness.pow_penalty_secs);
                    if now < until {
                        return Err(Unplaceable::ProofFailed {
                            at: *at,
                            until,
                            reason: format!("GPU {serial}: {reason}"),
                        });
                    }
                }
            }
        }
        let until = self.fresh_until(r);
        if now >= until {
            return Err(Unplaceable::AttestationLapsed {
                at: until,
                every: self.freshness.reattest_secs,
            });
        }
        let f = &self.freshness;
        if now
            > e.last_heartbeat
                .saturating_add(f.heartbeat_secs.saturating_mul(f.missed_heartbeats))
        {
            return Err(Unplaceable::HeartbeatsMissed {
                last: e.last_heartbeat,
                every: f.heartbeat_secs,
                missed: f.missed_heartbeats,
            });
        }
        Ok(())
    }

    /// Free GPUs of node `id`.
    pub fn free_gpus(&self, id: &str) -> Option<u32> {
        self.nodes
            .get(id)
            .map(|e| e.record.gpu_count - mask_count(e.used))
    }

    /// The cheap requirements (everything but the policy) of `req` on `e`.
    fn cheap_fit(&self, e: &Entry, req: &Requirements, now: i64) -> Result<(), Misfit> {
        let r = &e.record;
        self.entry_placeable(e, now).map_err(Misfit::Unplaceable)?;
        if r.gpu_model != req.gpu_model {
            return Err(Misfit::GpuModel {
                has: r.gpu_model.clone(),
                wants: req.gpu_model.clone(),
            });
        }
        if r.gpu_memory_gib < req.min_gpu_memory_gib {
            return Err(Misfit::GpuMemory {
                has: r.gpu_memory_gib,
                wants: req.min_gpu_memory_gib,
            });
        }
        if !req.tee.is_empty() && !req.tee.contains(&r.tee) {
            return Err(Misfit::Tee {
                has: r.tee.as_str(),
                allowed: req
                    .tee
                    .iter()
                    .map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join(","),
            });
        }
        if !req.regions.is_empty() && !req.regions.contains(&r.region) {
            return Err(Misfit::Region {
                has: r.region.clone(),
                allowed: req.regions.join(","),
            });
        }
        if r.price > req.max_price {
            return Err(Misfit::OverPrice {
                price: r.price,
                max: req.max_price,
            });
        }
        let free = r.gpu_count - mask_count(e.used);
        if free < req.gpu_count {
            return Err(Misfit::Full {
                free,
                wants: req.gpu_count,
            });
        }
        // A hold lasts until its tenant's last token expired and the monitor's pass released
        // it (`release_lapsed_holds`): the partitions and this filter agree at every moment.
        if e.tenant.as_ref().is_some_and(|(t, _)| *t != req.tenant) {
            return Err(Misfit::OtherTenant);
        }
        Ok(())
    }

    /// Does `req` still fit node `id` at `now`, the policy aside? (Checked again, under the
    /// lock, after the policy ran outside it.)
    pub fn cheap_fits(&self, id: &str, req: &Requirements, now: i64) -> Result<(), Misfit> {
        match self.nodes.get(id) {
            Some(e) => self.cheap_fit(e, req, now),
            None => Err(Misfit::Unplaceable(Unplaceable::NotAffirming {
                status: Tier::None,
                detail: "no longer registered".into(),
            })),
        }
    }

    /// The policy's input for a node: its offer and what placement needs of its verified
    /// claims ([`placement_claims`]: no chip id, device serial, FWID, nonce or report data — a
    /// tenant's policy has no business fingerprinting machines), and the job.
    pub fn policy_input(
        &self,
        record: &NodeRecord,
        reputation: i64,
        job: &serde_json::Value,
    ) -> serde_json::Value {
        serde_json::json!({
            "node": {
                "id": record.id, "operator": record.operator, "region": record.region,
                "tee": record.tee.as_str(), "sim": record.sim, "gpu_model": record.gpu_model,
                "gpu_chip": record.gpu_chip, "gpu_count": record.gpu_count,
                "gpu_memory_gib": record.gpu_memory_gib,
                "price_per_gpu_hour_micros": record.price,
                "reputation": reputation, "claims": placement_claims(&record.claims),
            },
            "job": job,
        })
    }

    fn policy_fit(&self, e: &Entry, req: &Requirements) -> Result<(), Misfit> {
        let Some(policy) = &req.policy else {
            return Ok(());
        };
        policy_verdict(
            policy,
            &self.policy_input(&e.record, self.reputation_of(e), &req.spec),
        )
    }

    /// Does `req` fit node `id` at `now`? (`None`: no such node.)
    pub fn fit(&self, id: &str, req: &Requirements, now: i64) -> Option<Result<(), Misfit>> {
        let e = self.nodes.get(id)?;
        Some(
            self.cheap_fit(e, req, now)
                .and_then(|()| self.policy_fit(e, req)),
        )
    }

    /// The best fitting node for `req` at `now` and the GPUs it would get (lowest free
    /// indices), or `None`. Walks, in rank order, only the partitions that can hold the job
    /// (its model, TEEs, regions, free-GPU buckets with room), each up to the job's price, and
    /// merges their heads; the policy runs only on the best remaining head. Equal to
    /// [`Index::scan_choose`] (the property tests hold them to it).
    pub fn choose(&self, req: &Requirements, now: i64) -> Option<Choice> {
        let policy = req.policy.as_ref();
        self.candidates(req, now)
            .into_iter()
            .find_map(|c| match (policy, &c.input) {
                (Some(p), Some(input)) => policy_verdict(p, input).is_ok().then_some(c.choice),
                _ => Some(c.choice),
            })
    }

    /// The nodes [`Index::choose`] would ask the job's policy about, best first: the
    /// best-ranked node passing every other filter when the job has no policy, else up to
    /// [`MAX_POLICY_EVALS`] of them, each with the policy's input. The policy itself runs on
    /// them outside the index's lock (a tenant's code never runs while the lock is held).
    pub fn candidates(&self, req: &Requirements, now: i64) -> Vec<Candidate> {
        let want = if req.policy.is_some() {
            MAX_POLICY_EVALS
        } else {
            1
        };
        self.best(req, now, want)
    }

    /// The `want` best-ranked nodes passing every filter but the job's policy, best first
    /// (with the policy's input when the job has one): placement's candidates, a quote's offers.
    pub fn best(&self, req: &Requirements, now: i64, want: usize) -> Vec<Candidate> {
        let mut out = Vec::new();
        let tees: &[TeeKind] = if req.tee.is_empty() {
            &[TeeKind::Snp, TeeKind::Tdx]
        } else {
            &req.tee
        };
        let any_region = req.regions.is_empty();
        let regions: Vec<&String> = if any_region {
            self.regions.iter().collect()
        } else {
            req.regions.iter().collect()
        };
        type Walk<'a> = (std::collections::btree_set::Iter<'a, RankKey>, usize);
        let own = self.held.contains_key(&req.tenant);
        let mut walks: Vec<Walk<'_>> = Vec::new();
        for tee in tees {
            for (rank, region) in regions.iter().enumerate() {
                // Free nodes, and nodes the job's own tenant holds (if it holds any): every
                // bucket with room enough.
                let rank = if any_region { 0 } else { rank };
                let own_shelf = own.then(|| Some(req.tenant.clone()));
                for holder in std::iter::once(None).chain(own_shelf) {
                    let shelf = (req.gpu_model.clone(), *tee, (*region).clone(), holder);
                    let Some(sets) = self.parts.get(&shelf) else {
                        continue;
                    };
                    for (b, set) in BUCKETS.iter().zip(sets) {
                        if *b >= req.gpu_count && !set.is_empty() {
                            walks.push((set.iter(), rank));
                        }
                    }
                }
            }
        }
        // Each walk's head: its first node passing the cheap filters.
        let head = |w: &mut Walk<'_>| -> Option<(&Entry, usize)> {
            for key in w.0.by_ref() {
                if key.0 > req.max_price {
                    return None;
                }
                if let Some(e) = self.nodes.get(&key.2)
                    && self.cheap_fit(e, req, now).is_ok()
                {
                    return Some((e, w.1));
                }
            }
            None
        };
        let mut heads: Vec<(Option<(&Entry, usize)>, Walk<'_>)> =
            walks.into_iter().map(|mut w| (head(&mut w), w)).collect();
        while out.len() < want {
            let Some((i, e, _)) = heads
                .iter()
                .enumerate()
                .filter_map(|(i, (h, _))| h.map(|(e, r)| (i, e, r)))
                .min_by(|a, b| {
                    (a.1.key.0, a.1.key.1, a.2, &a.1.key.2)
                        .cmp(&(b.1.key.0, b.1.key.1, b.2, &b.1.key.2))
                })
            else {
                break;
            };
            out.push(self.candidate(e, req));
            let (h, w) = &mut heads[i];
            *h = head(w);
        }
        out
    }

    /// Node `id` as the one candidate for `req` (a job held to a quoted offer), or why it does
    /// not fit now.
    pub fn candidate_on(
        &self,
        id: &str,
        req: &Requirements,
        now: i64,
    ) -> Result<Candidate, Misfit> {
        self.cheap_fits(id, req, now)?;
        let e = self
            .nodes
            .get(id)
            .ok_or(Misfit::Unplaceable(Unplaceable::NotAffirming {
                status: Tier::None,
                detail: "no longer registered".into(),
            }))?;
        Ok(self.candidate(e, req))
    }

    /// Entry `e` as a candidate for `req`: its free GPUs, and the policy's input when the job
    /// has a policy.
    fn candidate(&self, e: &Entry, req: &Requirements) -> Candidate {
        Candidate {
            record: e.record.clone(),
            choice: Choice {
                node_id: e.record.id.clone(),
                gpus: free_indices(e.used, e.record.gpu_count, req.gpu_count),
            },
            input: req
                .policy
                .as_ref()
                .map(|_| self.policy_input(&e.record, self.reputation_of(e), &req.spec)),
        }
    }

    /// Why nodes do not fit `req` (all but the job's policy), from at most
    /// [`WHY_NONE_SAMPLE`] nodes: the first `list` by node, and how many more.
    pub fn misfits(
        &self,
        req: &Requirements,
        now: i64,
        list: usize,
    ) -> (Vec<(String, Misfit)>, u64) {
        let mut out = Vec::new();
        let mut more = 0u64;
        for e in self.nodes.values().take(WHY_NONE_SAMPLE) {
            if let Err(m) = self.cheap_fit(e, req, now) {
                if out.len() < list {
                    out.push((e.record.id.clone(), m));
                } else {
                    more += 1;
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        (out, more)
    }

    /// The same decision by scanning every node: the oracle `choose` is tested against, and
    /// what the benchmark compares the partitioned walk with.
    pub fn scan_choose(&self, req: &Requirements, now: i64) -> Option<Choice> {
        let rank = |e: &Entry| {
            let region = if req.regions.is_empty() {
                0
            } else {
                req.regions
                    .iter()
                    .position(|r| *r == e.record.region)
                    .unwrap_or(usize::MAX)
            };
            (e.key.0, e.key.1, region, e.key.2.clone())
        };
        let mut fits: Vec<&Entry> = self
            .nodes
            .values()
            .filter(|e| self.cheap_fit(e, req, now).is_ok())
            .collect();
        fits.sort_by_key(|e| rank(e));
        let budget = if req.policy.is_some() {
            MAX_POLICY_EVALS
        } else {
            usize::MAX
        };
        let e = fits
            .into_iter()
            .take(budget)
            .find(|e| self.policy_fit(e, req).is_ok())?;
        Some(Choice {
            node_id: e.record.id.clone(),
            gpus: free_indices(e.used, e.record.gpu_count, req.gpu_count),
        })
    }

    /// A one-line summary of why no node fits (`3 full, 1 region`), from at most
    /// [`WHY_NONE_SAMPLE`] nodes (a pending job's answer stays cheap on a large fleet).
    ///
    /// The policy is not run here (this is answered under the index's lock, and for every
    /// status read): `verdicts` are what the policy said of nodes in the last placement
    /// attempt, and a node passing every other filter without one counts as
    /// `placement_policy_not_evaluated`.
    pub fn why_none(
        &self,
        req: &Requirements,
        now: i64,
        verdicts: &HashMap<String, Misfit>,
    ) -> String {
        let mut counts: std::collections::BTreeMap<&'static str, usize> = Default::default();
        let mut seen = 0;
        for e in self.nodes.values().take(WHY_NONE_SAMPLE) {
            seen += 1;
            let fit = self.cheap_fit(e, req, now).and_then(|()| {
                if !req.has_policy {
                    return Ok(());
                }
                match verdicts.get(&e.record.id) {
                    Some(m) => Err(m.clone()),
                    None => Err(Misfit::PolicyError("not evaluated".into())),
                }
            });
            if let Err(m) = fit {
                let code = match &m {
                    Misfit::PolicyError(d) if d == "not evaluated" => {
                        "placement_policy_not_evaluated"
                    }
                    _ => m.code(),
                };
                *counts.entry(code).or_default() += 1;
            }
        }
        if seen == 0 {
            return "no node is registered".into();
        }
        let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let of = if self.nodes.len() > seen {
            format!(" of {seen} examined")
        } else {
            String::new()
        };
        format!("no node fits{of} ({})", parts.join(", "))
    }

    /// Reserve `gpus` of `id` for a placement about to be written; false (and nothing changed)
    /// if one is already taken. [`Index::confirm`] after the commit, [`Index::release`] if it
    /// did not commit.
    pub fn reserve(&mut self, id: &str, gpus: &[u32]) -> bool {
        let Some(e) = self.nodes.get_mut(id) else {
            return false;
        };
        let mask = gpus_mask(gpus);
        if e.used & mask != 0 || mask & !full_mask(e.record.gpu_count) != 0 {
            return false;
        }
        e.used |= mask;
        e.inflight |= mask;
        self.repartition(id);
        true
    }

    /// [`Index::reserve`] for `tenant` at `now`: also false (nothing changed) if the node
    /// serves another tenant.
    pub fn reserve_for(&mut self, id: &str, gpus: &[u32], tenant: &str, now: i64) -> bool {
        let _ = now;
        let serves_other = self
            .nodes
            .get(id)
            .is_none_or(|e| e.tenant.as_ref().is_some_and(|(t, _)| t != tenant));
        if serves_other || !self.reserve(id, gpus) {
            return false;
        }
        if let Some(e) = self.nodes.get_mut(id) {
            e.tenant = Some((tenant.to_string(), i64::MAX));
        }
        self.repartition(id);
        true
    }

    /// The reservation of `gpus` committed: they are allocated like any other.
    pub fn confirm(&mut self, id: &str, gpus: &[u32]) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.inflight &= !gpus_mask(gpus);
        }
    }

    /// Free `gpus` of `id` (a lease ended, or a reservation did not commit).
    pub fn release(&mut self, id: &str, gpus: &[u32]) {
        if let Some(e) = self.nodes.get_mut(id) {
            let mask = gpus_mask(gpus);
            e.used &= !mask;
            e.inflight &= !mask;
        }
        self.repartition(id);
    }

    /// The database's allocations of `id`, plus this replica's reservations in flight.
    pub fn set_used(&mut self, id: &str, used: u64) {
        if let Some(e) = self.nodes.get_mut(id) {
            e.used = (used | e.inflight) & full_mask(e.record.gpu_count);
        }
        self.repartition(id);
    }

    /// [`Index::set_used`] with the tenant the database says holds the VM (this replica's
    /// reservation in flight keeps its own).
    pub fn set_use(&mut self, id: &str, used: &super::store::NodeUse) {
        self.set_used(id, used.gpus);
        if let Some(e) = self.nodes.get_mut(id)
            && (e.inflight == 0 || e.tenant.is_none())
        {
            e.tenant = used.tenant.clone();
        }
        self.repartition(id);
    }

    /// The tenant a lease of node `id` was just ended for holds the VM until `until` (its last
    /// token's expiry), not past it.
    pub fn hold_until(&mut self, id: &str, until: i64) {
        if let Some(e) = self.nodes.get_mut(id)
            && e.used == 0
            && let Some((_, u)) = &mut e.tenant
        {
            *u = (*u).min(until);
        }
        self.repartition(id);
    }

    /// Nodes with allocated GPUs that are no longer placeable: their leases end and their jobs
    /// move (failover).
    pub fn failing(&self, now: i64) -> Vec<(String, Unplaceable)> {
        let mut out: Vec<(String, Unplaceable)> = self
            .nodes
            .values()
            .filter(|e| e.used != 0)
            .filter_map(|e| {
                self.entry_placeable(e, now)
                    .err()
                    .map(|u| (e.record.id.clone(), u))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every node id, sorted.
    /// Every node with its operator and whether it is up now: heartbeating and attested
    /// (reputation's uptime; a proof penalty is not downtime, it counts as what it was).
    pub fn liveness(&self, now: i64) -> Vec<(String, String, bool)> {
        let mut v: Vec<(String, String, bool)> = self
            .nodes
            .values()
            .map(|e| {
                let up = !matches!(
                    self.entry_placeable(e, now),
                    Err(Unplaceable::HeartbeatsMissed { .. }
                        | Unplaceable::AttestationLapsed { .. })
                );
                (e.record.id.clone(), e.record.operator.clone(), up)
            })
            .collect();
        v.sort();
        v
    }

    /// Node ids after `after` (from the first for `None`), in order.
    pub fn ids_after<'a>(&'a self, after: Option<&'a str>) -> impl Iterator<Item = &'a String> {
        use std::ops::Bound;
        let lower = match after {
            Some(a) => Bound::Excluded(a),
            None => Bound::Unbounded,
        };
        self.by_id.range::<str, _>((lower, Bound::Unbounded))
    }

    /// A node's operator.
    pub fn operator_of(&self, id: &str) -> Option<&str> {
        self.nodes.get(id).map(|e| e.record.operator.as_str())
    }

    /// Every node's id, in order.
    pub fn ids(&self) -> Vec<String> {
        self.by_id.iter().cloned().collect()
    }

    /// The node's own reputation (without its operator's).
    pub fn node_reputation(&self, id: &str) -> Option<i64> {
        self.nodes.get(id).map(|e| e.node_reputation)
    }

    /// Combined reputation (node + operator) of `id`.
    pub fn reputation(&self, id: &str) -> Option<i64> {
        self.nodes.get(id).map(|e| self.reputation_of(e))
    }
}

/// What a placement policy says of one node's input: a fit, refusals, or its failure (a limit
/// it hit, an error): each that node's misfit, never the service's.
pub fn policy_verdict(policy: &PlacementPolicy, input: &serde_json::Value) -> Result<(), Misfit> {
    match policy.refusals(input) {
        Ok(r) if r.is_empty() => Ok(()),
        Ok(r) => Err(Misfit::Policy(r)),
        Err(err) => Err(Misfit::PolicyError(err.to_string())),
    }
}

/// Claim members a placement policy sees, per evidence kind's claims: what identifies the
/// platform and its software (kind, TCB, measurements of the image, firmware and driver
/// versions, modes), never what identifies one machine or one exchange (chip id, device
/// serial, FWID, report data, nonce, report ids).
const PLACEMENT_CLAIMS: &[&str] = &[
    // every kind
    "schema",
    "kind",
    "sim",
    "debug",
    // SEV-SNP
    "version",
    "product",
    "signing_key",
    "measurement",
    "host_data",
    "reported_tcb",
    "current_tcb",
    "committed_tcb",
    "launch_tcb",
    "policy",
    "guest_svn",
    "vmpl",
    "family_id",
    "image_id",
    "id_key_digest",
    "author_key_digest",
    "platform_info",
    "smt_enabled",
    "migration_agent_allowed",
    "firmware",
    // TDX
    "quote_version",
    "body",
    "tcb_status",
    "advisory_ids",
    "mr_td",
    "mr_config_id",
    "mr_owner",
    "mr_owner_config",
    "mr_seam",
    "mr_signer_seam",
    "rtmr",
    "td_attributes",
    "xfam",
    "tee_tcb_svn",
    "seam_attributes",
    "tee_tcb_svn2",
    "mr_service_td",
    // NVIDIA
    "spdm_version",
    "driver_version",
    "vbios_version",
    "chip",
    "ocsp",
    "cc_mode",
    "devtools_mode",
    "ppcie_mode",
];

/// `{"cpu": claims, "gpus": [claims…]}` reduced to [`PLACEMENT_CLAIMS`].
pub fn placement_claims(claims: &serde_json::Value) -> serde_json::Value {
    let keep = |c: &serde_json::Value| -> serde_json::Value {
        match c.as_object() {
            Some(o) => serde_json::Value::Object(
                o.iter()
                    .filter(|(k, _)| PLACEMENT_CLAIMS.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            None => serde_json::Value::Null,
        }
    };
    serde_json::json!({
        "cpu": keep(&claims["cpu"]),
        "gpus": claims["gpus"]
            .as_array()
            .map(|g| g.iter().map(keep).collect::<Vec<_>>())
            .unwrap_or_default(),
    })
}

pub fn gpus_mask(gpus: &[u32]) -> u64 {
    gpus.iter()
        .filter(|g| **g < MAX_GPUS)
        .fold(0u64, |m, g| m | (1u64 << g))
}

fn full_mask(count: u32) -> u64 {
    if count >= 64 {
        u64::MAX
    } else {
        (1u64 << count) - 1
    }
}

fn free_indices(used: u64, count: u32, want: u32) -> Vec<u32> {
    (0..count.min(MAX_GPUS))
        .filter(|i| used & (1u64 << i) == 0)
        .take(want as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const NOW: i64 = 1_000_000;
    const F: Freshness = Freshness {
        reattest_secs: 600,
        heartbeat_secs: 5,
        missed_heartbeats: 3,
        pow_penalty_secs: 3600,
    };

    fn record(id: &str, region: &str, price: f64, gpus: u32) -> NodeRecord {
        NodeRecord {
            id: id.into(),
            node_key: String::new(),
            tee_thumbprint: String::new(),
            operator: "op".into(),
            region: region.into(),
            tee: TeeKind::Snp,
            sim: false,
            gpu_model: "H100".into(),
            gpu_chip: "GH100".into(),
            gpu_count: gpus,
            gpu_memory_gib: 80,
            price: Micros::from_stored_float(price).unwrap(),
            status: Tier::Affirming,
            violations: Vec::new(),
            attested_at: NOW - 10,
            ear_expires_at: NOW + 3600,
            ear_digest: String::new(),
            claims: serde_json::json!({"cpu": {"debug": false}, "gpus": []}),
        }
    }

    fn req(gpus: u32) -> Requirements {
        Requirements {
            tenant: "t".into(),
            gpu_model: "H100".into(),
            gpu_count: gpus,
            min_gpu_memory_gib: 0,
            tee: Vec::new(),
            regions: Vec::new(),
            max_price: Micros(10_000_000),
            policy: None,
            has_policy: false,
            spec: Arc::new(serde_json::json!({})),
        }
    }

    fn index(records: Vec<NodeRecord>) -> Index {
        let mut i = Index::new(F);
        for r in records {
            i.upsert(r, String::new(), 0, NOW - 1, 1, 0);
        }
        i
    }

    fn misfit(i: &Index, id: &str, r: &Requirements, now: i64) -> &'static str {
        i.fit(id, r, now).unwrap().unwrap_err().code()
    }

    #[test]
    fn a_sync_that_read_before_a_local_write_skips_the_node() {
        let mut i = index(vec![record("a", "eu", 1.0, 8), record("b", "eu", 1.0, 8)]);
        let since = i.generation();
        assert!(!i.wrote_since("a", since));
        // A registration served here while a sync's rows were in flight.
        i.wrote("a");
        assert!(i.wrote_since("a", since));
        assert!(!i.wrote_since("b", since));
        // The next sync, which reads the row again after the write, applies it.
        assert!(!i.wrote_since("a", i.generation()));
    }

    #[test]
    fn every_misfit_is_refused_with_its_reason() {
        let mut contra = record("contra", "eu", 1.0, 8);
        contra.status = Tier::Contraindicated;
        contra.violations = vec!["cpu0: debug_forbidden".into()];
        let mut expired = record("expired", "eu", 1.0, 8);
        expired.attested_at = NOW - 601;
        let mut ear_expired = record("ear-expired", "eu", 1.0, 8);
        ear_expired.ear_expires_at = NOW;
        let mut tdx = record("tdx", "eu", 1.0, 8);
        tdx.tee = TeeKind::Tdx;
        let mut h200 = record("h200", "eu", 1.0, 8);
        h200.gpu_model = "H200".into();
        let mut small = record("small", "eu", 1.0, 8);
        small.gpu_memory_gib = 40;
        let mut sim = record("sim", "eu", 1.0, 8);
        sim.sim = true;
        let mut i = index(vec![
            record("good", "eu", 1.0, 8),
            contra,
            expired,
            ear_expired,
            tdx,
            h200,
            small,
            record("far", "us", 1.0, 8),
            record("pricey", "eu", 20.0, 8),
            record("busy", "eu", 1.0, 2),
            sim,
        ]);
        i.upsert(
            record("silent", "eu", 1.0, 8),
            String::new(),
            0,
            NOW - 16,
            1,
            0,
        );
        assert!(i.reserve("busy", &[0]));
        let mut r = req(2);
        r.tee = vec![TeeKind::Snp];
        r.regions = vec!["eu".into()];
        r.min_gpu_memory_gib = 80;
        r.policy = Some(Arc::new(
            PlacementPolicy::compile(
                "package placement\ndeny contains \"simulated hardware\" if input.node.sim",
            )
            .unwrap(),
        ));
        assert_eq!(i.fit("good", &r, NOW), Some(Ok(())));
        for (id, code) in [
            ("contra", "not_affirming"),
            ("expired", "attestation_lapsed"),
            ("ear-expired", "attestation_lapsed"),
            ("silent", "heartbeats_missed"),
            ("tdx", "tee"),
            ("h200", "gpu_model"),
            ("small", "gpu_memory"),
            ("far", "region"),
            ("pricey", "over_price"),
            ("busy", "full"),
            ("sim", "placement_policy"),
        ] {
            assert_eq!(misfit(&i, id, &r, NOW), code, "{id}");
        }
        // Reasons anyone can read.
        let why = i.fit("contra", &r, NOW).unwrap().unwrap_err().to_string();
        assert!(
            why.contains("contraindicated") && why.contains("debug_forbidden"),
            "{why}"
        );
        let why = i.fit("sim", &r, NOW).unwrap().unwrap_err().to_string();
        assert!(why.contains("simulated hardware"), "{why}");
        // Only the good node is chosen, whatever the ranks of the others.
        assert_eq!(i.choose(&r, NOW).unwrap().node_id, "good");
        let summary = i.why_none(&req(64), NOW, &HashMap::new());
        assert!(summary.starts_with("no node fits ("), "{summary}");
        assert!(i.fit("nobody", &r, NOW).is_none());
    }

    #[test]
    fn ranking_is_price_then_reputation_then_region_then_id() {
        let mut i = index(vec![
            record("b", "us", 2.0, 8),
            record("a", "us", 2.0, 8),
            record("c", "eu", 2.0, 8),
            record("d", "eu", 3.0, 8),
        ]);
        let mut r = req(1);
        // Same price and reputation: smallest id.
        assert_eq!(i.choose(&r, NOW).unwrap().node_id, "a");
        // A preferred region wins among equals.
        r.regions = vec!["eu".into(), "us".into()];
        assert_eq!(i.choose(&r, NOW).unwrap().node_id, "c");
        // Reputation beats region; price beats reputation.
        i.set_node_reputation("b", 5);
        assert_eq!(i.choose(&r, NOW).unwrap().node_id, "b");
        i.set_node_reputation("d", 100);
        assert_eq!(i.choose(&r, NOW).unwrap().node_id, "b");
        // Operator reputation counts for every node of the operator.
        i.set_operator_reputation("op", 7);
        assert_eq!(i.reputation("b"), Some(12));
        // Over the job's price: stop walking.
        r.max_price = Micros(1_000_000);
        assert!(i.choose(&r, NOW).is_none());
    }

    #[test]
    fn capacity_heartbeats_and_failing_nodes() {
        let mut i = index(vec![record("n", "eu", 1.0, 4)]);
        let c = i.choose(&req(3), NOW).unwrap();
        assert_eq!(c.gpus, vec![0, 1, 2]);
        assert!(i.reserve("n", &c.gpus));
        assert!(!i.reserve("n", &[2]), "a GPU is reserved once");
        assert!(!i.reserve("n", &[4]), "no such GPU");
        assert_eq!(i.free_gpus("n"), Some(1));
        assert!(i.choose(&req(2), NOW).is_none());
        assert_eq!(i.choose(&req(1), NOW).unwrap().gpus, vec![3]);
        // A sync from the database (which has not seen the reservation yet) keeps it reserved;
        // once committed, the database's word is the allocation.
        i.set_used("n", 0);
        assert_eq!(i.free_gpus("n"), Some(1), "in flight stays reserved");
        i.confirm("n", &c.gpus);
        i.set_used("n", 0b011);
        assert_eq!(i.free_gpus("n"), Some(2));
        i.set_used("n", 0b111);
        // Heartbeats: a sequence at or below the last is a replay.
        assert!(i.heartbeat("n", 2, NOW));
        assert!(!i.heartbeat("n", 2, NOW + 1));
        assert!(i.failing(NOW + 15).is_empty());
        let failing = i.failing(NOW + 16);
        assert_eq!(failing.len(), 1);
        assert!(matches!(failing[0].1, Unplaceable::HeartbeatsMissed { .. }));
        i.release("n", &c.gpus);
        assert!(
            i.failing(NOW + 16).is_empty(),
            "no allocations: nothing to move"
        );
        assert_eq!(i.free_gpus("n"), Some(4));
        assert!(i.remove("n"));
        assert!(i.choose(&req(1), NOW).is_none());
        assert!(i.is_empty());
    }

    /// The partitioned walk decides exactly as a scan of every node, over random fleets, jobs
    /// (regions, TEEs, memory, prices, policies), allocations, reputations and lapses.
    #[test]
    fn choose_equals_a_full_scan() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        let mut rnd = |n: u64| {
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            seed.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
        };
        let regions = ["eu", "us", "ap"];
        let models = ["H100", "H200"];
        let policy = Arc::new(
            PlacementPolicy::compile(
                "package placement\ndeny contains \"odd\" if endswith(input.node.id, \"7\")",
            )
            .unwrap(),
        );
        for round in 0..30 {
            let mut i = Index::new(F);
            for n in 0..150 {
                let mut r = record(
                    &format!("n{n:03}"),
                    regions[rnd(3) as usize],
                    1.0 + rnd(5) as f64 * 0.5,
                    [1, 2, 4, 8, 12, 64][rnd(6) as usize],
                );
                r.gpu_model = models[rnd(2) as usize].into();
                r.tee = if rnd(3) == 0 {
                    TeeKind::Tdx
                } else {
                    TeeKind::Snp
                };
                r.gpu_memory_gib = [40, 80][rnd(2) as usize];
                if rnd(20) == 0 {
                    r.status = Tier::Warning;
                }
                if rnd(20) == 0 {
                    r.attested_at = NOW - 700;
                }
                let hb = if rnd(20) == 0 { NOW - 30 } else { NOW };
                i.upsert(r, String::new(), rnd(4) as i64, hb, 1, 0);
            }
            if round % 3 == 0 {
                i.set_operator_reputation("op", 3);
            }
            for step in 0..200 {
                let mut q = req([1, 1, 2, 3, 4, 8, 9, 16][rnd(8) as usize]);
                q.gpu_model = models[rnd(2) as usize].into();
                q.max_price = Micros(1_000_000 + rnd(6) * 500_000);
                q.min_gpu_memory_gib = [0, 40, 80][rnd(3) as usize];
                q.tee = match rnd(3) {
                    0 => vec![TeeKind::Tdx],
                    1 => vec![TeeKind::Snp, TeeKind::Tdx],
                    _ => Vec::new(),
                };
                q.regions = match rnd(3) {
                    0 => Vec::new(),
                    1 => vec![regions[rnd(3) as usize].into()],
                    _ => vec![
                        regions[rnd(3) as usize].into(),
                        regions[rnd(3) as usize].into(),
                    ],
                };
                if rnd(4) == 0 {
                    q.policy = Some(policy.clone());
                }
                // Three tenants: a VM one holds is walked past by no other.
                q.tenant = ["t", "u", "v"][rnd(3) as usize].into();
                let a = i.choose(&q, NOW);
                assert_eq!(
                    a,
                    i.scan_choose(&q, NOW),
                    "round {round} step {step}: {q:?}"
                );
                if let Some(c) = a {
                    assert!(i.reserve_for(&c.node_id, &c.gpus, &q.tenant, NOW));
                }
                if rnd(5) == 0 {
                    let id = format!("n{:03}", rnd(150));
                    i.set_used(&id, 0);
                    // Its tenant's last token lives a little longer, or is gone.
                    i.hold_until(&id, NOW - 1 + rnd(3) as i64);
                    if rnd(2) == 0 {
                        i.release_lapsed_holds(NOW);
                    }
                    i.set_node_reputation(&id, rnd(6) as i64);
                }
                // Each tenant's count of held partition entries is exactly what the shelves
                // hold (a re-rank once left a held node counted twice).
                let mut counted: HashMap<String, usize> = HashMap::new();
                for ((_, _, _, holder), sets) in &i.parts {
                    if let Some(t) = holder {
                        *counted.entry(t.clone()).or_default() +=
                            sets.iter().map(BTreeSet::len).sum::<usize>();
                    }
                }
                assert_eq!(counted, i.held, "round {round} step {step}");
                assert!(i.parts.values().all(|s| s.iter().any(|b| !b.is_empty())));
            }
        }
    }
}
