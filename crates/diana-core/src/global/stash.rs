//! The lease stash of global rules: tokens the quota service granted beyond what the
//! request that asked needed (`lease: N`), kept in shared data so that every worker of the
//! gateway spends them without a callout, and the service's denials, cached until they can
//! change. One record per (rule, slot), `diana/lease/<rule id>/<slot>`, holding the
//! identity's fingerprint, the tokens left, until when they may be spent, and until when
//! the identity is known to be denied.
//!
//! Tokens are spent first: a denial cached by a concurrent request only means the service
//! has nothing more to give. A request that another rule rejects gives its tokens back
//! ([`Stash::give_back`]).
//!
//! A worker takes a small batch from the shared record when it holds many tokens, as
//! [`crate::local`] does for local counters (here at most 1/`STASH_SHARE` of them,
//! [`MAX_BATCH`] at most, none near the end), and spends it without touching shared data;
//! its tick gives an idle batch back ([`Stash::return_unspent`]). It remembers a denial for
//! [`DENIAL_CACHE`] at most, and forgets it when its own flight brings tokens; another
//! worker's tokens (a flight that was granted them before the service ran out, landing
//! after the denial) may go unseen by it that long. Not for `lease: 1`
//! ([`Rule::exact_lease`]): there every request reads the shared record, so a token asked
//! for a parked request is never shadowed by a denial and the count stays exact.
//!
//! Stored instants are checked against the clock: an expiry or a denial further ahead
//! than the rule can explain comes from a clock that stepped back, and is ignored.

use crate::config::{Policy, Rule};
use crate::local::{DENIAL_CACHE, LEASE_SPAN, MAX_BATCH, MAX_LEASES, SHARE};
use crate::store::{slot_key_in, SharedData, SlotAddress, Store};
use crate::time::Nanos;
use crate::wire::max_duration_ms;
use std::rc::Rc;

const NANOS_PER_MILLI: Nanos = 1_000_000;

/// A worker's batch is at most this share of the spare tokens of a stash. Larger than a
/// local counter's share ([`SHARE`]): the stash's tokens are this gateway's already (the
/// quota service counted them when it granted the lease), so a worker that holds more of
/// them can only make another worker of the same gateway ask the service a little early,
/// never admit more than the service granted. Near the end of a stash (fewer than
/// `2 × SHARE` spare) there is still no batch: the last tokens go one by one.
const STASH_SHARE: u64 = 4;

/// Words of a lease-stash record.
const LEASE_WORDS: usize = 7;
/// Bytes of a sealed lease-stash record.
pub const RECORD_BYTES: usize = 8 + 8 * LEASE_WORDS;

/// Tokens taken from the stash for one request, to give back if it is rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StashReceipt {
    pub rule: usize,
    key: Rc<str>,
    fingerprint: u64,
    tokens: u64,
    /// Taken from this worker's batch (else from the shared record).
    from_batch: bool,
}

/// What one worker holds of a (rule, identity)'s stash.
#[derive(Debug, Clone, Default)]
struct Batch {
    key: Rc<str>,
    tokens: u64,
    valid_until: Nanos,
    denied_until: Nanos,
}

/// What the service granted one request beyond its own cost.
#[derive(Debug, Clone, Copy)]
pub struct Grant {
    /// Tokens granted beyond what the request took, kept for later requests.
    pub spare: u64,
    /// Tokens the request itself took (counted into this gateway's spending rate).
    pub took: u64,
    /// Until when the spare tokens may be spent.
    pub valid_until: Nanos,
}

/// What the stash says for one rule of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// Leased tokens paid for the request. `refill`: the shared record is down to half a
    /// lease or less; ask for the next one now, before it runs out (the spending rate is
    /// carried for sizing `lease: auto`).
    Served(StashReceipt, Option<Refill>),
    /// The identity is known to be denied until this instant.
    Denied(Nanos),
    /// Ask the service; this gateway spends about this many tokens a second (0: unknown),
    /// for sizing `lease: auto`.
    Ask { spend_rate: u64 },
}

/// The stash of a (rule, identity) is running low: what to ask the service for ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
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
    let span = u128::from(spend_rate) * u128::from(crate::config::AUTO_LEASE_SPAN) / 1_000_000_000;
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

/// One stash record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Lease {
    fingerprint: u64,
    tokens: u64,
    valid_until: Nanos,
    denied_until: Nanos,
    /// When the last grant was stashed, and the tokens taken since.
    refilled_at: Nanos,
    spent: u64,
    /// This gateway's spending, tokens per second (a moving average over refills).
    spend_rate: u64,
}

