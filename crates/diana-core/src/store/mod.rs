//! Process-wide local state: algorithm state kept in the host's shared key/value store
//! (proxy-wasm shared data), updated with bounded compare-and-swap retries so that every
//! worker thread (Envoy) or worker process (nginx) charges the same counters.
//!
//! Memory is bounded whatever clients send: each rule owns a fixed-size table of `slots`
//! keys. An identity hashes (keyed, [`crate::hash::IdentityHasher`]) to two candidate
//! slots; a slot record starts with a fingerprint of the identity that holds it, so a
//! collision is detected, and a slot whose state has gone idle (see
//! [`crate::algo::Algorithm::is_idle`]) is reused by a new identity. When both candidates
//! are held by active identities, the newcomer takes over the one whose identity came back
//! the fewest times, then the least recently used ([`Eviction::FewestVisits`]), with a
//! fresh counter — except a leaky bucket's record, whose queued turns must keep their
//! pacing: that one is shared (charged as it is). Sharing, the only policy before, let a
//! flood of strangers lock every newcomer out (docs/security-slots.md has the figures and
//! the alternatives measured). A takeover is a compare-and-swap on the record as it was
//! read: a charge of its holder in between makes it fail and be decided again, so no
//! record is ever replaced under a charge; the holder's later give-backs carry its
//! fingerprint and leave the newcomer's counter alone. The identity taken over starts
//! afresh when it comes back (what it had spent is forgiven; a worker's batch of its
//! tokens, already counted, is still spent).
//! Envoy never frees a shared-data key, so the table can never grow past `slots` keys per
//! rule.
//!
//! Every record is sealed with a check of its own key ([`seal`], [`open`]):
//! ngx_wasm_module's `shm_kv` finds a key by its CRC32 alone, so two of Diana's keys can
//! share one entry. A record that carries another key's check is not ours: a slot treats
//! it like a slot held by another identity (a rule with one counter has a spare slot for
//! this, [`SlotAddress::single`]), a singleton record like a missing one. A zone
//! that is full evicts entries; an evicted record reads as missing and is created again,
//! race-free (below).
//!
//! Creating a key is made race-free on both hosts: Envoy inserts a missing key whatever
//! CAS is passed (two workers "creating" it would silently lose one update), nginx accepts
//! only CAS 0 for a missing key. We create with a CAS that matches no existing entry
//! ([`CREATE_CAS`]): Envoy inserts if the key is missing and refuses if another worker got
//! there first. If a host refuses that for a key that is still missing, it is strict
//! (nginx) and we create with CAS 0, which such a host only accepts for a missing key.

pub mod identity;
mod memory;

pub use memory::{CasSemantics, MemoryHost};

use crate::algo::{Algorithm, Limit, Mark, Verdict};
use crate::hash::hash64;
use crate::time::{Instant, Nanos};
use std::cell::Cell;
use std::fmt;

/// The CAS used to create a missing key on lenient hosts. Envoy hands out CAS values from
/// an incrementing counter starting at 1, so an existing entry has this CAS only after
/// four billion writes, and then only for one write.
pub const CREATE_CAS: u32 = u32::MAX;

/// How many times one update is retried when other workers keep winning the race.
pub const MAX_CAS_ATTEMPTS: usize = 32;

/// Two uses of a record at least this far apart are two visits ([`Eviction::FewestVisits`]):
/// half a worker's batch span (`local::BATCH_SPAN`, which checks it);
/// also how often a refused client's own record notes that it asked again (so a client that
/// keeps being refused writes at most 8 times a second, and each worker's denial cache,
/// [`crate::local::DENIAL_CACHE`], spaces its attempts further).
pub const VISIT_GAP: Nanos = Nanos::from_millis(125);

/// What a newcomer does when both its candidate slots are held by active identities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Eviction {
    /// Charge it on the first candidate's counter (the policy before; under a flood of
    /// strangers, a newcomer shares an exhausted counter and is locked out).
    Share,
    /// Take over the candidate charged least recently, with a fresh counter.
    LeastRecent,
    /// Take over the candidate whose state is closest to idle — the most tokens left, then
    /// the soonest full reset, then the least recently charged — with a fresh counter: the
    /// eviction forgives the fewest tokens.
    ClosestToIdle,
    /// Take over the candidate whose identity came back the fewest times ([`VISIT_GAP`]
    /// apart), then the least recently used, with a fresh counter: the one-shot identities
    /// of a flood go first, clients that keep coming (and keep being refused) stay.
    #[default]
    FewestVisits,
}

