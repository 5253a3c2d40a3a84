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
//! Stored instants are checked against the clock: an expiry or a denial further ahead
//! than the rule can explain comes from a clock that stepped back, and is ignored.

use crate::config::Rule;
use crate::store::{slot_key_in, SharedData, SlotAddress, Store};
use crate::time::Nanos;
use crate::wire::max_duration_ms;

const NANOS_PER_MILLI: Nanos = 1_000_000;

/// Bytes of a sealed lease-stash record.
pub const RECORD_BYTES: usize = 8 + 32;

/// Tokens taken from the stash for one request, to give back if it is rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StashReceipt {
    pub rule: usize,
    key: String,
    fingerprint: u64,
    tokens: u64,
}

/// What the stash says for one rule of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// Leased tokens paid for the request.
    Served(StashReceipt),
    /// The identity is known to be denied until this instant.
    Denied(Nanos),
    /// Ask the service.
    Ask,
}

/// One stash record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Lease {
    fingerprint: u64,
    tokens: u64,
    valid_until: Nanos,
    denied_until: Nanos,
}

impl Lease {
    fn decode(payload: Option<&[u8]>) -> Lease {
        let Some(payload) = payload.filter(|b| b.len() == 32) else {
            return Lease::default();
        };
        let mut words = payload
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        Lease {
            fingerprint: words.next().unwrap_or(0),
            tokens: words.next().unwrap_or(0),
            valid_until: words.next().unwrap_or(0),
            denied_until: words.next().unwrap_or(0),
        }
    }

    fn encode(&self) -> Vec<u8> {
        [
            self.fingerprint,
            self.tokens,
            self.valid_until,
            self.denied_until,
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

/// The lease stash; everything it knows is in shared data.
#[derive(Debug, Default)]
pub struct Stash {
    store: Store,
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
        let key = Stash::key(rule, address);
        let cost = u64::from(cost);
        let result = self.store.update(host, &key, |current| {
            let mut lease = Lease::decode(current);
            if lease.fingerprint != address.fingerprint {
                return (None, Take::Ask);
            }
            if lease.tokens >= cost && ahead(lease.valid_until, now, rule) {
                lease.tokens -= cost;
                let receipt = StashReceipt {
                    rule: rule.index,
                    key: key.clone(),
                    fingerprint: address.fingerprint,
                    tokens: cost,
                };
                return (Some(lease.encode()), Take::Served(receipt));
            }
            if ahead(lease.denied_until, now, rule) {
                return (None, Take::Denied(lease.denied_until));
            }
            (None, Take::Ask)
        });
        result.unwrap_or(Take::Ask)
    }

    /// Keeps `tokens` granted by the service for `address`, spendable until `valid_until`
    /// (with any still valid from an earlier grant).
    pub fn keep(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        address: SlotAddress,
        tokens: u64,
        valid_until: Nanos,
        now: Nanos,
    ) {
        self.merge(host, rule, address, now, |lease| {
            lease.tokens = lease.tokens.saturating_add(tokens);
            lease.valid_until = lease.valid_until.max(valid_until);
        });
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

    /// Gives back the tokens of a request that was rejected after all.
    pub fn give_back(
        &self,
        host: &dyn SharedData,
        rule: &Rule,
        receipt: &StashReceipt,
        now: Nanos,
    ) {
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
            if lease.fingerprint != address.fingerprint || !ahead(lease.valid_until, now, rule) {
                lease = Lease {
                    fingerprint: address.fingerprint,
                    denied_until: if lease.fingerprint == address.fingerprint {
                        lease.denied_until
                    } else {
                        0
                    },
                    ..Lease::default()
                };
            }
            change(&mut lease);
            (Some(lease.encode()), ())
        });
        if let Err(error) = result {
            log::debug!("diana: lease stash of {}: {error}", rule.name);
        }
    }
}
