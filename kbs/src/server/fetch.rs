//! Online collateral fetching, bounded.
//!
//! Evidence names the collateral it needs (an SNP chip's VCEK, a TDX FMSPC's TCB info, a GPU
//! certificate's OCSP status) before anything about it can be verified, so an unauthenticated
//! client could make the KBS fetch for chips that do not exist. Hence:
//! - the request path reads the collateral store only ([`super::attest::Attester`]); a miss comes
//!   here;
//! - one fetcher thread works a bounded queue, one fetch per key at a time (vendors pace and
//!   rate-limit us anyway); a waiting request holds no thread, only a channel;
//! - a new fetch is charged to the asking client's budget (a burst, then a slow refill); past
//!   it, 429 with `Retry-After`; with the queue full, 503;
//! - a key whose fetch failed is refused for a while without asking the vendor again;
//! - known chips never wait behind unknown ones: their collateral is in the store, so their
//!   attestations never reach the queue or the budget.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cgx_attestation::collateral::CollateralKey;
use cgx_attestation::collateral::fetch::CollateralSource;
use cgx_service::SharedClock;
use tokio::sync::oneshot;

use super::config::CollateralConfig;
use super::error::KbsError;

/// Longest a request waits for a fetch it asked for (vendor timeout and pacing included).
const WAIT: Duration = Duration::from_secs(60);
/// Clients and failed keys remembered at most (a flood of addresses or chips cannot grow them
/// without bound; past it the oldest half is forgotten).
const MAX_REMEMBERED: usize = 100_000;

type Waiter = oneshot::Sender<Result<(), String>>;
/// The fetches one request waits for: (collateral path, its answer).
type Waits = Vec<(String, oneshot::Receiver<Result<(), String>>)>;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// Keys queued or being fetched, with the requests waiting for each.
    waiting: HashMap<String, Vec<Waiter>>,
    /// Keys whose fetch failed: until when they are refused, and why.
    failed: HashMap<String, (Instant, String)>,
    budgets: HashMap<IpAddr, Bucket>,
    /// When a refresh of a stored key was last queued (one try per negative interval: a
    /// vendor that keeps failing is not asked again on every attestation).
    refreshed: HashMap<String, Instant>,
}

/// The bounded fetcher (see the module documentation).
#[derive(Debug)]
pub(crate) struct FetchGate {
    queue: SyncSender<CollateralKey>,
    state: Arc<Mutex<State>>,
    burst: f64,
    refill: Duration,
    negative: Duration,
}

/// How long a failed key is refused: the configured time for a definite answer (the vendor does
/// not know it, or answered something unusable), a short one for what may pass (a timeout, the
/// vendor's or our own rate limit) — so a flood that makes a vendor throttle us cannot get
/// genuine keys refused for long.
fn negative_for(error: &str, definite: Duration) -> Duration {
    let is_definite = (error.contains("HTTP 4") && !error.contains("HTTP 429"))
        || error.contains("unusable answer");
    if is_definite {
        definite
    } else {
        definite.min(Duration::from_secs(15))
    }
}

/// Whose budget a request is charged to: its IPv4 address, or its IPv6 /64 (one host can
/// have a whole /64 to itself).
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

fn forget_oldest<K: Clone + Eq + std::hash::Hash, V>(
    map: &mut HashMap<K, V>,
    at: impl Fn(&V) -> Instant,
) {
    if map.len() < MAX_REMEMBERED {
        return;
    }
    let mut times: Vec<Instant> = map.values().map(&at).collect();
    times.sort_unstable();
    let cut = times[times.len() / 2];
    map.retain(|_, v| at(v) > cut);
}

