//! The decisions over the states of one request's rules, as pure functions: what
//! diana-quota's memory store runs under its lock, what its `lua/decide.lua` does in Redis
//! (the two are tested to agree, `crates/diana-quota/tests/lua_matches_rust.rs`), and what
//! the in-process [`super::MemoryQuota`] runs for simulations and tests.
//!
//! The caller loads one state per distinct counter (`states`) and says which counter each
//! rule uses (`slots`): two rules on the same counter see each other's tentative charges.
//!
//! - [`acquire`]: all or nothing (rules in dry run aside: their denial stops nobody, and
//!   they are charged only with the others). Every rule is checked in order; an admitted leaky-bucket
//!   request whose delay is longer than its `max_delay` is denied (retry when its turn
//!   would be within the limit). Then either every rule was allowed and the states keep
//!   every charge, or they are restored as they were: the rules that had their cost
//!   available answer `allowed` with nothing granted (and what they have, read from the
//!   state as it was), the others are denied.
//! - [`charge`]: every rule is charged `want` tokens past its limit (a debt).
//! - [`release`]: gives back the grants of an earlier [`acquire`], rules in reverse order.
//! - [`renew`]: concurrency places still held move from the bucket they were counted in
//!   to the current one (`want` places each; a bucket already forgotten gives nothing
//!   back, and the places are counted again).
//! - [`spend`]: one call of Envoy's rate limit protocol (RLS), each rule a [`Spend`]: a
//!   *take* decided all or nothing as [`acquire`] decides it, a *check* that charges
//!   nothing and is refused once nothing is left, or a *count* that is charged whatever
//!   is left (envoyproxy/ratelimit's `INCRBY`) and refused when its cost did not fit.
//!   Each rule's [`Enforcement`] says whether its refusal refuses the call.

use super::Outcome;
use crate::algo::{Mark, Verdict};
use crate::time::Instant;
use crate::wire::{ceil_millis, ResolvedRule, RuleResult};

/// What a rule has right now, without changing anything (a probe: `want` 0).
fn probe(rule: &ResolvedRule<'_>, state: &[u64], now: Instant) -> Verdict {
    let mut copy = state.to_vec();
    rule.algo
        .acquire_at_least(&rule.limit, &mut copy, now, 1, 0)
}

/// Whether `need` tokens are there right now, and if not when they will be, without
/// changing anything (the decision of a take of `need`, on a copy).
fn probe_need(rule: &ResolvedRule<'_>, state: &[u64], now: Instant, need: u32) -> Verdict {
    let mut copy = state.to_vec();
    rule.algo
        .acquire_at_least(&rule.limit, &mut copy, now, need, need)
}

/// An allowed rule that was not charged: what it has, from a probe.
fn spared(probe: &Verdict) -> RuleResult {
    RuleResult {
        place: None,
        allowed: true,
        granted: 0,
        remaining: probe.remaining,
        reset_ms: ceil_millis(probe.reset),
        retry_after_ms: 0,
        delay_ms: 0,
    }
}

