//! The lease stash of global rules: tokens the quota service granted beyond what the
//! request that asked needed (`lease: N`), kept in shared data so that every worker of the
//! gateway spends them without a callout, and the service's denials, cached until they can
//! change.
//!
//! One record per (rule, slot), `diana/lease/<table>/<slot>` (sealed with the rule's
//! generation, [`crate::config::RuleKeys`]), with [`WAYS`] ways; a way
//! belongs to one identity (its full fingerprint) and holds its tokens left, until when
//! they may be spent, until when it is known to be denied and when its limit recovers, and
//! what the gateway learnt of its spending rate. An identity uses the way that holds its
//! fingerprint; a newcomer takes a free way, or one whose identity has nothing live in it
//! (no tokens that may still be spent, no denial still ahead). A way that still holds
//! another identity's tokens or denial is never taken, read or written: identities that
//! share a slot never spend, overwrite or drop each other's tokens (bounded: at most
//! [`WAYS`] identities per slot share it at once, in one record read and written in one
//! compare-and-swap). An identity that finds every way of its slot live keeps its spare
//! tokens in its worker's own batch (below) until they lapse, and its denial in the
//! worker's memory for [`DENIAL_CACHE`] at most; it does not learn a spending rate
//! (`lease: auto` then asks for small leases). Tokens given back ([`Stash::give_back`])
//! follow the same path: to the identity's way (taken afresh if it was given up while
//! the request was out), else to the worker's batch. A token is dropped only when it
//! lapsed, or when the worker's table is full as well ([`MAX_BATCHES`]).
//!
//! Tokens are spent first: a denial cached by a concurrent request only means the service
//! has nothing more to give. A request that another rule rejects gives its tokens back
//! ([`Stash::give_back`]).
//!
//! A worker takes a small batch from the shared record when it holds many tokens, as
//! [`crate::local`] does for local counters (here at most 1/`STASH_SHARE` of them,
//! [`MAX_BATCH`] at most, none near the end), and spends it without touching shared data;
//! its tick gives an idle batch back ([`Stash::return_unspent`]); a batch's tokens are
//! spent before a denial it remembers. It remembers a denial for
//! [`DENIAL_CACHE`] at most, and forgets it when its own flight brings tokens; another
//! worker's tokens (a flight that was granted them before the service ran out, landing
//! after the denial) may go unseen by it that long. Not for `lease: 1`
//! ([`Rule::exact_lease`]): there every request reads the shared record, so a token asked
//! for a parked request is never shadowed by a denial and the count stays exact. A denial,
//! cached or remembered, is answered with the wait the service gave, less the time since
//! (and the service's reset): the short life of the worker's memory is only how long it
//! is trusted.
//!
//! Stored instants are checked against the clock: an expiry or a denial further ahead
//! than the rule can explain comes from a clock that stepped back, and is ignored.

use crate::config::{Policy, Rule};
use crate::local::{BATCH_SPAN, DENIAL_CACHE, MAX_BATCH, MAX_BATCHES, SHARE};
use crate::store::{slot_key_in, SharedData, SlotAddress, Store};
use crate::time::{Instant, Nanos};
use crate::wire::max_duration_ms;
use std::sync::Arc;

/// A worker's batch is at most this share of the spare tokens of a stash. Larger than a
/// local counter's share ([`SHARE`]): the stash's tokens are this gateway's already (the
/// quota service counted them when it granted the lease), so a worker that holds more of
/// them can only make another worker of the same gateway ask the service a little early,
/// never admit more than the service granted. Near the end of a stash (fewer than
/// `2 × SHARE` spare) there is still no batch: the last tokens go one by one.
const STASH_SHARE: u64 = 4;

/// Identities one stash record holds at once (see the module doc).
pub const WAYS: usize = 2;
/// Words of one way: fingerprint, tokens and spent (32 bits each), valid until, denied
/// until, reset at, refilled at, spending rate.
const WAY_WORDS: usize = 7;
/// Words of a lease-stash record.
const LEASE_WORDS: usize = WAYS * WAY_WORDS;
/// Bytes of a sealed lease-stash record (with a key of up to 36 bytes, one 256-byte slab
/// allocation of nginx's `shm_kv`, as a slot record).
pub const RECORD_BYTES: usize = 8 + 8 * LEASE_WORDS;

