//! Per-worker token leases of local rules: the hot path without host calls.
//!
//! A rule's counter lives in shared data so that every worker counts against it; each
//! read and compare-and-swap of it is a host call (on Envoy, the read also calls back
//! into the VM to allocate its value). A worker that charges a busy counter therefore
//! takes a small batch of tokens in its one compare-and-swap, and spends the rest of the
//! batch on its next requests without touching shared data.
//!
//! Counts stay exact where it matters:
//! - Every token a worker spends was taken from the shared counter: no more is ever
//!   admitted than the limit allows.
//! - A batch is a share of what is left: at most 1/[`SHARE`] of the tokens the counter
//!   still had at the worker's last charge, never more than [`MAX_BATCH`]. Near the limit
//!   (fewer than `2 × SHARE` left) a worker takes exactly what each request needs, so the
//!   last tokens go one by one to whichever worker asks, and 80 requests over 4 workers
//!   against a limit of 20 admit exactly 20.
//! - Tokens are spent only while the algorithm's definition allows
//!   ([`crate::algo::Algorithm::lease_until`]: the window, the slice, 50 ms of a bucket)
//!   and for [`BATCH_SPAN`] at most; the rest go back to the counter with the worker's
//!   next charge or from its tick ([`Local::return_unspent`]), when their window or slice
//!   is still current (else they lapsed with it). So a worker that falls idle holds
//!   tokens for a quarter of a second plus one tick at most. A leaky bucket never lends:
//!   each of its turns has its own instant.
//! - A denial is remembered for at most [`DENIAL_CACHE`] (and never beyond the instant a
//!   token can be back): tokens given back by rejected requests of other workers can come
//!   back earlier than the algorithm alone says. The memory's short life is only how long
//!   it is trusted: it keeps the instants the counter answered (when a request of that
//!   cost passes, when the limit has recovered), and a request it rejects is told the wait
//!   still left until them, as the counter would have said. It answers requests of the
//!   cost that was denied only (a wait depends on the cost); others read the counter.
//! - A request's tokens from a batch go back exactly if another rule rejects it: into the
//!   batch while it lasts, else to the shared record they were taken from (the request
//!   carries its key and holder), also when the tick has retired the batch meanwhile.
//!
//! The table is bounded ([`MAX_BATCHES`] identities per worker); when it is full, new
//! identities are charged without a batch.

use crate::algo::Mark;
use crate::config::Rule;
use crate::store::{ChargeError, Receipt, SharedData, SlotAddress, SlotTable, Store};
use crate::time::{Instant, Nanos};
use hashbrown::HashMap;
use std::cell::RefCell;
use std::sync::Arc;

/// A batch is at most this share of what the counter has left.
pub const SHARE: u64 = 16;
/// The largest batch, in tokens beyond the request's own cost.
pub const MAX_BATCH: u64 = 64;
/// The longest a worker remembers a denial.
pub const DENIAL_CACHE: Nanos = Nanos::from_millis(100);
/// Most identities with a batch or a remembered denial per worker.
pub const MAX_BATCHES: usize = 1024;
/// The longest a worker holds a batch, whatever the algorithm allows: the worker's tick
/// ([`Local::return_unspent`]) gives an idle worker's tokens back to the shared counter.
pub const BATCH_SPAN: Nanos = Nanos::from_millis(250);

// A record's visits are counted at half the batch span (the store keeps its own constant,
// so that it needs nothing of this module).
const _: () = assert!(crate::store::VISIT_GAP.get() * 2 == BATCH_SPAN.get());

/// What a worker holds for one (rule, identity).
#[derive(Debug, Clone)]
struct Batch {
    /// Tokens taken and not spent.
    tokens: u32,
    /// Where they were counted, and until when they may be spent.
    mark: Mark,
    valid_until: Instant,
    /// The shared record they came from (to give tokens back to it).
    key: Arc<str>,
    holder: u64,
    /// What the counter had left after the worker's last charge.
    left: u64,
    /// The remembered denial is trusted until then (0: none), at most [`DENIAL_CACHE`].
    denied_until: Instant,
    /// The cost it is about: another cost may fit, or wait another time.
    denied_cost: u32,
    /// What the counter answered: when a request of `denied_cost` passes, and when the
    /// limit has recovered (instants, so that a later answer tells the wait left).
    retry_at: Instant,
    reset_at: Instant,
}

