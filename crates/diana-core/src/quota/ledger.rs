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
//! A release may also give back part of one rule's grant ([`Part`]): the gateway request
//! was answered, and its answer says the rule should not count it (`count: {status}`, a
//! reservation settled for less). That takes tokens out of the entry, which stays
//! `Granted` (what is left of the grant can still be released); it never notes a release
//! for an acquire still to come, and finds nothing in a `Released` entry.
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

    /// As [`encode`] writes it: 32 lower-case hex digits.
    pub fn hex(&self) -> String {
        format!("{:032x}", u128::from_be_bytes(self.0))
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

/// What a release of part of one rule's grant of a call found ([`CallLedger::take_part`],
/// and the Redis store's `calls.lua`, which does the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Given back: these tokens of the rule's grant, counted at its mark in its counter.
    Taken(Grant),
    /// Nothing to give back: the call is not known (not decided yet, released whole,
    /// forgotten), or that rule's grant has nothing left.
    Nothing,
    /// The call had fewer rules than the position named.
    NoSuchRule { rules: usize },
    /// Not the counter that rule of the call was granted by.
    OtherCounter,
}

impl Part {
    /// Takes up to `tokens` of the grant of the call's rule at `rule` (`grants`: the
    /// call's, rule by rule), if `counter` is the counter it was granted by.
    pub fn take(grants: &mut [Grant], rule: usize, tokens: u32, counter: CounterDigest) -> Part {
        let rules = grants.len();
        let Some(grant) = grants.get_mut(rule) else {
            return Part::NoSuchRule { rules };
        };
        if grant.counter != counter {
            return Part::OtherCounter;
        }
        let taken = tokens.min(grant.granted);
        if taken == 0 {
            return Part::Nothing;
        }
        grant.granted -= taken;
        Part::Taken(Grant {
            granted: taken,
            ..*grant
        })
    }

    /// What the release answers: the grant to give back (`None`: nothing), or why the
    /// body was refused (a 400, as a whole call's release with other rules).
    pub fn outcome(self, call: &str, rule: usize) -> Result<Option<Grant>, WireError> {
        match self {
            Part::Taken(grant) => Ok(Some(grant)),
            Part::Nothing => Ok(None),
            Part::NoSuchRule { rules } => Err(WireError::at(
                "rule",
                WireProblem::RulesOfCall {
                    rules: rule + 1,
                    call: call.to_string(),
                    granted: rules,
                },
            )),
            Part::OtherCounter => Err(WireError::at(
                "rules[0]",
                WireProblem::NotTheCallsCounter {
                    call: call.to_string(),
                },
            )),
        }
    }
}