/// Seed of the key checks that seal records.
const KEY_CHECK_SEED: u64 = 0x6469_616e_615f_6b63; // "diana_kc"

/// A failure of the host itself (not a CAS conflict).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostError {
    /// The host refused a call: which, on what (a key), and the status it answered.
    Refused {
        call: HostCall,
        subject: String,
        status: String,
    },
    /// No slot of an identity could be read (every candidate unreadable).
    NoCandidateSlot,
    /// An in-memory host's lock was poisoned by a panicking thread (tests, tools).
    Poisoned,
}

impl HostError {
    /// The host refused `call` on `subject` with `status` (the host's own status type).
    pub fn refused(call: HostCall, subject: &str, status: impl fmt::Debug) -> HostError {
        HostError::Refused {
            call,
            subject: subject.to_string(),
            status: format!("{status:?}"),
        }
    }
}

/// A host call that can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCall {
    GetSharedData,
    SetSharedData,
    CallBody,
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Refused {
                call,
                subject,
                status,
            } => {
                let call = match call {
                    HostCall::GetSharedData => "shared data: get",
                    HostCall::SetSharedData => "shared data: set",
                    HostCall::CallBody => "call answer's body",
                };
                write!(f, "{call} {subject}: {status}")
            }
            HostError::NoCandidateSlot => f.write_str("shared data: no candidate slot"),
            HostError::Poisoned => f.write_str("shared data: poisoned"),
        }
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
    /// Writes `value` if `cas` matches the host's rules (see the module docs). An empty
    /// value releases the key: nginx deletes it, Envoy keeps the key with no value.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError>;
}

/// Why an update could not be made. The engine turns these into defined behaviours: a
/// failing host admits the request (counted), contention rejects it with `Retry-After: 1`
/// (counted) — never a request admitted uncounted because of a lost race.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub verdict: Verdict,
    /// The identity's candidate slots were both held by active identities; it was charged
    /// on a shared counter.
    pub collided: bool,
    /// What was taken, to give it back if another rule denies the request (`None` when
    /// nothing was taken).
    pub receipt: Option<Receipt>,
}

/// Where a charge was made, to give it back exactly ([`Store::release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub key: String,
    /// The fingerprint of the record charged (the identity's own, or the holder's when
    /// the counter was shared): a release never touches a record another identity took
    /// over meanwhile.
    pub holder: u64,
    pub tokens: u32,
    pub mark: Mark,
}

/// Where one identity's state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

    /// The slot of a rule with one counter (`actor: all`): slot 0, and slot 1 as a spare
    /// for when slot 0 holds another key's record (nginx: two keys with the same CRC32).
    /// Without the spare, two such rules would take the entry over from each other on
    /// every request, each starting from a fresh counter: neither would ever limit.
    pub fn single() -> SlotAddress {
        SlotAddress {
            fingerprint: 1,
            first: 0,
            second: 1,
        }
    }
}

/// Which writing of a key a record belongs to: the key names of a rule's table outlive an
/// edit of its limit ([`crate::config::RuleKeys`]), so its records carry the rule's id and
/// a record of another generation reads as free. Records of one meaning use
/// [`ONLY_GENERATION`].
pub type Generation = u64;

/// The generation of records whose key has one meaning (breaker, remote, lifecycle, ...).
pub const ONLY_GENERATION: Generation = 0;

/// The check a record of `key` written for `generation` carries in its first 8 bytes: the
/// key's half (low 32 bits, never 0) tells Diana's own records from another key's sharing
/// the entry (nginx: same CRC32), the generation's half (high 32 bits) the current
/// writing from an earlier one.
pub fn key_check(key: &str, generation: Generation) -> u64 {
    let key_half = (hash64(KEY_CHECK_SEED, key.as_bytes()) & 0xffff_ffff) | 1;
    let generation_half = hash64(KEY_CHECK_SEED, &generation.to_le_bytes()) & !0xffff_ffff;
    generation_half | key_half
}

/// A record of `key` with `payload`, of the [`ONLY_GENERATION`].
pub fn seal(key: &str, payload: &[u8]) -> Vec<u8> {
    seal_for(key, ONLY_GENERATION, payload)
}