/// Tokens taken from the stash for one request, to give back if it is rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StashReceipt {
    pub rule: usize,
    key: Arc<str>,
    fingerprint: u64,
    tokens: u64,
    /// Until when they may be spent (the lease's end).
    valid_until: Instant,
    /// Taken from this worker's batch (else from the shared record).
    from_batch: bool,
}

impl StashReceipt {
    /// Tokens of `address` given back to its stash although no request took them from it
    /// (a settled answer's refund, [`super::Global::refund`]), spendable until `valid_until`.
    pub fn refund(
        rule: &Rule,
        address: SlotAddress,
        tokens: u64,
        valid_until: Instant,
    ) -> StashReceipt {
        StashReceipt {
            rule: rule.index,
            key: Stash::key(rule, address).into(),
            fingerprint: address.fingerprint,
            tokens,
            valid_until,
            from_batch: false,
        }
    }
}

/// What one worker holds of a (rule, identity)'s stash.
#[derive(Debug, Clone, Default)]
struct Batch {
    key: Arc<str>,
    tokens: u64,
    /// Until when this worker spends them; then they go back to the shared record.
    valid_until: Instant,
    /// Until when they may be spent at all (the lease's end).
    lease_until: Instant,
    /// The remembered denial is trusted until then (at most [`DENIAL_CACHE`]) ...
    denied_until: Instant,
    /// ... and answered with the service's instants: when a request may pass, when the
    /// limit has recovered.
    retry_at: Instant,
    reset_at: Instant,
}

impl Batch {
    /// `tokens` of this batch of `id` (its rule and identity), spent by a request
    /// (`from_batch`) or going back to the shared record.
    fn receipt(&self, id: (usize, u64), tokens: u64, from_batch: bool) -> StashReceipt {
        let (rule, fingerprint) = id;
        StashReceipt {
            rule,
            key: self.key.clone(),
            fingerprint,
            tokens,
            valid_until: self.lease_until,
            from_batch,
        }
    }

    /// Every token of this batch of `id`, taken out to go back to the shared record.
    fn take_all(&mut self, id: (usize, u64)) -> StashReceipt {
        let tokens = std::mem::take(&mut self.tokens);
        self.receipt(id, tokens, false)
    }
}

/// What the service granted one request beyond its own cost.
#[derive(Debug, Clone, Copy)]
pub struct Grant {
    /// Tokens granted beyond what the request took, kept for later requests.
    pub spare: u64,
    /// Tokens the request itself took (counted into this gateway's spending rate).
    pub took: u64,
    /// Until when the spare tokens may be spent.
    pub valid_until: Instant,
}

/// What the stash says for one rule of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// Leased tokens paid for the request. `refill`: the shared record is down to half a
    /// lease or less; ask for the next one now, before it runs out (the spending rate is
    /// carried for sizing `lease: auto`).
    Served(StashReceipt, Option<RefillOrder>),
    /// The identity is known to be denied: a request may pass at `retry_at`, the limit
    /// has recovered at `reset_at` (what the service said).
    Denied {
        retry_at: Instant,
        reset_at: Instant,
    },
    /// Ask the service; this gateway spends about this many tokens a second (0: unknown),
    /// for sizing `lease: auto`.
    Ask { spend_rate: u64 },
}

/// The stash of a (rule, identity) is running low: what to ask the service for ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefillOrder {
    /// This gateway's spending, tokens per second (0: unknown).
    pub spend_rate: u64,
}

/// What this gateway asks `rule`'s next lease to be before a request's own cost: the
/// rule's `lease`, or with `lease: auto` what it spends in [`AUTO_LEASE_SPAN`] at
/// `spend_rate` tokens a second, between one and the rule's cap.
///
/// [`AUTO_LEASE_SPAN`]: crate::config::AUTO_LEASE_SPAN
pub fn next_lease(rule: &Rule, spend_rate: u64) -> u32 {
    let lease = rule.lease.get();
    if !rule.lease_auto {
        return lease;
    }
    let span =
        u128::from(spend_rate) * u128::from(crate::config::AUTO_LEASE_SPAN.get()) / 1_000_000_000;
    u32::try_from(span).unwrap_or(u32::MAX).clamp(1, lease)
}

