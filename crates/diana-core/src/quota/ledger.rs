//! What the quota service remembers of the calls that carry an id (the wire's `call`), so
//! that a gateway can give back a grant nobody will spend: its request went away while the
//! call was in flight, and the host dropped the answer with it (the proxy-wasm SDK files a
//! call's answer under the request's context). The gateway then sends the same request to
//! [`crate::wire::RELEASE_PATH`].
//!
//! The release may reach the service before the acquire it releases (another connection,
//! another replica), so both orders end the same way — the grant given back, once:
//!
//! ```text
//!            acquire granted               release
//!   (none) ───────────────────▶ Granted ───────────▶ (none)   the grant given back
//!      │         release                  acquire granted
//!      └──────────────────────▶ Released ──────────▶ (none)   the grant given back at once
//! ```
//!
//! An entry is forgotten [`CALL_MEMORY`] after it was written (a release that late finds
//! nothing, and the grant stays charged, as it did before releases existed). The memory
//! store keeps at most [`MAX_CALLS`] entries; the Redis store keeps them as keys with that
//! expiry. Entries carry only what a release needs: per rule, the tokens granted, where
//! they were counted ([`Mark`]) and in which counter ([`CounterDigest`]), encoded by
//! [`encode`]. A release gives back only to those counters: one that names others is
//! refused, so that the call id of a grant on a throwaway counter cannot refill another.

use super::{counter_params, Outcome};
use crate::algo::Mark;
use crate::time::{Instant, Nanos};
use crate::wire::{ResolvedRule, RuleResult, WireError, WireProblem};
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// How long a call is remembered. A release leaves the gateway at most a tick (1 s) after
/// its request went, which is before the call's answer came, so within the callout's
/// timeout (`global.timeout_ms`; on the wait endpoint up to 10 s more) of the acquire:
/// 20 s covers timeouts of up to several seconds. It is also what a call costs: one entry
/// (a Redis key of about 150 bytes) for 20 s, so 10,000 calls a second hold some 200,000.
pub const CALL_MEMORY: Nanos = Nanos::from_secs(20);
/// Most calls the memory store remembers at once.
pub const MAX_CALLS: usize = 100_000;
/// The stored value of a release that came first.
pub const RELEASED: &str = "released";

/// Which counter a grant was counted in: the first 16 bytes of SHA-256 over the rule's key
/// and its parameters (the name a store gives the counter), so that a release can be
/// checked against it and no chosen key can pass for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterDigest(pub [u8; 16]);

impl CounterDigest {
    pub fn of(rule: &ResolvedRule<'_>) -> CounterDigest {
        let digest = Sha256::new()
            .chain_update(rule.key.as_bytes())
            .chain_update(b"\0")
            .chain_update(counter_params(rule.algo.code(), &rule.limit).as_bytes())
            .finalize();
        let mut first = [0; 16];
        for (to, from) in first.iter_mut().zip(digest) {
            *to = from;
        }
        CounterDigest(first)
    }
}

/// What one rule of a call was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub granted: u32,
    pub mark: Mark,
    pub counter: CounterDigest,
}

