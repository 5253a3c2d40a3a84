//! Process-wide local state: algorithm state kept in the host's shared key/value store
//! (proxy-wasm shared data), updated with bounded compare-and-swap retries so that every
//! worker thread (Envoy) or worker process (nginx) charges the same counters.
//!
//! Memory is bounded whatever clients send: each rule owns a fixed-size table of `slots`
//! keys. An identity hashes to two candidate slots; a slot record starts with a
//! fingerprint of the identity that holds it, so a collision is detected, and a slot whose
//! state has gone idle (see [`crate::algo::Algorithm::is_idle`]) is reused by a new
//! identity. When both candidates are held by active identities, the newcomer is charged
//! on the first candidate's counter (it shares a counter, so it may be limited early but
//! nobody ever gets more than the limit). Envoy never frees a shared-data key, so the table
//! can never grow past `slots` keys per rule.
//!
//! Creating a key is made race-free on both hosts: Envoy inserts a missing key whatever
//! CAS is passed (two workers "creating" it would silently lose one update), nginx accepts
//! only CAS 0 for a missing key. We create with a CAS that matches no existing entry
//! ([`CREATE_CAS`]): Envoy inserts if the key is missing and refuses if another worker got
//! there first. If a host refuses that for a key that is still missing, it is strict
//! (nginx) and we create with CAS 0, which such a host only accepts for a missing key.

mod memory;

pub use memory::{CasSemantics, MemoryHost};

use crate::algo::{Algorithm, Limit, Verdict};
use crate::time::Nanos;
use std::cell::Cell;
use std::fmt;

/// The CAS used to create a missing key on lenient hosts. Envoy hands out CAS values from
/// an incrementing counter starting at 1, so an existing entry has this CAS only after
/// four billion writes, and then only for one write.
pub const CREATE_CAS: u32 = u32::MAX;

/// How many times one rule's update is retried when other workers keep winning the race.
pub const MAX_CAS_ATTEMPTS: usize = 32;

/// A failure of the host store itself (not a CAS conflict).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostError(pub String);

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shared data: {}", self.0)
    }
}

/// Result of a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutcome {
    Written,
    CasMismatch,
}

/// The host's shared key/value store (proxy-wasm `get_shared_data`/`set_shared_data`).
pub trait SharedData {
    /// The value and its CAS, or `None` when the key does not exist.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError>;
    /// Writes `value` if `cas` matches the host's rules (see the module docs).
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError>;
}

/// Why a rule could not be charged. The engine turns these into a defined behaviour
/// (the request is admitted and the event counted) rather than an error response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeError {
    Host(HostError),
    /// Other workers won the CAS race [`MAX_CAS_ATTEMPTS`] times in a row.
    Contention,
}

impl fmt::Display for ChargeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChargeError::Host(error) => error.fmt(f),
            ChargeError::Contention => write!(f, "gave up after {MAX_CAS_ATTEMPTS} CAS attempts"),
        }
    }
}

impl From<HostError> for ChargeError {
    fn from(error: HostError) -> Self {
        ChargeError::Host(error)
    }
}

/// What happened in the slot table for one charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub verdict: Verdict,
    /// The identity's candidate slots were both held by active identities; it was charged
    /// on a shared counter.
    pub collided: bool,
}

/// Where one identity's state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddress {
    /// Non-zero fingerprint stored in the record (0 marks an empty record).
    pub fingerprint: u64,
    pub first: u32,
    pub second: u32,
}

impl SlotAddress {
    /// The two candidate slots of an identity hash in a table of `slots` entries.
    pub fn of(identity_hash: u64, slots: u32) -> SlotAddress {
        let slots = u64::from(slots.max(1));
        let mixed = identity_hash
            .rotate_left(29)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        SlotAddress {
            fingerprint: identity_hash | 1,
            first: (identity_hash % slots) as u32,
            second: ((mixed >> 17) % slots) as u32,
        }
    }

    /// The single slot of a rule with one counter (`actor: all`).
    pub fn single() -> SlotAddress {
        SlotAddress {
            fingerprint: 1,
            first: 0,
            second: 0,
        }
    }
}

