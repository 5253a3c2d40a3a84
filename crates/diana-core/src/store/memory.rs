//! An in-memory [`SharedData`] host that reproduces the CAS rules of the real hosts, for
//! native tests of everything that touches shared data.

use super::{HostError, SetOutcome, SharedData};
use std::collections::HashMap;
use std::sync::Mutex;

/// Which host's compare-and-swap rules to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasSemantics {
    /// Envoy (proxy-wasm-cpp-host): CAS 0 always writes; a non-zero CAS must match an
    /// existing entry; a missing key is inserted whatever the CAS.
    Envoy,
    /// ngx_wasm_module: the CAS must equal the entry's CAS, or 0 for a missing key.
    Nginx,
}

#[derive(Debug)]
struct Entries {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

/// Thread-safe in-memory shared data with a chosen [`CasSemantics`]. `get` and `set`
/// each take the lock separately, so concurrent callers interleave as on a real host.
#[derive(Debug)]
pub struct MemoryHost {
    semantics: CasSemantics,
    entries: Mutex<Entries>,
}

impl MemoryHost {
    pub fn new(semantics: CasSemantics) -> MemoryHost {
        MemoryHost {
            semantics,
            entries: Mutex::new(Entries {
                map: HashMap::new(),
                next_cas: 1,
            }),
        }
    }

    /// Number of keys ever created (the host never frees them).
    pub fn key_count(&self) -> usize {
        self.entries.lock().map(|e| e.map.len()).unwrap_or(0)
    }

    /// All keys, sorted (for assertions).
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .entries
            .lock()
            .map(|e| e.map.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// Overwrites a key unconditionally (to plant garbage in tests).
    pub fn put_raw(&self, key: &str, value: &[u8]) {
        if let Ok(mut entries) = self.entries.lock() {
            let cas = entries.next_cas;
            entries.next_cas = entries.next_cas.wrapping_add(1).max(1);
            entries.map.insert(key.to_string(), (value.to_vec(), cas));
        }
    }
}

impl SharedData for MemoryHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        let entries = self
            .entries
            .lock()
            .map_err(|_| HostError("poisoned".into()))?;
        Ok(entries.map.get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        let mut entries = self
            .entries
            .lock()
            .map_err(|_| HostError("poisoned".into()))?;
        let current = entries.map.get(key).map(|(_, existing)| *existing);
        let accepted = match (self.semantics, current) {
            (CasSemantics::Envoy, None) => true,
            (CasSemantics::Envoy, Some(existing)) => cas == 0 || cas == existing,
            (CasSemantics::Nginx, None) => cas == 0,
            (CasSemantics::Nginx, Some(existing)) => cas == existing,
        };
        if !accepted {
            return Ok(SetOutcome::CasMismatch);
        }
        let new_cas = entries.next_cas;
        entries.next_cas = entries.next_cas.wrapping_add(1).max(1);
        entries
            .map
            .insert(key.to_string(), (value.to_vec(), new_cas));
        Ok(SetOutcome::Written)
    }
}