/// A record of `key` written for `generation`: the key check, then the payload.
pub fn seal_for(key: &str, generation: Generation, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(8 + payload.len());
    bytes.extend_from_slice(&key_check(key, generation).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// What the bytes stored at a key are, for one generation of its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealed<'b> {
    /// A record of this key and generation: its payload.
    Current(&'b [u8]),
    /// Diana's record of this key, written for another generation (a rule since edited).
    Stale,
    /// No record: an empty (released) value, or too short to be one.
    Empty,
    /// Another key's record sharing the entry, or garbage.
    Foreign,
}

/// Reads the bytes stored at `key` as a record of `generation`.
pub fn unseal<'b>(key: &str, generation: Generation, bytes: &'b [u8]) -> Sealed<'b> {
    let Some((check, payload)) = bytes.split_first_chunk::<8>() else {
        return Sealed::Empty;
    };
    let check = u64::from_le_bytes(*check);
    let expected = key_check(key, generation);
    if check == expected {
        Sealed::Current(payload)
    } else if check & 0xffff_ffff == expected & 0xffff_ffff {
        Sealed::Stale
    } else {
        Sealed::Foreign
    }
}

/// The payload of a record of `key` of the [`ONLY_GENERATION`]; `None` when the bytes are
/// not one (another key sharing the entry, an empty or released value, garbage).
pub fn open<'b>(key: &str, bytes: &'b [u8]) -> Option<&'b [u8]> {
    match unseal(key, ONLY_GENERATION, bytes) {
        Sealed::Current(payload) => Some(payload),
        Sealed::Stale | Sealed::Empty | Sealed::Foreign => None,
    }
}

/// Reads a `u64` kept as 8 little-endian bytes; anything else (missing, another size)
/// reads as 0.
pub fn decode_u64(bytes: Option<&[u8]>) -> u64 {
    bytes
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// Reads an instant kept as 8 little-endian bytes (nanoseconds since the epoch); anything
/// else reads as the epoch.
pub fn decode_instant(bytes: Option<&[u8]>) -> Instant {
    Instant::from_unix_nanos(decode_u64(bytes))
}

/// An instant as [`decode_instant`] reads it.
pub fn encode_instant(instant: Instant) -> Vec<u8> {
    instant.unix_nanos().to_le_bytes().to_vec()
}

/// `instant`, or the nanosecond after the epoch if it is the epoch. A record reads the
/// epoch as "no instant" (all-zero state is fresh), so an instant that means something
/// (a breaker open until, a host seen not holding a pause) is kept no earlier: a clock
/// that reads the epoch still records.
pub fn recordable(instant: Instant) -> Instant {
    instant.max(Instant::from_unix_nanos(1))
}

/// The shared-data key of one slot of a rule, from the rule's key prefix
/// ([`crate::config::RuleKeys`]): `diana/<table>/<slot>`. Printable, fixed shape, bounded
/// length; every key starts with `diana/` (ngx_wasm_module stores `ns/key` in the
/// `shm_kv ns` zone). Built without the formatting machinery: this runs for every rule of
/// every request.
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

/// Bytes of a sealed slot record with `words` state words (what shared data holds per slot):
/// the key check, the fingerprint, the last use and the visits, the words.
pub const fn slot_record_bytes(words: usize) -> usize {
    8 + 8 + 8 + 8 + 8 * words
}

/// A decoded slot record: fingerprint, when it was last used and how many times its
/// identity came back, the algorithm's words.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    fingerprint: u64,
    /// The instant of the last use: a charge, or a refusal noted (0: never).
    touched: Instant,
    /// Uses at least [`VISIT_GAP`] after the one before.
    visits: u64,
    words: Vec<u64>,
}

impl Record {
    fn empty(words: usize) -> Record {
        Record {
            fingerprint: 0,
            touched: Instant::EPOCH,
            visits: 0,
            words: vec![0; words],
        }
    }

    /// Notes a use at `now`.
    fn touch(&mut self, now: Instant) {
        if self.touched != Instant::EPOCH && now.saturating_since(self.touched) >= VISIT_GAP {
            self.visits = self.visits.saturating_add(1);
        }
        self.touched = self.touched.max(now);
    }