/// Half of what the next grant of `rule` will be: at or below it, a stash asks for the
/// next grant ahead. `None` for rules without leases (lease 1, leaky bucket).
fn refill_mark(rule: &Rule, spend_rate: u64) -> Option<u64> {
    if rule.algo.waits() || rule.lease.get() < 2 {
        return None;
    }
    Some(u64::from(next_lease(rule, spend_rate)) / 2).filter(|mark| *mark > 0)
}

/// One way of a stash record: one identity's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Way {
    /// The identity's fingerprint (0: a free way).
    fingerprint: u64,
    tokens: u64,
    valid_until: Instant,
    /// Denied until then (a request may pass then), and when the limit recovers.
    denied_until: Instant,
    reset_at: Instant,
    /// When the last grant was stashed, and the tokens taken since.
    refilled_at: Instant,
    spent: u64,
    /// This gateway's spending, tokens per second (a moving average over refills).
    spend_rate: u64,
}

impl Way {
    /// A way of `fingerprint`'s with nothing in it.
    fn of(fingerprint: u64) -> Way {
        Way {
            fingerprint,
            ..Way::default()
        }
    }

    fn decode(words: &mut impl Iterator<Item = u64>) -> Way {
        let mut next = || words.next().unwrap_or(0);
        let fingerprint = next();
        let counts = next();
        Way {
            fingerprint,
            tokens: counts & u64::from(u32::MAX),
            spent: counts >> 32,
            valid_until: Instant::from_unix_nanos(next()),
            denied_until: Instant::from_unix_nanos(next()),
            reset_at: Instant::from_unix_nanos(next()),
            refilled_at: Instant::from_unix_nanos(next()),
            spend_rate: next(),
        }
    }

    fn encode(&self, bytes: &mut Vec<u8>) {
        let narrow = |count: u64| count.min(u64::from(u32::MAX));
        let counts = narrow(self.tokens) | (narrow(self.spent) << 32);
        for word in [
            self.fingerprint,
            counts,
            self.valid_until.unix_nanos(),
            self.denied_until.unix_nanos(),
            self.reset_at.unix_nanos(),
            self.refilled_at.unix_nanos(),
            self.spend_rate,
        ] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
    }

    /// Holds nothing that must be kept at `now`: no tokens still spendable, no denial
    /// still ahead (its way may go to another identity).
    fn idle(&self, now: Instant, rule: &Rule) -> bool {
        let spendable = self.tokens > 0 && ahead(self.valid_until, now, rule);
        !spendable && !ahead(self.denied_until, now, rule)
    }
}

/// One stash record: the ways of the identities that share a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Record {
    ways: [Way; WAYS],
}

impl Record {
    /// A payload of another size (another build's layout, garbage) reads as empty.
    fn decode(payload: Option<&[u8]>) -> Record {
        let mut record = Record::default();
        let Some(payload) = payload.filter(|b| b.len() == 8 * LEASE_WORDS) else {
            return record;
        };
        let mut words = payload
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        for way in &mut record.ways {
            *way = Way::decode(&mut words);
        }
        record
    }

    fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(8 * LEASE_WORDS);
        for way in &self.ways {
            way.encode(&mut bytes);
        }
        bytes
    }

    /// The way of `fingerprint`, if it has one.
    fn own(&mut self, fingerprint: u64) -> Option<&mut Way> {
        self.ways
            .iter_mut()
            .find(|way| way.fingerprint == fingerprint)
    }

    /// The way of `fingerprint`, or one taken for it (a free one first, then one whose
    /// identity has nothing live in it); `None` when every way holds another identity's
    /// live tokens or denial. An own way whose tokens lapsed keeps only what it knows of
    /// the rate.
    fn place(&mut self, fingerprint: u64, now: Instant, rule: &Rule) -> Option<&mut Way> {
        let index = self
            .ways
            .iter()
            .position(|way| way.fingerprint == fingerprint)
            .or_else(|| self.ways.iter().position(|way| way.fingerprint == 0))
            .or_else(|| self.ways.iter().position(|way| way.idle(now, rule)))?;
        let way = self.ways.get_mut(index)?;
        if way.fingerprint != fingerprint {
            *way = Way::of(fingerprint);
        } else if !ahead(way.valid_until, now, rule) {
            way.tokens = 0;
            way.valid_until = Instant::EPOCH;
        }
        Some(way)
    }
}