/// Tokens a request took, to give back if another rule rejects it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// From the worker's batch; `key` and `holder` name the shared record the batch was
    /// taken from (where the tokens go when the batch is gone).
    Batch {
        fingerprint: u64,
        tokens: u32,
        mark: Mark,
        key: Arc<str>,
        holder: u64,
    },
    /// From the shared counter.
    Shared(Receipt),
}

impl Taken {
    /// How many tokens were taken.
    pub fn tokens(&self) -> u32 {
        match self {
            Taken::Batch { tokens, .. } => *tokens,
            Taken::Shared(receipt) => receipt.tokens,
        }
    }

    /// The same place, `tokens` of it at most (to give back part of a charge).
    pub fn part(&self, tokens: u32) -> Taken {
        let mut part = self.clone();
        match &mut part {
            Taken::Batch { tokens: held, .. } => *held = (*held).min(tokens),
            Taken::Shared(receipt) => receipt.tokens = receipt.tokens.min(tokens),
        }
        part
    }
}

/// How a local rule decided.
#[derive(Debug)]
pub enum LocalCharge {
    /// Admitted: the request's tokens, the verdict's report data.
    Admitted {
        taken: Taken,
        remaining: u64,
        reset: Nanos,
        delay: Nanos,
        collided: bool,
    },
    /// Denied: when to retry, what is left, when the limit recovers.
    Denied {
        retry_after: Nanos,
        remaining: u64,
        reset: Nanos,
        collided: bool,
    },
}

/// One worker's batches.
#[derive(Debug, Default)]
pub struct Local {
    store: Store,
    leases: RefCell<HashMap<(usize, u64), Batch>>,
    /// When a full table may be swept of lapsed leases again.
    next_sweep: std::cell::Cell<Instant>,
}

impl Local {
    pub fn new() -> Local {
        Local::default()
    }