impl FetchGate {
    /// Start the fetcher thread over `source` (which must be online).
    pub(crate) fn start(
        source: Arc<CollateralSource>,
        config: &CollateralConfig,
        clock: SharedClock,
    ) -> Result<Self, KbsError> {
        let (queue, jobs) = std::sync::mpsc::sync_channel::<CollateralKey>(config.fetch_queue);
        let state = Arc::new(Mutex::new(State::default()));
        let negative = Duration::from_secs(config.negative_ttl_secs);
        let shared = state.clone();
        std::thread::Builder::new()
            .name("collateral-fetch".into())
            .spawn(move || {
                // Ends when the gate (the queue's sender) is dropped with the KBS.
                for key in jobs {
                    let path = key.path();
                    // A panic below (a parser bug on a vendor's answer) fails this key, not the
                    // fetcher: its waiters get an answer, later keys are still fetched.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        source.get(&key, clock.unix())
                    }))
                    .map_err(|_| "the fetcher failed on this item".to_string())
                    .and_then(|r| r.map(|_| ()).map_err(|e| e.to_string()));
                    let mut st = shared
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if let Err(e) = &result {
                        tracing::warn!(collateral = %path, error = %e, "collateral fetch failed");
                        forget_oldest(&mut st.failed, |(until, _)| *until);
                        st.failed.insert(
                            path.clone(),
                            (Instant::now() + negative_for(e, negative), e.clone()),
                        );
                    }
                    for w in st.waiting.remove(&path).unwrap_or_default() {
                        let _ = w.send(result.clone());
                    }
                }
            })
            .map_err(|e| KbsError::Config(format!("collateral fetcher thread: {e}")))?;
        Ok(FetchGate {
            queue,
            state,
            burst: f64::from(config.fetch_burst.max(1)),
            refill: Duration::from_secs(config.fetch_refill_secs.max(1)),
            negative,
        })
    }

    /// Fetch `keys` for `client` and wait until each is in the store. Refused at once: a key
    /// that failed recently, a client past its budget (429), a full queue (503).
    pub(crate) async fn fetch(
        &self,
        client: IpAddr,
        keys: &[CollateralKey],
    ) -> Result<(), KbsError> {
        let waits = self.enqueue(client, keys, true)?;
        let deadline = tokio::time::Instant::now() + WAIT;
        for (path, rx) in waits {
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    return Err(KbsError::AttestationFailed(format!(
                        "collateral {path}: {e}"
                    )));
                }
                _ => {
                    return Err(KbsError::AttestationFailed(format!(
                        "collateral {path}: the vendor did not answer in time"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Fetch `keys` without waiting (collateral an attestation could do without, or a refresh
    /// of what the store holds): charged to `client` when given; skipped, not refused, when
    /// the budget or the queue has no room.
    pub(crate) fn prefetch(&self, client: Option<IpAddr>, keys: &[CollateralKey]) {
        let _ = match client {
            Some(c) => self.enqueue(c, keys, false).map(drop),
            None => self.enqueue_uncharged(keys),
        };
    }

    fn enqueue_uncharged(&self, keys: &[CollateralKey]) -> Result<(), KbsError> {
        let now = Instant::now();
        let mut st = self.lock()?;
        for key in keys {
            let path = key.path();
            let tried = st
                .refreshed
                .get(&path)
                .is_some_and(|t| now.duration_since(*t) < self.negative);
            if tried || st.waiting.contains_key(&path) {
                continue;
            }
            if self.queue.try_send(key.clone()).is_ok() {
                forget_oldest(&mut st.refreshed, |t| *t);
                st.refreshed.insert(path.clone(), now);
                st.waiting.insert(path, Vec::new());
            }
        }
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>, KbsError> {
        self.state
            .lock()
            .map_err(|_| KbsError::Internal("collateral fetcher state".into()))
    }

    fn enqueue(
        &self,
        client: IpAddr,
        keys: &[CollateralKey],
        wait: bool,
    ) -> Result<Waits, KbsError> {
        let now = Instant::now();
        let mut st = self.lock()?;
        let mut waits = Vec::new();
        // Waiters per key are bounded by the requests in flight; drop those that gave up.
        for w in st.waiting.values_mut() {
            w.retain(|tx| !tx.is_closed());
        }
        for key in keys {
            let path = key.path();
            if waits.iter().any(|(p, _)| *p == path) {
                continue;
            }
            if let Some((until, why)) = st.failed.get(&path)
                && *until > now
            {
                if !wait {
                    continue;
                }
                return Err(KbsError::AttestationFailed(format!(
                    "collateral {path}: {why} (not asked again for {} s)",
                    until.saturating_duration_since(now).as_secs()
                )));
            }
            let (tx, rx) = oneshot::channel();
            // Joining a fetch already under way costs nothing.
            if let Some(w) = st.waiting.get_mut(&path) {
                if wait {
                    w.push(tx);
                    waits.push((path, rx));
                }
                continue;
            }
            let (burst, refill) = (self.burst, self.refill.as_secs_f64());
            forget_oldest(&mut st.budgets, |b| b.at);
            let bucket = st.budgets.entry(client_key(client)).or_insert(Bucket {
                tokens: burst,
                at: now,
            });
            bucket.tokens =
                (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() / refill).min(burst);
            bucket.at = now;
            if bucket.tokens < 1.0 {
                if !wait {
                    return Ok(waits);
                }
                let retry = ((1.0 - bucket.tokens) * refill).ceil() as u64;
                return Err(KbsError::TooManyRequests {
                    retry_after: retry.max(1),
                    detail: format!(
                        "this client may start no more collateral fetches for now (it asked for \
                         {path}); known platforms are not affected"
                    ),
                });
            }
            match self.queue.try_send(key.clone()) {
                Ok(()) => {
                    bucket.tokens -= 1.0;
                    st.waiting
                        .insert(path.clone(), if wait { vec![tx] } else { Vec::new() });
                    if wait {
                        waits.push((path, rx));
                    }
                }
                Err(TrySendError::Full(_)) => {
                    if !wait {
                        return Ok(waits);
                    }
                    return Err(KbsError::Overloaded {
                        retry_after: 5,
                        detail: "the collateral fetch queue is full".into(),
                    });
                }
                Err(TrySendError::Disconnected(_)) => {
                    return Err(KbsError::Internal("collateral fetcher stopped".into()));
                }
            }
        }
        Ok(waits)
    }
}