/// Decides every rule, all or nothing (see the module documentation). Returns one outcome
/// per rule and whether the states were changed.
pub fn acquire(
    rules: &[ResolvedRule<'_>],
    slots: &[usize],
    states: &mut [Vec<u64>],
    now: Instant,
) -> (Vec<Outcome>, bool) {
    let original = states.to_vec();
    let mut verdicts = Vec::with_capacity(rules.len());
    for (rule, &slot) in rules.iter().zip(slots) {
        let Some(state) = states.get_mut(slot) else {
            verdicts.push(Verdict::default());
            continue;
        };
        let before = state.clone();
        let mut verdict =
            rule.algo
                .acquire_at_least(&rule.limit, state, now, rule.cost.get(), rule.want.get());
        if let Some(max_delay) = rule.max_delay {
            if verdict.granted > 0 && rule.algo.waits() && verdict.delay > max_delay {
                // Its turn is further away than the gateway accepts: nothing reserved.
                let retry_after = verdict.delay - max_delay;
                verdict = Verdict {
                    retry_after,
                    ..probe(rule, &before, now)
                };
                *state = before;
            }
        }
        verdicts.push(verdict);
    }
    let all = verdicts
        .iter()
        .zip(rules)
        .all(|(verdict, rule)| verdict.granted > 0 || rule.dry_run);
    if !all {
        states.clone_from_slice(&original);
    }
    let outcomes = rules
        .iter()
        .zip(slots)
        .zip(&verdicts)
        .map(|((rule, &slot), verdict)| {
            if all {
                Outcome {
                    result: RuleResult::from_verdict(verdict).placed(rule.algo, verdict.mark),
                    mark: verdict.mark,
                }
            } else if verdict.granted > 0 {
                let before = original.get(slot).map_or(&[][..], Vec::as_slice);
                Outcome {
                    result: spared(&probe(rule, before, now)),
                    ..Outcome::default()
                }
            } else {
                Outcome {
                    result: RuleResult::from_verdict(verdict),
                    ..Outcome::default()
                }
            }
        })
        .collect();
    (outcomes, all)
}

/// Charges every rule `want` tokens past its limit. The answer says `granted = want`,
/// `allowed`, and when the identity may pass again (`retry_after_ms`, 0 while it still has
/// tokens).
pub fn charge(
    rules: &[ResolvedRule<'_>],
    slots: &[usize],
    states: &mut [Vec<u64>],
    now: Instant,
) -> Vec<RuleResult> {
    rules
        .iter()
        .zip(slots)
        .map(|(rule, &slot)| {
            let mut empty = Vec::new();
            let state = states.get_mut(slot).unwrap_or(&mut empty);
            let verdict = rule
                .algo
                .charge_debt(&rule.limit, state, now, rule.want.get());
            RuleResult {
                place: None,
                allowed: true,
                granted: rule.want.get(),
                remaining: verdict.remaining,
                reset_ms: ceil_millis(verdict.reset),
                retry_after_ms: ceil_millis(verdict.retry_after),
                delay_ms: 0,
            }
        })
        .collect()
}

/// Gives back the grants of `outcomes` (one per rule, from [`acquire`]), in reverse order,
/// and answers what each rule has afterwards.
pub fn release(
    rules: &[ResolvedRule<'_>],
    slots: &[usize],
    states: &mut [Vec<u64>],
    outcomes: &[Outcome],
    now: Instant,
) -> Vec<RuleResult> {
    for ((rule, &slot), outcome) in rules.iter().zip(slots).zip(outcomes).rev() {
        if outcome.result.granted > 0 {
            if let Some(state) = states.get_mut(slot) {
                rule.algo.release(
                    &rule.limit,
                    state,
                    now,
                    outcome.result.granted,
                    outcome.mark,
                );
            }
        }
    }
    rules
        .iter()
        .zip(slots)
        .map(|(rule, &slot)| {
            let state = states.get(slot).map_or(&[][..], Vec::as_slice);
            spared(&probe(rule, state, now))
        })
        .collect()
}

/// Renews the concurrency places of `rules` (`want` each), counted at `places` (the
/// buckets an acquire or the last renewal answered): each comes back with the bucket they
/// are counted in now, to send next time.
pub fn renew(
    rules: &[ResolvedRule<'_>],
    slots: &[usize],
    states: &mut [Vec<u64>],
    places: &[Mark],
    now: Instant,
) -> Vec<Outcome> {
    rules
        .iter()
        .zip(slots)
        .zip(places)
        .map(|((rule, &slot), &place)| {
            let mut empty = Vec::new();
            let state = states.get_mut(slot).unwrap_or(&mut empty);
            let places = rule.want.get();
            rule.algo.release(&rule.limit, state, now, places, place);
            let verdict = rule.algo.charge_debt(&rule.limit, state, now, places);
            Outcome {
                result: RuleResult {
                    allowed: true,
                    granted: places,
                    retry_after_ms: 0,
                    ..RuleResult::from_verdict(&verdict)
                }
                .placed(rule.algo, verdict.mark),
                mark: verdict.mark,
            }
        })
        .collect()
}

/// How one rule of an RLS call spends its counter ([`spend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Spend {
    /// Takes its `cost`, all or nothing with the call's other takes: charged only when the
    /// call is admitted, refused (nothing charged) when the cost is not there.
    Take,
    /// Charges nothing; refused once nothing is left (a request of one would be refused).
    Check,
    /// Charges its `want` whatever is left, past the limit if need be, even when the call
    /// is refused (envoyproxy/ratelimit's `INCRBY`); refused when the cost did not fit in
    /// what was left. The algorithm must take debts.
    Count,
}

/// Whether a rule's refusal refuses the call ([`spend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Enforcement {
    /// A refusal refuses the call.
    #[default]
    Enforced,
    /// Never refuses (envoyproxy/ratelimit's `shadow_mode`, Diana's dry run).
    Shadow,
    /// A soft limit (envoyproxy/ratelimit's `quota_mode`): the call is refused only when
    /// every quota rule of the call is refused.
    Quota,
}

/// One rule's part in a [`spend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spending {
    pub spend: Spend,
    pub enforcement: Enforcement,
}

/// The decision of a [`spend`]: one outcome per rule (`allowed`: the rule's own verdict;
/// `granted`: what it was charged) and whether the call is admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spent {
    pub outcomes: Vec<Outcome>,
    pub admitted: bool,
}

