//! An in-memory [`SharedData`] host that reproduces the rules of the real hosts, for
//! native tests of everything that touches shared data: the CAS rules of Envoy and
//! ngx_wasm_module, and optionally `shm_kv`'s zone behaviour (entries found by a hash of
//! the key alone, so two keys can share one entry; a full zone evicting its least recently
//! used entries).

use super::{HostError, SetOutcome, SharedData};
use std::collections::HashMap;
use std::sync::Mutex;

/// Which host's compare-and-swap rules to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasSemantics {
    /// Envoy (proxy-wasm-cpp-host): CAS 0 always writes; a non-zero CAS must match an
    /// existing entry; a missing key is inserted whatever the CAS. An empty value is kept.
    Envoy,
    /// ngx_wasm_module: the CAS must equal the entry's CAS, or 0 for a missing key. An
    /// empty value deletes the entry.
    Nginx,
}

#[derive(Debug)]
struct Entry {
    value: Vec<u8>,
    cas: u32,
    /// Last use, for least-recently-used eviction.
    used: u64,
}

#[derive(Debug)]
struct Entries {
    map: HashMap<u64, Entry>,
    next_cas: u32,
    clock: u64,
    evictions: u64,
    reads: u64,
    writes: u64,
}

/// How a key finds its entry: the identity of the key, or (nginx) a hash of it alone.
pub type EntryOf = fn(&str) -> u64;

fn whole_key(key: &str) -> u64 {
    crate::hash::hash64(0, key.as_bytes())
}

/// Thread-safe in-memory shared data with a chosen [`CasSemantics`]. `get` and `set`
/// each take the lock separately, so concurrent callers interleave as on a real host.
#[derive(Debug)]
pub struct MemoryHost {
    semantics: CasSemantics,
    entry_of: EntryOf,
    capacity: Option<usize>,
    entries: Mutex<Entries>,
}

impl MemoryHost {
    pub fn new(semantics: CasSemantics) -> MemoryHost {
        MemoryHost {
            semantics,
            entry_of: whole_key,
            capacity: None,
            entries: Mutex::new(Entries {
                map: HashMap::new(),
                next_cas: 1,
                clock: 0,
                evictions: 0,
                reads: 0,
                writes: 0,
            }),
        }
    }

    /// An nginx `shm_kv` zone: entries found by `entry_of(key)` alone (two keys with the
    /// same value share one entry, as two keys with the same CRC32 do), and at most
    /// `capacity` entries, the least recently used evicted to make room.
    pub fn nginx_zone(entry_of: EntryOf, capacity: usize) -> MemoryHost {
        MemoryHost {
            entry_of,
            capacity: Some(capacity.max(1)),
            ..MemoryHost::new(CasSemantics::Nginx)
        }
    }

    /// Number of entries held.
    pub fn key_count(&self) -> usize {
        self.entries.lock().map(|e| e.map.len()).unwrap_or(0)
    }

    /// Host calls made so far: (reads, writes).
    pub fn calls(&self) -> (u64, u64) {
        self.entries
            .lock()
            .map(|e| (e.reads, e.writes))
            .unwrap_or((0, 0))
    }

    /// Entries evicted to make room so far.
    pub fn evictions(&self) -> u64 {
        self.entries.lock().map(|e| e.evictions).unwrap_or(0)
    }

    /// Overwrites a key unconditionally (to plant garbage in tests).
    pub fn put_raw(&self, key: &str, value: &[u8]) {
        let id = (self.entry_of)(key);
        if let Ok(mut entries) = self.entries.lock() {
            let cas = entries.next_cas;
            entries.next_cas = entries.next_cas.wrapping_add(1).max(1);
            entries.clock += 1;
            let used = entries.clock;
            entries.map.insert(
                id,
                Entry {
                    value: value.to_vec(),
                    cas,
                    used,
                },
            );
        }
    }

    /// Drops an entry, as a full zone's eviction does.
    pub fn evict(&self, key: &str) {
        let id = (self.entry_of)(key);
        if let Ok(mut entries) = self.entries.lock() {
            if entries.map.remove(&id).is_some() {
                entries.evictions += 1;
            }
        }
    }
}

impl SharedData for MemoryHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        let id = (self.entry_of)(key);
        let mut entries = self.entries.lock().map_err(|_| HostError::Poisoned)?;
        entries.clock += 1;
        entries.reads += 1;
        let now = entries.clock;
        Ok(entries.map.get_mut(&id).map(|entry| {
            entry.used = now;
            (entry.value.clone(), entry.cas)
        }))
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        let id = (self.entry_of)(key);
        let mut entries = self.entries.lock().map_err(|_| HostError::Poisoned)?;
        entries.writes += 1;
        let current = entries.map.get(&id).map(|entry| entry.cas);
        let accepted = match (self.semantics, current) {
            (CasSemantics::Envoy, None) => true,
            (CasSemantics::Envoy, Some(existing)) => cas == 0 || cas == existing,
            (CasSemantics::Nginx, None) => cas == 0,
            (CasSemantics::Nginx, Some(existing)) => cas == existing,
        };
        if !accepted {
            return Ok(SetOutcome::CasMismatch);
        }
        if value.is_empty() && self.semantics == CasSemantics::Nginx {
            entries.map.remove(&id);
            return Ok(SetOutcome::Written);
        }
        if current.is_none() {
            if let Some(capacity) = self.capacity {
                while entries.map.len() >= capacity {
                    let oldest = entries
                        .map
                        .iter()
                        .min_by_key(|(_, entry)| entry.used)
                        .map(|(id, _)| *id);
                    let Some(oldest) = oldest else { break };
                    entries.map.remove(&oldest);
                    entries.evictions += 1;
                }
            }
        }
        let new_cas = entries.next_cas;
        entries.next_cas = entries.next_cas.wrapping_add(1).max(1);
        entries.clock += 1;
        let used = entries.clock;
        entries.map.insert(
            id,
            Entry {
                value: value.to_vec(),
                cas: new_cas,
                used,
            },
        );
        Ok(SetOutcome::Written)
    }
}
