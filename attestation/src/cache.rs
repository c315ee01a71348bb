//! A bounded cache of verified certificate chains (SNP, NVIDIA) and parsed collateral (TDX).
//!
//! Entries are keyed by the exact bytes they were verified from: the first part (the signing
//! certificate) is hashed, the others are compared on a hit. So a hit costs hashing about a
//! kilobyte and a few memory compares — not a digest of everything — and no two different inputs
//! can share an entry. The std `Mutex` is never held across anything slow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bound on entries; past it the cache is cleared (chains are cheap to re-verify and one verifier
/// sees far fewer distinct devices than this between restarts).
const CAP: usize = 4096;

#[derive(Debug)]
struct Entry<T> {
    rest: Vec<Vec<u8>>,
    value: Arc<T>,
}

#[derive(Debug)]
pub(crate) struct ChainCache<T> {
    map: Mutex<HashMap<Vec<u8>, Entry<T>>>,
}

impl<T> ChainCache<T> {
    pub(crate) fn new() -> Self {
        ChainCache {
            map: Mutex::new(HashMap::new()),
        }
    }

    /// The value verified from exactly `key` and `rest`, if cached.
    pub(crate) fn get(&self, key: &[u8], rest: &[&[u8]]) -> Option<Arc<T>> {
        let map = self.map.lock().ok()?;
        let e = map.get(key)?;
        let same = e.rest.len() == rest.len() && e.rest.iter().zip(rest).all(|(a, b)| a == b);
        same.then(|| e.value.clone())
    }

    pub(crate) fn insert(&self, key: &[u8], rest: &[&[u8]], value: Arc<T>) {
        if let Ok(mut map) = self.map.lock() {
            if map.len() >= CAP {
                map.clear();
            }
            map.insert(
                key.to_vec(),
                Entry {
                    rest: rest.iter().map(|r| r.to_vec()).collect(),
                    value,
                },
            );
        }
    }
}
