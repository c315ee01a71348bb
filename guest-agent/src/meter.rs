//! Metering: one record per lease per window (`cgx_protocol::metering`), signed by the node
//! key, chained by the hash of the one before. A window's record is sent when the window
//! closes, with each GPU's usage sampled then (NVML; simulated under `--sim`) and the window's
//! proof-of-work answer if one fell in it. A record is made once: one the broker did not take
//! is sent again, the same bytes while its token lives, then the same record signed anew.

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_protocol::broker::LeaseGrant;
use cgx_protocol::metering::{
    GpuUsage, METERING_TTL_SECS, MeteringRecord, PowAnswer, genesis, token_hash,
};
use cgx_protocol::records::WorkloadState;

use crate::daemon::log;
use crate::machine::Machine;

/// Seconds between tries of a record the broker did not take.
const RETRY_SECS: i64 = 5;

/// One lease's chain as this node holds it.
#[derive(Debug)]
pub struct Meter {
    lease: String,
    start: i64,
    window_secs: u32,
    gpus: Vec<u32>,
    seq: u64,
    prev: String,
    /// The record of `seq`, made once (its usage sampled, its proof answer taken), and its
    /// token while that lives: retries send the same bytes, then the same record re-signed.
    pending: Option<MeteringRecord>,
    token: Option<(String, i64)>,
    /// The hashes of every signing of the pending record: the only hashes its successor may
    /// link to.
    signed: Vec<String>,
    /// The broker named a hash this node never signed for the window: the chain cannot go on
    /// honestly, so it stops (said in the log).
    broken: bool,
    next_try: i64,
    /// The volatile ECC totals last read, per GPU: records carry the window's increase.
    ecc: std::collections::HashMap<u32, (u64, u64)>,
    /// When the lease stopped on this node: the windows that began before are still metered
    /// (the last one when it would have closed), none after — the provider is paid for the
    /// windows it ran and proved, the last one included.
    ended: Option<i64>,
}

impl Meter {
    /// From a verified grant (its start and window are the signed lease's); `None` for a
    /// lease whose token carries no start.
    pub fn new(g: &LeaseGrant) -> Option<Meter> {
        (g.start > 0 && g.window_secs > 0).then(|| Meter {
            lease: g.lease_id.clone(),
            start: g.start,
            window_secs: g.window_secs,
            gpus: g.gpus.clone(),
            seq: 0,
            prev: genesis(&g.lease_id),
            pending: None,
            token: None,
            signed: Vec::new(),
            broken: false,
            next_try: 0,
            ecc: Default::default(),
            ended: None,
        })
    }

    fn window_start(&self, seq: u64) -> i64 {
        self.start
            .saturating_add(i64::from(self.window_secs).saturating_mul(seq as i64))
    }

    /// The window `seq` falls in at `now`.
    pub fn due(&self, now: i64) -> bool {
        !self.broken
            && self.ended.is_none_or(|e| self.window_start(self.seq) < e)
            && now >= self.window_start(self.seq + 1)
            && now >= self.next_try
    }

    /// The lease stopped at `at`: meter the windows begun before, then nothing.
    pub fn end(&mut self, at: i64) {
        self.ended
            .get_or_insert(cgx_protocol::metering::metered_end(self.start, at));
    }

    /// Nothing left to send: the lease stopped and its last window's record was taken, or
    /// cannot be any more (its chain broke, or the broker would no longer take it).
    pub fn done(&self, now: i64) -> bool {
        match self.ended {
            None => false,
            Some(e) => {
                self.broken
                    || self.window_start(self.seq) >= e
                    || now > e.saturating_add(METERING_TTL_SECS)
            }
        }
    }

    fn usage(&mut self, machine: &dyn Machine) -> Vec<GpuUsage> {
        let mut out = Vec::with_capacity(self.gpus.len());
        for &g in &self.gpus {
            let mut u = machine.gpu_usage(g).unwrap_or(GpuUsage {
                index: g,
                utilization_pct: 0,
                memory_used_mib: 0,
                temperature_c: 0,
                power_mw: 0,
                ecc_corrected: 0,
                ecc_uncorrected: 0,
                throttle_reasons: 0,
            });
            let (c, un) = (u.ecc_corrected, u.ecc_uncorrected);
            let (lc, lu) = self.ecc.insert(g, (c, un)).unwrap_or((c, un));
            u.index = g;
            u.ecc_corrected = c.saturating_sub(lc);
            u.ecc_uncorrected = un.saturating_sub(lu);
            out.push(u);
        }
        out
    }

    /// Send the record of the window that closed, if one did: `pow` gives the window's
    /// answer (asked only when a new record is made).
    #[allow(clippy::too_many_arguments)]
    pub fn tick(
        &mut self,
        now: i64,
        node_id: &str,
        signer: &cgx_protocol::signed::Signer,
        machine: &dyn Machine,
        client: &BrokerClient,
        workload: WorkloadState,
        pow: impl FnOnce(u64) -> Option<PowAnswer>,
    ) {
        if !self.due(now) {
            return;
        }
        let record = match self.pending.take() {
            Some(r) => r,
            None => {
                let start = self.window_start(self.seq);
                MeteringRecord {
                    sub: node_id.to_string(),
                    lease: self.lease.clone(),
                    seq: self.seq,
                    window_start: start,
                    window_secs: self.window_secs,
                    gpus: self.usage(machine),
                    pow: pow(self.seq),
                    workload,
                    prev: self.prev.clone(),
                }
            }
        };
        let token = match self.token.take() {
            // Still alive for a minute: the same bytes again.
            Some((t, exp)) if exp > now + 60 => t,
            _ => match signer.sign(&record, now, now + METERING_TTL_SECS) {
                Ok(t) => {
                    self.signed.push(token_hash(&t));
                    t
                }
                Err(e) => {
                    log(format_args!("lease {}: metering record: {e}", self.lease));
                    self.pending = Some(record);
                    self.next_try = now + RETRY_SECS;
                    return;
                }
            },
        };
        match client.metering(node_id, &token) {
            Ok(a) if a.seq == self.seq && a.hash == token_hash(&token) => {
                self.advance(token_hash(&token));
            }
            Ok(a) => self.stop(&format!(
                "the broker took record {} as sequence {} with hash {}: not what this node sent",
                self.seq, a.seq, a.hash
            )),
            // Accepted before (an answer lost on the way): the chain goes on from the record
            // the broker holds — this one's, or an earlier signing of the same record.
            Err(ClientError::Refused {
                status: 409,
                detail,
                ..
            }) if detail.contains(&format!("sequence {} already accepted", self.seq)) => {
                let held = detail.rsplit("accepted as ").next().unwrap_or("");
                if self.signed.iter().any(|h| h == held) {
                    self.advance(held.to_string());
                } else {
                    self.stop(&format!(
                        "the broker holds a record of window {} this node did not sign",
                        self.seq
                    ));
                }
            }
            Err(e) => {
                log(format_args!(
                    "lease {}: metering record {}: {e}",
                    self.lease, self.seq
                ));
                self.pending = Some(record);
                self.token = Some((token, now + METERING_TTL_SECS));
                self.next_try = now + RETRY_SECS;
            }
        }
    }

    fn advance(&mut self, hash: String) {
        self.prev = hash;
        self.seq += 1;
        self.signed.clear();
    }

    fn stop(&mut self, why: &str) {
        log(format_args!(
            "lease {}: metering stopped: {why}",
            self.lease
        ));
        self.broken = true;
    }

    /// Records accepted so far.
    pub fn sent(&self) -> u64 {
        self.seq
    }
}