    /// Charges `cost` tokens of `rule` to the identity at `address`.
    pub fn charge(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        rule: &Rule,
        address: SlotAddress,
        cost: u32,
        now: Instant,
    ) -> Result<LocalCharge, ChargeError> {
        let lends = rule.algo.lends();
        let id = (rule.index, address.fingerprint);
        let mut unspent = None;
        let mut left = 0;
        if lends {
            if let Ok(mut leases) = self.leases.try_borrow_mut() {
                if let Some(lease) = leases.get_mut(&id) {
                    if lease.denied_until > now
                        && lease.denied_until - now <= DENIAL_CACHE
                        && cost == lease.denied_cost
                    {
                        // The wait the counter gave, less the time since: not the
                        // memory's own (shorter) life.
                        return Ok(LocalCharge::Denied {
                            retry_after: lease.retry_at.saturating_since(now).max(Nanos::new(1)),
                            remaining: lease.left,
                            reset: lease.reset_at.saturating_since(now),
                            collided: false,
                        });
                    }
                    if lease.tokens >= cost && now < lease.valid_until {
                        lease.tokens -= cost;
                        let taken = Taken::Batch {
                            fingerprint: address.fingerprint,
                            tokens: cost,
                            mark: lease.mark,
                            key: Arc::clone(&lease.key),
                            holder: lease.holder,
                        };
                        return Ok(LocalCharge::Admitted {
                            taken,
                            remaining: lease.left.saturating_add(u64::from(lease.tokens)),
                            reset: lease.valid_until - now,
                            delay: Nanos::ZERO,
                            collided: false,
                        });
                    }
                    if lease.tokens > 0 {
                        unspent = Some((lease.tokens, lease.mark));
                        lease.tokens = 0;
                    }
                    left = lease.left;
                }
            }
        }
        // A batch is worth taking only if it pays at least one more request of this size:
        // else it strands tokens that no request of this worker can spend until the tick
        // gives them back (a reservation of 200 would be denied while 64 wait here).
        let extra = match (left / SHARE).min(MAX_BATCH) {
            extra if lends && left >= 2 * SHARE && extra >= u64::from(cost) => extra,
            _ => 0,
        };
        let want = u32::try_from(u64::from(cost) + extra).unwrap_or(cost);
        let charge = self
            .store
            .exchange(host, table, address, now, cost, want, unspent)?;
        let verdict = charge.verdict;
        let Some(receipt) = charge.receipt else {
            if lends && !verdict.retry_after.is_zero() {
                self.remember(id, now, |lease| {
                    lease.denied_cost = cost;
                    lease.denied_until = now.saturating_add(verdict.retry_after.min(DENIAL_CACHE));
                    lease.retry_at = now.saturating_add(verdict.retry_after);
                    lease.reset_at = now.saturating_add(verdict.reset);
                    lease.left = verdict.remaining;
                });
            }
            return Ok(LocalCharge::Denied {
                retry_after: verdict.retry_after,
                remaining: verdict.remaining,
                reset: verdict.reset,
                collided: charge.collided,
            });
        };
        let batch = verdict.granted - cost.min(verdict.granted);
        // Worth remembering: a batch to spend, or enough left for one next time.
        if lends && (batch > 0 || verdict.remaining >= 2 * SHARE || left > 0) {
            let valid_until = rule
                .algo
                .lease_until(&rule.limit, verdict.mark, now)
                .min(now.saturating_add(BATCH_SPAN));
            let mut key = None;
            self.remember(id, now, |lease| {
                lease.tokens = batch;
                lease.mark = verdict.mark;
                lease.valid_until = valid_until;
                if *lease.key != *receipt.key {
                    lease.key = Arc::from(receipt.key.as_str());
                }
                lease.holder = receipt.holder;
                lease.left = verdict.remaining;
                lease.denied_until = Instant::EPOCH;
                key = Some(Arc::clone(&lease.key));
            });
            if let (true, Some(key)) = (batch > 0, key) {
                return Ok(LocalCharge::Admitted {
                    taken: Taken::Batch {
                        fingerprint: address.fingerprint,
                        tokens: cost,
                        mark: verdict.mark,
                        key,
                        holder: receipt.holder,
                    },
                    remaining: verdict.remaining.saturating_add(u64::from(batch)),
                    reset: verdict.reset,
                    delay: verdict.delay,
                    collided: charge.collided,
                });
            }
        }
        // No batch (a batch is only taken for a lease this table holds): the request holds
        // all it took.
        let taken = Taken::Shared(receipt);
        Ok(LocalCharge::Admitted {
            taken,
            remaining: verdict.remaining.saturating_add(u64::from(batch)),
            reset: verdict.reset,
            delay: verdict.delay,
            collided: charge.collided,
        })
    }

    /// Gives back what a request took: into the worker's batch when it is still the one
    /// the tokens came from, else to the shared record they were taken from (also when the
    /// batch was retired meanwhile: the tokens are never dropped).
    pub fn give_back(
        &self,
        host: &dyn SharedData,
        table: &SlotTable<'_>,
        rule: &Rule,
        taken: &Taken,
        now: Instant,
    ) -> Result<(), ChargeError> {
        // A token given back may end a denial this worker remembers.
        let fingerprint = match taken {
            Taken::Shared(receipt) => receipt.holder,
            Taken::Batch { fingerprint, .. } => *fingerprint,
        };
        if let Ok(mut leases) = self.leases.try_borrow_mut() {
            if let Some(lease) = leases.get_mut(&(rule.index, fingerprint)) {
                lease.denied_until = Instant::EPOCH;
            }
        }
        match taken {
            Taken::Shared(receipt) => self.store.release(host, table, receipt, now),
            Taken::Batch {
                fingerprint,
                tokens,
                mark,
                key,
                holder,
            } => {
                // Into the batch it came from while that batch lasts.
                let kept =
                    self.leases.try_borrow_mut().ok().is_some_and(|mut leases| {
                        match leases.get_mut(&(rule.index, *fingerprint)) {
                            Some(lease)
                                if lease.mark == *mark
                                    && now < lease.valid_until
                                    && lease.key == *key =>
                            {
                                lease.tokens = lease.tokens.saturating_add(*tokens);
                                true
                            }
                            _ => false,
                        }
                    });
                if kept {
                    return Ok(());
                }
                // Else to the shared record the batch was taken from (which takes them
                // only while their window or slice is current, and its holder the same).
                let receipt = Receipt {
                    key: key.to_string(),
                    holder: *holder,
                    tokens: *tokens,
                    mark: *mark,
                };
                self.store.release(host, table, &receipt, now)
            }
        }
    }

