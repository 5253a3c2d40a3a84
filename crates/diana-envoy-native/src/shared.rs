//! The process's shared data: what proxy-wasm's shared data is for every VM of a `vm_id`,
//! here one store in process memory for every Envoy worker thread, with Envoy's
//! compare-and-swap rules (those of [`diana_core::store::CasSemantics::Envoy`], which
//! [`diana_core::store::MemoryHost`] reproduces for the tests and which the tests below
//! hold this store to).
//!
//! The counters are read and written without a lock. A key's record is an immutable
//! `(value, cas)` behind an [`ArcSwap`]: a read loads it, a write swaps in a new one only
//! if the record it was checked against is still there (one atomic compare-and-swap of a
//! pointer), so a write that raced another one fails with a CAS mismatch — which is what
//! the worker's algorithms expect and retry — or, unconditional (CAS 0), tries again. The
//! map from keys to records only grows: finding a key takes its shard's read lock (shared
//! by every reader), and only the first write of a key takes the shard's write lock, once.
//! Keys are never freed, as in Envoy; the slot tables bound them.
//!
//! ```text
//!   key ──shard (read lock, shared)──► Arc<ArcSwap<Record>> ──load──► { value, cas }
//!                                                          ◄─compare_and_swap─ new Record
//! ```

use arc_swap::ArcSwap;
use diana_core::store::{HostError, SetOutcome, SharedData};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

/// Shards of the key map: first writes of different keys rarely wait for each other.
const SHARDS: usize = 16;

/// A key's value and the CAS that a write of it must name.
struct Record {
    value: Vec<u8>,
    cas: u32,
}

type Cell = Arc<ArcSwap<Record>>;

/// Shared data in process memory. See the module docs.
pub struct SharedStore {
    shards: [RwLock<HashMap<String, Cell>>; SHARDS],
    next_cas: AtomicU32,
}

impl Default for SharedStore {
    fn default() -> Self {
        SharedStore {
            shards: std::array::from_fn(|_| RwLock::new(HashMap::new())),
            next_cas: AtomicU32::new(1),
        }
    }
}

impl SharedStore {
    fn shard(&self, key: &str) -> &RwLock<HashMap<String, Cell>> {
        let index = diana_core::hash::hash64(0, key.as_bytes()) % SHARDS as u64;
        let [first, ..] = &self.shards;
        usize::try_from(index)
            .ok()
            .and_then(|index| self.shards.get(index))
            .unwrap_or(first)
    }

    fn find(&self, key: &str) -> Result<Option<Cell>, HostError> {
        let shard = self.shard(key).read().map_err(|_| HostError::Poisoned)?;
        Ok(shard.get(key).cloned())
    }

    /// A CAS no record holds yet (never 0: 0 means "unconditional").
    fn fresh_cas(&self) -> u32 {
        loop {
            let cas = self.next_cas.fetch_add(1, Ordering::Relaxed);
            if cas != 0 {
                return cas;
            }
        }
    }

    fn record(&self, value: &[u8]) -> Arc<Record> {
        Arc::new(Record {
            value: value.to_vec(),
            cas: self.fresh_cas(),
        })
    }

    /// The key's first write: inserted whatever the CAS (Envoy's rule for a missing
    /// key), unless another thread inserted it first — then `None`, and the caller
    /// writes to that record.
    fn insert(&self, key: &str, value: &[u8]) -> Result<Option<Cell>, HostError> {
        let mut shard = self.shard(key).write().map_err(|_| HostError::Poisoned)?;
        if let Some(cell) = shard.get(key) {
            return Ok(Some(Arc::clone(cell)));
        }
        let cell = Arc::new(ArcSwap::new(self.record(value)));
        shard.insert(key.to_string(), cell);
        Ok(None)
    }
}