impl Grant {
    /// The grants of a decision of `rules`, rule by rule (`None` when nothing was granted).
    pub fn of(rules: &[ResolvedRule<'_>], outcomes: &[Outcome]) -> Option<Vec<Grant>> {
        outcomes
            .iter()
            .any(|outcome| outcome.result.granted > 0)
            .then(|| {
                rules
                    .iter()
                    .zip(outcomes)
                    .map(|(rule, outcome)| Grant {
                        granted: outcome.result.granted,
                        mark: outcome.mark,
                        counter: CounterDigest::of(rule),
                    })
                    .collect()
            })
    }

    /// The outcomes a release of `call` takes for its grants, given back to `rules` (the
    /// release's body): refused unless they are that call's counters, rule by rule, so
    /// that nothing is given back to other counters.
    pub fn released(
        call: &str,
        rules: &[ResolvedRule<'_>],
        grants: &[Grant],
    ) -> Result<Vec<Outcome>, WireError> {
        if grants.len() != rules.len() {
            return Err(WireError::at(
                "rules",
                WireProblem::RulesOfCall {
                    rules: rules.len(),
                    call: call.to_string(),
                    granted: grants.len(),
                },
            ));
        }
        if let Some(index) = rules
            .iter()
            .zip(grants)
            .position(|(rule, grant)| CounterDigest::of(rule) != grant.counter)
        {
            return Err(WireError::at(
                format!("rules[{index}]"),
                WireProblem::NotTheCallsCounter {
                    call: call.to_string(),
                },
            ));
        }
        Ok(Grant::outcomes(grants))
    }

    /// The outcomes a store's release takes for these grants.
    pub fn outcomes(grants: &[Grant]) -> Vec<Outcome> {
        grants
            .iter()
            .map(|grant| Outcome {
                result: RuleResult {
                    allowed: grant.granted > 0,
                    granted: grant.granted,
                    ..RuleResult::default()
                },
                mark: grant.mark,
            })
            .collect()
    }
}

/// Grants as stored: `<granted>:<mark hex>:<counter digest hex>` per rule, comma
/// separated.
pub fn encode(grants: &[Grant]) -> String {
    grants
        .iter()
        .map(|grant| {
            format!(
                "{}:{:x}:{:032x}",
                grant.granted,
                grant.mark.0,
                u128::from_be_bytes(grant.counter.0)
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The grants of an [`encode`]d value; `None` for anything else ([`RELEASED`] included, and
/// an entry written before grants named their counter: it stays charged).
pub fn decode(value: &str) -> Option<Vec<Grant>> {
    value
        .split(',')
        .map(|part| {
            let mut fields = part.split(':');
            let (granted, mark, counter) = (fields.next()?, fields.next()?, fields.next()?);
            if fields.next().is_some() || counter.len() != 32 {
                return None;
            }
            Some(Grant {
                granted: granted.parse().ok()?,
                mark: Mark(u128::from_str_radix(mark, 16).ok()?),
                counter: CounterDigest(u128::from_str_radix(counter, 16).ok()?.to_be_bytes()),
            })
        })
        .collect()
}

/// What noting a grant found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Noted {
    /// Remembered for a release (or not, when the ledger is full: then it stays charged).
    Kept,
    /// The call was released before it was decided: give the grant back now.
    AlreadyReleased,
}

#[derive(Debug)]
enum Entry {
    Granted(Vec<Grant>),
    Released,
}

/// The calls of one process (the memory store, [`super::MemoryQuota`]), with time passed in.
#[derive(Debug, Default)]
pub struct CallLedger {
    entries: HashMap<String, (Entry, Instant)>,
    /// When a full ledger last looked for expired entries: at most once a [`FULL_SWEEP`],
    /// so that calls arriving at a ledger full of live entries do not each scan it.
    swept_at: Option<Instant>,
}

/// How often a full ledger looks for expired entries.
const FULL_SWEEP: Nanos = Nanos::from_secs(1);

impl CallLedger {
    /// Notes what `call` was granted at `now`.
    pub fn granted(&mut self, call: &str, grants: Vec<Grant>, now: Instant) -> Noted {
        if let Some((Entry::Released, at)) = self.entries.remove(call) {
            if !expired(at, now) {
                return Noted::AlreadyReleased;
            }
        }
        if self.has_room(now) {
            self.entries
                .insert(call.to_string(), (Entry::Granted(grants), now));
        }
        Noted::Kept
    }

    /// Takes what `call` was granted (at most once); when it is not known yet, notes the
    /// release so that its acquire gives its grant back.
    pub fn release(&mut self, call: &str, now: Instant) -> Option<Vec<Grant>> {
        match self.entries.remove(call) {
            Some((Entry::Granted(grants), at)) if !expired(at, now) => Some(grants),
            Some((Entry::Released, at)) if !expired(at, now) => {
                self.entries.insert(call.to_string(), (Entry::Released, at));
                None
            }
            _ => {
                if self.has_room(now) {
                    self.entries
                        .insert(call.to_string(), (Entry::Released, now));
                }
                None
            }
        }
    }

    /// Calls remembered (expired ones until the next sweep).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Room for one more entry, after forgetting the expired ones if the ledger is full
    /// (looked for at most once a [`FULL_SWEEP`]).
    fn has_room(&mut self, now: Instant) -> bool {
        let due = self
            .swept_at
            .is_none_or(|at| now.saturating_since(at) >= FULL_SWEEP);
        if self.entries.len() >= MAX_CALLS && due {
            self.entries.retain(|_, (_, at)| !expired(*at, now));
            self.swept_at = Some(now);
        }
        self.entries.len() < MAX_CALLS
    }
}

fn expired(at: Instant, now: Instant) -> bool {
    now.saturating_since(at) >= CALL_MEMORY
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::NANOS_PER_SECOND;

    /// `n` seconds after the epoch.
    fn second(n: u64) -> Instant {
        Instant::EPOCH + n * NANOS_PER_SECOND
    }

    fn grants(granted: u32) -> Vec<Grant> {
        vec![
            Grant {
                granted,
                mark: Mark(0xfeed_0000_0000_0000_0001),
                counter: CounterDigest([7; 16]),
            },
            Grant {
                granted: 0,
                mark: Mark(0),
                counter: CounterDigest([0; 16]),
            },
        ]
    }

    #[test]
    fn either_order_gives_the_grant_back_once() {
        let mut ledger = CallLedger::default();
        // Acquire first, then release: the release takes the grant, once.
        assert_eq!(ledger.granted("a", grants(3), second(10)), Noted::Kept);
        assert_eq!(ledger.release("a", second(11)), Some(grants(3)));
        assert_eq!(ledger.release("a", second(11)), None);
        // Release first: the acquire is told to give its grant back, once.
        assert_eq!(ledger.release("b", second(10)), None);
        assert_eq!(
            ledger.release("b", second(10)),
            None,
            "a second release changes nothing"
        );
        assert_eq!(
            ledger.granted("b", grants(2), second(11)),
            Noted::AlreadyReleased
        );
        assert_eq!(ledger.granted("b", grants(2), second(12)), Noted::Kept);
        assert_eq!(ledger.release("b", second(12)), Some(grants(2)));
        // What is left: a's second release, waiting for an acquire until it expires.
        assert_eq!(ledger.len(), 1);
    }

    #[test]
    fn a_call_is_forgotten_after_its_memory() {
        let mut ledger = CallLedger::default();
        ledger.granted("a", grants(3), second(10));
        assert_eq!(ledger.release("a", second(10) + CALL_MEMORY), None);
        ledger.release("b", second(10));
        assert_eq!(
            ledger.granted("b", grants(1), second(10) + CALL_MEMORY),
            Noted::Kept
        );
    }

    #[test]
    fn the_ledger_is_bounded() {
        let mut ledger = CallLedger::default();
        for call in 0..MAX_CALLS + 10 {
            ledger.granted(&call.to_string(), grants(1), second(1));
        }
        assert_eq!(ledger.len(), MAX_CALLS);
        // Once the first ones expire, new calls are remembered again.
        ledger.granted("late", grants(1), second(1) + CALL_MEMORY);
        assert_eq!(
            ledger.release("late", second(1) + CALL_MEMORY),
            Some(grants(1))
        );
    }

    #[test]
    fn grants_round_trip_through_their_encoding() {
        let value = encode(&grants(7));
        assert_eq!(
            value,
            "7:feed0000000000000001:07070707070707070707070707070707,\
             0:0:00000000000000000000000000000000"
        );
        assert_eq!(decode(&value), Some(grants(7)));
        assert_eq!(decode(RELEASED), None);
        assert_eq!(decode("7:zz:07070707070707070707070707070707"), None);
        assert_eq!(decode("7:feed:0707"), None);
        // Written before grants named their counter: not a grant to give back.
        assert_eq!(decode("7:feed0000000000000001,0:0"), None);
        assert_eq!(decode(""), None);
    }

    #[test]
    fn a_release_gives_back_only_to_the_calls_own_counters() {
        use crate::wire::{AcquireRequest, RuleRequest};
        let rule = |key: &str, rpu: u32| RuleRequest {
            key: key.to_string(),
            algo: "W".to_string(),
            rpu,
            unit: "hour".to_string(),
            burst: rpu,
            slices: 10,
            want: 1,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            place: None,
        };
        let request = |rules: Vec<RuleRequest>| AcquireRequest {
            rules,
            call: Some("c".to_string()),
        };
        let acquired = request(vec![rule("mine:1", 5)]);
        let resolved = acquired.resolve().unwrap();
        let outcomes = Grant::outcomes(&[Grant {
            granted: 1,
            mark: Mark(0),
            counter: CounterDigest::of(&resolved[0]),
        }]);
        let grants = Grant::of(&resolved, &outcomes).unwrap();
        assert!(Grant::released("c", &resolved, &grants).is_ok());
        // Another key, or the same key with other parameters: another counter.
        for other in [rule("victim:1", 5), rule("mine:1", 6)] {
            let release = request(vec![other]);
            let error = Grant::released("c", &release.resolve().unwrap(), &grants).unwrap_err();
            assert_eq!(error.field, "rules[0]");
            assert_eq!(
                error.problem,
                WireProblem::NotTheCallsCounter {
                    call: "c".to_string()
                }
            );
        }
        let two = request(vec![rule("mine:1", 5), rule("victim:1", 5)]);
        assert!(matches!(
            Grant::released("c", &two.resolve().unwrap(), &grants)
                .unwrap_err()
                .problem,
            WireProblem::RulesOfCall { .. }
        ));
    }
}