impl Lease {
    fn decode(payload: Option<&[u8]>) -> Lease {
        let Some(payload) = payload.filter(|b| b.len() == 8 * LEASE_WORDS) else {
            return Lease::default();
        };
        let mut words = payload
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        let mut next = || words.next().unwrap_or(0);
        Lease {
            fingerprint: next(),
            tokens: next(),
            valid_until: next(),
            denied_until: next(),
            refilled_at: next(),
            spent: next(),
            spend_rate: next(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        [
            self.fingerprint,
            self.tokens,
            self.valid_until,
            self.denied_until,
            self.refilled_at,
            self.spent,
            self.spend_rate,
        ]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
    }
}

/// The longest a lease or a denial can legitimately last for `rule`.
fn horizon(rule: &Rule) -> Nanos {
    max_duration_ms(&rule.limit)
        .saturating_mul(NANOS_PER_MILLI)
        .max(rule.limit.unit.nanos())
}

/// An instant stored for `rule` that is still ahead of `now`, and not further ahead than
/// the rule can explain.
fn ahead(instant: Nanos, now: Nanos, rule: &Rule) -> bool {
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
        now: Nanos,
    ) -> Take {
        let id = (rule.index, address.fingerprint);
        let cost = u64::from(cost);
        if let Ok(mut batches) = self.batches.try_borrow_mut() {
            if let Some(batch) = batches.get_mut(&id) {
                if batch.denied_until > now && batch.denied_until - now <= DENIAL_CACHE {
                    return Take::Denied(batch.denied_until);
                }
                if batch.tokens >= cost && now < batch.valid_until {
                    batch.tokens -= cost;
                    let receipt = StashReceipt {
                        rule: rule.index,
                        key: batch.key.clone(),
                        fingerprint: address.fingerprint,
                        tokens: cost,
                        from_batch: true,
                    };
                    return Take::Served(receipt, None);
                }
            }
        }
        let key: Rc<str> = Stash::key(rule, address).into();
        let result = self.store.update(host, &key, |current| {
            let mut lease = Lease::decode(current);
            if lease.fingerprint != address.fingerprint {
                return (None, (Take::Ask { spend_rate: 0 }, 0, 0));
            }
            if lease.tokens >= cost && ahead(lease.valid_until, now, rule) {
                let spare = lease.tokens - cost;
                let batch = if spare >= 2 * SHARE {
                    (spare / STASH_SHARE).min(MAX_BATCH)
                } else {
                    0
                };
                lease.tokens -= cost + batch;
                lease.spent = lease.spent.saturating_add(cost + batch);
                let receipt = StashReceipt {
                    rule: rule.index,
                    key: Rc::clone(&key),
                    fingerprint: address.fingerprint,
                    tokens: cost,
                    from_batch: false,
                };
                let until = lease.valid_until;
                let refill = refill_mark(rule, lease.spend_rate)
                    .filter(|mark| lease.tokens <= *mark)
                    .map(|_| Refill {
                        spend_rate: lease.spend_rate,
                    });
                return (
                    Some(lease.encode()),
                    (Take::Served(receipt, refill), batch, until),
                );
            }
            if ahead(lease.denied_until, now, rule) {
                return (None, (Take::Denied(lease.denied_until), 0, 0));
            }
            let spend_rate = lease.spend_rate;
            (None, (Take::Ask { spend_rate }, 0, 0))
        });
        let Ok((take, batch, until)) = result else {
            return Take::Ask { spend_rate: 0 };
        };
        match &take {
            Take::Served(..) if batch > 0 => self.remember(id, now, |held| {
                held.key = Rc::clone(&key);
                held.tokens = batch;
                held.valid_until = until.min(now.saturating_add(LEASE_SPAN));
                held.denied_until = 0;
            }),
            Take::Denied(until) if !rule.exact_lease() => {
                let until = (*until).min(now.saturating_add(DENIAL_CACHE));
                self.remember(id, now, |held| held.denied_until = until);
            }
            _ => {}
        }
        take
    }

    /// From the worker's tick: idle batches go back to the shared stash.
    pub fn return_unspent(&self, host: &dyn SharedData, policy: &Policy, now: Nanos) {
        let lapsed: Vec<(usize, u64, Rc<str>, u64)> = match self.batches.try_borrow_mut() {
            Ok(mut batches) => {
                let lapsed = batches
                    .iter_mut()
                    .filter(|(_, batch)| batch.tokens > 0 && batch.valid_until <= now)
                    .map(|(&(index, fingerprint), batch)| {
                        let tokens = std::mem::take(&mut batch.tokens);
                        (index, fingerprint, batch.key.clone(), tokens)
                    })
                    .collect();
                batches.retain(|_, batch| batch.valid_until > now || batch.denied_until > now);
                lapsed
            }
            Err(_) => return,
        };
        for (index, fingerprint, key, tokens) in lapsed {
            if let Some(rule) = policy.rule(index) {
                let receipt = StashReceipt {
                    rule: index,
                    key,
                    fingerprint,
                    tokens,
                    from_batch: false,
                };
                self.give_back(host, rule, &receipt, now);
            }
        }
    }

    /// Updates this worker's batch of `id`, if the table has room.
    fn remember(&self, id: (usize, u64), now: Nanos, change: impl FnOnce(&mut Batch)) {
        let Ok(mut batches) = self.batches.try_borrow_mut() else {
            return;
        };
        if batches.len() >= MAX_LEASES && !batches.contains_key(&id) {
            batches.retain(|_, batch| batch.valid_until > now || batch.denied_until > now);
            if batches.len() >= MAX_LEASES {
                return;
            }
        }
        change(batches.entry(id).or_default());
    }

    /// Keeps the spare tokens of a grant for `address`, spendable until its `valid_until`
    /// (with any still valid from an earlier grant).
    pub fn keep(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        grant: Grant,
        now: Nanos,
    ) {
        self.merge(host, rule, address, now, |lease| {
            // The tokens spent since the last grant (this one's included), over the time
            // they lasted: this gateway's rate, averaged with what it was.
            let spent = lease.spent.saturating_add(grant.took);
            if lease.refilled_at > 0 && now > lease.refilled_at {
                let elapsed = u128::from(now - lease.refilled_at);
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
        if grant.spare > 0 {
            // This worker's own tokens are not to be hidden by the denial it remembers.
            if let Ok(mut batches) = self.batches.try_borrow_mut() {
                if let Some(held) = batches.get_mut(&(rule.index, address.fingerprint)) {
                    held.denied_until = 0;
                }
            }
        }
    }

    /// Remembers that the service denied `address` until `until`.
    pub fn deny(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        until: Nanos,
        now: Nanos,
    ) {
        self.merge(host, rule, address, now, |lease| {
            lease.denied_until = until;
        });
    }

    /// Gives back the tokens of a request that was rejected after all: to this worker's
    /// batch when they came from it and it is still valid, else to the shared stash.
    pub fn give_back(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        receipt: &StashReceipt,
        now: Nanos,
    ) {
        if receipt.from_batch {
            let kept = self
                .batches
                .try_borrow_mut()
                .ok()
                .is_some_and(|mut batches| {
                    match batches.get_mut(&(receipt.rule, receipt.fingerprint)) {
                        Some(batch) if now < batch.valid_until && batch.key == receipt.key => {
                            batch.tokens = batch.tokens.saturating_add(receipt.tokens);
                            true
                        }
                        _ => false,
                    }
                });
            if kept {
                return;
            }
        }
        let result = self.store.update(host, &receipt.key, |current| {
            let mut lease = Lease::decode(current);
            if lease.fingerprint != receipt.fingerprint || !ahead(lease.valid_until, now, rule) {
                // Another identity took the record over, or the lease ended: the tokens
                // are gone with it.
                return (None, ());
            }
            lease.tokens = lease.tokens.saturating_add(receipt.tokens);
            (Some(lease.encode()), ())
        });
        if let Err(error) = result {
            log::debug!("diana: lease stash of {}: {error}", rule.name);
        }
    }

    /// Updates the record of `address` with `change`, starting from an empty one when the
    /// record is another identity's or has nothing valid left.
    fn merge(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        now: Nanos,
        change: impl Fn(&mut Lease),
    ) {
        let key = Stash::key(rule, address);
        let result = self.store.update(host, &key, |current| {
            let mut lease = Lease::decode(current);
            if lease.fingerprint != address.fingerprint {
                lease = Lease {
                    fingerprint: address.fingerprint,
                    ..Lease::default()
                };
            } else if !ahead(lease.valid_until, now, rule) {
                // The tokens lapsed; what the record knows of the rate stays.
                lease.tokens = 0;
                lease.valid_until = 0;
            }
            change(&mut lease);
            (Some(lease.encode()), ())
        });
        if let Err(error) = result {
            log::debug!("diana: lease stash of {}: {error}", rule.name);
        }
    }
}