/// Grants as stored: `<granted>:<mark hex>:<counter digest hex>` per rule, comma
/// separated.
pub fn encode(grants: &[Grant]) -> String {
    grants
        .iter()
        .map(|grant| {
            format!(
                "{}:{:x}:{}",
                grant.granted,
                grant.mark.0,
                grant.counter.hex()
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

/// What the Redis store's ledger script (`calls.lua`, `part`) answered, as a [`Part`]:
/// nothing (`nil`), `rules:<n>` (the call had `n` rules), `counter` (another counter), or
/// the tokens taken as one [`encode`]d grant. Anything else finds nothing.
pub fn part_of_reply(reply: Option<&str>) -> Part {
    match reply {
        None => Part::Nothing,
        Some("counter") => Part::OtherCounter,
        Some(reply) => match reply.strip_prefix("rules:") {
            Some(rules) => rules
                .parse()
                .map_or(Part::Nothing, |rules| Part::NoSuchRule { rules }),
            None => match decode(reply).as_deref() {
                Some([grant]) if grant.granted > 0 => Part::Taken(*grant),
                _ => Part::Nothing,
            },
        },
    }
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

    /// Takes up to `tokens` of what `call` granted its rule at `rule`, if `counter` is
    /// that rule's counter (see [`Part`]). The entry stays, with what is left.
    pub fn take_part(
        &mut self,
        call: &str,
        rule: usize,
        tokens: u32,
        counter: CounterDigest,
        now: Instant,
    ) -> Part {
        match self.entries.get_mut(call) {
            Some((Entry::Granted(grants), at)) if !expired(*at, now) => {
                Part::take(grants, rule, tokens, counter)
            }
            _ => Part::Nothing,
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

    /// Part of one rule's grant: taken from the entry, which keeps the rest (a whole
    /// release then gives back only that); never noted ahead of the acquire; refused for
    /// a rule the call did not have or another counter.
    #[test]
    fn part_of_a_rules_grant_is_taken_once_and_the_rest_stays() {
        let mut ledger = CallLedger::default();
        let counter = CounterDigest([7; 16]);
        let part = |ledger: &mut CallLedger, rule: usize, tokens: u32, counter, at| {
            ledger.take_part("a", rule, tokens, counter, second(at))
        };
        // Not decided yet: nothing, and the acquire is not told to give anything back.
        assert_eq!(part(&mut ledger, 0, 1, counter, 10), Part::Nothing);
        assert_eq!(ledger.granted("a", grants(3), second(10)), Noted::Kept);
        let taken = |granted: u32| {
            Part::Taken(Grant {
                granted,
                ..grants(0)[0]
            })
        };
        assert_eq!(part(&mut ledger, 0, 1, counter, 11), taken(1));
        // More than is left: what is left.
        assert_eq!(part(&mut ledger, 0, 5, counter, 11), taken(2));
        assert_eq!(part(&mut ledger, 0, 1, counter, 11), Part::Nothing);
        // The second rule granted nothing; there is no third; another counter is refused.
        assert_eq!(
            part(&mut ledger, 1, 1, CounterDigest([0; 16]), 11),
            Part::Nothing
        );
        assert_eq!(
            part(&mut ledger, 2, 1, counter, 11),
            Part::NoSuchRule { rules: 2 }
        );
        assert_eq!(
            part(&mut ledger, 0, 1, CounterDigest([8; 16]), 11),
            Part::OtherCounter
        );
        // A whole release afterwards gives back what is left (nothing of rule 0).
        let left = ledger.release("a", second(12)).unwrap();
        assert_eq!(left[0].granted, 0);
        // Forgotten after the memory.
        ledger.granted("b", grants(3), second(20));
        assert_eq!(
            ledger.take_part("b", 0, 1, counter, second(20) + CALL_MEMORY),
            Part::Nothing
        );
        // What a release answers for each.
        assert!(matches!(
            Part::NoSuchRule { rules: 2 }
                .outcome("a", 2)
                .unwrap_err()
                .problem,
            WireProblem::RulesOfCall {
                rules: 3,
                granted: 2,
                ..
            }
        ));
        assert_eq!(
            Part::OtherCounter.outcome("a", 0).unwrap_err().field,
            "rules[0]"
        );
        assert_eq!(Part::Nothing.outcome("a", 0), Ok(None));
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
    fn the_scripts_answers_to_a_part_read_as_parts() {
        let taken = Grant {
            granted: 2,
            ..grants(0)[0]
        };
        let cases = [
            (None, Part::Nothing),
            (Some("counter".to_string()), Part::OtherCounter),
            (Some("rules:3".to_string()), Part::NoSuchRule { rules: 3 }),
            (Some("rules:x".to_string()), Part::Nothing),
            (Some(encode(&[taken])), Part::Taken(taken)),
            (Some(encode(&grants(0)[..1])), Part::Nothing),
            (Some(encode(&grants(1))), Part::Nothing),
            (Some("junk".to_string()), Part::Nothing),
        ];
        for (reply, part) in cases {
            assert_eq!(part_of_reply(reply.as_deref()), part, "{reply:?}");
        }
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
            period: None,
        };
        let request = |rules: Vec<RuleRequest>| AcquireRequest {
            rules,
            call: Some("c".to_string()),
            rule: None,
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