    /// From the worker's tick: gives the tokens of batches it no longer spends back to
    /// their shared counters (and forgets lapsed denials). `table` finds a rule's table.
    pub fn return_unspent<'r>(
        &self,
        host: &dyn SharedData,
        now: Instant,
        table: impl Fn(usize) -> Option<(&'r Rule, SlotTable<'r>)>,
    ) -> usize {
        let lapsed: Vec<(usize, Receipt)> = match self.leases.try_borrow_mut() {
            Ok(mut leases) => {
                let mut lapsed = Vec::new();
                for (&(rule, _), lease) in leases.iter_mut() {
                    if lease.tokens > 0 && lease.valid_until <= now {
                        lapsed.push((
                            rule,
                            Receipt {
                                key: lease.key.to_string(),
                                holder: lease.holder,
                                tokens: lease.tokens,
                                mark: lease.mark,
                            },
                        ));
                        lease.tokens = 0;
                    }
                }
                leases.retain(|_, lease| lease.valid_until > now || lease.denied_until > now);
                lapsed
            }
            Err(_) => return 0,
        };
        let mut returned = 0;
        for (rule, receipt) in lapsed {
            if let Some((_, table)) = table(rule) {
                if self.store.release(host, &table, &receipt, now).is_ok() {
                    returned += receipt.tokens as usize;
                }
            }
        }
        returned
    }

    /// Pays `tokens` of a response cost from this worker's batch of (rule, identity) as
    /// far as it goes (those tokens were taken from the shared counter already) and returns
    /// what is left to charge there. The batch is also sized afresh at the next charge:
    /// without this, a worker went on spending a batch taken before a large response cost
    /// put the counter in debt. Other workers' batches (each at most 1/[`SHARE`] of what
    /// the counter had left) are still spent: the inaccuracy a response cost can add.
    pub fn pay_from_batch(&self, rule: usize, fingerprint: u64, tokens: u32, now: Instant) -> u32 {
        let Ok(mut leases) = self.leases.try_borrow_mut() else {
            return tokens;
        };
        let Some(lease) = leases.get_mut(&(rule, fingerprint)) else {
            return tokens;
        };
        lease.left = 0;
        if now >= lease.valid_until {
            return tokens;
        }
        let paid = lease.tokens.min(tokens);
        lease.tokens -= paid;
        tokens - paid
    }

    /// The store behind the batches (for debts and peeks).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Updates the lease of `id`, creating it if the table has room (a full table is swept
    /// of lapsed leases at most every [`DENIAL_CACHE`]).
    fn remember(&self, id: (usize, u64), now: Instant, change: impl FnOnce(&mut Batch)) {
        let Ok(mut leases) = self.leases.try_borrow_mut() else {
            return;
        };
        if leases.len() >= MAX_BATCHES && !leases.contains_key(&id) {
            if now < self.next_sweep.get() {
                return;
            }
            self.next_sweep.set(now.saturating_add(DENIAL_CACHE));
            leases.retain(|_, lease| lease.valid_until > now || lease.denied_until > now);
            if leases.len() >= MAX_BATCHES {
                return;
            }
        }
        let lease = leases.entry(id).or_insert_with(|| Batch {
            tokens: 0,
            mark: Mark::default(),
            valid_until: Instant::EPOCH,
            key: Arc::from(""),
            holder: 0,
            left: 0,
            denied_until: Instant::EPOCH,
            denied_cost: 0,
            retry_at: Instant::EPOCH,
            reset_at: Instant::EPOCH,
        });
        change(lease);
    }
}