/// The longest a lease or a denial can legitimately last for `rule`.
fn horizon(rule: &Rule) -> Nanos {
    Nanos::saturating_from_millis(max_duration_ms(&rule.limit)).max(rule.limit.unit.nanos())
}

/// An instant stored for `rule` that is still ahead of `now`, and not further ahead than
/// the rule can explain.
fn ahead(instant: Instant, now: Instant, rule: &Rule) -> bool {
    instant > now && instant - now <= horizon(rule)
}

/// The lease stash: shared data, and this worker's batches of it.
#[derive(Debug, Default)]
pub struct Stash {
    store: Store,
    batches: std::cell::RefCell<hashbrown::HashMap<(usize, u64), Batch>>,
}

impl Stash {
    fn key(rule: &Rule, address: SlotAddress) -> String {
        slot_key_in(&rule.keys.leases, address.first)
    }

    /// Takes `cost` leased tokens for a request of `address`, or says why not.
    pub fn take(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        cost: u32,
        now: Instant,
    ) -> Take {
        let id = (rule.index, address.fingerprint);
        let cost = u64::from(cost);
        // A batch too small for this request goes back to the shared record first, where
        // with the record's own tokens it may pay (a cost of 200 is not denied while 50
        // wait here and 150 there).
        let mut too_small = None;
        let mut denied = None;
        if let Ok(mut batches) = self.batches.try_borrow_mut() {
            if let Some(batch) = batches.get_mut(&id) {
                let live = now < batch.valid_until;
                // Tokens are spent first (as from the shared record).
                if live && batch.tokens >= cost {
                    batch.tokens -= cost;
                    return Take::Served(batch.receipt(id, cost, true), None);
                }
                if live && batch.tokens > 0 {
                    too_small = Some(batch.take_all(id));
                }
                if batch.denied_until > now && batch.denied_until - now <= DENIAL_CACHE {
                    // The service's instants: the memory's own life is shorter.
                    denied = Some(Take::Denied {
                        retry_at: batch.retry_at,
                        reset_at: batch.reset_at,
                    });
                }
            }
        }
        if let Some(receipt) = too_small {
            self.give_back(host, rule, &receipt, now);
        }
        if let Some(denied) = denied {
            return denied;
        }
        let key: Arc<str> = Stash::key(rule, address).into();
        let result = self
            .store
            .update_for(host, &key, rule.keys.generation, |current| {
                let mut record = Record::decode(current);
                let Some(lease) = record.own(address.fingerprint) else {
                    return (None, (Take::Ask { spend_rate: 0 }, 0, Instant::EPOCH));
                };
                if lease.tokens >= cost && ahead(lease.valid_until, now, rule) {
                    let spare = lease.tokens - cost;
                    // A batch is worth carving only if it pays at least one request of
                    // this size: else the tokens are split where neither half pays one.
                    let batch = match (spare / STASH_SHARE).min(MAX_BATCH) {
                        batch if spare >= 2 * SHARE && batch >= cost => batch,
                        _ => 0,
                    };
                    lease.tokens -= cost + batch;
                    lease.spent = lease.spent.saturating_add(cost + batch);
                    let receipt = StashReceipt {
                        rule: rule.index,
                        key: Arc::clone(&key),
                        fingerprint: address.fingerprint,
                        tokens: cost,
                        valid_until: lease.valid_until,
                        from_batch: false,
                    };
                    let until = lease.valid_until;
                    let refill = refill_mark(rule, lease.spend_rate)
                        .filter(|mark| lease.tokens <= *mark)
                        .map(|_| RefillOrder {
                            spend_rate: lease.spend_rate,
                        });
                    return (
                        Some(record.encode()),
                        (Take::Served(receipt, refill), batch, until),
                    );
                }
                if ahead(lease.denied_until, now, rule) {
                    let denied = Take::Denied {
                        retry_at: lease.denied_until,
                        reset_at: lease.reset_at,
                    };
                    return (None, (denied, 0, Instant::EPOCH));
                }
                let spend_rate = lease.spend_rate;
                (None, (Take::Ask { spend_rate }, 0, Instant::EPOCH))
            });
        let Ok((take, batch, until)) = result else {
            return Take::Ask { spend_rate: 0 };
        };
        match &take {
            Take::Served(..) if batch > 0 => {
                let held = self.remember(id, now, |held| {
                    // Tokens still held (fewer than a request needed, or idle and not yet
                    // returned by the tick) are kept while their lease lasts.
                    if !ahead(held.lease_until, now, rule) {
                        held.tokens = 0;
                    }
                    held.lease_until = if held.tokens > 0 {
                        held.lease_until.max(until)
                    } else {
                        until
                    };
                    held.key = Arc::clone(&key);
                    held.tokens = held.tokens.saturating_add(batch);
                    held.valid_until = until.min(now.saturating_add(BATCH_SPAN));
                    held.denied_until = Instant::EPOCH;
                });
                if !held {
                    // No room in this worker's table: the batch goes back at once.
                    if let Take::Served(receipt, _) = &take {
                        let batch = StashReceipt {
                            tokens: batch,
                            from_batch: false,
                            ..receipt.clone()
                        };
                        self.give_back(host, rule, &batch, now);
                    }
                }
            }
            Take::Denied { retry_at, reset_at } if !rule.exact_lease() => {
                self.remember_denial(id, *retry_at, *reset_at, now);
            }
            _ => {}
        }
        take
    }