/// Whether a call whose rules spend as `how` and passed as `passed` is admitted: every
/// enforced rule passed and, if the call has quota rules, one of them did.
pub fn admits(how: &[Spending], passed: &[bool]) -> bool {
    let mut quota = how
        .iter()
        .zip(passed)
        .filter(|(spending, _)| spending.enforcement == Enforcement::Quota)
        .peekable();
    let quota_passed = quota.peek().is_none() || quota.any(|(_, &passed)| passed);
    quota_passed
        && how
            .iter()
            .zip(passed)
            .all(|(spending, &passed)| passed || spending.enforcement != Enforcement::Enforced)
}

/// Decides one RLS call (see the module documentation and [`Spend`]). Rules are decided in
/// order, each on the state the rules before it left (two rules on one counter see each
/// other's charge). The call is admitted when every enforced rule passed and, if it has
/// quota rules, one of them passed. Admitted: every charge stays. Refused: the takes are
/// undone (the states are the stored ones with the counts alone applied, in order), the
/// counts stay.
///
/// Each outcome's `remaining`, `reset_ms` and (when refused) `retry_after_ms` describe the
/// counter as the call left it, for a request of the rule's cost. A take's grant carries
/// its mark (a late answer gives it back); a count's never goes back.
pub fn spend(
    rules: &[ResolvedRule<'_>],
    slots: &[usize],
    states: &mut [Vec<u64>],
    how: &[Spending],
    now: Instant,
) -> Spent {
    let stored = states.to_vec();
    let mut passed = Vec::with_capacity(rules.len());
    let mut taken = Vec::with_capacity(rules.len());
    for ((rule, &slot), spending) in rules.iter().zip(slots).zip(how) {
        let Some(state) = states.get_mut(slot) else {
            passed.push(false);
            taken.push(Verdict::default());
            continue;
        };
        let cost = rule.want.get();
        match spending.spend {
            Spend::Check => {
                passed.push(probe(rule, state, now).remaining >= 1);
                taken.push(Verdict::default());
            }
            Spend::Count => {
                passed.push(probe(rule, state, now).remaining >= u64::from(cost));
                rule.algo.charge_debt(&rule.limit, state, now, cost);
                taken.push(Verdict::default());
            }
            Spend::Take => {
                let verdict = rule
                    .algo
                    .acquire_at_least(&rule.limit, state, now, cost, cost);
                passed.push(verdict.granted > 0);
                taken.push(verdict);
            }
        }
    }
    let admitted = admits(how, &passed);
    let took = taken.iter().any(|verdict| verdict.granted > 0);
    if !admitted && took {
        // The takes are undone; the counts are charged again, in order, on the stored states.
        states.clone_from_slice(&stored);
        for ((rule, &slot), spending) in rules.iter().zip(slots).zip(how) {
            if spending.spend == Spend::Count {
                if let Some(state) = states.get_mut(slot) {
                    rule.algo
                        .charge_debt(&rule.limit, state, now, rule.want.get());
                }
            }
        }
    }
    let outcomes = rules
        .iter()
        .zip(slots)
        .zip(how)
        .zip(passed.iter().zip(&taken))
        .map(|(((rule, &slot), spending), (&passed, verdict))| {
            let state = states.get(slot).map_or(&[][..], Vec::as_slice);
            let cost = rule.want.get();
            let left = probe(rule, state, now);
            let (granted, mark) = match spending.spend {
                Spend::Take if admitted => (verdict.granted, verdict.mark),
                Spend::Count => (cost, Mark::default()),
                Spend::Take | Spend::Check => (0, Mark::default()),
            };
            Outcome {
                result: RuleResult {
                    place: None,
                    allowed: passed,
                    granted,
                    remaining: left.remaining,
                    reset_ms: ceil_millis(left.reset),
                    // When the rule's cost is there again.
                    retry_after_ms: if passed {
                        0
                    } else {
                        ceil_millis(probe_need(rule, state, now, cost).retry_after).max(1)
                    },
                    delay_ms: 0,
                },
                mark,
            }
        })
        .collect();
    Spent { outcomes, admitted }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::RuleRequest;

    fn rule(key: &str, algo: &str, rpu: u32, want: u32, cost: u32) -> RuleRequest {
        RuleRequest {
            place: None,
            key: key.to_string(),
            algo: algo.to_string(),
            rpu,
            unit: "hour".to_string(),
            burst: rpu,
            slices: 4,
            want,
            cost,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        }
    }

    #[test]
    fn all_or_nothing_on_shared_counters() {
        let now = Instant::from_unix_nanos(1_700_000_000_000_000_000);
        let requests = [rule("a", "W", 5, 3, 3), rule("a", "W", 5, 3, 3)];
        let rules: Vec<_> = requests.iter().filter_map(|r| r.resolve(0).ok()).collect();
        let mut states = vec![vec![0; 2]];
        // Two rules on one counter of 5: the second sees the first's 3, has only 2 < 3.
        let (outcomes, committed) = acquire(&rules, &[0, 0], &mut states, now);
        assert!(!committed);
        assert_eq!(states, vec![vec![0; 2]]);
        let granted: Vec<(bool, u32, u64)> = outcomes
            .iter()
            .map(|o| (o.result.allowed, o.result.granted, o.result.remaining))
            .collect();
        assert_eq!(granted, [(true, 0, 5), (false, 0, 2)]);
        // On two counters both pass and both are kept.
        let mut states = vec![vec![0; 2], vec![0; 2]];
        let (outcomes, committed) = acquire(&rules, &[0, 1], &mut states, now);
        assert!(committed);
        assert!(outcomes.iter().all(|o| o.result.granted == 3));
        // And come back exactly.
        let after = release(&rules, &[0, 1], &mut states, &outcomes, now);
        assert!(after.iter().all(|r| r.remaining == 5 && r.allowed));
    }

    #[test]
    fn a_turn_beyond_max_delay_is_denied_and_not_reserved() {
        let now = Instant::from_unix_nanos(1_700_000_000_000_000_000);
        let mut lb = rule("q", "LB", 3_600, 1, 1);
        lb.unit = "second".to_string();
        lb.burst = 10;
        lb.max_delay_ms = Some(2);
        let requests = [lb];
        let rules: Vec<_> = requests.iter().filter_map(|r| r.resolve(0).ok()).collect();
        let mut states = vec![vec![0; 2]];
        let slots = [0];
        // T = 1/3.6 ms: turns at 0, 0.28, 0.56, ... 1.94 ms are within 2 ms (8 turns).
        let mut admitted = 0;
        for _ in 0..8 {
            let (outcomes, committed) = acquire(&rules, &slots, &mut states, now);
            admitted += usize::from(committed && outcomes[0].result.granted == 1);
        }
        assert_eq!(admitted, 8);
        let before = states.clone();
        let (outcomes, committed) = acquire(&rules, &slots, &mut states, now);
        assert!(!committed);
        assert_eq!(states, before);
        assert!(!outcomes[0].result.allowed);
        assert_eq!(outcomes[0].result.retry_after_ms, 1);
        assert_eq!(outcomes[0].result.remaining, 3);
    }
}