    /// Decodes the payload of a sealed record; a payload of the wrong size (another
    /// build's layout, garbage) reads as empty, so the slot is simply reclaimed.
    fn decode(payload: &[u8], words: usize) -> Record {
        if payload.len() != 8 * (words + 3) {
            return Record::empty(words);
        }
        let mut values = payload
            .chunks_exact(8)
            .map(|chunk| u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])));
        let fingerprint = values.next().unwrap_or(0);
        let touched = Instant::from_unix_nanos(values.next().unwrap_or(0));
        let visits = values.next().unwrap_or(0);
        Record {
            fingerprint,
            touched,
            visits,
            words: values.collect(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(8 * (self.words.len() + 3));
        bytes.extend_from_slice(&self.fingerprint.to_le_bytes());
        bytes.extend_from_slice(&self.touched.unix_nanos().to_le_bytes());
        bytes.extend_from_slice(&self.visits.to_le_bytes());
        for word in &self.words {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes
    }
}

/// One rule's counters in the host store.
#[derive(Debug, Clone, Copy)]
pub struct SlotTable<'a> {
    /// The rule's slot key prefix ([`crate::config::RuleKeys::slots`]).
    pub key_prefix: &'a str,
    /// What its records are sealed with ([`crate::config::RuleKeys::generation`]).
    pub generation: Generation,
    pub algo: &'a dyn Algorithm,
    pub limit: &'a Limit,
    /// The longest an admitted request may wait for its turn (leaky bucket). A request
    /// whose turn is further away is denied, `retry_after` the excess, and nothing is
    /// reserved. Zero on hosts that cannot hold a request.
    pub max_delay: Nanos,
}

/// Charges rules against a [`SharedData`] host, remembering whether the host has strict
/// (nginx) CAS semantics once it has shown them.
#[derive(Debug, Default)]
pub struct Store {
    strict_host: Cell<bool>,
    eviction: Eviction,
}

/// What a read of one candidate slot says about an identity.
enum Probe {
    Mine(Record, u32),
    Free(Option<u32>),
    /// Held by another active identity: shared only if no candidate is free.
    Taken(Record, u32),
    /// Another key's record in the same entry (nginx: same CRC32): taken over, like an
    /// eviction, only when nothing else is left.
    Foreign(u32),
}

/// The slot chosen for a charge.
struct Located {
    key: String,
    record: Record,
    /// `None`: the key is missing (create it).
    cas: Option<u32>,
    /// Both candidates were held by active identities (a shared counter or a takeover).
    collided: bool,
    /// The record is another identity's, charged as it is (its fingerprint stays).
    shared: bool,
}

impl Located {
    fn at(key: String, record: Record, cas: Option<u32>, collided: bool) -> Located {
        Located {
            key,
            record,
            cas,
            collided,
            shared: collided,
        }
    }

    /// Another identity's record, taken over with a fresh counter (compare-and-swap on its
    /// CAS: if it changed meanwhile, the charge is retried on what is there then).
    fn taken_over(key: String, words: usize, cas: u32) -> Located {
        Located {
            key,
            record: Record::empty(words),
            cas: Some(cas),
            collided: true,
            shared: false,
        }
    }
}

impl Store {
    pub fn new() -> Store {
        Store::default()
    }

    /// A store for a host known to have strict (nginx) CAS semantics.
    pub fn strict() -> Store {
        Store {
            strict_host: Cell::new(true),
            ..Store::default()
        }
    }

    /// The same store with another [`Eviction`] policy (to measure the alternatives).
    pub fn with_eviction(self, eviction: Eviction) -> Store {
        Store { eviction, ..self }
    }

    pub fn eviction(&self) -> Eviction {
        self.eviction
    }

    /// True once the host has refused a create-CAS on a missing key (nginx semantics).
    pub fn host_is_strict(&self) -> bool {
        self.strict_host.get()
    }

    /// Charges the identity at `address` of `table` at `now`: at least `need` tokens, up
    /// to `want`, or nothing.
    pub fn charge(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Instant,
        need: u32,
        want: u32,
    ) -> Result<Charge, ChargeError> {
        self.exchange(host, table, address, now, need, want, None)
    }