    /// From the worker's tick: idle batches go back to the shared stash.
    pub fn return_unspent(&self, host: &dyn SharedData, policy: &Policy, now: Instant) {
        let lapsed: Vec<StashReceipt> = match self.batches.try_borrow_mut() {
            Ok(mut batches) => {
                let lapsed = batches
                    .iter_mut()
                    .filter(|(_, batch)| batch.tokens > 0 && batch.valid_until <= now)
                    .map(|(&id, batch)| batch.take_all(id))
                    .collect();
                batches.retain(|_, batch| batch.valid_until > now || batch.denied_until > now);
                lapsed
            }
            Err(_) => return,
        };
        for receipt in lapsed {
            if let Some(rule) = policy.rule(receipt.rule) {
                self.give_back(host, rule, &receipt, now);
            }
        }
    }

    /// Updates this worker's batch of `id`, if the table has room (a full table is swept
    /// of batches with nothing left to spend, to return or to remember).
    fn remember(&self, id: (usize, u64), now: Instant, change: impl FnOnce(&mut Batch)) -> bool {
        let Ok(mut batches) = self.batches.try_borrow_mut() else {
            return false;
        };
        if batches.len() >= MAX_BATCHES && !batches.contains_key(&id) {
            batches.retain(|_, batch| {
                batch.tokens > 0 || batch.valid_until > now || batch.denied_until > now
            });
            if batches.len() >= MAX_BATCHES {
                return false;
            }
        }
        change(batches.entry(id).or_default());
        true
    }

    /// Remembers, for [`DENIAL_CACHE`] at most, that `id` is denied: a request may pass at
    /// `retry_at`, the limit has recovered at `reset_at`.
    fn remember_denial(
        &self,
        id: (usize, u64),
        retry_at: Instant,
        reset_at: Instant,
        now: Instant,
    ) {
        self.remember(id, now, |held| {
            held.denied_until = retry_at.min(now.saturating_add(DENIAL_CACHE));
            held.retry_at = retry_at;
            held.reset_at = reset_at;
        });
    }

    /// Keeps the tokens of `tokens` (an identity's, spendable until its `valid_until`) in
    /// this worker's own batch: their way in the shared record is another identity's (or
    /// cannot be written).
    fn hold(&self, rule: &Rule, tokens: &StashReceipt, now: Instant) {
        if tokens.tokens == 0 || !ahead(tokens.valid_until, now, rule) {
            return;
        }
        let id = (tokens.rule, tokens.fingerprint);
        let held = self.remember(id, now, |held| {
            if !ahead(held.lease_until, now, rule) {
                // What it held lapsed with its lease.
                held.tokens = 0;
            }
            held.lease_until = if held.tokens > 0 {
                held.lease_until.max(tokens.valid_until)
            } else {
                tokens.valid_until
            };
            // With no place to go back to, they are this worker's until the lease ends.
            held.valid_until = held.lease_until;
            held.key = Arc::clone(&tokens.key);
            held.tokens = held.tokens.saturating_add(tokens.tokens);
            held.denied_until = Instant::EPOCH;
        });
        if !held {
            log::debug!(
                "diana: lease stash of {}: no room for {} tokens; they lapse",
                rule.name,
                tokens.tokens
            );
        }
    }

