//! Bounded caches of verified results: certificate chains (SNP, NVIDIA), OCSP verdicts (NVIDIA)
//! and known TDX platforms.
//!
//! **What may enter.** Callers insert only what verified in full — for a chain, the chain *and*
//! the report or SPDM signature made under it — and key it by a canonical form of its input (DER
//! certificates, canonical PEM, CRLs and OCSP responses without trailing bytes), so neither
//! public chains paired with junk reports nor junk re-encodings of one chain make entries.
//!
//! **Keys.** An entry is keyed by its first part (hashed) and its other parts (compared on a
//! hit): a hit costs hashing about a kilobyte and a few memory compares, and no two different
//! inputs share an entry.
//!
//! **Bounds.** A cache holds at most [`BUDGET`] bytes (keys plus each value's declared size plus
//! a per-entry overhead), never an entry count, and evicts least-recently-used entries one at a
//! time — never everything at once. It is segmented (SLRU): a new entry starts on probation and
//! is promoted to the protected segment on its first hit, and eviction takes probation entries
//! first. So a flood of one-shot entries (even valid ones, from hardware an attacker owns)
//! churns only the probation segment, and the entries honest nodes use again and again stay.
//!
//! The std `Mutex` is never held across anything slow (no verification runs under it).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes one cache may hold by default. A verified SNP or NVIDIA chain costs a few KiB here
/// (its tables, when built, are budgeted by `crypto/p384.rs`), a known TDX platform about 8 KiB:
/// thousands of devices fit.
pub(crate) const BUDGET: usize = 32 << 20;

/// Bookkeeping per entry, counted against the budget with its bytes (map slots, the LRU index,
/// the `Arc`), so that many tiny entries cannot outgrow it either.
const ENTRY_OVERHEAD: usize = 160;

/// Share of the budget the protected segment may keep (the rest is probation's, at least).
const PROTECTED_SHARE: (usize, usize) = (4, 5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    Probation = 0,
    Protected = 1,
}

#[derive(Debug)]
struct Entry<T> {
    rest: Vec<Box<[u8]>>,
    value: Arc<T>,
    size: usize,
    segment: Segment,
    /// Its position in its segment's LRU order.
    tick: u64,
}

#[derive(Debug)]
struct Inner<T> {
    map: HashMap<Box<[u8]>, Entry<T>>,
    /// Per segment, keys by last use (oldest first).
    order: [BTreeMap<u64, Box<[u8]>>; 2],
    bytes: [usize; 2],
    tick: u64,
}

/// What a cache holds and how it has been used (tests and benchmarks read it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Entries held.
    pub entries: usize,
    /// Bytes held, as the budget counts them.
    pub bytes: usize,
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that found nothing (the caller then verifies in full).
    pub misses: u64,
    /// Entries evicted to stay within the budget.
    pub evictions: u64,
}