/// Reads a `u64` kept as 8 little-endian bytes in shared data; anything else (missing,
/// another size) reads as 0.
pub fn decode_u64(bytes: Option<&[u8]>) -> u64 {
    bytes
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// The shared-data key of one slot of one rule: `diana/<rule id, 16 hex digits>/<slot>`.
/// Printable, fixed shape, bounded length. Every key starts with `diana/`:
/// ngx_wasm_module stores `ns/key` in the `shm_kv ns` zone.
pub fn slot_key(rule_id: u64, slot: u32) -> String {
    slot_key_in(&key_prefix(rule_id), slot)
}

/// `diana/<rule id>/`, the part of a rule's slot keys computed once per rule.
pub fn key_prefix(rule_id: u64) -> String {
    format!("diana/{rule_id:016x}/")
}

/// A slot's key from its rule's [`key_prefix`], without the formatting machinery: this
/// runs for every rule of every request.
pub fn slot_key_in(prefix: &str, slot: u32) -> String {
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    let mut rest = slot;
    loop {
        start -= 1;
        if let Some(digit) = digits.get_mut(start) {
            *digit = b'0' + (rest % 10) as u8;
        }
        rest /= 10;
        if rest == 0 || start == 0 {
            break;
        }
    }
    let mut key = String::with_capacity(prefix.len() + digits.len() - start);
    key.push_str(prefix);
    for &digit in digits.get(start..).unwrap_or_default() {
        key.push(char::from(digit));
    }
    key
}

/// A decoded slot record: fingerprint plus the algorithm's state words.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    fingerprint: u64,
    words: Vec<u64>,
}

impl Record {
    fn empty(words: usize) -> Record {
        Record {
            fingerprint: 0,
            words: vec![0; words],
        }
    }

    /// Decodes `bytes`; a record of the wrong size (another build's layout, garbage) reads
    /// as empty, so the slot is simply reclaimed.
    fn decode(bytes: &[u8], words: usize) -> Record {
        if bytes.len() != 8 * (words + 1) {
            return Record::empty(words);
        }
        let mut values = bytes
            .chunks_exact(8)
            .map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])));
        let fingerprint = values.next().unwrap_or(0);
        Record {
            fingerprint,
            words: values.collect(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(8 * (self.words.len() + 1));
        bytes.extend_from_slice(&self.fingerprint.to_le_bytes());
        for word in &self.words {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes
    }
}

/// One rule's counters in the host store.
#[derive(Debug, Clone, Copy)]
pub struct SlotTable<'a> {
    /// The rule's [`key_prefix`].
    pub key_prefix: &'a str,
    pub algo: &'a dyn Algorithm,
    pub limit: &'a Limit,
    /// Admit only what can pass now: a decision that would make the request wait
    /// (leaky bucket) is a denial instead. For hosts that cannot pause a request.
    pub immediate_only: bool,
}

/// Charges rules against a [`SharedData`] host, remembering whether the host has strict
/// (nginx) CAS semantics once it has shown them.
#[derive(Debug, Default)]
pub struct Store {
    strict_host: Cell<bool>,
}

/// What a read of one candidate slot says about an identity.
enum Probe {
    Mine(Record, u32),
    Free(Option<u32>),
    Taken(Record, u32),
}

impl Store {
    pub fn new() -> Store {
        Store::default()
    }

    /// True once the host has refused a create-CAS on a missing key (nginx semantics).
    pub fn host_is_strict(&self) -> bool {
        self.strict_host.get()
    }