    /// Keeps the spare tokens of a grant for `address`, spendable until its `valid_until`
    /// (with any still valid from an earlier grant): in the identity's way of the shared
    /// record, else (every way another identity's) in this worker's batch.
    pub fn keep(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        grant: Grant,
        now: Instant,
    ) {
        let placed = self.merge(host, rule, address, now, |lease| {
            // The tokens spent since the last grant (this one's included), over the time
            // they lasted: this gateway's rate, averaged with what it was.
            let spent = lease.spent.saturating_add(grant.took);
            if lease.refilled_at > Instant::EPOCH && now > lease.refilled_at {
                let elapsed = u128::from((now - lease.refilled_at).get());
                let sample = u128::from(spent) * 1_000_000_000 / elapsed;
                let sample = u64::try_from(sample).unwrap_or(u64::MAX);
                lease.spend_rate = if lease.spend_rate == 0 {
                    sample
                } else {
                    lease.spend_rate / 2 + sample / 2
                };
            }
            lease.refilled_at = now;
            lease.spent = 0;
            lease.tokens = lease.tokens.saturating_add(grant.spare);
            lease.valid_until = lease.valid_until.max(grant.valid_until);
        });
        let id = (rule.index, address.fingerprint);
        if !placed {
            let spare = StashReceipt {
                rule: rule.index,
                key: Stash::key(rule, address).into(),
                fingerprint: address.fingerprint,
                tokens: grant.spare,
                valid_until: grant.valid_until,
                from_batch: false,
            };
            self.hold(rule, &spare, now);
        } else if grant.spare > 0 {
            // This worker's own tokens are not to be hidden by the denial it remembers.
            if let Ok(mut batches) = self.batches.try_borrow_mut() {
                if let Some(held) = batches.get_mut(&id) {
                    held.denied_until = Instant::EPOCH;
                }
            }
        }
    }

    /// Remembers that the service denied `address`: a request may pass at `retry_at`, the
    /// limit has recovered at `reset_at`. In the identity's way of the shared record, else
    /// (every way another identity's) in this worker's memory only.
    pub fn deny(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        retry_at: Instant,
        reset_at: Instant,
        now: Instant,
    ) {
        let placed = self.merge(host, rule, address, now, |lease| {
            lease.denied_until = retry_at;
            lease.reset_at = reset_at;
        });
        if !placed && !rule.exact_lease() {
            self.remember_denial((rule.index, address.fingerprint), retry_at, reset_at, now);
        }
    }

    /// Forgets a denial of `address`, in the shared record and in this worker's memory:
    /// tokens went back to the service (a release), which the denial would hide until its
    /// retry.
    pub fn forget_denial(&self, host: &dyn SharedData, rule: &Rule, address: SlotAddress) {
        // Only the identity's own way, and only if it holds a denial: nothing is taken
        // for an identity that has none, nor written when there is nothing to forget.
        let key = Stash::key(rule, address);
        let result = self
            .store
            .update_for(host, &key, rule.keys.generation, |current| {
                let mut record = Record::decode(current);
                match record.own(address.fingerprint) {
                    Some(way) if way.denied_until != Instant::EPOCH => {
                        way.denied_until = Instant::EPOCH;
                        (Some(record.encode()), ())
                    }
                    _ => (None, ()),
                }
            });
        if let Err(error) = result {
            log::debug!("diana: lease stash of {}: {error}", rule.name);
        }
        if let Ok(mut batches) = self.batches.try_borrow_mut() {
            if let Some(batch) = batches.get_mut(&(rule.index, address.fingerprint)) {
                batch.denied_until = Instant::EPOCH;
            }
        }
    }