    /// [`Store::charge`], first giving back `unspent` tokens this identity took earlier
    /// (counted at their mark) — one compare-and-swap for both. Given back even when the
    /// charge is denied.
    #[allow(clippy::too_many_arguments)]
    pub fn exchange(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Instant,
        need: u32,
        want: u32,
        unspent: Option<(u32, Mark)>,
    ) -> Result<Charge, ChargeError> {
        let words = table.algo.state_words(table.limit);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let Located {
                key,
                mut record,
                cas,
                collided,
                shared,
            } = self.locate(host, table, address, now, words)?;
            let mut returned = false;
            let mine = !shared && record.fingerprint == address.fingerprint;
            if let Some((tokens, mark)) = unspent.filter(|_| mine) {
                table
                    .algo
                    .release(table.limit, &mut record.words, now, tokens, mark);
                returned = true;
            }
            let mut verdict =
                table
                    .algo
                    .acquire_at_least(table.limit, &mut record.words, now, need, want);
            if verdict.delay > table.max_delay {
                // Its turn is too far away: a denial, and nothing is reserved.
                verdict = Verdict {
                    granted: 0,
                    retry_after: verdict.delay - table.max_delay,
                    delay: Nanos::ZERO,
                    ..verdict
                };
            }
            if !verdict.allowed() && !returned {
                // A rejected request is not counted: nothing to write, except that an
                // identity's own record notes it was asked (at most every `IN_USE`, best
                // effort): a client that keeps being refused stays recent, and is not
                // flushed out of the table to a fresh counter while it insists. (A leaky
                // bucket's words may hold the turn just refused: never written back, and
                // its records are never taken over anyway.)
                if mine && !table.algo.waits() && now.saturating_since(record.touched) >= VISIT_GAP
                {
                    record.touch(now);
                    let _ = self.write(
                        host,
                        &key,
                        &seal_for(&key, table.generation, &record.encode()),
                        cas,
                    );
                }
                return Ok(Charge {
                    verdict,
                    collided,
                    receipt: None,
                });
            }
            // A denial changes nothing (`acquire_at_least`'s contract): what is written
            // then is only the tokens given back.
            if !shared {
                record.fingerprint = address.fingerprint;
            }
            if verdict.allowed() {
                record.touch(now);
            }
            if self.write(
                host,
                &key,
                &seal_for(&key, table.generation, &record.encode()),
                cas,
            )? == SetOutcome::Written
            {
                let receipt = verdict.allowed().then_some(Receipt {
                    key,
                    holder: record.fingerprint,
                    tokens: verdict.granted,
                    mark: verdict.mark,
                });
                return Ok(Charge {
                    verdict,
                    collided,
                    receipt,
                });
            }
        }
        Err(ChargeError::Contention)
    }

    /// Gives back what `receipt` took, if its record still belongs to the same holder.
    pub fn release(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        receipt: &Receipt,
        now: Instant,
    ) -> Result<(), ChargeError> {
        let words = table.algo.state_words(table.limit);
        self.update_for(host, &receipt.key, table.generation, |current| {
            let Some(payload) = current else {
                return (None, ());
            };
            let mut record = Record::decode(payload, words);
            if record.fingerprint != receipt.holder {
                return (None, ());
            }
            table.algo.release(
                table.limit,
                &mut record.words,
                now,
                receipt.tokens,
                receipt.mark,
            );
            (Some(record.encode()), ())
        })
    }

    /// Moves what `receipt` took to `now` in one compare-and-swap: given back where it was
    /// counted and counted again as of now, whatever the limit (a concurrency place renewed
    /// by the worker of a request still inside, [`crate::algo::InFlight`]). The new
    /// receipt; `None` when the record went to another holder meanwhile (nothing to move).
    pub fn renew(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        receipt: &Receipt,
        now: Instant,
    ) -> Result<Option<Receipt>, ChargeError> {
        let words = table.algo.state_words(table.limit);
        self.update_for(host, &receipt.key, table.generation, |current| {
            let Some(payload) = current else {
                return (None, None);
            };
            let mut record = Record::decode(payload, words);
            if record.fingerprint != receipt.holder {
                return (None, None);
            }
            table.algo.release(
                table.limit,
                &mut record.words,
                now,
                receipt.tokens,
                receipt.mark,
            );
            let verdict =
                table
                    .algo
                    .charge_debt(table.limit, &mut record.words, now, receipt.tokens);
            record.touch(now);
            let renewed = Receipt {
                mark: verdict.mark,
                ..receipt.clone()
            };
            (Some(record.encode()), Some(renewed))
        })
    }

    /// Charges `tokens` to the identity at `address` whatever is left (a response cost):
    /// the counter may go past its limit.
    pub fn charge_debt(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Instant,
        tokens: u32,
    ) -> Result<Verdict, ChargeError> {
        let words = table.algo.state_words(table.limit);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let Located {
                key,
                mut record,
                cas,
                shared,
                ..
            } = self.locate(host, table, address, now, words)?;
            let verdict = table
                .algo
                .charge_debt(table.limit, &mut record.words, now, tokens);
            if !shared {
                record.fingerprint = address.fingerprint;
            }
            record.touch(now);
            if self.write(
                host,
                &key,
                &seal_for(&key, table.generation, &record.encode()),
                cas,
            )? == SetOutcome::Written
            {
                return Ok(verdict);
            }
        }
        Err(ChargeError::Contention)
    }

    /// Read-modify-write of one sealed record with bounded CAS retries and race-free
    /// creation. `change` sees the current payload (`None` when the key is missing or
    /// holds another key's record) and returns the payload to write (`None`: leave it)
    /// plus a result; it may run several times under contention.
    pub fn update<T>(
        &self,
        host: &dyn SharedData,
        key: &str,
        change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
    ) -> Result<T, ChargeError> {
        self.update_for(host, key, ONLY_GENERATION, change)
    }

    /// [`Store::update`] of a record of `generation`: a record of another generation is
    /// seen as missing (`None`) and written over.
    pub fn update_for<T>(
        &self,
        host: &dyn SharedData,
        key: &str,
        generation: Generation,
        mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
    ) -> Result<T, ChargeError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = host.get(key)?;
            let (payload, cas) = match &current {
                Some((bytes, cas)) => match unseal(key, generation, bytes) {
                    Sealed::Current(payload) => (Some(payload), Some(*cas)),
                    Sealed::Stale | Sealed::Empty | Sealed::Foreign => (None, Some(*cas)),
                },
                None => (None, None),
            };
            let (new_payload, result) = change(payload);
            let Some(new_payload) = new_payload else {
                return Ok(result);
            };
            let sealed = seal_for(key, generation, &new_payload);
            let outcome = match (&current, cas) {
                (Some((bytes, _)), Some(cas))
                    if self.strict_host.get() && sealed.len() > bytes.len() =>
                {
                    // ngx_wasm_module can crash when an entry grows in a full zone (its
                    // eviction frees the node it is rewriting): release it, then create it
                    // anew. Another worker may create it in between; then this retries.
                    match host.set(key, &[], cas)? {
                        SetOutcome::Written => host.set(key, &sealed, 0)?,
                        SetOutcome::CasMismatch => SetOutcome::CasMismatch,
                    }
                }
                _ => self.write(host, key, &sealed, cas)?,
            };
            if outcome == SetOutcome::Written {
                return Ok(result);
            }
        }
        Err(ChargeError::Contention)
    }

    /// The payload of the sealed record at `key`, if there is one of this key.
    pub fn read(&self, host: &dyn SharedData, key: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.read_for(host, key, ONLY_GENERATION)
    }

    /// The payload of the record at `key` of `generation`, if there is one.
    pub fn read_for(
        &self,
        host: &dyn SharedData,
        key: &str,
        generation: Generation,
    ) -> Result<Option<Vec<u8>>, HostError> {
        Ok(host
            .get(key)?
            .and_then(|(bytes, _)| match unseal(key, generation, &bytes) {
                Sealed::Current(payload) => Some(payload.to_vec()),
                Sealed::Stale | Sealed::Empty | Sealed::Foreign => None,
            }))
    }

    /// Releases the record at `key` if it is one of Diana's records of this key, of any
    /// generation (a dropped table's slot): nginx deletes it, Envoy keeps the key with no
    /// value. A missing key stays missing (Envoy would create it).
    pub fn clear(&self, host: &dyn SharedData, key: &str) -> Result<bool, HostError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let Some((bytes, cas)) = host.get(key)? else {
                return Ok(false);
            };
            match unseal(key, ONLY_GENERATION, &bytes) {
                Sealed::Current(_) | Sealed::Stale => {}
                Sealed::Empty | Sealed::Foreign => return Ok(false),
            }
            if host.set(key, &[], cas)? == SetOutcome::Written {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Reads the state of `address` without charging (for reporting, e.g. headers).
    pub fn peek(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Instant,
    ) -> Result<Vec<u64>, HostError> {
        let words = table.algo.state_words(table.limit);
        Ok(self.locate(host, table, address, now, words)?.record.words)
    }

    /// Finds the slot to charge: the identity's own record in either candidate, else a
    /// free or idle candidate, else (both held by active identities) one taken over or the
    /// first shared, as [`Eviction`] says.
    fn locate(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        now: Instant,
        words: usize,
    ) -> Result<Located, HostError> {
        let first_key = slot_key_in(table.key_prefix, address.first);
        let first = self.probe(host, table, address, &first_key, now, words)?;
        if let Probe::Mine(record, cas) = first {
            return Ok(Located::at(first_key, record, Some(cas), false));
        }
        let mut candidates = vec![(first_key, first)];
        if address.second != address.first {
            let second_key = slot_key_in(table.key_prefix, address.second);
            let second = self.probe(host, table, address, &second_key, now, words)?;
            candidates.push((second_key, second));
        }
        let (mut free, mut foreign) = (None, None);
        let mut taken: Vec<(String, Record, u32)> = Vec::new();
        for (key, probe) in candidates {
            match probe {
                Probe::Mine(record, cas) => return Ok(Located::at(key, record, Some(cas), false)),
                Probe::Free(cas) => {
                    free = free.or(Some(Located::at(key, Record::empty(words), cas, false)))
                }
                Probe::Taken(record, cas) => taken.push((key, record, cas)),
                Probe::Foreign(cas) => {
                    let fresh = Located::at(key, Record::empty(words), Some(cas), false);
                    foreign = foreign.or(Some(fresh))
                }
            }
        }
        // A free slot first, then a record taken over or shared, then another key's entry.
        if let Some(free) = free {
            return Ok(free);
        }
        if let Some((key, cas)) = self.victim(table, &taken, now) {
            return Ok(Located::taken_over(key, words, cas));
        }
        let shared = taken
            .into_iter()
            .next()
            .map(|(key, record, cas)| Located::at(key, record, Some(cas), true));
        shared.or(foreign).ok_or(HostError::NoCandidateSlot)
    }

    /// The held candidate a newcomer takes over (its key and CAS), or `None` to share the
    /// first one's counter: the [`Eviction`] policy, never a leaky bucket's record (its
    /// queued turns keep their pacing).
    fn victim(
        &self,
        table: &SlotTable<'_>,
        taken: &[(String, Record, u32)],
        now: Instant,
    ) -> Option<(String, u32)> {
        if self.eviction == Eviction::Share || table.algo.waits() {
            return None;
        }
        let evictable = taken.iter();
        let chosen = match self.eviction {
            Eviction::Share => None,
            Eviction::LeastRecent => evictable.min_by_key(|(_, record, _)| record.touched),
            Eviction::FewestVisits => {
                evictable.min_by_key(|(_, record, _)| (record.visits, record.touched))
            }
            Eviction::ClosestToIdle => evictable.min_by_key(|(_, record, _)| {
                // A read-only probe: what is left, and how long until the state is as fresh.
                let mut words = record.words.clone();
                let probe = table
                    .algo
                    .acquire_at_least(table.limit, &mut words, now, 0, 0);
                (u64::MAX - probe.remaining, probe.reset, record.touched)
            }),
        };
        chosen.map(|(key, _, cas)| (key.clone(), *cas))
    }

    fn probe(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        address: SlotAddress,
        key: &str,
        now: Instant,
        words: usize,
    ) -> Result<Probe, HostError> {
        Ok(match host.get(key)? {
            None => Probe::Free(None),
            Some((bytes, cas)) => match unseal(key, table.generation, &bytes) {
                // An empty (released) value is free, and so is a record of the rule's
                // table written under other parameters (an edited rule starts afresh);
                // another key's record sharing the entry (nginx: same CRC32) is held.
                Sealed::Empty | Sealed::Stale => Probe::Free(Some(cas)),
                Sealed::Foreign => Probe::Foreign(cas),
                Sealed::Current(payload) => {
                    let record = Record::decode(payload, words);
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
            },
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