    /// Charges `want` tokens to the identity at `address` of `table`, at `now`.
    pub fn charge(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Nanos,
        want: u32,
    ) -> Result<Charge, ChargeError> {
        let words = table.algo.state_words(table.limit);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (key, record, cas, collided) = self.locate(host, table, address, now, words)?;
            let mut record = record;
            let mut verdict = table
                .algo
                .acquire(table.limit, &mut record.words, now, want);
            if table.immediate_only && verdict.delay > 0 {
                // The host cannot hold the request: the wait becomes a retry-after and
                // nothing is reserved.
                verdict = Verdict {
                    granted: 0,
                    retry_after: verdict.delay,
                    delay: 0,
                    ..verdict
                };
            }
            if !verdict.allowed() {
                // A rejected request is not counted: nothing to write.
                return Ok(Charge { verdict, collided });
            }
            if !collided {
                record.fingerprint = address.fingerprint;
            }
            if self.write(host, &key, &record.encode(), cas)? == SetOutcome::Written {
                return Ok(Charge { verdict, collided });
            }
        }
        Err(ChargeError::Contention)
    }

    /// Read-modify-write of one whole key with bounded CAS retries and race-free creation.
    /// `change` sees the current value (`None` when missing) and returns the value to
    /// write (`None`: leave it) plus a result; it may run several times under contention.
    pub fn update<T>(
        &self,
        host: &dyn SharedData,
        key: &str,
        mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
    ) -> Result<T, ChargeError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = host.get(key)?;
            let (value, cas) = match &current {
                Some((bytes, cas)) => (Some(bytes.as_slice()), Some(*cas)),
                None => (None, None),
            };
            let (new_value, result) = change(value);
            let Some(new_value) = new_value else {
                return Ok(result);
            };
            if self.write(host, key, &new_value, cas)? == SetOutcome::Written {
                return Ok(result);
            }
        }
        Err(ChargeError::Contention)
    }

    /// Reads the state of `address` without charging (for reporting, e.g. headers).
    pub fn peek(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Nanos,
    ) -> Result<Vec<u64>, HostError> {
        let words = table.algo.state_words(table.limit);
        let (_, record, _, _) = self.locate(host, table, address, now, words)?;
        Ok(record.words)
    }

    /// Finds the slot to charge: the identity's own record in either candidate, else a
    /// free or idle candidate, else (both held by active identities) the first candidate,
    /// shared. Returns the slot's key, the record to update, its CAS (`None` = missing
    /// key) and whether the counter is shared.
    #[allow(clippy::type_complexity)]
    fn locate(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Nanos,
        words: usize,
    ) -> Result<(String, Record, Option<u32>, bool), HostError> {
        let first_key = slot_key_in(table.key_prefix, address.first);
        let first = self.probe(host, table, address, &first_key, now, words)?;
        if let Probe::Mine(record, cas) = first {
            return Ok((first_key, record, Some(cas), false));
        }
        if address.second == address.first {
            return Ok(match first {
                Probe::Free(cas) => (first_key, Record::empty(words), cas, false),
                Probe::Taken(record, cas) | Probe::Mine(record, cas) => {
                    (first_key, record, Some(cas), true)
                }
            });
        }
        let second_key = slot_key_in(table.key_prefix, address.second);
        let second = self.probe(host, table, address, &second_key, now, words)?;
        Ok(match (first, second) {
            (_, Probe::Mine(record, cas)) => (second_key, record, Some(cas), false),
            (Probe::Free(cas), _) => (first_key, Record::empty(words), cas, false),
            (_, Probe::Free(cas)) => (second_key, Record::empty(words), cas, false),
            (Probe::Taken(record, cas) | Probe::Mine(record, cas), Probe::Taken(..)) => {
                (first_key, record, Some(cas), true)
            }
        })
    }

    fn probe(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        key: &str,
        now: Nanos,
        words: usize,
    ) -> Result<Probe, HostError> {
        Ok(match host.get(key)? {
            None => Probe::Free(None),
            Some((bytes, cas)) => {
                let record = Record::decode(&bytes, words);
                if record.fingerprint == address.fingerprint {
                    Probe::Mine(record, cas)
                } else if record.fingerprint == 0
                    || table.algo.is_idle(table.limit, &record.words, now)
                {
                    Probe::Free(Some(cas))
                } else {
                    Probe::Taken(record, cas)
                }
            }
        })
    }

    /// A conditional write; `cas: None` creates the key race-free (see the module docs).
    fn write(
        &self,
        host: &dyn SharedData,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<SetOutcome, HostError> {
        match cas {
            Some(cas) => host.set(key, value, cas),
            None if self.strict_host.get() => host.set(key, value, 0),
            None => match host.set(key, value, CREATE_CAS)? {
                SetOutcome::Written => Ok(SetOutcome::Written),
                SetOutcome::CasMismatch => {
                    if host.get(key)?.is_some() {
                        // Another worker created it first: retry on its value.
                        return Ok(SetOutcome::CasMismatch);
                    }
                    // Still missing, yet refused: a strict host. Create the nginx way.
                    self.strict_host.set(true);
                    host.set(key, value, 0)
                }
            },
        }
    }
}

#[cfg(test)]
mod tests;