#[derive(Debug)]
pub(crate) struct ChainCache<T> {
    inner: Mutex<Inner<T>>,
    budget: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl<T> ChainCache<T> {
    pub(crate) fn new() -> Self {
        Self::with_budget(BUDGET)
    }

    pub(crate) fn with_budget(budget: usize) -> Self {
        ChainCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: [BTreeMap::new(), BTreeMap::new()],
                bytes: [0, 0],
                tick: 0,
            }),
            budget,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The value verified from exactly `key` and `rest`, if cached; a hit makes it the most
    /// recently used (and promotes it from probation). A lookup that finds nothing is not
    /// counted: a caller may look a second time under the input's canonical form, and says
    /// [`Self::note_miss`] when it goes on to verify in full.
    pub(crate) fn get(&self, key: &[u8], rest: &[&[u8]]) -> Option<Arc<T>> {
        let found = self.lookup(key, rest);
        if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Count a lookup that ended in a full verification.
    pub(crate) fn note_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    fn lookup(&self, key: &[u8], rest: &[&[u8]]) -> Option<Arc<T>> {
        let mut guard = self.inner.lock().ok()?;
        let inner = &mut *guard;
        let e = inner.map.get_mut(key)?;
        let same =
            e.rest.len() == rest.len() && e.rest.iter().zip(rest).all(|(a, b)| a.as_ref() == *b);
        if !same {
            return None;
        }
        let value = e.value.clone();
        // Move it to the most recent end of the protected segment (re-using the boxed key).
        inner.tick += 1;
        let (old_segment, old_tick) = (e.segment as usize, e.tick);
        e.tick = inner.tick;
        e.segment = Segment::Protected;
        let size = e.size;
        if let Some(k) = inner.order[old_segment].remove(&old_tick) {
            inner.order[Segment::Protected as usize].insert(inner.tick, k);
        }
        if old_segment != Segment::Protected as usize {
            inner.bytes[old_segment] -= size;
            inner.bytes[Segment::Protected as usize] += size;
            self.rebalance(inner);
        }
        Some(value)
    }

    /// Cache `value`, verified from `key` and `rest`, declaring `value_bytes` for what it holds
    /// beyond its own struct. A value larger than a tenth of the budget is not cached.
    pub(crate) fn insert(&self, key: &[u8], rest: &[&[u8]], value: Arc<T>, value_bytes: usize) {
        let size = ENTRY_OVERHEAD
            + 2 * key.len() // the map's key and the LRU index's copy
            + rest.iter().map(|r| r.len()).sum::<usize>()
            + std::mem::size_of::<T>()
            + value_bytes;
        if size > self.budget / 10 {
            return;
        }
        let Ok(mut guard) = self.inner.lock() else {
            return;
        };
        let inner = &mut *guard;
        if let Some(old) = inner.map.remove(key) {
            inner.order[old.segment as usize].remove(&old.tick);
            inner.bytes[old.segment as usize] -= old.size;
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order[Segment::Probation as usize].insert(tick, key.into());
        inner.bytes[Segment::Probation as usize] += size;
        inner.map.insert(
            key.into(),
            Entry {
                rest: rest.iter().map(|r| Box::<[u8]>::from(*r)).collect(),
                value,
                size,
                segment: Segment::Probation,
                tick,
            },
        );
        self.rebalance(inner);
    }

    /// Demote protected entries past the protected share to probation, then evict the oldest
    /// probation entries (the oldest protected ones once probation is empty) past the budget.
    fn rebalance(&self, inner: &mut Inner<T>) {
        let (num, den) = PROTECTED_SHARE;
        let protected_cap = self.budget / den * num;
        while inner.bytes[Segment::Protected as usize] > protected_cap {
            let Some((_, k)) = inner.order[Segment::Protected as usize].pop_first() else {
                break;
            };
            inner.tick += 1;
            let tick = inner.tick;
            if let Some(e) = inner.map.get_mut(&k) {
                e.segment = Segment::Probation;
                e.tick = tick;
                inner.bytes[Segment::Protected as usize] -= e.size;
                inner.bytes[Segment::Probation as usize] += e.size;
            }
            inner.order[Segment::Probation as usize].insert(tick, k);
        }
        while inner.bytes[0] + inner.bytes[1] > self.budget {
            let victim = inner.order[Segment::Probation as usize]
                .pop_first()
                .or_else(|| inner.order[Segment::Protected as usize].pop_first());
            let Some((_, k)) = victim else {
                break;
            };
            if let Some(e) = inner.map.remove(&k) {
                inner.bytes[e.segment as usize] -= e.size;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Drop every entry (benchmarks and tests).
    #[cfg(feature = "test-support")]
    pub(crate) fn clear(&self) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.map.clear();
            inner.order = [BTreeMap::new(), BTreeMap::new()];
            inner.bytes = [0, 0];
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let (entries, bytes) = self
            .inner
            .lock()
            .map(|i| (i.map.len(), i.bytes[0] + i.bytes[1]))
            .unwrap_or_default();
        CacheStats {
            entries,
            bytes,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(i: usize) -> Vec<u8> {
        format!("key-{i:06}").into_bytes()
    }

    #[test]
    fn stays_within_its_byte_budget_and_evicts_one_at_a_time() {
        let c: ChainCache<u32> = ChainCache::with_budget(100_000);
        for i in 0..10_000 {
            c.insert(&key(i), &[&[0u8; 500]], Arc::new(i as u32), 1000);
            assert!(c.stats().bytes <= 100_000);
        }
        let s = c.stats();
        assert!(s.entries > 30, "{s:?}");
        // The newest entries are there; the oldest went first.
        assert!(c.get(&key(9_999), &[&[0u8; 500]]).is_some());
        assert!(c.get(&key(0), &[&[0u8; 500]]).is_none());
        assert_eq!(s.evictions as usize, 10_000 - s.entries);
    }

    #[test]
    fn a_value_too_large_for_the_budget_is_not_cached() {
        let c: ChainCache<u32> = ChainCache::with_budget(100_000);
        c.insert(&key(1), &[], Arc::new(1), 20_000);
        assert!(c.get(&key(1), &[]).is_none());
        assert_eq!(c.stats().entries, 0);
    }

    #[test]
    fn entries_in_use_survive_a_flood_of_one_shot_entries() {
        let c: ChainCache<u32> = ChainCache::with_budget(200_000);
        // Honest entries, each used again (promoted).
        for i in 0..20 {
            c.insert(&key(i), &[b"chain"], Arc::new(i as u32), 2000);
            assert!(c.get(&key(i), &[b"chain"]).is_some());
        }
        // A flood of entries never used again: far more than the budget holds.
        for i in 1000..50_000 {
            c.insert(&key(i), &[b"chain"], Arc::new(i as u32), 2000);
        }
        for i in 0..20 {
            assert_eq!(*c.get(&key(i), &[b"chain"]).unwrap(), i as u32, "{i}");
        }
        assert!(c.stats().bytes <= 200_000);
        assert!(c.stats().evictions > 40_000);
    }

    #[test]
    fn the_protected_segment_is_bounded_too() {
        let c: ChainCache<u32> = ChainCache::with_budget(100_000);
        for i in 0..1000 {
            c.insert(&key(i), &[], Arc::new(i as u32), 1000);
            c.get(&key(i), &[]).unwrap();
        }
        let s = c.stats();
        assert!(s.bytes <= 100_000, "{s:?}");
        // The most recently used survive.
        assert!(c.get(&key(999), &[]).is_some());
        assert!(c.get(&key(0), &[]).is_none());
    }

    #[test]
    fn a_different_rest_is_a_miss_and_replacing_keeps_the_accounting() {
        let c: ChainCache<u32> = ChainCache::with_budget(100_000);
        c.insert(&key(1), &[b"a"], Arc::new(1), 10);
        assert!(c.get(&key(1), &[b"b"]).is_none());
        assert!(c.get(&key(1), &[b"a", b"b"]).is_none());
        let one = c.stats().bytes;
        c.insert(&key(1), &[b"b"], Arc::new(2), 10);
        assert_eq!(c.stats().entries, 1);
        assert_eq!(c.stats().bytes, one);
        assert_eq!(*c.get(&key(1), &[b"b"]).unwrap(), 2);
    }
}