    /// Gives back the tokens of a request that was rejected after all: to this worker's
    /// batch when they came from it and it is still valid, else to the identity's way of
    /// the shared stash (taken afresh if it went to another identity meanwhile), else to
    /// this worker's batch until the lease ends. Lapsed tokens are gone.
    pub fn give_back(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        receipt: &StashReceipt,
        now: Instant,
    ) {
        let id = (receipt.rule, receipt.fingerprint);
        if receipt.from_batch {
            let kept = self
                .batches
                .try_borrow_mut()
                .ok()
                .is_some_and(|mut batches| match batches.get_mut(&id) {
                    Some(batch) if now < batch.valid_until && batch.key == receipt.key => {
                        batch.tokens = batch.tokens.saturating_add(receipt.tokens);
                        true
                    }
                    _ => false,
                });
            if kept {
                return;
            }
        }
        if !ahead(receipt.valid_until, now, rule) {
            // The lease ended: the tokens lapsed with it.
            return;
        }
        let result = self
            .store
            .update_for(host, &receipt.key, rule.keys.generation, |current| {
                let mut record = Record::decode(current);
                let Some(lease) = record.place(receipt.fingerprint, now, rule) else {
                    return (None, false);
                };
                lease.tokens = lease.tokens.saturating_add(receipt.tokens);
                lease.valid_until = lease.valid_until.max(receipt.valid_until);
                (Some(record.encode()), true)
            });
        match result {
            Ok(true) => {}
            Ok(false) => self.hold(rule, receipt, now),
            Err(error) => {
                log::debug!("diana: lease stash of {}: {error}", rule.name);
                self.hold(rule, receipt, now);
            }
        }
    }