impl SharedData for SharedStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(self.find(key)?.map(|cell| {
            let record = cell.load();
            (record.value.clone(), record.cas)
        }))
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        let cell = match self.find(key)? {
            Some(cell) => cell,
            None => match self.insert(key, value)? {
                None => return Ok(SetOutcome::Written),
                Some(cell) => cell,
            },
        };
        loop {
            let current = cell.load_full();
            if cas != 0 && cas != current.cas {
                return Ok(SetOutcome::CasMismatch);
            }
            let previous = cell.compare_and_swap(&current, self.record(value));
            if Arc::ptr_eq(&previous, &current) {
                return Ok(SetOutcome::Written);
            }
            // Another write came first: a conditional write's CAS is stale now (the next
            // pass answers a mismatch); an unconditional one writes over it.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diana_core::store::{CasSemantics, MemoryHost};

    fn cas_of(store: &dyn SharedData, key: &str) -> u32 {
        store.get(key).ok().flatten().map_or(0, |(_, cas)| cas)
    }

    /// The same operations on this store and on the reference model of Envoy's rules give
    /// the same outcomes and values; each step names the CAS it writes with: none (0),
    /// the key's current one, or a stale one.
    #[test]
    fn follows_envoys_compare_and_swap_rules() {
        #[derive(Clone, Copy, Debug)]
        enum With {
            Zero,
            Current,
            Stale,
        }
        let steps: &[(&str, &[u8], With, SetOutcome)] = &[
            ("a", b"1", With::Stale, SetOutcome::Written), // missing: inserted whatever the CAS
            ("a", b"2", With::Current, SetOutcome::Written),
            ("a", b"3", With::Stale, SetOutcome::CasMismatch),
            ("a", b"4", With::Zero, SetOutcome::Written),
            ("a", b"", With::Current, SetOutcome::Written), // an empty value is kept
            ("b", b"x", With::Zero, SetOutcome::Written),
            ("b", b"y", With::Stale, SetOutcome::CasMismatch),
            ("b", b"z", With::Current, SetOutcome::Written),
        ];
        let store = SharedStore::default();
        let model = MemoryHost::new(CasSemantics::Envoy);
        for (index, &(key, value, with, expected)) in steps.iter().enumerate() {
            for host in [&store as &dyn SharedData, &model] {
                let cas = match with {
                    With::Zero => 0,
                    With::Current => cas_of(host, key),
                    With::Stale => cas_of(host, key).wrapping_add(1000).max(1),
                };
                assert_eq!(host.set(key, value, cas), Ok(expected), "step {index}");
            }
            let ours = store.get(key).ok().flatten().map(|(value, _)| value);
            let theirs = model.get(key).ok().flatten().map(|(value, _)| value);
            assert_eq!(ours, theirs, "step {index}: {with:?}");
        }
        assert_eq!(store.get("missing"), Ok(None));
    }

    /// Threads that read, add one and write back with the CAS they read, retrying on a
    /// mismatch (as the worker's algorithms do), lose no increment.
    #[test]
    fn concurrent_increments_are_never_lost() {
        const THREADS: u64 = 4;
        const EACH: u64 = 2_000;
        let store = Arc::new(SharedStore::default());
        // Created first: a missing key is inserted whatever the CAS, in Envoy too.
        assert_eq!(
            store.set("counter", &0u64.to_le_bytes(), 0),
            Ok(SetOutcome::Written)
        );
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        loop {
                            let Ok(Some((value, cas))) = store.get("counter") else {
                                return false;
                            };
                            let count = decode(&value);
                            let next = (count + 1).to_le_bytes();
                            if store.set("counter", &next, cas) == Ok(SetOutcome::Written) {
                                break;
                            }
                        }
                    }
                    true
                })
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.join().ok(), Some(true), "a thread lost the counter");
        }
        let total = store.get("counter").ok().flatten().map(|(v, _)| decode(&v));
        assert_eq!(total, Some(THREADS * EACH));
    }

    /// diana-core's `Store::update`, as the worker's algorithms use it: threads racing to
    /// create the key (with `CREATE_CAS`, refused once another thread created it) and then
    /// to increment it, lose no increment.
    #[test]
    fn store_updates_racing_from_creation_are_never_lost() {
        const THREADS: u64 = 8;
        const EACH: u64 = 500;
        for round in 0..20 {
            let store = Arc::new(SharedStore::default());
            let key = format!("diana/test/{round}");
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    let store = Arc::clone(&store);
                    let key = key.clone();
                    std::thread::spawn(move || {
                        let records = diana_core::store::Store::new();
                        (0..EACH)
                            .filter(|_| {
                                records
                                    .update(store.as_ref(), &key, |current| {
                                        let count = current.map_or(0, decode);
                                        (Some((count + 1).to_le_bytes().to_vec()), ())
                                    })
                                    .is_ok()
                            })
                            .count() as u64
                    })
                })
                .collect();
            let done: u64 = handles.into_iter().filter_map(|h| h.join().ok()).sum();
            let records = diana_core::store::Store::new();
            let total = records
                .read(store.as_ref(), &key)
                .ok()
                .flatten()
                .map(|v| decode(&v));
            assert_eq!(total, Some(done), "round {round}");
        }
    }

    fn decode(value: &[u8]) -> u64 {
        value.try_into().map(u64::from_le_bytes).unwrap_or_default()
    }
}