    /// Updates the way of `address` with `change` (see [`Record::place`]). False when it
    /// has none and no way can be taken for it, or the record could not be written.
    fn merge(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        now: Instant,
        change: impl Fn(&mut Way),
    ) -> bool {
        let key = Stash::key(rule, address);
        let result = self
            .store
            .update_for(host, &key, rule.keys.generation, |current| {
                let mut record = Record::decode(current);
                let Some(lease) = record.place(address.fingerprint, now, rule) else {
                    return (None, false);
                };
                change(lease);
                (Some(record.encode()), true)
            });
        match result {
            Ok(placed) => placed,
            Err(error) => {
                log::debug!("diana: lease stash of {}: {error}", rule.name);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_policy;
    use crate::store::{CasSemantics, MemoryHost};
    use crate::time::NANOS_PER_SECOND;

    const S: Nanos = NANOS_PER_SECOND;
    const T0: Instant = Instant::EPOCH.saturating_add(Nanos::from_secs(1_767_225_601));

    fn policy() -> Policy {
        let doc = "resources:\n  - Url: /\n    rules: [{actor: ip, rpu: 100, unit: minute, scope: global, lease: 10, slots: 1}]\n";
        parse_policy(doc).unwrap()
    }

    /// Identities that all share slot 0 of a one-slot table.
    fn identity(n: u64) -> SlotAddress {
        let address = SlotAddress::of(n.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1);
        assert_eq!(address.first, 0);
        address
    }

    fn grant(spare: u64) -> Grant {
        Grant {
            spare,
            took: 1,
            valid_until: T0 + 60 * S,
        }
    }

    fn served(take: Take) -> StashReceipt {
        match take {
            Take::Served(receipt, _) => receipt,
            other => panic!("expected leased tokens, got {other:?}"),
        }
    }

    /// Takes one token at a time until none is left: how many there were.
    fn drain(stash: &Stash, host: &MemoryHost, rule: &Rule, who: SlotAddress) -> usize {
        (0..100)
            .take_while(|_| matches!(stash.take(host, rule, who, 1, T0), Take::Served(..)))
            .count()
    }

    // nginx: 96 bytes of node, a key of up to 36 bytes, the record: one 256-byte slab.
    const _: () = assert!(96 + 36 + RECORD_BYTES <= 256);

    #[test]
    fn a_record_holds_two_identities_and_fits_a_slot_records_allocation() {
        let policy = policy();
        let rule = policy.rule(0).unwrap();
        let (host, stash) = (MemoryHost::new(CasSemantics::Envoy), Stash::default());
        let (a, b) = (identity(1), identity(2));
        stash.keep(&host, rule, a, grant(5), T0);
        stash.keep(&host, rule, b, grant(7), T0);
        stash.deny(&host, rule, b, T0 + 30 * S, T0 + 40 * S, T0);
        let key = Stash::key(rule, a);
        let generation = rule.keys.generation;
        let payload = stash
            .store
            .read_for(&host, &key, generation)
            .unwrap()
            .unwrap();
        let record = Record::decode(Some(&payload));
        assert_eq!(Record::decode(Some(&record.encode())), record);
        let [first, second] = record.ways;
        assert_eq!((first.fingerprint, first.tokens), (a.fingerprint, 5));
        assert_eq!((second.fingerprint, second.tokens), (b.fingerprint, 7));
        assert_eq!(
            (second.denied_until, second.reset_at),
            (T0 + 30 * S, T0 + 40 * S)
        );
    }

    /// Both ways hold live tokens: a third identity's grant goes to its worker's batch,
    /// and touches neither of the others'.
    #[test]
    fn a_third_identity_keeps_its_tokens_in_its_worker_and_takes_no_others() {
        let policy = policy();
        let rule = policy.rule(0).unwrap();
        let (host, stash) = (MemoryHost::new(CasSemantics::Envoy), Stash::default());
        let (a, b, c) = (identity(1), identity(2), identity(3));
        stash.keep(&host, rule, a, grant(5), T0);
        stash.keep(&host, rule, b, grant(6), T0);
        stash.keep(&host, rule, c, grant(7), T0);
        stash.deny(&host, rule, c, T0 + 30 * S, T0 + 30 * S, T0);
        // Another worker sees a's and b's tokens, not c's (held by the first worker).
        let other = Stash::default();
        assert_eq!(drain(&other, &host, rule, a), 5);
        assert_eq!(drain(&other, &host, rule, b), 6);
        assert_eq!(
            other.take(&host, rule, c, 1, T0),
            Take::Ask { spend_rate: 0 }
        );
        assert_eq!(drain(&stash, &host, rule, c), 7);
    }

    /// a took its way's last token; its way, idle, went to another identity while the
    /// request was out. The rejected request's token is not dropped: it goes to a's
    /// worker (every way is live), and a spends it next.
    #[test]
    fn a_token_given_back_after_its_way_was_taken_over_is_kept() {
        let policy = policy();
        let rule = policy.rule(0).unwrap();
        let (host, stash) = (MemoryHost::new(CasSemantics::Envoy), Stash::default());
        let (a, b, c) = (identity(1), identity(2), identity(3));
        stash.keep(&host, rule, a, grant(1), T0);
        let receipt = served(stash.take(&host, rule, a, 1, T0));
        stash.keep(&host, rule, b, grant(3), T0);
        stash.keep(&host, rule, c, grant(4), T0);
        let other = Stash::default();
        assert_eq!(
            other.take(&host, rule, a, 1, T0),
            Take::Ask { spend_rate: 0 }
        );
        stash.give_back(&host, rule, &receipt, T0);
        assert_eq!(drain(&stash, &host, rule, a), 1);
        assert_eq!(drain(&other, &host, rule, b), 3);
        assert_eq!(drain(&other, &host, rule, c), 4);
    }

    /// The worker's batch (22 tokens) is too small for a request of 30: it goes back to
    /// the shared record, which pays the request with it; no token is lost on the way.
    #[test]
    fn a_batch_too_small_for_a_request_pays_it_through_the_shared_record() {
        let policy = policy();
        let rule = policy.rule(0).unwrap();
        let (host, stash) = (MemoryHost::new(CasSemantics::Envoy), Stash::default());
        let a = identity(1);
        stash.keep(&host, rule, a, grant(90), T0);
        // 1 spent, a batch of (90 - 1) / 4 = 22 carved for this worker, 67 left shared.
        let first = served(stash.take(&host, rule, a, 1, T0));
        assert!(!first.from_batch);
        let big = served(stash.take(&host, rule, a, 30, T0));
        assert_eq!((big.tokens, big.from_batch), (30, false));
        assert_eq!(drain(&stash, &host, rule, a), 90 - 1 - 30);
    }

    /// A denial read from the shared record and then remembered by the worker answers the
    /// service's instants, not the memory's short life.
    #[test]
    fn a_remembered_denial_carries_the_services_instants() {
        let policy = policy();
        let rule = policy.rule(0).unwrap();
        let (host, stash) = (MemoryHost::new(CasSemantics::Envoy), Stash::default());
        let a = identity(1);
        stash.deny(&host, rule, a, T0 + 54 * S, T0 + 59 * S, T0);
        let denied = Take::Denied {
            retry_at: T0 + 54 * S,
            reset_at: T0 + 59 * S,
        };
        assert_eq!(stash.take(&host, rule, a, 1, T0), denied);
        let before = host.calls();
        assert_eq!(stash.take(&host, rule, a, 1, T0 + S / 20), denied);
        assert_eq!(host.calls(), before, "remembered");
    }
}
